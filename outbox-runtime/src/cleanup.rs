//! Retention: deleting what the outbox and the consumers no longer need —
//! published `outbox_event` rows, `processed_event` rows, processed
//! `inbox_event` rows and completed saga instances (`outbox_saga`) older
//! than a window — in small batches, each its own
//! short statement, so that no long lock is held and the relay and the
//! consumers keep running.
//!
//! Never deleted: unpublished outbox rows, parked ones (dropped or not),
//! inbox rows not yet processed or dead-lettered. Dead letters only when
//! asked ([`Retention::resolved_dead_letters`], [`Retention::dead_letters`]),
//! each by its own age, and never one marked for retry.
//!
//! The window may not be shorter than the deduplication window: a
//! `processed_event` row is what makes a redelivered event a duplicate, so
//! it must outlive every redelivery (the Kafka retention of the topics and
//! the longest a consumer may lag). [`Retention::validate`] refuses it. A
//! completed saga instance is kept as long, by its own window
//! ([`Retention::completed_sagas`], the window by default): once it is gone,
//! a late message of the instance finds none and changes nothing, but a
//! redelivered start message whose dedup row is gone too would start it
//! again.
//!
//! A scheduled job ([`Cleanup`]) runs the pass periodically with a single
//! leader across processes: the one holding a session-level advisory lock,
//! the outbox's own ([`OutboxScope::cleanup_lock`]: the cleanup jobs of
//! another schema's outbox in the same database have another leader).
//!
//! How the batches walk the tables: `outbox_event` in id order (a keyset
//! cursor, `FOR UPDATE SKIP LOCKED`, bounded by the first row younger than
//! the window, found by a binary search over the primary key: a few dozen
//! index probes, whatever the table's size, instead of a walk over every
//! old row); `processed_event`, `inbox_event` and `dead_letter`, which
//! have no B-tree on their timestamps (adding one would cost every consumed
//! event), by ranges of heap pages (a TID range scan). For the first two,
//! the pages between the first and the last that may hold a row past the
//! window, found over a BRIN index on `processed_at` (a summary per 128
//! pages): a pass with nothing to delete reads next to nothing; the dead
//! letters (kept unless asked, and few) are read whole.
//!
//! With the partitioned layout ([`crate::partition`]), a pass first creates
//! the partitions missing ahead and drops the partitions whose whole range
//! is past the window, with the plan given to [`partition::enable`]
//! (partitions ahead, lock timeout), read back from the tables; a
//! partition whose table stays busy is left for the next pass (counted),
//! and the rest of the pass goes on. Only the legacy and default partitions
//! are then cleaned row by row.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::postgres::Postgres;
use sqlx::{Connection, PgPool};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::ops::format_duration;
use crate::partition;
use crate::scope::OutboxScope;

/// The default deduplication window (7 days).
pub const DEFAULT_DEDUP_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

/// What to delete and how.
#[derive(Debug, Clone)]
pub struct Retention {
    /// Rows older than this are deleted (published outbox rows by
    /// `published_at`, dedup rows and processed inbox rows by `processed_at`).
    pub older_than: Duration,
    /// How long consumers need their dedup rows (at least the topics' Kafka
    /// retention plus the longest consumer lag). `older_than` may not be
    /// shorter.
    pub dedup_window: Duration,
    /// Rows per statement (about, for the page-range passes).
    pub batch_size: i64,
    /// Pause between two statements (gives the I/O to the live traffic).
    pub pause: Duration,
    /// Also delete dead letters resolved (re-driven successfully) longer
    /// ago than this. `None` (the default): keep them.
    pub resolved_dead_letters: Option<Duration>,
    /// Also delete dead letters, resolved or not, whose last failure (or
    /// resolution) is older than this; never one marked for retry. `None`
    /// (the default): keep them. Whatever a deleted dead letter held is
    /// gone: its message is no longer in the database.
    pub dead_letters: Option<Duration>,
    /// Completed saga instances are deleted this long after their
    /// completion. `None` (the default): after `older_than`. Never shorter
    /// than the dedup window.
    pub completed_sagas: Option<Duration>,
}

impl Retention {
    /// A retention of `older_than`, with the default dedup window (7 days),
    /// 1,000 rows per statement and no pause.
    pub fn new(older_than: Duration) -> Self {
        Self {
            older_than,
            dedup_window: DEFAULT_DEDUP_WINDOW,
            batch_size: 1000,
            pause: Duration::ZERO,
            resolved_dead_letters: None,
            dead_letters: None,
            completed_sagas: None,
        }
    }

