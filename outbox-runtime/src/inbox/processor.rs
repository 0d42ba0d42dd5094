//! Inbox mode, the processing half: claims stored, unprocessed rows and
//! runs their handlers, marking them processed in the same transaction.
//!
//! Work is divided by Kafka partition. A transaction first takes a
//! transaction-scoped advisory lock on (consumer, topic, partition) — so one
//! processor at a time, in any process, works on a partition — then claims
//! that partition's next rows in received order (`seq`) with `FOR UPDATE SKIP
//! LOCKED`. A key's rows are in one partition, so per-key order is kept; a
//! row waiting for a retry (`next_attempt_at` in the future) holds back the
//! later rows of its key, and only those: other keys continue.
//!
//! Fast path: the claimed rows' handlers all run in the claiming
//! transaction, which records them in `processed_event` and marks them
//! processed. Slow path: if a handler fails, the transaction rolls back, the
//! failure is recorded on that row alone (attempts, last error, next attempt
//! after an exponential back-off; after `max_attempts` it is dead-lettered),
//! and the next claim takes the partition's rows again — without the failed
//! row and the later rows of its key.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use outbox_core::{Headers, IncomingEvent};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::apply::{self, Failure};
use super::backoff;
use super::db::{Health, pg_text};
use super::dead_letter::{self, DeadLetterReason, NewDeadLetter};
use super::dispatch::{Registry, Route};
use super::record::{Event, Rejected};
use super::{ConsumerConfig, Stats};

/// The partitions with pending rows, by a loose index scan of
/// `ix_inbox_event_pending` (one index probe per partition).
const PENDING_PARTITIONS: &str = r#"
WITH RECURSIVE p AS (
    (SELECT topic, "partition" FROM inbox_event
     WHERE consumer = $1 AND NOT processed AND dead_lettered_at IS NULL
     ORDER BY topic, "partition" LIMIT 1)
    UNION ALL
    SELECT n.topic, n."partition" FROM p, LATERAL (
        SELECT topic, "partition" FROM inbox_event
        WHERE consumer = $1 AND NOT processed AND dead_lettered_at IS NULL
          AND (topic, "partition") > (p.topic, p."partition")
        ORDER BY topic, "partition" LIMIT 1) n
)
SELECT topic, "partition" FROM p"#;

const LOCK_PARTITION: &str =
    "SELECT pg_try_advisory_xact_lock(hashtextextended($1 || '/' || $2 || '/' || $3::text, 0))";

const WAIT_FOR_PARTITION: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || $2 || '/' || $3::text, 0))";

const CLAIM: &str = r#"
SELECT event_id, topic, "partition" AS partition, COALESCE("offset", -1) AS offset,
       COALESCE(partition_key, '') AS partition_key, COALESCE(event_type, '') AS event_type,
       event_version, payload::text AS payload, headers::text AS headers, attempts
FROM inbox_event e
WHERE consumer = $1 AND topic = $2 AND "partition" = $3
  AND NOT processed AND dead_lettered_at IS NULL
  AND (next_attempt_at IS NULL OR next_attempt_at <= now())
  AND NOT EXISTS (
      SELECT 1 FROM inbox_event b
      WHERE b.consumer = $1 AND b.topic = $2 AND b.partition_key = e.partition_key
        AND NOT b.processed AND b.dead_lettered_at IS NULL
        AND b.next_attempt_at IS NOT NULL AND b.next_attempt_at > now()
        AND b.seq < e.seq)
ORDER BY seq
LIMIT $4
FOR UPDATE SKIP LOCKED"#;

const INSERT_PROCESSED: &str = "\
INSERT INTO processed_event (consumer, event_id)
SELECT $1, e FROM UNNEST($2::uuid[]) AS u(e)
ON CONFLICT DO NOTHING
RETURNING event_id";

const MARK_PROCESSED: &str = "\
UPDATE inbox_event
SET processed = true, processed_at = now(), attempts = attempts + $2,
    last_attempt_at = now(), next_attempt_at = NULL
WHERE event_id = ANY($1)";

const RECORD_FAILURE: &str = "\
UPDATE inbox_event
SET attempts = attempts + 1, last_error = $2, last_attempt_at = now(),
    next_attempt_at = now() + make_interval(secs => $3)
WHERE event_id = $1 AND NOT processed";

const MARK_DEAD: &str = "\
UPDATE inbox_event
SET attempts = attempts + $3, last_error = $2, last_attempt_at = now(),
    dead_lettered_at = now(), next_attempt_at = NULL
WHERE event_id = $1 AND NOT processed";

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
    pub pool: PgPool,
    pub config: Arc<ConsumerConfig>,
    pub registry: Arc<Registry>,
    pub stats: Arc<super::ConsumerStats>,
    pub wake: Arc<Notify>,
    pub worker: usize,
}

