//! Dedup mode (the default): each batch of messages is applied in one
//! transaction — one multi-row `INSERT INTO processed_event … ON CONFLICT DO
//! NOTHING RETURNING event_id` tells which events are new, the handlers run
//! for those only, in order, malformed messages are dead-lettered — and only
//! after `COMMIT` are the batch's offsets handed to the polling thread.
//!
//! A failing handler: the batch's handlers run in segments, each after a
//! savepoint. When a handler fails, its segment is taken back, the failing
//! event and every later event of its key are *set aside* in `inbox_event`
//! (the failure recorded on it: attempts, error, next attempt after a
//! back-off) instead of applied, the events before it run again, then the
//! rest, all in the batch's one transaction (past 48 segments, or with
//! `max_attempts` 1, the events before it commit on their own and the rest
//! follows in another). The other keys of the partition go on; the inbox
//! processor (`processor.rs`, one runs in dedup mode too) retries the failing
//! event and applies its key's later events after it, in order, and
//! dead-letters it after `max_attempts`. While a key has events set aside,
//! every new event of that key is set aside behind them (a query per
//! transaction on the small index of rows waiting for a retry), whichever
//! member of the group receives it: per-key order holds, and a failing event
//! holds back its key alone. With `max_attempts` 1 a failing event is
//! dead-lettered at once, in place.
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
use super::db::pg_text;
use super::dead_letter::{self, DeadLetterReason, NewDeadLetter};
use super::dispatch::Registry;
use super::held::Held;
use super::poller::Shared;
use super::record::{Body, Record};
use super::txn::GuardedConn;
use super::{ConsumerConfig, Stats};
use crate::backoff::Health;
use crate::refusal::{Statement, Trouble};

/// Taking back the dedup rows of events not applied after all, as a
/// refusal names it.
pub(crate) const UNDO: Statement = Statement {
    name: "consumer: take back the dedup rows of events not applied",
    needs: "SELECT, DELETE ON processed_event",
};

/// Takes out the dedup rows of events a segment did not apply after all
/// (a handler's failure that changed nothing in the transaction, on them or
/// on an earlier event of their key).
pub(crate) const UNDO_PROCESSED: &str = "\
DELETE FROM processed_event WHERE consumer = $1 AND event_id = ANY($2)";

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