    /// Keeps completed saga instances `older_than` after their completion
    /// (instead of the window).
    pub fn completed_sagas(mut self, older_than: Duration) -> Self {
        self.completed_sagas = Some(older_than);
        self
    }

    /// Also deletes dead letters resolved longer ago than `older_than`.
    pub fn resolved_dead_letters(mut self, older_than: Duration) -> Self {
        self.resolved_dead_letters = Some(older_than);
        self
    }

    /// Also deletes dead letters (dead or resolved, never marked for retry)
    /// whose last failure or resolution is older than `older_than`.
    pub fn dead_letters(mut self, older_than: Duration) -> Self {
        self.dead_letters = Some(older_than);
        self
    }

    /// Sets the dedup window.
    pub fn dedup_window(mut self, d: Duration) -> Self {
        self.dedup_window = d;
        self
    }

    /// Sets the rows per statement.
    pub fn batch_size(mut self, n: i64) -> Self {
        self.batch_size = n;
        self
    }

    /// Refuses a window shorter than the dedup window, and empty settings.
    pub fn validate(&self) -> Result<()> {
        if self.older_than < self.dedup_window {
            return Err(Error::Config(format!(
                "retention {} is shorter than the dedup window {}: consumers would apply a \
                 redelivered event again once its dedup row is gone; keep at least the dedup \
                 window (pass a longer --older-than, or a shorter --dedup-window if the topics' \
                 Kafka retention and the consumers' lag allow it)",
                format_duration(self.older_than),
                format_duration(self.dedup_window)
            )));
        }
        if self.older_than.is_zero() {
            return Err(Error::Config("retention must be > 0".into()));
        }
        if let Some(sagas) = self.completed_sagas.filter(|d| *d < self.dedup_window) {
            return Err(Error::Config(format!(
                "the completed sagas' retention {} is shorter than the dedup window {}: a \
                 redelivered start message would start a deleted instance again",
                format_duration(sagas),
                format_duration(self.dedup_window)
            )));
        }
        if self.resolved_dead_letters.is_some_and(|d| d.is_zero())
            || self.dead_letters.is_some_and(|d| d.is_zero())
        {
            return Err(Error::Config(
                "the dead letters' retention must be > 0".into(),
            ));
        }
        if !(1..=100_000).contains(&self.batch_size) {
            return Err(Error::Config(format!(
                "cleanup batch size must be 1..=100000, got {}",
                self.batch_size
            )));
        }
        Ok(())
    }
}

/// Rows one cleanup pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CleanupReport {
    /// Published `outbox_event` rows (and cancelled scheduled ones).
    pub outbox_events: u64,
    /// `processed_event` rows.
    pub processed_events: u64,
    /// Processed `inbox_event` rows.
    pub inbox_events: u64,
    /// `dead_letter` rows (only with a dead letters' retention).
    pub dead_letters: u64,
    /// Statements run.
    pub statements: u64,
    /// Partitions dropped (partitioned layout).
    pub partitions_dropped: u64,
    /// Partitions past the window kept: they hold rows still needed
    /// (unpublished, parked, unprocessed or younger by their own
    /// timestamp).
    pub partitions_kept: u64,
    /// Partitions past the window left for the next pass: their table
    /// stayed locked longer than the lock timeout.
    pub partitions_busy: u64,
    /// Positions of the progress mode no lane stands at any more (of those
    /// recorded within the window, one a minute per set of slots stays).
    pub positions: u64,
    /// Completed saga instances (`outbox_saga`).
    pub sagas: u64,
}

/// The first row at or after `$1` (a probe of the bound's binary search).
fn outbox_probe(table: &str) -> String {
    format!("SELECT created_at FROM {table} WHERE id >= $1 ORDER BY id LIMIT 1")
}

