//! Inbox mode, the processing half: claims stored, unprocessed rows and
//! runs their handlers, marking them processed in the same transaction.
//!
//! Work is divided by Kafka partition. A transaction first picks the
//! partitions of the oldest claimable rows and takes a transaction-scoped
//! advisory lock on each (consumer, topic, partition) it can get — so one
//! processor at a time, in any process, works on a partition — then, in a
//! new statement (whose snapshot sees everything the previous holder of
//! those partitions committed), claims their rows in received order (`seq`)
//! with `FOR UPDATE SKIP LOCKED`. A key's rows are in one partition, so
//! per-key order is kept; a row waiting for a retry (`next_attempt_at` in the
//! future) holds back the later rows of its key, and only those: other keys
//! continue. Several processors of one consumer split the partitions between
//! them by hash.
//!
//! Fast path: the claimed rows' handlers all run in the claiming
//! transaction, which records them in `processed_event` and marks them
//! processed. Slow path: if a handler fails, the transaction rolls back, the
//! failure is recorded on that row alone (attempts, last error, next attempt
//! after an exponential back-off; after `max_attempts` it is dead-lettered),
//! and the next claim takes the rows again — without the failed row and the
//! later rows of its key.
//!
//! The claiming transactions run on the processor's guarded connection
//! (`txn.rs`): if a handler aborted or ended the transaction without saying
//! so, the next claim runs its rows checked event by event, which names the
//! row; it then fails like any failing handler.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use outbox_core::{Headers, IncomingEvent};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::apply::{self, Failure};
use super::backoff;
use super::db::pg_text;
use super::dead_letter::{self, DeadLetterReason, NewDeadLetter};
use super::dispatch::{Registry, Route};
use super::record::{Event, Rejected};
use super::txn::GuardedConn;
use super::{ConsumerConfig, Stats};
use crate::backoff::Health;
use crate::refusal::{Statement, Trouble};

/// The claim of stored events, as a refusal names it.
const CLAIM: Statement = Statement {
    name: "consumer (inbox): claim stored events",
    needs: "SELECT, UPDATE ON inbox_event",
};

/// Marking stored events processed, failed or dead-lettered.
const SETTLE: Statement = Statement {
    name: "consumer (inbox): mark stored events processed, failed or dead-lettered",
    needs: "UPDATE ON inbox_event",
};

/// `error` of `statement`, for the processor's retry.
fn during(statement: Statement) -> impl Fn(sqlx::Error) -> Trouble {
    move |error| Trouble::from(error).during(statement)
}

/// A row that may be claimed now: not waiting for a retry, and no earlier
/// row of its key waiting for one.
const CLAIMABLE: &str = r#"
      (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
  AND NOT EXISTS (
      SELECT 1 FROM inbox_event b
      WHERE b.consumer = e.consumer AND b.topic = e.topic AND b.partition_key = e.partition_key
        AND NOT b.processed AND b.dead_lettered_at IS NULL
        AND b.next_attempt_at IS NOT NULL AND b.next_attempt_at > now()
        AND b.seq < e.seq)"#;

/// The partitions of the oldest claimable rows (of this processor's share).
fn candidates_sql() -> String {
    format!(
        r#"
SELECT DISTINCT topic || '/' || "partition" FROM (
    SELECT e.topic, e."partition" FROM inbox_event e
    WHERE NOT e.processed AND e.dead_lettered_at IS NULL AND e.consumer = $1
      AND mod(mod(hashtext(e.topic)::bigint + e."partition", $3) + $3, $3) = $4
      AND {CLAIMABLE}
    ORDER BY e.seq
    LIMIT $2) s"#
    )
}

/// Locks the partitions no other processor holds; returns them.
const LOCK_PARTITIONS: &str = "
SELECT p FROM UNNEST($2::text[]) AS u(p)
WHERE pg_try_advisory_xact_lock(hashtextextended($1 || '/' || p, 0))";

const WAIT_FOR_PARTITION: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || $2 || '/' || $3::text, 0))";