/// Writing a segment's saga steps (`Prefetched::flush`).
pub(crate) const SAGA_WRITE: Statement = Statement {
    name: "consumer: write the saga instances a segment's steps moved",
    needs: "SELECT, UPDATE ON outbox_saga",
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

/// Set-aside events: keys (topic, partition key) of a batch that have
/// events waiting in `inbox_event` behind a failing one. One probe of the
/// small index of waiting rows per key (the `LATERAL … LIMIT 1` keeps it so
/// whatever the statistics say: a join planned on stale ones walked every
/// waiting row once per key, 335 ms per transaction at 5,000 waiting rows).
const HELD_KEYS: &str = "
SELECT k.topic, k.key
FROM UNNEST($2::text[], $3::text[]) AS k(topic, key)
CROSS JOIN LATERAL (
    SELECT 1 FROM inbox_event e
    WHERE e.consumer = $1 AND e.topic = k.topic AND e.partition_key = k.key
      AND NOT e.processed AND e.dead_lettered_at IS NULL AND e.next_attempt_at IS NOT NULL
    LIMIT 1) h";

/// Sets events aside in `inbox_event`, in batch order: the failing one with
/// its failure (attempts 1, next attempt after `$13` seconds), the ones
/// behind it due at once (`next_attempt_at` set: the index of rows waiting
/// for a retry finds them, and they wait behind the failing one).
const SET_ASIDE: &str = r#"
INSERT INTO inbox_event
    (event_id, payload, consumer, topic, "partition", "offset", partition_key,
     event_type, event_version, headers, attempts, last_error, last_attempt_at,
     next_attempt_at)
SELECT e, p::jsonb, $1, t, pa, o, k, et, ev, h::jsonb, a, er,
       CASE WHEN a > 0 THEN now() END, now() + make_interval(secs => d)
FROM UNNEST($2::uuid[], $3::text[], $4::text[], $5::int4[], $6::int8[], $7::text[],
            $8::text[], $9::int4[], $10::text[], $11::int4[], $12::text[], $13::float8[])
     WITH ORDINALITY AS u(e, p, t, pa, o, k, et, ev, h, a, er, d, n)
ORDER BY n
ON CONFLICT (consumer, event_id) DO NOTHING"#;

/// Setting events aside, as a refusal names it.
const SET_ASIDE_STATEMENT: Statement = Statement {
    name: "consumer: set events aside behind a failing event of their key",
    needs: "SELECT, INSERT ON inbox_event",
};

/// Why an event of a batch is set aside in `inbox_event` rather than
/// applied.
#[derive(Clone, Debug)]
enum Aside {
    /// Its handler failed (`attempts` times so far): the processor retries
    /// it after a back-off.
    Failed {
        handler: &'static str,
        error: String,
        attempts: u32,
    },
    /// An earlier event of its key is set aside.
    Behind,
    /// Held in memory with its key (`held.rs`): not applied, not written.
    Memory,
}

/// The (topic, partition key) of an event record.
fn key_of(r: &Record) -> Option<(&str, &str)> {
    match &r.body {
        Body::Event(e) => Some((&r.topic, &e.incoming.partition_key)),
        _ => None,
    }
}

/// What one committed transaction did.
#[derive(Default)]
struct Report {
    processed: u64,
    duplicates: u64,
    ignored: u64,
    set_aside: u64,
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
    /// Wakes the inbox processor when events were set aside (it then
    /// waits for the first one's retry).
    pub wake: Option<&'a tokio::sync::Notify>,
    /// Failing keys held in memory (`ConsumerConfig::memory_retries`).
    pub held: Box<Held>,
}

impl Applier<'_> {
    /// Applies `batch`; returns when every message committed (applied, set
    /// aside or dead-lettered), or early on shutdown during an outage (the
    /// rest is not committed: it will be read again).
    pub async fn process(&mut self, mut batch: Vec<Record>, shutdown: &CancellationToken) {
        let n = batch.len();
        let (mut start, mut end) = (0, n);
        // Events this batch's failures set aside, with the later events of
        // their keys.
        let mut aside: Vec<Option<Aside>> = vec![None; n];
        // A message out of attempts (`max_attempts` 1), dead-lettered once
        // what precedes it has committed.
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
                    self.held.settled(self.shared, &batch[i]);
                    self.shared.completed(&batch[i..=i]);
                    start = i + 1;
                    end = n;
                    continue;
                }
                doomed = Some((i, handler, error, attempts));
            }
            let result = self
                .transaction(&mut batch[start..end], &mut aside[start..end], careful)
                .await;
            if result.is_err() {
                self.conn.settle().await;
            }
            match result {
                Ok(report) => {
                    self.db.up();
                    self.account(report);
                    if !self.held.is_empty() {
                        for (r, a) in batch[start..end].iter().zip(&aside[start..end]) {
                            if !matches!(a, Some(Aside::Memory)) {
                                self.held.settled(self.shared, r);
                            }
                        }
                    }
                    self.shared.completed(&batch[start..end]);
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
                Err(Failure::Handler {
                    at, handler, error, ..
                }) => {
                    careful = false;
                    self.stats.handler_failures.fetch_add(1, Ordering::Relaxed);
                    let i = start + at;
                    // The messages before it go first (in their own
                    // transaction), then the rest.
                    end = if at > 0 { i } else { n };
                    if self.config.max_attempts <= 1 {
                        // No retry: dead-letter it once the messages before
                        // it have committed (right away if none).
                        doomed = Some((i, handler, error, 1));
                        continue;
                    }
                    tracing::debug!(
                        offset = batch[i].offset,
                        partition = batch[i].partition,
                        handler,
                        %error,
                        "handler failed: setting its key aside for the inbox processor to retry"
                    );
                    aside[i] = Some(Aside::Failed {
                        handler,
                        error,
                        attempts: 1,
                    });
                    let key = key_of(&batch[i]).map(|(t, k)| (t.to_owned(), k.to_owned()));
                    for j in i + 1..n {
                        if aside[j].is_none()
                            && key_of(&batch[j]).is_some_and(|(t, k)| {
                                key.as_ref().is_some_and(|key| key.0 == t && key.1 == k)
                            })
                        {
                            aside[j] = Some(Aside::Behind);
                        }
                    }
                }
            }
        }
        // The events held in memory join their keys' queues.
        if aside.iter().any(|a| matches!(a, Some(Aside::Memory))) {
            for (r, a) in batch.into_iter().zip(aside) {
                if matches!(a, Some(Aside::Memory)) {
                    self.held.queue(r);
                }
            }
        }
        self.held.end_batch();
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
    }

    /// The events whose retry from memory is due, each key's in order (see
    /// `held.rs`): the consumer's loop puts them before the next batch, in
    /// its transaction.
    pub fn due(&mut self) -> Vec<Record> {
        self.held.take_due(self.shared)
    }

    fn account(&self, report: Report) {
        let s = self.stats;
        s.processed.fetch_add(report.processed, Ordering::Relaxed);
        s.duplicates.fetch_add(report.duplicates, Ordering::Relaxed);
        s.ignored.fetch_add(report.ignored, Ordering::Relaxed);
        s.stored.fetch_add(report.set_aside, Ordering::Relaxed);
        if report.set_aside > 0
            && let Some(wake) = self.wake
        {
            wake.notify_one();
        }
        if !report.rejected.is_empty() {
            s.dead_lettered
                .fetch_add(report.rejected.len() as u64, Ordering::Relaxed);
            // Handlers out of attempts were logged each (`hold_failures`).
            let malformed: Vec<_> = report
                .rejected
                .into_iter()
                .filter(|(reason, _)| *reason != DeadLetterReason::HandlerFailed)
                .collect();
            if !malformed.is_empty() {
                log_rejected(&self.config.group, &malformed);
            }
        }
    }

    /// One transaction over `records`: applies their events, but sets
    /// aside those of `aside` and those of keys with events set aside
    /// already.
    async fn transaction(
        &mut self,
        records: &mut [Record],
        aside: &mut [Option<Aside>],
        careful: bool,
    ) -> Result<Report, Failure> {
        let started = Instant::now();
        let mut handler_time = std::time::Duration::ZERO;
        let (config, stats) = (self.config, self.stats);
        let mut tx = self
            .conn
            .begin()
            .await
            .map_err(|e| Failure::Outage(Trouble::from(e).during(TX_GUARD)))?;
        // Events of keys waiting in memory join them: those not set aside
        // yet, and those marked behind a failure of their key in an earlier
        // transaction of this batch (its failing event went to memory
        // since, and so must they).
        if !self.held.is_empty() {
            for (r, a) in records.iter().zip(aside.iter_mut()) {
                if matches!(a, None | Some(Aside::Behind))
                    && !self.held.retrying(r)
                    && Held::key(r).is_some_and(|k| self.held.holds(&k))
                {
                    *a = Some(Aside::Memory);
                    self.held.pin(self.shared, r);
                }
            }
        }
        let held = held_keys(&mut tx, &self.config.group, records, aside).await?;
        let mut set_aside: Vec<bool> = records
            .iter()
            .zip(aside.iter())
            .map(|(r, a)| {
                a.is_some()
                    || key_of(r).is_some_and(|(t, k)| {
                        !held.is_empty() && held.contains(&(t.to_owned(), pg_text(k).into_owned()))
                    })
            })
            .collect();
        // An event PostgreSQL cannot store cannot wait behind its key:
        // dead-lettered (nothing lost; `outbox dead-letters retry` runs it).
        for ((r, aside), why) in records
            .iter_mut()
            .zip(set_aside.iter_mut())
            .zip(aside.iter())
        {
            if matches!(why, Some(Aside::Memory)) {
                continue; // held in memory, not stored
            }
            if let (true, Body::Event(e)) = (*aside, &r.body)
                && let Some(why) = unstorable(e)
            {
                let rejected = e.rejected(
                    DeadLetterReason::NotJson,
                    format!("{why}: it cannot be set aside behind a failing event of its key"),
                    None,
                    0,
                );
                r.body = Body::Rejected(Box::new(rejected));
                *aside = false;
            }
        }
        let prefetched =
            super::saga::lock_instances(&mut tx, self.registry, records, &set_aside).await?;
        let handling = apply::Handling {
            registry: self.registry,
            timeout: self.config.handler_timeout,
            careful,
            prefetched: Some(&prefetched),
        };
        // Segments, each after a savepoint: a failing handler takes its
        // segment back, its event and the later ones of its key are set
        // aside, the events before it run again, then the rest — in this
        // transaction (see `run_segments`).
        let (mut report, follow_ups, time) = run_segments(
            &mut tx,
            config,
            stats,
            records,
            aside,
            &mut set_aside,
            handling,
        )
        .await?;
        handler_time += time;
        if let Some(window) = self.config.memory_retries {
            hold_failures(
                (&mut *self.held, self.shared, self.config),
                records,
                aside,
                &mut set_aside,
                window,
            );
        }
        apply::seal(&mut tx).await?;
        follow_ups.write(&mut tx).await?;
        let (written, offered) =
            set_aside_rows(&mut tx, self.config, records, &*aside, &set_aside).await?;
        report.set_aside = written;
        report.duplicates += offered - written;
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

/// Holds in memory, where `memory_retries` allows, the failures of this
/// transaction (`Aside::Failed`) with the later events of their keys:
/// the next attempt due within the window and room left (a key that fails
/// again soon after its queue ran stays in memory: its queue runs in
/// chunks, see `held.rs`, so a failure does not run the rest of a long
/// queue again). Out of attempts, the event is dead-lettered in this transaction
/// instead and the later events of its key wait in memory, due at once.
/// Otherwise it is set aside in `inbox_event` with its attempts so far.
fn hold_failures(
    (held, shared, config): (&mut Held, &Shared, &ConsumerConfig),
    records: &mut [Record],
    aside: &mut [Option<Aside>],
    set_aside: &mut [bool],
    window: std::time::Duration,
) {
    let n = records.len();
    for i in 0..n {
        let Some(Aside::Failed { handler, error, .. }) = &aside[i] else {
            continue;
        };
        let (handler, error) = (*handler, error.clone());
        let Some(key) = Held::key(&records[i]) else {
            continue;
        };
        let attempts = held.attempts(&records[i]) + 1;
        let behind: Vec<usize> = (i + 1..n)
            .filter(|&j| {
                matches!(aside[j], Some(Aside::Behind))
                    && Held::key(&records[j]).as_ref() == Some(&key)
            })
            .collect();
        let delay = backoff::delay(config.retry_backoff, config.retry_backoff_max, attempts);
        let (due, head) = if attempts >= config.max_attempts {
            let Body::Event(e) = &records[i].body else {
                continue;
            };
            tracing::warn!(
                group = %config.group,
                event_id = %e.incoming.event_id,
                event_type = %e.incoming.event_type,
                handler,
                attempts,
                %error,
                "handler kept failing: event dead-lettered (re-drive with `outbox dead-letters retry`)"
            );
            let rejected = e.rejected(
                DeadLetterReason::HandlerFailed,
                error,
                Some(handler),
                i32::try_from(attempts).unwrap_or(i32::MAX),
            );
            records[i].body = Body::Rejected(Box::new(rejected));
            aside[i] = None;
            set_aside[i] = false;
            (tokio::time::Instant::now(), false)
        } else if delay <= window && held.room(1 + behind.len(), config.memory_retries_max_events) {
            tracing::debug!(
                offset = records[i].offset,
                partition = records[i].partition,
                handler,
                attempts,
                %error,
                "handler failed: its key waits in memory for the next attempt"
            );
            held.failed(&records[i], attempts);
            (tokio::time::Instant::now() + delay, true)
        } else {
            aside[i] = Some(Aside::Failed {
                handler,
                error,
                attempts,
            });
            continue;
        };
        if !head && behind.is_empty() {
            continue;
        }
        held.hold_key(key, due);
        for j in head.then_some(i).into_iter().chain(behind) {
            aside[j] = Some(Aside::Memory);
            set_aside[j] = false;
            held.pin(shared, &records[j]);
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

/// The columns of [`SET_ASIDE`].
#[derive(Default)]
struct SetAside {
    ids: Vec<Uuid>,
    payloads: Vec<String>,
    topics: Vec<String>,
    partitions: Vec<i32>,
    offsets: Vec<i64>,
    keys: Vec<String>,
    types: Vec<String>,
    versions: Vec<i32>,
    headers: Vec<String>,
    attempts: Vec<i32>,
    errors: Vec<Option<String>>,
    delays: Vec<f64>,
}

/// The keys of `records` (those not already set aside by this batch) with
/// events set aside in `inbox_event`.
async fn held_keys(
    tx: &mut sqlx::PgConnection,
    group: &str,
    records: &[Record],
    aside: &[Option<Aside>],
) -> Result<HashSet<(String, String)>, Failure> {
    let keys: HashSet<(String, String)> = records
        .iter()
        .zip(aside)
        .filter(|(_, a)| a.is_none())
        .filter_map(|(r, _)| key_of(r))
        .map(|(t, k)| (pg_text(t).into_owned(), pg_text(k).into_owned()))
        .collect();
    if keys.is_empty() {
        return Ok(HashSet::new());
    }
    let (topics, keys): (Vec<String>, Vec<String>) = keys.into_iter().unzip();
    let held: Vec<(String, String)> = sqlx::query_as(HELD_KEYS)
        .bind(pg_text(group).as_ref())
        .bind(&topics)
        .bind(&keys)
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| Failure::Outage(Trouble::from(e).during(SET_ASIDE_STATEMENT)))?;
    Ok(held.into_iter().collect())
}

/// Why PostgreSQL cannot store `e` in `inbox_event`, if it cannot: `jsonb`
/// refuses the `\u0000` escape (and text that is not UTF-8).
fn unstorable(e: &super::record::Event) -> Option<&'static str> {
    const NUL: &str = "\\u0000";
    match std::str::from_utf8(&e.payload) {
        Err(_) => Some("its payload is not UTF-8"),
        Ok(p) if p.contains(NUL) => Some("its payload holds \\u0000, which jsonb cannot store"),
        Ok(_) if e.incoming.headers.to_json().contains(NUL) => {
            Some("its headers hold \\u0000, which jsonb cannot store")
        }
        Ok(_) => None,
    }
}

/// Writes the set-aside events of `records` to `inbox_event`; returns
/// how many were written and how many offered (the rest were there
/// already: a redelivery).
async fn set_aside_rows(
    tx: &mut sqlx::PgConnection,
    config: &ConsumerConfig,
    records: &[Record],
    aside: &[Option<Aside>],
    set_aside: &[bool],
) -> Result<(u64, u64), Failure> {
    let delay = |attempts: u32| {
        backoff::delay(config.retry_backoff, config.retry_backoff_max, attempts).as_secs_f64()
    };
    let mut rows = SetAside::default();
    // Events held in memory (`Aside::Memory`) are not applied either, and
    // not written.
    for ((r, a), _) in records
        .iter()
        .zip(aside)
        .zip(set_aside)
        .filter(|((_, a), set)| **set && !matches!(a, Some(Aside::Memory)))
    {
        let Body::Event(e) = &r.body else { continue };
        let i = &e.incoming;
        rows.ids.push(i.event_id);
        rows.payloads.push(
            std::str::from_utf8(&e.payload)
                .unwrap_or_default()
                .to_owned(),
        );
        rows.topics.push(pg_text(&r.topic).into_owned());
        rows.partitions.push(r.partition);
        rows.offsets.push(r.offset);
        rows.keys.push(pg_text(&i.partition_key).into_owned());
        rows.types.push(pg_text(&i.event_type).into_owned());
        rows.versions
            .push(i32::try_from(i.event_version).unwrap_or(i32::MAX));
        rows.headers.push(i.headers.to_json());
        match a {
            Some(Aside::Failed {
                handler,
                error,
                attempts,
            }) => {
                rows.attempts
                    .push(i32::try_from(*attempts).unwrap_or(i32::MAX));
                rows.errors
                    .push(Some(pg_text(&format!("{handler}: {error}")).into_owned()));
                rows.delays.push(delay(*attempts));
            }
            _ => {
                rows.attempts.push(0);
                rows.errors.push(None);
                rows.delays.push(0.0);
            }
        }
    }
    if rows.ids.is_empty() {
        return Ok((0, 0));
    }
    let written = sqlx::query(SET_ASIDE)
        .bind(pg_text(&config.group).as_ref())
        .bind(&rows.ids)
        .bind(&rows.payloads)
        .bind(&rows.topics)
        .bind(&rows.partitions)
        .bind(&rows.offsets)
        .bind(&rows.keys)
        .bind(&rows.types)
        .bind(&rows.versions)
        .bind(&rows.headers)
        .bind(&rows.attempts)
        .bind(&rows.errors)
        .bind(&rows.delays)
        .execute(&mut *tx)
        .await
        .map_err(|e| Failure::Outage(Trouble::from(e).during(SET_ASIDE_STATEMENT)))?
        .rows_affected();
    Ok((written, rows.ids.len() as u64))
}

/// Runs the handlers of `records` (not `set_aside`) in `tx`, a segment
/// at a time after a savepoint. A handler's failure takes its segment
/// back: its event is set aside (`aside`, `set_aside`) with the later
/// events of its key, the events before it run again in a segment of
/// their own, then the rest; each event's handlers run at most twice
/// and the batch keeps its one transaction. With `max_attempts` 1, or
/// after `apply::MAX_SEGMENTS` segments, the failure is returned instead (the
/// caller commits the events before it on their own, as it does after
/// an outage).
async fn run_segments(
    tx: &mut sqlx::PgConnection,
    config: &ConsumerConfig,
    stats: &Stats,
    records: &mut [Record],
    aside: &mut [Option<Aside>],
    set_aside: &mut [bool],
    handling: apply::Handling<'_>,
) -> Result<(Report, apply::FollowUps, std::time::Duration), Failure> {
    let n = records.len();
    let mut report = Report::default();
    let mut follow_ups = apply::FollowUps::default();
    let mut handler_time = std::time::Duration::ZERO;
    let (mut start, mut stop) = (0, n);
    let mut segments = 0;
    // Whether handlers ran since the session was last put back.
    let mut restore = false;
    while start < n {
        segments += 1;
        if restore {
            match super::txn::probe(&mut *tx).await {
                Ok(()) => {}
                Err(super::txn::Broken::Outage(e)) => return Err(Failure::Outage(e.into())),
                Err(broken) => return Err(Failure::Suspect(broken.blame())),
            }
        }
        sqlx::query(apply::SAVEPOINT)
            .execute(&mut *tx)
            .await
            .map_err(|e| apply::bookkeeping(e, PROCESSED))?;
        let ids: Vec<Uuid> = records[start..stop]
            .iter()
            .zip(&set_aside[start..stop])
            .filter_map(|(r, aside)| match &r.body {
                Body::Event(e) if !aside => Some(e.incoming.event_id),
                _ => None,
            })
            .collect();
        let mut fresh: HashSet<Uuid> = if ids.is_empty() {
            HashSet::new()
        } else {
            sqlx::query_scalar(INSERT_PROCESSED)
                .bind(&config.group)
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| apply::bookkeeping(e, PROCESSED))?
                .into_iter()
                .collect()
        };
        let mut part = Report::default();
        let mut part_follow_ups = apply::FollowUps::default();
        let mut part_time = std::time::Duration::ZERO;
        let mut failed = None;
        // Dedup rows of this segment's events set aside after all.
        let mut undone = Vec::new();
        for i in start..stop {
            match &mut records[i].body {
                Body::Event(_) if set_aside[i] => {}
                Body::Event(e) => {
                    if !fresh.remove(&e.incoming.event_id) {
                        part.duplicates += 1;
                        continue;
                    }
                    let t = Instant::now();
                    part_follow_ups.at = i;
                    match apply::run_handlers(&mut *tx, handling, e, &mut part_follow_ups).await {
                        Ok(()) => {}
                        // The handler changed nothing in the transaction:
                        // set its key aside here, and go on.
                        Err(Failure::Handler {
                            handler,
                            error,
                            clean: true,
                            ..
                        }) if config.max_attempts > 1
                            && stats
                                .may_undo_dedup(&mut *tx)
                                .await
                                .map_err(|e| apply::bookkeeping(e, UNDO))? =>
                        {
                            undone.push(e.incoming.event_id);
                            part_follow_ups.forget(i);
                            stats.handler_failures.fetch_add(1, Ordering::Relaxed);
                            for j in set_key_aside(records, aside, set_aside, i, handler, error) {
                                if let Body::Event(later) = &records[j].body
                                    && j < stop
                                    && fresh.remove(&later.incoming.event_id)
                                {
                                    undone.push(later.incoming.event_id);
                                }
                            }
                            continue;
                        }
                        Err(Failure::Handler { handler, error, .. })
                            if config.max_attempts > 1 && segments < apply::MAX_SEGMENTS =>
                        {
                            failed = Some((i, handler, error));
                            break;
                        }
                        Err(f) => return Err(f.at(i)),
                    }
                    part_time += t.elapsed();
                    part.processed += 1;
                }
                Body::Ignored => part.ignored += 1,
                Body::Rejected(_) => {}
            }
        }
        let Some((i, handler, error)) = failed else {
            // The segment's saga steps, written in one statement.
            if let Some(batch) = handling.prefetched {
                batch
                    .flush(&mut *tx)
                    .await
                    .map_err(|e| apply::bookkeeping(e, SAGA_WRITE))?;
            }
            if !undone.is_empty() {
                sqlx::query(UNDO_PROCESSED)
                    .bind(&config.group)
                    .bind(&undone)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| apply::bookkeeping(e, UNDO))?;
            }
            restore = part.processed > 0;
            report.processed += part.processed;
            report.duplicates += part.duplicates;
            report.ignored += part.ignored;
            follow_ups.append(part_follow_ups);
            handler_time += part_time;
            start = stop;
            stop = n;
            continue;
        };
        // The saga instances its steps moved are as they were again (and
        // what the steps left unwritten goes with them).
        if let Some(prefetched) = handling.prefetched {
            prefetched.clear();
        }
        if let Err(failure) = apply::undo(&mut *tx, PROCESSED).await {
            // The savepoint is gone (a careful run found the handler
            // ended the transaction): the caller settles it.
            return Err(match failure {
                Failure::Suspect(_) if handling.careful => Failure::Handler {
                    at: i,
                    handler,
                    error,
                    clean: false,
                },
                other => other,
            });
        }
        restore = false;
        stats.handler_failures.fetch_add(1, Ordering::Relaxed);
        set_key_aside(records, aside, set_aside, i, handler, error);
        // The events before it again, then the rest.
        stop = if i > start { i } else { n };
    }
    Ok((report, follow_ups, handler_time))
}

/// Sets the event at `i` aside after its handler's failure, with the later
/// events of its key; returns the indexes of those later events.
fn set_key_aside(
    records: &[Record],
    aside: &mut [Option<Aside>],
    set_aside: &mut [bool],
    i: usize,
    handler: &'static str,
    error: String,
) -> Vec<usize> {
    tracing::debug!(
        offset = records[i].offset,
        partition = records[i].partition,
        handler,
        %error,
        "handler failed: setting its key aside for the inbox processor to retry"
    );
    aside[i] = Some(Aside::Failed {
        handler,
        error,
        attempts: 1,
    });
    set_aside[i] = true;
    let key = key_of(&records[i]).map(|(t, k)| (t.to_owned(), k.to_owned()));
    let mut behind = Vec::new();
    for j in i + 1..records.len() {
        if !set_aside[j]
            && key_of(&records[j])
                .is_some_and(|(t, k)| key.as_ref().is_some_and(|key| key.0 == t && key.1 == k))
        {
            aside[j] = Some(Aside::Behind);
            set_aside[j] = true;
            behind.push(j);
        }
    }
    behind
}
