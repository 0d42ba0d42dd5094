//! Judging a batch's deliveries: which rows are published, which failed
//! (and whether to retry, hold or park them), which keys and topics must
//! wait, and how the batch is then finished in the database.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::claim::{Batch, Failure, Finished, Unfinished};
use super::super::publish::{FailureKind, Outcome};
use super::Loop;
use crate::backoff::{self};

impl Loop<'_> {
    /// Turns the outcomes of a batch into the rows to mark, the failures
    /// to record and the withheld rows to hold (see [`held`]); updates
    /// blocked keys and topics and the counters.
    pub(super) fn evaluate(
        &mut self,
        seq: u64,
        batch: &Batch,
        outcomes: Vec<Outcome>,
    ) -> Evaluated {
        let mut published = Vec::with_capacity(batch.rows.len());
        let mut failures = Vec::new();
        let mut failed_keys: Vec<String> = Vec::new();
        let mut transient = None;
        let (mut withheld, mut parked) = (0_u64, 0_u64);
        let now = Instant::now();
        let mut withheld_rows = Vec::new();
        // The row of each failure, in the order of `failures`.
        let mut failed_rows = Vec::new();
        let mut failed_deliveries = 0_u64;
        for (row, outcome) in batch.rows.iter().zip(outcomes) {
            let key_failed = failed_keys.contains(&row.partition_key);
            match outcome {
                Outcome::Delivered => {
                    if key_failed {
                        self.stats.order_violations.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            id = row.id,
                            key = %row.partition_key,
                            "event delivered after an earlier event of its key failed"
                        );
                    }
                    published.push(row.id);
                }
                // Counted when it was delivered.
                Outcome::Unrecorded => published.push(row.id),
                Outcome::Withheld => {
                    withheld += 1;
                    withheld_rows.push(row);
                }
                Outcome::Failed(kind, error) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    failed_deliveries += 1;
                    if !key_failed {
                        failed_keys.push(row.partition_key.clone());
                        let held = self.held.entry(row.partition_key.clone()).or_insert(seq);
                        *held = (*held).max(seq);
                    }
                    match kind {
                        FailureKind::Transient => {
                            transient.get_or_insert(error);
                        }
                        FailureKind::Fatal => {
                            self.producer_unusable = true;
                            transient.get_or_insert(error);
                        }
                        FailureKind::Message => {
                            let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
                            // Only a failure of the row sent alone is surely
                            // its own (a broker refuses a whole batch for one
                            // bad record): a first failure never parks.
                            let park = attempts >= self.config.max_attempts && row.attempts > 0;
                            if park {
                                parked += 1;
                                tracing::error!(
                                    id = row.id, event_id = %row.event_id, attempts, error,
                                    "event parked after repeated failures (requeue with `outbox parked requeue`)"
                                );
                            } else {
                                let delay = backoff::delay(
                                    self.config.retry_backoff,
                                    self.config.retry_backoff_max,
                                    attempts,
                                );
                                self.blocked
                                    .keys
                                    .insert(row.partition_key.clone(), now + delay);
                            }
                            failures.push(Failure {
                                id: row.id,
                                error,
                                counted: true,
                                park,
                                hold: None,
                            });
                            failed_rows.push(row);
                        }
                        FailureKind::Topic => {
                            self.topics.forget(&row.topic);
                            let entry = self
                                .blocked
                                .topics
                                .entry(row.topic.clone())
                                .or_insert((now, 0));
                            if entry.0 <= now {
                                entry.1 += 1;
                                let delay = backoff::delay(
                                    self.config.retry_backoff,
                                    self.config.retry_backoff_max,
                                    entry.1,
                                );
                                entry.0 = now + delay;
                                tracing::error!(topic = %row.topic, error, "cannot publish to topic: holding its events back");
                            }
                            failures.push(Failure {
                                id: row.id,
                                error,
                                counted: true,
                                park: false,
                                hold: None,
                            });
                            failed_rows.push(row);
                        }
                    }
                }
            }
        }
        // Rows of blocked keys and topics, and rows behind a held row of
        // their key, are held until the block ends (rows withheld only
        // because an earlier batch of this relay is still open are not:
        // they are claimed again once it ends).
        let secs = |until: Instant| until.saturating_duration_since(now).as_secs_f64();
        for (failure, row) in failures.iter_mut().zip(failed_rows) {
            if !failure.park {
                failure.hold = self.blocked.deadline(row).map(secs);
            }
        }
        let mut holds = Vec::new();
        for row in withheld_rows {
            let blocked = self.blocked.deadline(row).map(secs);
            let behind = row.behind_held_secs.map(|s| s.max(0.0));
            let missing = self.topics.held(&row.topic);
            let missing_secs = missing.map(|(until, _)| secs(until));
            let Some(hold) = blocked
                .into_iter()
                .chain(behind)
                .chain(missing_secs)
                .reduce(f64::max)
            else {
                continue;
            };
            match missing {
                // The reason goes with the hold (not counted as an attempt).
                Some((_, reason)) => failures.push(Failure {
                    id: row.id,
                    error: reason.to_owned(),
                    counted: false,
                    park: false,
                    hold: Some(hold),
                }),
                None => holds.push((row.id, hold)),
            }
        }
        if transient.is_none() {
            self.broker.up();
        }
        if !published.is_empty() {
            self.stats.failing_over();
        } else if failed_deliveries > 0 {
            self.stats.failed_round();
        }
        self.stats
            .published
            .fetch_add(published.len() as u64, Ordering::Relaxed);
        self.stats.withheld.fetch_add(withheld, Ordering::Relaxed);
        self.stats.parked.fetch_add(parked, Ordering::Relaxed);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        // Keys whose row gets a state of its own (a failure, a hold) when
        // the batch ends: a claim running meanwhile read their later rows
        // without seeing it (see `Loop::released_keys`).
        let stated: std::collections::HashSet<i64> = failures
            .iter()
            .map(|f| f.id)
            .chain(holds.iter().map(|h| h.0))
            .collect();
        for row in batch.rows.iter().filter(|r| stated.contains(&r.id)) {
            let entry = self.stated.entry(row.partition_key.clone()).or_insert(seq);
            *entry = (*entry).max(seq);
            if let Some(mode) = self.progress.as_mut() {
                let entry = mode
                    .stated
                    .entry((row.topic.clone(), row.partition_key.clone()))
                    .or_insert(seq);
                *entry = (*entry).max(seq);
            }
        }
        Evaluated {
            published,
            failures,
            holds,
            transient,
        }
    }
}

/// What a batch's deliveries came to (see [`Loop::evaluate`]).
pub(super) struct Evaluated {
    pub(super) published: Vec<i64>,
    pub(super) failures: Vec<Failure>,
    /// Withheld rows to hold: id, seconds.
    pub(super) holds: Vec<(i64, f64)>,
    /// The first transient failure.
    pub(super) transient: Option<String>,
}

impl Batch {
    pub(super) async fn finish_owned(
        self,
        e: Evaluated,
    ) -> std::result::Result<Finished, Unfinished> {
        self.finish(&e.published, &e.failures, &e.holds).await
    }
}