/// A batch of the rows to delete: published before the cutoff `$3`,
/// scheduled events cancelled before it, or, in the progress mode, rows
/// created before it and passed by their slot's position (see
/// [`crate::relay::progress`]); ids after `$1` and before `$2`, at most
/// `$4`. Rows an operator dropped stay (for the record).
fn outbox_batch(table: &str) -> String {
    format!(
        "\
WITH RECURSIVE {positions},
batch AS (
    SELECT o.id FROM {table} o LEFT JOIN pos ON pos.slot = o.lane_slot
    WHERE o.id > $1 AND o.id < $2
      AND (o.published_at < $3
           OR (o.discard_reason = 'cancelled' AND o.discarded_at < $3
               AND o.published_at IS NULL)
           OR (pos.slot IS NOT NULL AND o.created_at < $3 AND o.txid IS NOT NULL
               AND o.published_at IS NULL AND o.parked_at IS NULL AND o.held_until IS NULL
               AND {passed}))
    ORDER BY o.id LIMIT $4
    FOR UPDATE OF o SKIP LOCKED
), gone AS (
    DELETE FROM {table} o USING batch b WHERE o.id = b.id RETURNING o.id
)
SELECT count(*), max(id) FROM gone",
        positions = crate::relay::progress::POSITIONS,
        passed = crate::relay::progress::passed("o"),
    )
}

/// Rows per page of a table, and its size in pages.
const TABLE_PAGES: &str = "\
SELECT CASE WHEN c.relpages > 0 AND c.reltuples > 0
            THEN c.reltuples / c.relpages ELSE 100 END::float8,
       (pg_relation_size(c.oid) / current_setting('block_size')::bigint)::bigint
FROM pg_class c WHERE c.oid = $1::regclass";

/// The first and the last heap page of `{table}` holding a processed row
/// older than `$1` (over the BRIN index on `processed_at`).
const PROCESSED_PAGES: &str = "\
SELECT (min(ctid)::text::point)[0]::int8, (max(ctid)::text::point)[0]::int8
FROM {table} WHERE processed_at < $1";

const PROCESSED_BATCH: &str = "\
DELETE FROM {table}
WHERE ctid >= $1::tid AND ctid < $2::tid AND processed_at < $3";

const INBOX_BATCH: &str = "\
DELETE FROM {table}
WHERE ctid >= $1::tid AND ctid < $2::tid AND processed AND processed_at < $3";

/// `$3`: resolved before (or NULL); `$4`: last failed or resolved before
/// (or NULL).
const DEAD_LETTER_BATCH: &str = "\
DELETE FROM {table}
WHERE ctid >= $1::tid AND ctid < $2::tid AND status <> 'retry'
  AND ((status = 'resolved' AND resolved_at < $3)
       OR coalesce(resolved_at, last_failed_at) < $4)";

/// Up to `$2` saga instances completed before `$1`, oldest first (over
/// the index of completed instances).
const SAGA_BATCH: &str = "\
DELETE FROM outbox_saga WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM outbox_saga WHERE completed_at < $1
    ORDER BY completed_at LIMIT $2 FOR UPDATE SKIP LOCKED))";

/// Whether a saga instance completed before `$1` (the probe before the
/// batches, like the page ranges' bounds: a pass with none runs no
/// delete).
const SAGA_PROBE: &str = "SELECT EXISTS (SELECT 1 FROM outbox_saga WHERE completed_at < $1)";

type Time = sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>;

/// The database's `now()` minus `age`.
async fn cutoff(pool: &PgPool, age: Duration) -> Result<Time> {
    Ok(
        sqlx::query_scalar("SELECT now() - make_interval(secs => $1)")
            .bind(age.as_secs_f64())
            .fetch_one(pool)
            .await?,
    )
}

