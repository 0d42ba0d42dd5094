//! Dedup mode (the default): each batch of messages is applied in one
//! transaction — one multi-row `INSERT INTO processed_event … ON CONFLICT DO
//! NOTHING RETURNING event_id` tells which events are new, the handlers run
//! for those only, in order, malformed messages are dead-lettered — and only
//! after `COMMIT` are the batch's offsets handed to the polling thread.
//!
//! Fast path / slow path: when a handler fails, the batch's transaction
//! rolls back and the batch is redone around the failing message: the
//! messages before it in one transaction, the failing message alone (retried
//! with exponential back-off, dead-lettered after `max_attempts`), then the
//! rest in one transaction again. A failure costs only its own message's
//! retries. While a message is retried its partition's later messages wait
//! (they are behind it in the batch): dedup mode keeps per-partition order.
//!
//! Transactions run on the applier's guarded connection (`txn.rs`): a
//! handler that aborts or ends the transaction without saying so is found
//! by the seal after the handlers; the range then runs again, checked event
//! by event, which names the event, and that event fails like any other.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::apply::{self, Failure};
use super::backoff;
use super::clock::RetryClock;
use super::dead_letter::{self, DeadLetterReason, NewDeadLetter};
use super::dispatch::Registry;
use super::poller::Shared;
use super::record::{Body, Record};
use super::txn::GuardedConn;
use super::{ConsumerConfig, Stats};
use crate::backoff::Health;
use crate::refusal::{Statement, Trouble};

const INSERT_PROCESSED: &str = "\
INSERT INTO processed_event (consumer, event_id)
SELECT $1, e FROM UNNEST($2::uuid[]) AS u(e)
ON CONFLICT DO NOTHING
RETURNING event_id";

/// [`INSERT_PROCESSED`], as a refusal names it (the inbox processor runs it too).
pub(crate) const PROCESSED: Statement = Statement {
    name: "consumer: record processed events",
    needs: "SELECT, INSERT ON processed_event",
};

/// The `BEGIN` of a handlers' transaction, which arms the commit guard.
pub(crate) const TX_GUARD: Statement = Statement {
    name: "consumer: arm the commit guard",
    needs: "SELECT, INSERT, UPDATE ON outbox_tx_guard",
};

/// Writing dead letters.
pub(crate) const DEAD_LETTERS: Statement = Statement {
    name: "consumer: write dead letters",
    needs: "INSERT ON dead_letter",
};

/// What one committed transaction did.
#[derive(Default)]
struct Report {
    processed: u64,
    duplicates: u64,
    ignored: u64,
    rejected: Vec<(DeadLetterReason, String)>,
}

/// Applies batches in dedup mode.
pub(crate) struct Applier<'a> {
    pub pool: &'a PgPool,
    pub config: &'a ConsumerConfig,
    pub registry: &'a Registry,
    pub stats: &'a Stats,
    pub shared: &'a Shared,
    pub db: Health,
    pub latency: crate::metrics::ConsumerLatency,
    /// The connection handlers run on.
    pub conn: GuardedConn,
    /// What a failing handler's retry waits on.
    pub clock: RetryClock,
}