/// The locked partitions' claimable rows, in received order: at most `$3`
/// rows and, past the first, at most `$4` bytes (payload, headers and key;
/// the row that reaches the budget ends the batch). Rows locked past the
/// budget are released at commit and claimed next time: the partitions are
/// this processor's meanwhile, so their order is kept.
fn claim_sql() -> String {
    format!(
        r#"
SELECT c.event_id, c.topic, c.partition, c.offset, c.partition_key, c.event_type,
       c.event_version, c.payload, c.headers, c.attempts
FROM (
    SELECT l.*, sum(l.bytes) OVER (ORDER BY l.seq ROWS UNBOUNDED PRECEDING) - l.bytes AS before
    FROM (
        SELECT e.seq, e.event_id, e.topic, e."partition" AS partition,
               COALESCE(e."offset", -1) AS offset,
               COALESCE(e.partition_key, '') AS partition_key,
               COALESCE(e.event_type, '') AS event_type,
               e.event_version, e.payload::text AS payload, e.headers::text AS headers,
               e.attempts,
               octet_length(e.payload::text) + octet_length(e.headers::text)
                 + octet_length(COALESCE(e.partition_key, '')) AS bytes
        FROM inbox_event e
        WHERE NOT e.processed AND e.dead_lettered_at IS NULL AND e.consumer = $1
          AND e.topic || '/' || e."partition" = ANY($2)
          AND {CLAIMABLE}
        ORDER BY e.seq
        LIMIT $3
        FOR UPDATE SKIP LOCKED) l
) c
WHERE c.before < $4
ORDER BY c.seq"#
    )
}

const INSERT_PROCESSED: &str = "\
INSERT INTO processed_event (consumer, event_id)
SELECT $1, e FROM UNNEST($2::uuid[]) AS u(e)
ON CONFLICT DO NOTHING
RETURNING event_id";

const MARK_PROCESSED: &str = "\
UPDATE inbox_event
SET processed = true, processed_at = now(), attempts = attempts + $2,
    last_attempt_at = now(), next_attempt_at = NULL
WHERE consumer = $3 AND event_id = ANY($1)";

const RECORD_FAILURE: &str = "\
UPDATE inbox_event
SET attempts = attempts + 1, last_error = $2, last_attempt_at = now(),
    next_attempt_at = now() + make_interval(secs => $3)
WHERE consumer = $4 AND event_id = $1 AND NOT processed";

const MARK_DEAD: &str = "\
UPDATE inbox_event
SET attempts = attempts + $3, last_error = $2, last_attempt_at = now(),
    dead_lettered_at = now(), next_attempt_at = NULL
WHERE consumer = $4 AND event_id = $1 AND NOT processed";

#[derive(sqlx::FromRow)]
struct Row {
    event_id: Uuid,
    topic: String,
    partition: i32,
    offset: i64,
    partition_key: String,
    event_type: String,
    event_version: i32,
    payload: String,
    headers: String,
    attempts: i32,
}

/// What to do with a claimed row.
enum Item {
    Event(Box<Event>),
    Ignored,
    Rejected(Box<Rejected>),
}

/// One processor task of a consumer in inbox mode.
pub(crate) struct Processor {
    pool: PgPool,
    config: Arc<ConsumerConfig>,
    registry: Arc<Registry>,
    stats: Arc<super::ConsumerStats>,
    wake: Arc<Notify>,
    /// This processor's share of the partitions: `worker` of `workers`.
    worker: usize,
    workers: usize,
    candidates_sql: String,
    claim_sql: String,
    latency: crate::metrics::ConsumerLatency,
}

/// What one round found.
pub(crate) enum Round {
    /// Rows settled (processed, dead-lettered or failed).
    Settled(usize),
    /// A handler broke the transaction without saying so: claim again,
    /// checking event by event.
    Suspect,
}

impl Processor {
    pub fn new(
        pool: PgPool,
        config: Arc<ConsumerConfig>,
        registry: Arc<Registry>,
        stats: Arc<super::ConsumerStats>,
        wake: Arc<Notify>,
        worker: usize,
    ) -> Self {
        let workers = config.processors.max(1);
        let latency = crate::metrics::ConsumerLatency::new(&config.group);
        Self {
            pool,
            config,
            registry,
            stats,
            wake,
            worker,
            workers,
            candidates_sql: candidates_sql(),
            claim_sql: claim_sql(),
            latency,
        }
    }