/// One cleanup pass, without the leader lock (see [`cleanup_as_leader`]).
/// Validates `retention` first; deletes nothing if it is refused.
pub async fn cleanup(pool: &PgPool, retention: &Retention) -> Result<CleanupReport> {
    retention.validate()?;
    let cutoff = cutoff(pool, retention.older_than).await?;
    let mut report = CleanupReport::default();
    let started = Instant::now();

    // Whole partitions first (partitioned layout).
    let dropped = partition::retention_pass(pool, cutoff).await?;
    report.partitions_dropped = dropped.dropped;
    report.partitions_kept = dropped.kept;
    report.partitions_busy = dropped.busy;

    // Positions of the progress mode no lane stands at any more (one a
    // minute kept within the window: the events' publication times).
    report.positions = crate::relay::progress::prune(pool, cutoff).await?;

    // Published outbox rows, in id order.
    for table in partition::row_cleaned(pool, "outbox_event").await? {
        report.outbox_events += outbox_rows(pool, &table, cutoff, retention, &mut report).await?;
    }
    for table in partition::row_cleaned(pool, "processed_event").await? {
        report.processed_events += by_pages(
            pool,
            &table,
            (PROCESSED_BATCH, Some(PROCESSED_PAGES)),
            &[Some(cutoff)],
            retention,
            &mut report,
        )
        .await?;
    }
    for table in partition::row_cleaned(pool, "inbox_event").await? {
        report.inbox_events += by_pages(
            pool,
            &table,
            (INBOX_BATCH, Some(PROCESSED_PAGES)),
            &[Some(cutoff)],
            retention,
            &mut report,
        )
        .await?;
    }
    // Inbox rows of consumers in the progress mode that their positions
    // passed (never marked processed).
    let (rows, statements) = crate::inbox::progress::cleanup(pool, cutoff, retention).await?;
    report.inbox_events += rows;
    report.statements += statements;
    if retention.resolved_dead_letters.is_some() || retention.dead_letters.is_some() {
        let mut cutoffs = [None, None];
        for (at, age) in cutoffs
            .iter_mut()
            .zip([retention.resolved_dead_letters, retention.dead_letters])
        {
            if let Some(age) = age {
                *at = Some(self::cutoff(pool, age).await?);
            }
        }
        report.dead_letters = by_pages(
            pool,
            "dead_letter",
            (DEAD_LETTER_BATCH, None),
            &cutoffs,
            retention,
            &mut report,
        )
        .await?;
    }
    let sagas_cutoff = match retention.completed_sagas {
        Some(age) => self::cutoff(pool, age).await?,
        None => cutoff,
    };
    report.sagas = completed_sagas(pool, sagas_cutoff, retention, &mut report).await?;
    tracing::info!(
        outbox_events = report.outbox_events,
        processed_events = report.processed_events,
        inbox_events = report.inbox_events,
        dead_letters = report.dead_letters,
        sagas = report.sagas,
        statements = report.statements,
        partitions_dropped = report.partitions_dropped,
        partitions_kept = report.partitions_kept,
        partitions_busy = report.partitions_busy,
        elapsed_ms = started.elapsed().as_millis() as u64,
        older_than = %format_duration(retention.older_than),
        "cleanup pass done"
    );
    Ok(report)
}

/// The first id of `table` not known to be older than `cutoff`: a binary
/// search over the id space, each probe one primary-key lookup (ids and
/// creation times grow together; a row out of order is left for the next
/// pass, never deleted early: the batches check `published_at`). `None`
/// when no row is known to be older (nothing to walk).
async fn outbox_bound(pool: &PgPool, table: &str, cutoff: Time) -> Result<Option<i64>> {
    let (min, max): (Option<i64>, Option<i64>) =
        sqlx::query_as(&format!("SELECT min(id), max(id) FROM {table}"))
            .fetch_one(pool)
            .await?;
    let (Some(min), Some(max)) = (min, max) else {
        return Ok(None);
    };
    let mut lo = min;
    let probe = outbox_probe(table);
    let mut hi = max.saturating_add(1);
    // The predicate "the first row at or after x is young, or there is
    // none" holds at `hi` and only grows with x.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let at: Option<Time> = sqlx::query_scalar(&probe)
            .bind(mid)
            .fetch_optional(pool)
            .await?;
        if at.is_none_or(|at| at >= cutoff) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok((lo > min).then_some(lo))
}

/// Deletes the published rows of `table` older than `cutoff`, in id order.
async fn outbox_rows(
    pool: &PgPool,
    table: &str,
    cutoff: Time,
    retention: &Retention,
    report: &mut CleanupReport,
) -> Result<u64> {
    let Some(bound) = outbox_bound(pool, table, cutoff).await? else {
        return Ok(0);
    };
    let batch = outbox_batch(table);
    let mut deleted = 0;
    let mut after = i64::MIN;
    loop {
        let (n, last): (i64, Option<i64>) = sqlx::query_as(&batch)
            .bind(after)
            .bind(bound)
            .bind(cutoff)
            .bind(retention.batch_size)
            .fetch_one(pool)
            .await?;
        report.statements += 1;
        deleted += n as u64;
        match last {
            Some(last) if n >= retention.batch_size => after = last,
            _ => break,
        }
        pause(retention.pause).await;
    }
    Ok(deleted)
}