impl Applier<'_> {
    /// Applies `batch`; returns when every message committed, or early on
    /// shutdown during a back-off (the rest is not committed: it will be
    /// read again).
    pub async fn process(&mut self, mut batch: Vec<Record>, shutdown: &CancellationToken) {
        let n = batch.len();
        let (mut start, mut end) = (0, n);
        // The message being retried: its index, attempts so far, and when
        // it may run again.
        let mut failing: Option<(usize, u32, Instant)> = None;
        // A message out of attempts, dead-lettered once what precedes it
        // has committed.
        let mut doomed: Option<(usize, &'static str, String, u32)> = None;
        // Check event by event (a handler broke a transaction of this range
        // without saying so).
        let mut careful = false;
        while start < n {
            if let Some((i, handler, error, attempts)) = doomed.take() {
                if i == start {
                    if !self
                        .dead_letter(&batch[i], handler, error, attempts, shutdown)
                        .await
                    {
                        return;
                    }
                    self.shared.completed(&batch[i..=i]);
                    failing = None;
                    start = i + 1;
                    end = n;
                    continue;
                }
                doomed = Some((i, handler, error, attempts));
            }
            if let Some((i, _, at)) = failing
                && i == start
            {
                let wait = at.saturating_duration_since(self.clock.now());
                if !wait.is_zero() && !self.clock.pause(wait, shutdown).await {
                    return;
                }
            }
            let result = self.transaction(&mut batch[start..end], careful).await;
            if result.is_err() {
                self.conn.settle().await;
            }
            match result {
                Ok(report) => {
                    self.db.up();
                    self.account(report);
                    self.shared.completed(&batch[start..end]);
                    if failing.is_some_and(|(i, _, _)| i < end) {
                        failing = None;
                    }
                    start = end;
                    end = n;
                    careful = false;
                }
                Err(Failure::Outage(error)) => {
                    self.conn.discard();
                    let wait = self.db.down(&error);
                    if !apply::pause(wait, shutdown).await {
                        return;
                    }
                }
                Err(Failure::Suspect(error)) if careful => {
                    // Every event was checked and still: treat it as an
                    // outage of unknown cause rather than blame an event.
                    self.conn.discard();
                    let wait = self.db.down(&error);
                    if !apply::pause(wait, shutdown).await {
                        return;
                    }
                }
                Err(Failure::Suspect(error)) => {
                    tracing::info!(%error, "a handler broke the transaction: checking event by event");
                    careful = true;
                }
                Err(Failure::Rejected { at, rejected }) => {
                    batch[start + at].body = Body::Rejected(rejected);
                }
                Err(Failure::Handler { at, handler, error }) => {
                    careful = false;
                    self.stats.handler_failures.fetch_add(1, Ordering::Relaxed);
                    let i = start + at;
                    let attempts = match failing {
                        Some((f, a, _)) if f == i => a + 1,
                        _ => 1,
                    };
                    if attempts >= self.config.max_attempts {
                        // Out of attempts: dead-letter it once the messages
                        // before it have committed (right away if none).
                        doomed = Some((i, handler, error, attempts));
                        end = i;
                        if at == 0 {
                            end = n;
                        }
                        continue;
                    }
                    tracing::debug!(
                        offset = batch[i].offset,
                        partition = batch[i].partition,
                        handler,
                        attempts,
                        %error,
                        "handler failed: retrying"
                    );
                    let delay = backoff::delay(
                        self.config.retry_backoff,
                        self.config.retry_backoff_max,
                        attempts,
                    );
                    failing = Some((i, attempts, self.clock.now() + delay));
                    // The messages before it go first, then it alone.
                    end = if at > 0 { i } else { i + 1 };
                }
            }
        }
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
    }

    fn account(&self, report: Report) {
        let s = self.stats;
        s.processed.fetch_add(report.processed, Ordering::Relaxed);
        s.duplicates.fetch_add(report.duplicates, Ordering::Relaxed);
        s.ignored.fetch_add(report.ignored, Ordering::Relaxed);
        if !report.rejected.is_empty() {
            s.dead_lettered
                .fetch_add(report.rejected.len() as u64, Ordering::Relaxed);
            log_rejected(&self.config.group, &report.rejected);
        }
    }

    /// One transaction over `records`.
    async fn transaction(
        &mut self,
        records: &mut [Record],
        careful: bool,
    ) -> Result<Report, Failure> {
        let started = Instant::now();
        let mut handler_time = std::time::Duration::ZERO;
        let handling = apply::Handling {
            registry: self.registry,
            timeout: self.config.handler_timeout,
            careful,
        };
        let mut tx = self
            .conn
            .begin()
            .await
            .map_err(|e| Failure::Outage(Trouble::from(e).during(TX_GUARD)))?;
        let ids: Vec<Uuid> = records
            .iter()
            .filter_map(|r| match &r.body {
                Body::Event(e) => Some(e.incoming.event_id),
                _ => None,
            })
            .collect();
        let mut fresh: HashSet<Uuid> = if ids.is_empty() {
            HashSet::new()
        } else {
            sqlx::query_scalar(INSERT_PROCESSED)
                .bind(&self.config.group)
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| Failure::Outage(Trouble::from(e).during(PROCESSED)))?
                .into_iter()
                .collect()
        };
        let mut report = Report::default();
        let mut follow_ups = apply::FollowUps::default();
        for (i, r) in records.iter_mut().enumerate() {
            match &mut r.body {
                Body::Event(e) => {
                    if !fresh.remove(&e.incoming.event_id) {
                        report.duplicates += 1;
                        continue;
                    }
                    let t = Instant::now();
                    follow_ups.at = i;
                    apply::run_handlers(&mut tx, handling, e, &mut follow_ups)
                        .await
                        .map_err(|f| f.at(i))?;
                    handler_time += t.elapsed();
                    report.processed += 1;
                }
                Body::Ignored => report.ignored += 1,
                Body::Rejected(_) => {}
            }
        }
        apply::seal(&mut tx).await?;
        follow_ups.write(&mut tx).await?;
        let letters: Vec<NewDeadLetter<'_>> = records
            .iter()
            .filter_map(|r| match &r.body {
                Body::Rejected(rejected) => Some(NewDeadLetter {
                    topic: &r.topic,
                    partition: r.partition,
                    offset: r.offset,
                    rejected,
                }),
                _ => None,
            })
            .collect();
        dead_letter::insert(&mut tx, &self.config.group, &letters)
            .await
            .map_err(|e| Failure::Outage(refused_dead_letters(e)))?;
        report.rejected = letters
            .iter()
            .map(|l| (l.rejected.reason, l.rejected.error.clone()))
            .collect();
        tx.commit().await?;
        self.latency.batch.record(started.elapsed());
        if report.processed > 0 {
            self.latency
                .handler
                .record(handler_time.as_secs_f64() / report.processed as f64);
        }
        Ok(report)
    }

    /// Dead-letters an event whose handler kept failing (retrying through
    /// database outages). Returns false on shutdown.
    async fn dead_letter(
        &mut self,
        record: &Record,
        handler: &'static str,
        error: String,
        attempts: u32,
        shutdown: &CancellationToken,
    ) -> bool {
        let Body::Event(event) = &record.body else {
            return true;
        };
        let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
        let rejected = event.rejected(
            DeadLetterReason::HandlerFailed,
            error.clone(),
            Some(handler),
            attempts,
        );
        loop {
            let result = async {
                let mut tx = self.pool.begin().await?;
                let letter = NewDeadLetter {
                    topic: &record.topic,
                    partition: record.partition,
                    offset: record.offset,
                    rejected: &rejected,
                };
                dead_letter::insert(&mut tx, &self.config.group, &[letter]).await?;
                tx.commit().await
            }
            .await;
            match result {
                Ok(()) => {
                    self.db.up();
                    self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        group = %self.config.group,
                        event_id = %event.incoming.event_id,
                        event_type = %event.incoming.event_type,
                        handler,
                        attempts,
                        %error,
                        "handler kept failing: event dead-lettered (re-drive with `outbox dead-letters retry`)"
                    );
                    return true;
                }
                Err(db) => {
                    let wait = self.db.down(refused_dead_letters(db));
                    if !apply::pause(wait, shutdown).await {
                        return false;
                    }
                }
            }
        }
    }
}