    pub async fn run(self, shutdown: CancellationToken) {
        // The connection the claiming transactions (and handlers) run on.
        let mut conn = GuardedConn::new(self.pool.clone(), self.config.handler_timeout);
        let mut careful = false;
        let mut db = Health::new(
            "database (inbox processor)",
            self.config.outage_backoff,
            self.config.outage_backoff_max,
        )
        .reporting(self.stats.problems.clone());
        while !shutdown.is_cancelled() {
            let worked = match self.round(&mut conn, std::mem::take(&mut careful)).await {
                Ok(Round::Settled(n)) => {
                    db.up();
                    n > 0
                }
                Ok(Round::Suspect) => {
                    careful = true;
                    continue;
                }
                Err(error) => {
                    conn.discard();
                    let wait = db.down(&error);
                    apply::pause(wait, &shutdown).await;
                    continue;
                }
            };
            if !worked {
                if self.config.mode == super::Mode::Dedup {
                    // Set-aside events are rare: the connection goes back
                    // to the pool the consumer shares with its applier.
                    conn.release().await;
                }
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(self.config.processor_poll_interval) => {}
                    _ = shutdown.cancelled() => {}
                }
            }
        }
        conn.release().await;
    }

    /// One transaction: lock partitions, claim their next rows, process
    /// them. Returns how many rows were settled (processed, dead-lettered
    /// or failed).
    pub(crate) async fn round(
        &self,
        conn: &mut GuardedConn,
        careful: bool,
    ) -> Result<Round, Trouble> {
        let group = &self.config.group;
        let limit = i64::try_from(self.config.processor_batch_size).unwrap_or(i64::MAX);
        let mut tx = conn.begin().await.map_err(during(super::dedup::TX_GUARD))?;
        let candidates: Vec<String> = sqlx::query_scalar(&self.candidates_sql)
            .bind(group)
            .bind(limit)
            .bind(self.workers as i64)
            .bind(self.worker as i64)
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        if candidates.is_empty() {
            return Ok(Round::Settled(0));
        }
        let locked: Vec<String> = sqlx::query_scalar(LOCK_PARTITIONS)
            .bind(group)
            .bind(&candidates)
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        if locked.is_empty() {
            return Ok(Round::Settled(0)); // other processors have them
        }
        let rows: Vec<Row> = sqlx::query_as(&self.claim_sql)
            .bind(group)
            .bind(&locked)
            .bind(limit)
            .bind(i64::try_from(self.config.max_batch_bytes).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        if rows.is_empty() {
            return Ok(Round::Settled(0));
        }
        let started = std::time::Instant::now();
        let mut items: Vec<Item> = rows.iter().map(|r| self.item(r)).collect();
        match self.fast(&mut tx, &rows, &mut items, careful).await {
            Ok(batch) => {
                tx.commit().await?;
                self.latency.batch.record(started.elapsed());
                if batch.processed > 0 {
                    self.latency
                        .handler
                        .record(batch.handler_time.as_secs_f64() / batch.processed as f64);
                }
                if !batch.rejected.is_empty() {
                    super::dedup::log_rejected(group, &batch.rejected);
                }
                batch.apply(&self.stats);
                Ok(Round::Settled(rows.len()))
            }
            Err(Failure::Outage(error)) => Err(error),
            // Every event was checked and still: an outage of unknown cause.
            Err(Failure::Suspect(error)) if careful => Err(error.into()),
            Err(Failure::Suspect(error)) => {
                tracing::info!(%error, "a handler broke the transaction: checking event by event");
                Ok(Round::Suspect)
            }
            Err(Failure::Handler { at, handler, error }) => {
                drop(tx);
                conn.settle().await;
                self.stats.handler_failures.fetch_add(1, Ordering::Relaxed);
                let row = &rows[at];
                let attempts = row.attempts.saturating_add(1);
                if u32::try_from(attempts).unwrap_or(u32::MAX) >= self.config.max_attempts {
                    let Item::Event(event) = &items[at] else {
                        return Ok(Round::Settled(1));
                    };
                    let rejected = event.rejected(
                        DeadLetterReason::HandlerFailed,
                        error.clone(),
                        Some(handler),
                        attempts,
                    );
                    self.dead_letter(row, &rejected, 1).await?;
                    tracing::warn!(
                        group = %group,
                        event_id = %row.event_id,
                        event_type = %row.event_type,
                        handler,
                        attempts,
                        %error,
                        "handler kept failing: event dead-lettered (re-drive with `outbox dead-letters retry`)"
                    );
                } else {
                    let delay = backoff::delay(
                        self.config.retry_backoff,
                        self.config.retry_backoff_max,
                        u32::try_from(attempts).unwrap_or(u32::MAX),
                    );
                    self.record_failure(row, &error, delay.as_secs_f64())
                        .await?;
                    tracing::debug!(event_id = %row.event_id, handler, attempts, %error, "handler failed: retrying later");
                }
                Ok(Round::Settled(1))
            }
            Err(Failure::Rejected { at, rejected }) => {
                drop(tx);
                conn.settle().await;
                self.dead_letter(&rows[at], &rejected, 0).await?;
                super::dedup::log_rejected(group, &[(rejected.reason, rejected.error.clone())]);
                Ok(Round::Settled(1))
            }
        }
    }

    fn item(&self, row: &Row) -> Item {
        let headers: Headers = serde_json::from_str(&row.headers).unwrap_or_default();
        let incoming = IncomingEvent::new(
            row.event_id,
            row.event_type.clone(),
            u32::try_from(row.event_version).unwrap_or(1),
            row.topic.clone(),
            row.partition_key.clone(),
            headers,
        );
        let mut event = Event {
            incoming,
            handlers: Vec::new(),
            payload: row.payload.as_bytes().to_vec(),
            decoded: Vec::new(),
        };
        match self.registry.route(&row.topic, &row.event_type) {
            Route::Handlers(h) => {
                event.handlers = h.to_vec();
                Item::Event(Box::new(event))
            }
            Route::Ignored => Item::Ignored,
            Route::Unknown => Item::Rejected(Box::new(event.rejected(
                DeadLetterReason::UnknownEventType,
                format!(
                    "no handler for event type `{}` on topic `{}` any more (handled: {})",
                    row.event_type,
                    row.topic,
                    self.registry.known_types(&row.topic)
                ),
                None,
                0,
            ))),
        }
    }

    /// Runs every claimed row in the claiming transaction.
    async fn fast(
        &self,
        tx: &mut PgConnection,
        rows: &[Row],
        items: &mut [Item],
        careful: bool,
    ) -> Result<Batch, Failure> {
        let group = &self.config.group;
        let handling = apply::Handling {
            registry: &self.registry,
            timeout: self.config.handler_timeout,
            careful,
        };
        let ids: Vec<Uuid> = items
            .iter()
            .zip(rows)
            .filter(|(i, _)| matches!(i, Item::Event(_)))
            .map(|(_, r)| r.event_id)
            .collect();
        let fresh: HashSet<Uuid> = if ids.is_empty() {
            HashSet::new()
        } else {
            sqlx::query_scalar(INSERT_PROCESSED)
                .bind(group)
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| Failure::Outage(during(super::dedup::PROCESSED)(e)))?
                .into_iter()
                .collect()
        };
        let mut batch = Batch::default();
        let mut settled = Vec::with_capacity(rows.len());
        let mut letters = Vec::new();
        let mut follow_ups = apply::FollowUps::default();
        for (i, (item, row)) in items.iter_mut().zip(rows).enumerate() {
            match item {
                Item::Event(event) => {
                    if fresh.contains(&row.event_id) {
                        let t = std::time::Instant::now();
                        follow_ups.at = i;
                        apply::run_handlers(tx, handling, event, &mut follow_ups)
                            .await
                            .map_err(|f| f.at(i))?;
                        batch.handler_time += t.elapsed();
                        batch.processed += 1;
                    } else {
                        batch.duplicates += 1;
                    }
                    settled.push(row.event_id);
                }
                Item::Ignored => {
                    batch.ignored += 1;
                    settled.push(row.event_id);
                }
                Item::Rejected(rejected) => letters.push((row, &**rejected)),
            }
        }
        apply::seal(tx).await?;
        follow_ups.write(tx).await?;
        sqlx::query(MARK_PROCESSED)
            .bind(&settled)
            .bind(1_i32)
            .bind(group)
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::Outage(during(SETTLE)(e)))?;
        if !letters.is_empty() {
            let new: Vec<NewDeadLetter<'_>> = letters
                .iter()
                .map(|(row, rejected)| NewDeadLetter {
                    topic: &row.topic,
                    partition: row.partition,
                    offset: row.offset,
                    rejected,
                })
                .collect();
            dead_letter::insert(tx, group, &new)
                .await
                .map_err(|e| Failure::Outage(super::dedup::refused_dead_letters(e)))?;
            for (row, rejected) in &letters {
                sqlx::query(MARK_DEAD)
                    .bind(row.event_id)
                    .bind(pg_text(&rejected.error).as_ref())
                    .bind(0_i32)
                    .bind(group)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| Failure::Outage(during(SETTLE)(e)))?;
            }
            batch.rejected = letters
                .iter()
                .map(|(_, r)| (r.reason, r.error.clone()))
                .collect();
        }
        Ok(batch)
    }

    /// Records a failed attempt on one row (its key waits `delay_secs`).
    async fn record_failure(&self, row: &Row, error: &str, delay_secs: f64) -> Result<(), Trouble> {
        let result = async {
            let mut tx = self.pool.begin().await?;
            self.wait_for_partition(&mut tx, row).await?;
            sqlx::query(RECORD_FAILURE)
                .bind(row.event_id)
                .bind(pg_text(error).as_ref())
                .bind(delay_secs)
                .bind(&self.config.group)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
        .await;
        result.map_err(during(SETTLE))
    }

    /// Dead-letters one row and takes it out of the queue.
    async fn dead_letter(
        &self,
        row: &Row,
        rejected: &Rejected,
        attempts: i32,
    ) -> Result<(), Trouble> {
        let result = async {
            let mut tx = self.pool.begin().await?;
            self.wait_for_partition(&mut tx, row).await?;
            let letter = NewDeadLetter {
                topic: &row.topic,
                partition: row.partition,
                offset: row.offset,
                rejected,
            };
            dead_letter::insert(&mut tx, &self.config.group, &[letter])
                .await
                .map_err(super::dedup::refused_dead_letters)?;
            let marked = sqlx::query(MARK_DEAD)
                .bind(row.event_id)
                .bind(pg_text(&rejected.error).as_ref())
                .bind(attempts)
                .bind(&self.config.group)
                .execute(&mut *tx)
                .await
                .map_err(during(SETTLE))?;
            tx.commit().await?;
            Ok::<_, Trouble>(marked.rows_affected())
        }
        .await;
        match result {
            Ok(n) => {
                self.stats.dead_lettered.fetch_add(n, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn wait_for_partition(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        row: &Row,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(WAIT_FOR_PARTITION)
            .bind(&self.config.group)
            .bind(&row.topic)
            .bind(row.partition)
            .execute(&mut **tx)
            .await
            .map(|_| ())
    }
}

/// What one committed processor transaction did.
#[derive(Default)]
struct Batch {
    processed: u64,
    handler_time: std::time::Duration,
    duplicates: u64,
    ignored: u64,
    rejected: Vec<(DeadLetterReason, String)>,
}

impl Batch {
    fn apply(self, stats: &Stats) {
        stats.processed.fetch_add(self.processed, Ordering::Relaxed);
        stats
            .duplicates
            .fetch_add(self.duplicates, Ordering::Relaxed);
        stats.ignored.fetch_add(self.ignored, Ordering::Relaxed);
        if !self.rejected.is_empty() {
            stats
                .dead_lettered
                .fetch_add(self.rejected.len() as u64, Ordering::Relaxed);
        }
    }
}
