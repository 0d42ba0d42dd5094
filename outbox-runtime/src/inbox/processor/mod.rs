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
//! The claimed rows' handlers run in the claiming transaction, which
//! records them in `processed_event` and marks them processed. They run in
//! segments, each after a savepoint; the rows that failed before (retries,
//! each its key's only row in the round) run first, in a segment of their
//! own, apart from the rest. If a handler fails, its segment is taken
//! back to the savepoint, the failure is recorded on that row in the same
//! transaction (attempts, last error, next attempt after an exponential
//! back-off; after `max_attempts` it is dead-lettered), the row and the
//! later rows of its key are left for a later round, and the rows before it
//! run again, then the rest: each event's handlers run at most twice, and
//! the batch still commits once. A row retried now is claimed without the
//! rows behind it (they would most likely be left again).
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
use super::dedup::UNDO;
use super::dispatch::{Registry, Route};
use super::record::{Event, Rejected};
use super::txn::{self, Broken, GuardedConn};

mod failure;
mod segments;
mod window;
use super::{ConsumerConfig, Stats};
use crate::backoff::Health;
use crate::refusal::{Statement, Trouble};
use failure::Failed;

/// The claim of stored events, as a refusal names it.
const CLAIM: Statement = Statement {
    name: "consumer (inbox): claim stored events",
    needs: "SELECT, UPDATE ON inbox_event",
};