/// Runs `delete` over `table` by ranges of heap pages (`$1`, `$2`), with
/// `cutoffs` as `$3`, `$4`, …; over the pages `candidates` returns (the
/// first and the last that may hold a row to delete, given the first
/// cutoff) if any, else over every page.
async fn by_pages(
    pool: &PgPool,
    table: &str,
    (delete, candidates): (&str, Option<&str>),
    cutoffs: &[Option<Time>],
    retention: &Retention,
    report: &mut CleanupReport,
) -> Result<u64> {
    let (per_page, pages): (f64, i64) = sqlx::query_as(TABLE_PAGES)
        .bind(table)
        .fetch_one(pool)
        .await?;
    let (mut page, pages) = match candidates {
        Some(sql) => {
            // Planned with the cutoff's value (an unnamed statement), so
            // that the planner sees how few rows are that old.
            let (first, last): (Option<i64>, Option<i64>) =
                sqlx::query_as(&sql.replace("{table}", table))
                    .bind(cutoffs.first().copied().flatten())
                    .persistent(false)
                    .fetch_one(pool)
                    .await?;
            match (first, last) {
                (Some(first), Some(last)) => (first, last + 1),
                _ => return Ok(0),
            }
        }
        None => (0_i64, pages),
    };
    let step = ((retention.batch_size as f64 / per_page.max(1.0)) as i64).clamp(1, 100_000);
    let delete = delete.replace("{table}", table);
    let mut deleted = 0;
    while page < pages {
        let next = page + step;
        let mut query = sqlx::query(&delete)
            .bind(format!("({page},0)"))
            .bind(format!("({next},0)"));
        for cutoff in cutoffs {
            query = query.bind(*cutoff);
        }
        let result = query.execute(pool).await?;
        report.statements += 1;
        deleted += result.rows_affected();
        page = next;
        if page < pages {
            pause(retention.pause).await;
        }
    }
    Ok(deleted)
}

/// Deletes the saga instances completed before `cutoff`, a batch per
/// statement, until a batch comes back short.
async fn completed_sagas(
    pool: &PgPool,
    cutoff: Time,
    retention: &Retention,
    report: &mut CleanupReport,
) -> Result<u64> {
    let any: bool = sqlx::query_scalar(SAGA_PROBE)
        .bind(cutoff)
        .fetch_one(pool)
        .await?;
    let mut deleted = 0;
    if !any {
        return Ok(0);
    }
    loop {
        let n = sqlx::query(SAGA_BATCH)
            .bind(cutoff)
            .bind(retention.batch_size)
            .execute(pool)
            .await?
            .rows_affected();
        report.statements += 1;
        deleted += n;
        if n < retention.batch_size as u64 {
            break;
        }
        pause(retention.pause).await;
    }
    Ok(deleted)
}

async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// A connection holding the cleanup leader lock. [`Leadership::release`]
/// unlocks it and closes the connection; dropped, the connection is closed
/// without the unlock, and the lock stays held until the server has noticed
/// (a moment, or longer on a busy server).
struct Leadership {
    conn: Option<PoolConnection<Postgres>>,
    lock: i64,
}

impl Leadership {
    async fn try_take(pool: &PgPool) -> Result<Option<Self>> {
        let mut conn = pool.acquire().await?;
        let lock = OutboxScope::of(&mut *conn).await?.cleanup_lock();
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(lock)
            .fetch_one(&mut *conn)
            .await?;
        Ok(taken.then(|| Self {
            conn: Some(conn),
            lock,
        }))
    }

    /// Whether the lock's connection is still alive (a lost connection
    /// loses the lock).
    async fn alive(&mut self) -> bool {
        match self.conn.as_mut() {
            Some(conn) => sqlx::query("SELECT 1").execute(&mut **conn).await.is_ok(),
            None => false,
        }
    }

    /// Unlocks, then closes the connection: the next job or one-off pass
    /// can take the lock as soon as this returns.
    async fn release(mut self) {
        if let Some(conn) = self.conn.take() {
            let mut conn = conn.detach();
            let unlock = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(self.lock)
                .execute(&mut conn);
            let _ = tokio::time::timeout(Duration::from_secs(5), unlock).await;
            let _ = tokio::time::timeout(Duration::from_secs(5), conn.close()).await;
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Closing the session releases its advisory locks.
            drop(conn.detach());
        }
    }
}