impl Processor {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut db = Health::new(
            "database (inbox processor)",
            self.config.outage_backoff,
            self.config.outage_backoff_max,
        );
        let mut rotation = self.worker;
        while !shutdown.is_cancelled() {
            let partitions: Vec<(String, i32)> = match sqlx::query_as(PENDING_PARTITIONS)
                .bind(&self.config.group)
                .fetch_all(&self.pool)
                .await
            {
                Ok(p) => p,
                Err(error) => {
                    let wait = db.down(&error);
                    apply::pause(wait, &shutdown).await;
                    continue;
                }
            };
            let mut worked = false;
            if !partitions.is_empty() {
                let k = rotation % partitions.len();
                rotation = rotation.wrapping_add(1);
                for (topic, partition) in partitions[k..].iter().chain(&partitions[..k]) {
                    if shutdown.is_cancelled() {
                        break;
                    }
                    match self.partition(topic, *partition).await {
                        Ok(n) => {
                            db.up();
                            worked |= n > 0;
                        }
                        Err(error) => {
                            let wait = db.down(&error);
                            apply::pause(wait, &shutdown).await;
                            break;
                        }
                    }
                }
            }
            if !worked {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(self.config.processor_poll_interval) => {}
                    _ = shutdown.cancelled() => {}
                }
            }
        }
    }

    /// Processes the next claimable rows of one partition; returns how many
    /// rows were settled (processed, dead-lettered or failed).
    async fn partition(&self, topic: &str, partition: i32) -> Result<usize, String> {
        let group = &self.config.group;
        let mut tx = self.pool.begin().await.map_err(|e| e.to_string())?;
        let locked: bool = sqlx::query_scalar(LOCK_PARTITION)
            .bind(group)
            .bind(topic)
            .bind(partition)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        if !locked {
            return Ok(0); // another processor has it
        }
        let rows: Vec<Row> = sqlx::query_as(CLAIM)
            .bind(group)
            .bind(topic)
            .bind(partition)
            .bind(i64::try_from(self.config.processor_batch_size).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        if rows.is_empty() {
            return Ok(0);
        }
        let mut items: Vec<Item> = rows.iter().map(|r| self.item(r)).collect();
        match self.fast(&mut tx, &rows, &mut items).await {
            Ok(batch) => {
                tx.commit().await.map_err(|e| e.to_string())?;
                if !batch.rejected.is_empty() {
                    super::dedup::log_rejected(group, &batch.rejected);
                }
                batch.apply(&self.stats);
                Ok(rows.len())
            }
            Err(Failure::Outage(error)) => Err(error),
            Err(Failure::Handler { at, handler, error }) => {
                drop(tx);
                self.stats.handler_failures.fetch_add(1, Ordering::Relaxed);
                let row = &rows[at];
                let attempts = row.attempts.saturating_add(1);
                if u32::try_from(attempts).unwrap_or(u32::MAX) >= self.config.max_attempts {
                    let Item::Event(event) = &items[at] else {
                        return Ok(1);
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
                Ok(1)
            }
            Err(Failure::Rejected { at, rejected }) => {
                drop(tx);
                self.dead_letter(&rows[at], &rejected, 0).await?;
                super::dedup::log_rejected(group, &[(rejected.reason, rejected.error.clone())]);
                Ok(1)
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
        tx: &mut Transaction<'static, Postgres>,
        rows: &[Row],
        items: &mut [Item],
    ) -> Result<Batch, Failure> {
        let group = &self.config.group;
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
                .fetch_all(&mut **tx)
                .await?
                .into_iter()
                .collect()
        };
        let mut batch = Batch::default();
        let mut settled = Vec::with_capacity(rows.len());
        let mut letters = Vec::new();
        for (i, (item, row)) in items.iter_mut().zip(rows).enumerate() {
            match item {
                Item::Event(event) => {
                    if fresh.contains(&row.event_id) {
                        apply::run_handlers(tx, &self.registry, event)
                            .await
                            .map_err(|f| f.at(i))?;
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
        sqlx::query(MARK_PROCESSED)
            .bind(&settled)
            .bind(1_i32)
            .execute(&mut **tx)
            .await?;
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
            dead_letter::insert(tx, group, &new).await?;
            for (row, rejected) in &letters {
                sqlx::query(MARK_DEAD)
                    .bind(row.event_id)
                    .bind(pg_text(&rejected.error).as_ref())
                    .bind(0_i32)
                    .execute(&mut **tx)
                    .await?;
            }
            batch.rejected = letters
                .iter()
                .map(|(_, r)| (r.reason, r.error.clone()))
                .collect();
        }
        Ok(batch)
    }

    /// Records a failed attempt on one row (its key waits `delay_secs`).
    async fn record_failure(&self, row: &Row, error: &str, delay_secs: f64) -> Result<(), String> {
        let result = async {
            let mut tx = self.pool.begin().await?;
            self.wait_for_partition(&mut tx, row).await?;
            sqlx::query(RECORD_FAILURE)
                .bind(row.event_id)
                .bind(pg_text(error).as_ref())
                .bind(delay_secs)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
        .await;
        result.map_err(|e| e.to_string())
    }

    /// Dead-letters one row and takes it out of the queue.
    async fn dead_letter(
        &self,
        row: &Row,
        rejected: &Rejected,
        attempts: i32,
    ) -> Result<(), String> {
        let result = async {
            let mut tx = self.pool.begin().await?;
            self.wait_for_partition(&mut tx, row).await?;
            let letter = NewDeadLetter {
                topic: &row.topic,
                partition: row.partition,
                offset: row.offset,
                rejected,
            };
            dead_letter::insert(&mut tx, &self.config.group, &[letter]).await?;
            let marked = sqlx::query(MARK_DEAD)
                .bind(row.event_id)
                .bind(pg_text(&rejected.error).as_ref())
                .bind(attempts)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(marked.rows_affected())
        }
        .await;
        match result {
            Ok(n) => {
                self.stats.dead_lettered.fetch_add(n, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(e.to_string()),
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