/// A dead-letter insert that failed: an outage, a refusal of our setup (a
/// missing privilege: see `crate::refusal`), or another refusal (a trigger's
/// policy, say) that is retried like an outage — the message is never
/// acknowledged without its dead letter — and said so.
pub(crate) fn refused_dead_letters(error: sqlx::Error) -> Trouble {
    match Trouble::from(&error).during(DEAD_LETTERS) {
        Trouble::Outage(_) if !super::db::is_outage(&error) => Trouble::Outage(format!(
            "the database refuses to write dead letters ({error}): retrying; nothing from the \
             refused message on is acknowledged until it is written"
        )),
        trouble => trouble,
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Outage(e) => e.fmt(f),
            Failure::Suspect(e) => f.write_str(e),
            Failure::Handler { error, .. } => f.write_str(error),
            Failure::Rejected { rejected, .. } => f.write_str(&rejected.error),
        }
    }
}

/// One log line for the malformed messages of a transaction: counts per
/// reason and the first error.
pub(crate) fn log_rejected(group: &str, rejected: &[(DeadLetterReason, String)]) {
    let mut counts: Vec<(DeadLetterReason, usize)> = Vec::new();
    for (reason, _) in rejected {
        match counts.iter_mut().find(|(r, _)| r == reason) {
            Some((_, n)) => *n += 1,
            None => counts.push((*reason, 1)),
        }
    }
    let summary: Vec<String> = counts.iter().map(|(r, n)| format!("{r}: {n}")).collect();
    tracing::warn!(
        group,
        count = rejected.len(),
        reasons = %summary.join(", "),
        first_error = %rejected[0].1,
        "malformed messages dead-lettered (see `outbox dead-letters list`)"
    );
}