/// One cleanup pass if no other cleanup job holds the leader lock; `None`
/// when another one does.
pub async fn cleanup_as_leader(
    pool: &PgPool,
    retention: &Retention,
) -> Result<Option<CleanupReport>> {
    retention.validate()?;
    let Some(leadership) = Leadership::try_take(pool).await? else {
        return Ok(None);
    };
    let report = cleanup(pool, retention).await;
    leadership.release().await;
    report.map(Some)
}

/// A scheduled cleanup: every `interval`, one pass — by the single leader
/// among every `Cleanup` running against the database (the holder of the
/// advisory lock [`OutboxScope::cleanup_lock`]; the others check every interval whether
/// they can take over).
#[derive(Debug, Clone)]
pub struct Cleanup {
    pool: PgPool,
    retention: Retention,
    interval: Duration,
}

/// What a running [`Cleanup`] did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CleanupCounts {
    /// Whether this job currently holds the leader lock.
    pub leader: bool,
    /// Passes run by this job.
    pub passes: u64,
    /// Rows deleted by this job, over all passes.
    pub deleted: u64,
    /// Passes that failed (logged; retried at the next interval).
    pub failures: u64,
}

/// A running [`Cleanup`].
#[derive(Debug)]
pub struct CleanupHandle {
    token: CancellationToken,
    counts: tokio::sync::watch::Receiver<CleanupCounts>,
    task: JoinHandle<()>,
}

impl CleanupHandle {
    /// What the job did so far.
    pub fn counts(&self) -> CleanupCounts {
        *self.counts.borrow()
    }

    /// Stops the job (after the statement in flight) and releases the lock.
    pub async fn shutdown(self) -> Result<()> {
        self.token.cancel();
        self.task.await.map_err(|e| Error::Task(e.to_string()))
    }
}

impl Cleanup {
    /// A job running `retention` every `interval` on `pool` (which needs 2
    /// connections: one holds the lock).
    pub fn new(pool: PgPool, retention: Retention, interval: Duration) -> Result<Self> {
        retention.validate()?;
        if interval.is_zero() {
            return Err(Error::Config("cleanup interval must be > 0".into()));
        }
        Ok(Self {
            pool,
            retention,
            interval,
        })
    }

    /// Runs the job on a tokio task.
    pub fn spawn(self) -> CleanupHandle {
        let token = CancellationToken::new();
        let (tx, counts) = tokio::sync::watch::channel(CleanupCounts::default());
        let task = tokio::spawn(self.run_with(token.clone(), tx));
        CleanupHandle {
            token,
            counts,
            task,
        }
    }

    /// Runs the job until `shutdown` is cancelled.
    pub async fn run(self, shutdown: CancellationToken) {
        let (tx, _rx) = tokio::sync::watch::channel(CleanupCounts::default());
        self.run_with(shutdown, tx).await;
    }

    async fn run_with(
        self,
        shutdown: CancellationToken,
        counts: tokio::sync::watch::Sender<CleanupCounts>,
    ) {
        let mut leadership: Option<Leadership> = None;
        loop {
            if let Some(l) = leadership.as_mut()
                && !l.alive().await
            {
                tracing::warn!("cleanup leader lost its lock connection");
                leadership = None;
            }
            if leadership.is_none() {
                match Leadership::try_take(&self.pool).await {
                    Ok(Some(l)) => {
                        tracing::info!("cleanup: this job is the leader");
                        leadership = Some(l);
                    }
                    Ok(None) => {
                        tracing::debug!("cleanup: another job is the leader");
                    }
                    Err(error) => tracing::warn!(%error, "cleanup: could not reach the database"),
                }
            }
            let leader = leadership.is_some();
            counts.send_modify(|c| c.leader = leader);
            if leader {
                let pass = tokio::select! {
                    r = cleanup(&self.pool, &self.retention) => Some(r),
                    _ = shutdown.cancelled() => None,
                };
                match pass {
                    Some(Ok(r)) => counts.send_modify(|c| {
                        c.passes += 1;
                        c.deleted += r.outbox_events
                            + r.processed_events
                            + r.inbox_events
                            + r.dead_letters
                            + r.sagas;
                    }),
                    Some(Err(error)) => {
                        tracing::warn!(%error, "cleanup pass failed: retrying at the next interval");
                        counts.send_modify(|c| c.failures += 1);
                    }
                    None => break,
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.interval) => {}
                _ = shutdown.cancelled() => break,
            }
        }
        if let Some(leadership) = leadership {
            leadership.release().await;
        }
        counts.send_modify(|c| c.leader = false);
    }
}