/// Reading whether the processor runs in the progress mode.
const MODE: Statement = Statement {
    name: "consumer (inbox): read the processor's mode",
    needs: "SELECT ON inbox_progress_consumer",
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

/// The keys waiting for a retry: each key's first row that failed before
/// (its next attempt in the future, or due now: then it is claimed alone,
/// without the rows behind it, which would most likely be left behind it
/// again and take the round's room from other keys). Few (one per failing
/// key), found on the small index of rows waiting for a retry, and made one
/// `jsonb` object (`topic/key` → `seq`; a topic name has no `/`), so that
/// checking a row against them is one lookup whatever the planner's
/// statistics say: an anti-join per row on `inbox_event`, planned on stale
/// statistics after the inbox grew, once took 12 s per claim at 6,000
/// pending rows, and a join with the waiting keys as rows 140 ms at 9,000.
const WAITING: &str = r#"
WITH waiting AS MATERIALIZED (
    SELECT COALESCE(jsonb_object_agg(k, s), '{}') AS keys FROM (
        SELECT b.topic || '/' || b.partition_key AS k, min(b.seq) AS s FROM inbox_event b
        WHERE b.consumer = $1 AND NOT b.processed AND b.dead_lettered_at IS NULL
          AND b.next_attempt_at IS NOT NULL AND (b.next_attempt_at > now() OR b.attempts > 0)
        GROUP BY 1) x)"#;

/// The claimable rows are those of `inbox_event e` (with the [`WAITING`]
/// keys)…
const WITH_WAITING: &str = "inbox_event e CROSS JOIN waiting w";

/// …that are not waiting for a retry, and have no earlier row of their key
/// waiting for one or retried now.
const CLAIMABLE: &str = r#"
      (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
  AND COALESCE((w.keys ->> (e.topic || '/' || e.partition_key))::int8 >= e.seq, true)"#;

/// The partitions of the oldest claimable rows (of this processor's share).
fn candidates_sql() -> String {
    format!(
        r#"{WAITING}
SELECT DISTINCT topic || '/' || "partition" FROM (
    SELECT e.topic, e."partition" FROM {WITH_WAITING}
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
        r#"{WAITING}
SELECT c.event_id, c.topic, c.partition, c.offset, c.partition_key, c.event_type,
       c.event_version, c.payload, c.headers, c.attempts, c.unkeyed
FROM (
    SELECT l.*, sum(l.bytes) OVER (ORDER BY l.seq ROWS UNBOUNDED PRECEDING) - l.bytes AS before
    FROM (
        SELECT e.seq, e.event_id, e.topic, e."partition" AS partition,
               COALESCE(e."offset", -1) AS offset,
               COALESCE(e.partition_key, '') AS partition_key,
               COALESCE(e.event_type, '') AS event_type,
               e.event_version, e.payload::text AS payload, e.headers::text AS headers,
               e.attempts, e.next_attempt_at IS NULL AS unkeyed,
               octet_length(e.payload::text) + octet_length(e.headers::text)
                 + octet_length(COALESCE(e.partition_key, '')) AS bytes
        FROM {WITH_WAITING}
        WHERE NOT e.processed AND e.dead_lettered_at IS NULL AND e.consumer = $1
          AND e.topic || '/' || e."partition" = ANY($2)
          AND {CLAIMABLE}
        ORDER BY e.seq
        LIMIT $3
        FOR UPDATE OF e SKIP LOCKED) l
) c
WHERE c.before < $4
ORDER BY c.seq"#
    )
}

/// Dedup mode: each key with set-aside rows, and its first row (`k`).
/// Every row a dedup-mode consumer sets aside has `next_attempt_at` (the
/// failing one its retry, the ones behind it the time they were set
/// aside), so they are all on the small index of rows waiting for a retry,
/// ordered by key and `seq`: one probe per key finds the next key and its
/// first row, whatever the number of rows waiting behind them — the scan of
/// every pending row that [`CLAIMABLE`] costs took 25–75 ms per statement
/// at 23,000 set-aside rows, this 1–10 ms.
const KEYS: &str = r#"
WITH RECURSIVE k AS (
    (SELECT e.seq, e.topic, e."partition", e.partition_key, e.attempts, e.next_attempt_at
     FROM inbox_event e
     WHERE e.consumer = $1 AND NOT e.processed AND e.dead_lettered_at IS NULL
       AND e.next_attempt_at IS NOT NULL
     ORDER BY e.topic, e.partition_key, e.seq LIMIT 1)
    UNION ALL
    SELECT n.* FROM k CROSS JOIN LATERAL (
        SELECT e.seq, e.topic, e."partition", e.partition_key, e.attempts, e.next_attempt_at
        FROM inbox_event e
        WHERE e.consumer = $1 AND NOT e.processed AND e.dead_lettered_at IS NULL
          AND e.next_attempt_at IS NOT NULL
          AND (e.topic, e.partition_key) > (k.topic, k.partition_key)
        ORDER BY e.topic, e.partition_key, e.seq LIMIT 1) n
)"#;

/// Dedup mode: the partitions of the keys whose first row is due (of this
/// processor's share), oldest first.
fn keyed_candidates_sql() -> String {
    format!(
        r#"{KEYS}
SELECT DISTINCT topic || '/' || "partition" FROM (
    SELECT topic, "partition" FROM k
    WHERE next_attempt_at <= now()
      AND mod(mod(hashtext(topic)::bigint + "partition", $3) + $3, $3) = $4
    ORDER BY seq
    LIMIT $2) s"#
    )
}

/// Dedup mode: the locked partitions' due keys' rows, in received order,
/// with the row count and byte budget of [`claim_sql`]. A key whose first
/// row failed before gives that row alone (a retry); another gives its rows
/// from the first up to the next that failed or is not due, at most a share
/// of the batch each (twice the batch over the due keys, so that one long
/// key does not lock rows the batch cannot take). A key whose first row
/// another transaction holds gives nothing: its later rows wait for it.
fn keyed_claim_sql() -> String {
    format!(
        r#"{KEYS},
share AS (
    SELECT 1 + 2 * $3 / greatest(count(*), 1) AS n FROM k
    WHERE k.next_attempt_at <= now() AND k.topic || '/' || k."partition" = ANY($2)
)
SELECT c.event_id, c.topic, c.partition, c.offset, c.partition_key, c.event_type,
       c.event_version, c.payload, c.headers, c.attempts, false AS unkeyed
FROM (
    SELECT l.*, sum(l.bytes) OVER (ORDER BY l.seq ROWS UNBOUNDED PRECEDING) - l.bytes AS before
    FROM (
        SELECT r.* FROM (
            SELECT r.*,
                   bool_or(r.seq > k.seq AND (r.attempts > 0 OR r.due > now())) OVER w
                     AS blocked,
                   min(r.seq) OVER w = k.seq AS from_first
            FROM k CROSS JOIN share CROSS JOIN LATERAL (
                SELECT e.seq, e.event_id, e.topic, e."partition" AS partition,
                       COALESCE(e."offset", -1) AS offset,
                       COALESCE(e.partition_key, '') AS partition_key,
                       COALESCE(e.event_type, '') AS event_type,
                       e.event_version, e.payload::text AS payload, e.headers::text AS headers,
                       e.attempts, e.next_attempt_at AS due,
                       octet_length(e.payload::text) + octet_length(e.headers::text)
                         + octet_length(COALESCE(e.partition_key, '')) AS bytes
                FROM inbox_event e
                WHERE e.consumer = $1 AND e.topic = k.topic AND e.partition_key = k.partition_key
                  AND NOT e.processed AND e.dead_lettered_at IS NULL
                  AND e.next_attempt_at IS NOT NULL AND e.seq >= k.seq
                ORDER BY e.seq
                LIMIT CASE WHEN k.attempts > 0 THEN 1 ELSE share.n END
                FOR UPDATE OF e SKIP LOCKED) r
            WHERE k.next_attempt_at <= now() AND k.topic || '/' || k."partition" = ANY($2)
            WINDOW w AS (PARTITION BY k.topic, k.partition_key ORDER BY r.seq
                         ROWS UNBOUNDED PRECEDING)
        ) r
        WHERE NOT r.blocked AND r.from_first
        ORDER BY r.seq
        LIMIT $3
    ) l
) c
WHERE c.before < $4
ORDER BY c.seq"#
    )
}

/// How often a dedup-mode processor also claims the way inbox mode does,
/// for rows without `next_attempt_at` (stored by an inbox-mode instance of
/// the group, before or during a switch of modes), which the per-key claim
/// does not see. A dedup-mode consumer never writes such rows: a processor
/// sweeps at its start and then every interval, round after round until
/// one claims none of them. Between sweeps a later row of their key could
/// be applied before them: a group runs in one mode (to switch, stop every
/// instance, then start them in the other mode).
const SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// Seconds until the next retry of the consumer's rows is due.
const NEXT_RETRY: &str = "
SELECT EXTRACT(EPOCH FROM min(next_attempt_at) - now())::float8
FROM inbox_event
WHERE consumer = $1 AND NOT processed AND dead_lettered_at IS NULL AND next_attempt_at > now()";

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

/// A failed attempt on a row not applied yet (`processed_at` NULL: in the
/// progress mode rows are stored with `processed` true, see
/// [`super::progress`]; the row goes back to the per-key claim's queue).
const RECORD_FAILURE: &str = "\
UPDATE inbox_event
SET processed = false, attempts = attempts + 1, last_error = $2, last_attempt_at = now(),
    next_attempt_at = now() + make_interval(secs => $3)
WHERE consumer = $4 AND event_id = $1 AND processed_at IS NULL";

const MARK_DEAD: &str = "\
UPDATE inbox_event
SET processed = false, attempts = attempts + $3, last_error = $2, last_attempt_at = now(),
    dead_lettered_at = now(), next_attempt_at = NULL
WHERE consumer = $4 AND event_id = $1 AND processed_at IS NULL";

/// Moves the claimed retries that are their key's only row in the batch
/// (every retry, as the claims take them: a key's retry is claimed without
/// the rows behind it) to the front, in received order, so that they run in
/// one segment rather than one each: a retry that fails again without
/// having changed anything (a refusal) then costs no savepoint of its own.
/// Per-key order is kept: no other row of their key is in the batch. A
/// retry that fails having written takes its segment back, and the retries
/// before it run again (once: the next segment starts after it).
fn retries_first(rows: &mut Vec<Row>) {
    if !rows.iter().any(|r| r.attempts > 0) {
        return;
    }
    let mut per_key: std::collections::HashMap<(&str, &str), u32> =
        std::collections::HashMap::new();
    for r in rows.iter() {
        *per_key
            .entry((r.topic.as_str(), r.partition_key.as_str()))
            .or_default() += 1;
    }
    let alone: Vec<bool> = rows
        .iter()
        .map(|r| r.attempts > 0 && per_key[&(r.topic.as_str(), r.partition_key.as_str())] == 1)
        .collect();
    // Stable: retries keep their received order, the others theirs.
    let (first, rest): (Vec<_>, Vec<_>) = std::mem::take(rows)
        .into_iter()
        .zip(alone)
        .partition(|(_, alone)| *alone);
    rows.extend(first.into_iter().chain(rest).map(|(row, _)| row));
}

#[derive(sqlx::FromRow)]
struct Row {
    /// Received order (read by the progress mode's windows only).
    #[sqlx(default)]
    seq: i64,
    /// Payload, headers and key, in bytes (the progress mode's windows).
    #[sqlx(default)]
    bytes: i64,
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
    /// Stored without `next_attempt_at` (by an inbox-mode instance): the
    /// per-key claim of dedup mode does not see it.
    unkeyed: bool,
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
    /// Dedup mode and the progress mode: the claim per key (see [`KEYS`]).
    keyed: (String, String),
    /// The progress mode's start (see [`super::progress`]), once read:
    /// `Some(None)` in the default mode.
    progress: std::sync::OnceLock<Option<String>>,
    /// The progress mode: the partitions' windows, as this processor last
    /// recorded them.
    windows: std::sync::Mutex<std::collections::HashMap<(String, i32), super::progress::Window>>,
    /// Dedup mode: when the last sweep ended (see [`SWEEP_INTERVAL`]).
    swept: std::sync::Mutex<Option<std::time::Instant>>,
    latency: crate::metrics::ConsumerLatency,
}

/// How a round claims its rows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Claiming {
    /// Inbox mode: the pending rows in received order.
    InboxMode,
    /// Dedup mode: per key ([`KEYS`]).
    PerKey,
    /// Dedup mode, the inbox mode's way (see [`SWEEP_INTERVAL`]).
    Sweep,
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
        let keyed = (keyed_candidates_sql(), keyed_claim_sql());
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
            keyed,
            progress: std::sync::OnceLock::new(),
            windows: Default::default(),
            swept: std::sync::Mutex::new(None),
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
                // Until the next poll, or the next retry if it is due sooner.
                let poll = self.config.processor_poll_interval;
                let wait = self.next_retry().await.map_or(poll, |due| due.min(poll));
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(wait) => {}
                    _ = shutdown.cancelled() => {}
                }
            }
        }
        conn.release().await;
    }

    /// This round's candidate and claim statements, and how it claims: per
    /// key in dedup mode, but the way inbox mode claims at the start and
    /// every [`SWEEP_INTERVAL`], until a round claims no row the per-key
    /// claim misses ([`Self::swept`]).
    fn claim_statements(&self, claiming: Option<Claiming>) -> (&str, &str, Claiming) {
        let (candidates, claim) = &self.keyed;
        if claiming == Some(Claiming::PerKey) {
            return (candidates, claim, Claiming::PerKey);
        }
        if self.config.mode == super::Mode::Dedup {
            let swept = self.swept.lock().unwrap_or_else(|p| p.into_inner());
            if swept.is_some_and(|at| at.elapsed() < SWEEP_INTERVAL) {
                return (candidates, claim, Claiming::PerKey);
            }
            return (&self.candidates_sql, &self.claim_sql, Claiming::Sweep);
        }
        (&self.candidates_sql, &self.claim_sql, Claiming::InboxMode)
    }

    /// A round claimed `rows`: a sweep ends when none of them is one the
    /// per-key claim misses.
    fn swept(&self, claiming: Claiming, rows: &[Row]) {
        if claiming == Claiming::Sweep && !rows.iter().any(|r| r.unkeyed) {
            *self.swept.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
        }
    }

    /// How long until this consumer's next row waiting for a retry is due,
    /// if one is (`None` also when the database does not answer: the
    /// next round finds out).
    async fn next_retry(&self) -> Option<std::time::Duration> {
        let secs: Option<f64> = sqlx::query_scalar(NEXT_RETRY)
            .bind(&self.config.group)
            .fetch_one(&self.pool)
            .await
            .ok()
            .flatten();
        secs.map(|s| std::time::Duration::from_secs_f64(s.clamp(0.0, 86_400.0)))
    }

    /// One round: in the default mode, one transaction that locks
    /// partitions, claims their next rows and processes them; in the
    /// progress mode, a round of the per-key claim (rows set aside or
    /// failed), then one of the windows (see [`super::progress`]). Returns
    /// how many rows were settled (processed, dead-lettered or failed).
    pub(crate) async fn round(
        &self,
        conn: &mut GuardedConn,
        careful: bool,
    ) -> Result<Round, Trouble> {
        let Some(start) = self.progress_start().await? else {
            return self.claimed_round(conn, careful, None).await;
        };
        let keyed = match self
            .claimed_round(conn, careful, Some(Claiming::PerKey))
            .await?
        {
            Round::Settled(n) => n,
            Round::Suspect => return Ok(Round::Suspect),
        };
        match self.window_round(conn, careful, &start).await? {
            Round::Settled(n) => Ok(Round::Settled(keyed + n)),
            Round::Suspect => Ok(Round::Suspect),
        }
    }

    /// The progress mode's start, if the consumer is in that mode (inbox
    /// mode only: a dedup-mode consumer's inbox rows are its rare path),
    /// read once.
    async fn progress_start(&self) -> Result<Option<String>, Trouble> {
        if let Some(start) = self.progress.get() {
            return Ok(start.clone());
        }
        let start = if self.config.mode == super::Mode::Inbox {
            let mut conn = self.pool.acquire().await.map_err(during(MODE))?;
            super::progress::start(&mut conn, &self.config.group)
                .await
                .map_err(|e| Trouble::from(e).during(MODE))?
        } else {
            None
        };
        Ok(self.progress.get_or_init(|| start).clone())
    }

    /// One transaction: lock partitions, claim their next rows (`claiming`,
    /// or as the mode says), process them.
    async fn claimed_round(
        &self,
        conn: &mut GuardedConn,
        careful: bool,
        claiming: Option<Claiming>,
    ) -> Result<Round, Trouble> {
        let group = &self.config.group;
        let limit = i64::try_from(self.config.processor_batch_size).unwrap_or(i64::MAX);
        let (candidates_sql, claim_sql, claiming) = self.claim_statements(claiming);
        // The per-key statements are planned at each execution (unnamed): a
        // plan cached while the inbox was nearly empty scanned every
        // pending row per key once it had grown (1–1.7 s per statement at
        // 23,000 rows).
        let cached = claiming != Claiming::PerKey;
        let claim_started = std::time::Instant::now();
        let mut tx = conn.begin().await.map_err(during(super::dedup::TX_GUARD))?;
        let candidates: Vec<String> = sqlx::query_scalar(candidates_sql)
            .persistent(cached)
            .bind(group)
            .bind(limit)
            .bind(self.workers as i64)
            .bind(self.worker as i64)
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        if candidates.is_empty() {
            self.swept(claiming, &[]);
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
        let mut rows: Vec<Row> = sqlx::query_as(claim_sql)
            .persistent(cached)
            .bind(group)
            .bind(&locked)
            .bind(limit)
            .bind(i64::try_from(self.config.max_batch_bytes).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        self.swept(claiming, &rows);
        if rows.is_empty() {
            return Ok(Round::Settled(0));
        }
        retries_first(&mut rows);
        let claim_time = claim_started.elapsed();
        let started = std::time::Instant::now();
        let mut items: Vec<Item> = rows.iter().map(|r| self.item(r)).collect();
        let work = match self
            .segments(&mut tx, &rows, &mut items, careful, true)
            .await
        {
            Ok(work) => work,
            Err(Failure::Outage(error)) => return Err(error),
            // Every event was checked and still: an outage of unknown cause.
            Err(Failure::Suspect(error)) if careful => return Err(error.into()),
            Err(Failure::Suspect(error)) => {
                tracing::info!(%error, "a handler broke the transaction: checking event by event");
                return Ok(Round::Suspect);
            }
            // Found where the transaction cannot be taken back to a
            // savepoint (a careful run found a handler that ended it, or
            // the follow-up events of a handler are refused): the whole
            // transaction rolls back and the failure is settled alone.
            Err(Failure::Handler {
                at, handler, error, ..
            }) => {
                drop(tx);
                conn.settle().await;
                self.stats.handler_failures.fetch_add(1, Ordering::Relaxed);
                self.settle_alone(&rows[at], &items[at], handler, &error)
                    .await?;
                return Ok(Round::Settled(1));
            }
            Err(Failure::Rejected { at, rejected }) => {
                drop(tx);
                conn.settle().await;
                self.dead_letter(&rows[at], &rejected, 0).await?;
                super::dedup::log_rejected(group, &[(rejected.reason, rejected.error.clone())]);
                return Ok(Round::Settled(1));
            }
        };
        tx.commit().await?;
        let settled = self.committed(work, &rows, started, claim_time, locked.len());
        Ok(Round::Settled(settled))
    }

    /// Reports a committed round's work; returns how many rows it settled.
    fn committed(
        &self,
        work: Work,
        rows: &[Row],
        started: std::time::Instant,
        claim_time: std::time::Duration,
        partitions: usize,
    ) -> usize {
        let group = &self.config.group;
        self.latency.batch.record(started.elapsed());
        let batch = work.batch;
        if batch.processed > 0 {
            self.latency
                .handler
                .record(batch.handler_time.as_secs_f64() / batch.processed as f64);
        }
        if !batch.rejected.is_empty() {
            super::dedup::log_rejected(group, &batch.rejected);
        }
        let settled = work.settled + work.failed.len();
        tracing::debug!(
            claimed = rows.len(),
            settled,
            failed = work.failed.len(),
            partitions,
            claim_ms = claim_time.as_millis() as u64,
            ms = started.elapsed().as_millis() as u64,
            "round settled"
        );
        for failed in &work.failed {
            self.stats.handler_failures.fetch_add(1, Ordering::Relaxed);
            if failed.dead {
                self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
            }
            self.report_failure(&rows[failed.at], failed);
        }
        batch.apply(&self.stats);
        settled
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

/// What one segment's handlers did (not committed yet).
#[derive(Default)]
struct Segment {
    /// Where it ended (exclusive): a retry runs alone.
    end: usize,
    batch: Batch,
    /// Rows to mark processed.
    ids: Vec<Uuid>,
    follow_ups: apply::FollowUps,
}

/// What a round's segments did.
#[derive(Default)]
struct Work {
    batch: Batch,
    ids: Vec<Uuid>,
    failed: Vec<Failed>,
    /// Rows settled: processed (or duplicates, ignored) and dead-lettered.
    settled: usize,
    /// The rows before this index were reached (the others are claimed
    /// again).
    reached: usize,
    /// The rows left for later: failed, or behind a failure of their key.
    left: Vec<bool>,
}

impl Work {
    fn add(&mut self, segment: Segment, follow_ups: &mut apply::FollowUps) {
        let b = segment.batch;
        self.batch.processed += b.processed;
        self.batch.handler_time += b.handler_time;
        self.batch.duplicates += b.duplicates;
        self.batch.ignored += b.ignored;
        self.ids.extend(segment.ids);
        follow_ups.append(segment.follow_ups);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str, attempts: i32, n: u8) -> Row {
        Row {
            seq: i64::from(n),
            bytes: 0,
            event_id: Uuid::from_bytes([n; 16]),
            topic: "t".into(),
            partition: 0,
            offset: i64::from(n),
            partition_key: key.into(),
            event_type: String::new(),
            event_version: 1,
            payload: String::new(),
            headers: String::new(),
            attempts,
            unkeyed: false,
        }
    }

    /// Retries alone in their key go first, in received order; a retry
    /// with other rows of its key in the batch stays in place (its key's
    /// order), and the other rows keep theirs.
    #[test]
    fn retries_alone_in_their_key_go_first_in_order() {
        let mut rows = vec![
            row("a", 0, 1),
            row("b", 1, 2),
            row("c", 0, 3),
            row("d", 2, 4),
            row("c", 0, 5),
            row("e", 1, 6),
            row("e", 0, 7),
        ];
        retries_first(&mut rows);
        let order: Vec<i64> = rows.iter().map(|r| r.offset).collect();
        assert_eq!(order, [2, 4, 1, 3, 5, 6, 7]);
        let mut none = vec![row("a", 0, 1), row("b", 0, 2)];
        retries_first(&mut none);
        assert_eq!(none.iter().map(|r| r.offset).collect::<Vec<_>>(), [1, 2]);
    }
}
