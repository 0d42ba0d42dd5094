//! Inbox mode's progress per batch: the processor reads each partition's
//! stored rows by snapshot windows and records how far it applied them,
//! instead of marking every row processed (see
//! `docs/design/progress-per-batch.md`, "The inbox processor"). This module
//! owns the mode's state (`inbox_progress_consumer`, `inbox_progress`), its
//! windows and the SQL of its common path; the processor
//! (`processor.rs`) runs the handlers.
//!
//! Every `inbox_event` row stores the id of the transaction that stored it
//! (`txid`). A (consumer, topic, partition)'s position is a snapshot `done`
//! (every row of the partition stored by a transaction visible in it is
//! applied, or has a state of its own), the window being read `upto` and
//! the received order `after_seq` inside it, appended to `inbox_progress`.
//! A window is the partition's rows visible in `upto` and not in `done`:
//! stored after those of earlier windows (a transaction in flight when
//! `upto` was taken is in its `xip` list, its rows in a later window).
//! Inside a window rows go in received order (`seq`), which is offset
//! order within a partition. As for the relay, a window is read in two
//! parts: the rows of the transactions of `done`'s `xip` list, probed one
//! by one, and those of the transactions that started after `done`.
//!
//! The common path writes no row: a window's rows are applied and one
//! position per partition appended, in the round's transaction. The rare
//! paths keep per-row state, as in the default mode: a failing row records
//! its failure, the later rows of its key are *set aside* (`processed`
//! false, `next_attempt_at` now) and go through the per-key claim, which
//! marks them; a window's row whose key has rows waiting is set aside too.
//! A row with such a state is not read by windows.
//!
//! Rows are stored with `processed` true and `processed_at` NULL in this
//! mode: "not the default mode's queue". They stay out of its partial
//! indexes of pending rows (which would otherwise hold every row until
//! retention), and whether they are applied is what their partition's
//! position says.

use std::collections::VecDeque;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::Result;

/// Most rows of a window listed at once.
pub(crate) const LIST_CAP: i64 = 100_000;

/// The index windows are read through (created when the mode is enabled).
pub const INDEX: &str = "ix_inbox_event_progress";

/// A row without a state of its own (`e`), written with `num_nonnulls`: the
/// default mode's partial indexes of pending rows must not serve it.
pub(crate) const NO_STATE: &str =
    "num_nonnulls(e.processed_at, e.next_attempt_at, e.dead_lettered_at) = 0";

/// Creates the index windows are read through, if it is missing.
pub async fn create_index(pool: &sqlx::PgPool) -> Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(INDEX)
        .fetch_one(pool)
        .await?;
    if !exists {
        sqlx::query(&format!(
            r#"CREATE INDEX IF NOT EXISTS {INDEX} ON inbox_event (consumer, topic, "partition", txid)
               WHERE txid IS NOT NULL"#
        ))
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// Turns the progress mode on for consumer group `consumer` (its
/// processors stopped: each reads the mode when it starts). Its pending
/// rows (stored, not applied, without a state) are given the enabling
/// transaction's id if they have none, and taken out of the default mode's
/// queue; its partitions start at a snapshot that sees none of them.
/// Enabling twice changes nothing.
pub async fn enable(pool: &sqlx::PgPool, consumer: &str) -> Result<()> {
    create_index(pool).await?;
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE inbox_progress_consumer IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    let enabled: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM inbox_progress_consumer WHERE consumer = $1)",
    )
    .bind(consumer)
    .fetch_one(&mut *tx)
    .await?;
    if enabled {
        return Ok(());
    }
    sqlx::query(
        "UPDATE inbox_event SET txid = coalesce(txid, pg_current_xact_id()), processed = true
         WHERE consumer = $1 AND NOT processed AND dead_lettered_at IS NULL
           AND next_attempt_at IS NULL",
    )
    .bind(consumer)
    .execute(&mut *tx)
    .await?;
    // `m:m:`: exactly the transactions before `m` are visible, `m` at most
    // the oldest pending row's transaction and the oldest in flight now.
    sqlx::query(&format!(
        "INSERT INTO inbox_progress_consumer (consumer, start)
         SELECT $1, (m || ':' || m || ':')::pg_snapshot
         FROM (SELECT least(pg_snapshot_xmin(pg_current_snapshot()),
                            (SELECT min(e.txid) FROM inbox_event e
                             WHERE e.consumer = $1 AND e.txid IS NOT NULL AND {NO_STATE})) AS m) b"
    ))
    .bind(consumer)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Where the partitions of `consumer` without a position start, if the
/// consumer is in the progress mode.
pub(crate) async fn start(conn: &mut PgConnection, consumer: &str) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT start::text FROM inbox_progress_consumer WHERE consumer = $1")
            .bind(consumer)
            .fetch_optional(conn)
            .await?,
    )
}

/// The partitions `topic/partition` with rows of consumer `$1` stored in
/// the progress mode, of the processor's share (`$3` of `$2`): a skip scan
/// of [`INDEX`], a probe per partition.
pub(crate) const PARTITIONS: &str = r#"
WITH RECURSIVE p AS (
    (SELECT e.topic, e."partition" FROM inbox_event e
     WHERE e.consumer = $1 AND e.txid IS NOT NULL AND e.topic IS NOT NULL
       AND e."partition" IS NOT NULL
     ORDER BY e.consumer, e.topic, e."partition" LIMIT 1)
    UNION ALL
    SELECT n.topic, n."partition" FROM p CROSS JOIN LATERAL (
        SELECT e.topic, e."partition" FROM inbox_event e
        WHERE e.consumer = $1 AND e.txid IS NOT NULL
          AND (e.topic, e."partition") > (p.topic, p."partition")
        ORDER BY e.consumer, e.topic, e."partition" LIMIT 1) n
)
SELECT topic || '/' || "partition" FROM p
WHERE mod(mod(hashtext(topic)::bigint + "partition", $2) + $2, $2) = $3"#;

/// A partition as [`PARTITIONS`] names it (`topic/partition`): its topic
/// and number.
pub(crate) fn partition_of(name: &str) -> Option<(String, i32)> {
    let (topic, n) = name.rsplit_once('/')?;
    Some((topic.to_owned(), n.parse().ok()?))
}

/// The newest position of a partition.
const NEWEST: &str = r#"
SELECT id, done::text, upto::text, after_seq FROM inbox_progress
WHERE consumer = $1 AND topic = $2 AND "partition" = $3
ORDER BY id DESC LIMIT 1"#;

/// A window's rows after `$6` (seq, event id, `ctid`), in received order,
/// at most `$7`: the rows of partition (`$1`, `$2`, `$3`) whose transaction
/// is visible in `$5` (`upto`) and not in `$4` (`done`), without a state of
/// their own. The transactions of `done`'s `xip` list are probed one by one
/// (see the relay's window, `relay::progress`).
static LIST: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        r#"
SELECT w.seq, w.event_id, w.tid FROM (
    SELECT e.* FROM unnest(ARRAY(SELECT pg_snapshot_xip($4::pg_snapshot))) AS x(txid)
    CROSS JOIN LATERAL (
        SELECT e.seq, e.event_id, e.ctid::text AS tid FROM inbox_event e
        WHERE e.consumer = $1 AND e.topic = $2 AND e."partition" = $3 AND e.txid = x.txid
          AND pg_visible_in_snapshot(e.txid, $5::pg_snapshot)
          AND e.seq > $6 AND {NO_STATE}
        OFFSET 0) e
    UNION ALL
    SELECT e.seq, e.event_id, e.ctid::text AS tid FROM inbox_event e
    WHERE e.consumer = $1 AND e.topic = $2 AND e."partition" = $3
      AND e.txid >= pg_snapshot_xmax($4::pg_snapshot)
      AND e.txid < pg_snapshot_xmax($5::pg_snapshot)
      AND pg_visible_in_snapshot(e.txid, $5::pg_snapshot)
      AND e.seq > $6 AND {NO_STATE}
) w
ORDER BY w.seq LIMIT $7"#
    )
});

/// Records positions (appended), one per partition: `$1` consumer, then
/// topics, partitions, `done`, `upto`, `after_seq`.
pub(crate) const RECORD: &str = r#"
INSERT INTO inbox_progress (consumer, topic, "partition", done, upto, after_seq)
SELECT $1, t, p, d::pg_snapshot, u::pg_snapshot, a
FROM UNNEST($2::text[], $3::int4[], $4::text[], $5::text[], $6::int8[]) AS x(t, p, d, u, a)
RETURNING id"#;

/// Sets rows aside (`$2`, of consumer `$1`): they and the later rows of
/// their key go through the per-key claim. Rows that have a state by now
/// keep it.
pub(crate) const SET_ASIDE: &str = "
UPDATE inbox_event e SET processed = false, next_attempt_at = now()
WHERE e.consumer = $1 AND e.event_id = ANY($2) AND num_nonnulls(e.processed_at, e.next_attempt_at, e.dead_lettered_at) = 0";

/// A partition's window, where it stands and what is known of it in
/// memory (valid while the newest recorded position is `recorded`).
#[derive(Debug, Clone)]
pub(crate) struct Window {
    pub topic: String,
    pub partition: i32,
    /// Every row visible in this snapshot is applied (or has a state).
    pub done: String,
    /// The window being read; `None` until a read takes it.
    pub upto: Option<String>,
    /// Rows of the window up to this `seq` are passed.
    pub after_seq: i64,
    /// The id of the position this state was loaded from or recorded as.
    pub recorded: Option<i64>,
    /// Rows listed and not handed over yet (seq, event id, `ctid`).
    listed: VecDeque<(i64, Uuid, String)>,
    /// Whether `listed` holds every remaining row of the window.
    complete: bool,
    /// Whether the position moved since it was recorded.
    pub moved: bool,
}

/// A row of a window handed over: its `seq`, event id and `ctid`.
pub(crate) type Listed = (i64, Uuid, String);

impl Window {
    /// The partition's window as recorded (`cached` when its newest
    /// position is still the one it was recorded as).
    pub async fn load(
        conn: &mut PgConnection,
        consumer: &str,
        start: &str,
        (topic, partition): (&str, i32),
        cached: Option<Window>,
    ) -> Result<Window> {
        let newest: Option<(i64, String, Option<String>, Option<i64>)> = sqlx::query_as(NEWEST)
            .bind(consumer)
            .bind(topic)
            .bind(partition)
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(w) = cached
            && w.recorded == newest.as_ref().map(|n| n.0)
            && !w.moved
        {
            return Ok(w);
        }
        let (recorded, done, upto, after_seq) = match newest {
            Some((id, done, upto, after)) => (Some(id), done, upto, after.unwrap_or(0)),
            None => (None, start.to_owned(), None, 0),
        };
        Ok(Window {
            topic: topic.to_owned(),
            partition,
            done,
            upto,
            after_seq,
            recorded,
            listed: VecDeque::new(),
            complete: false,
            moved: false,
        })
    }

    /// The next rows of the window, at most `limit`; when the window has
    /// none left, the next window's (one new snapshot per call at most).
    /// Returns no rows when nothing was stored since. The position does
    /// not move: [`Window::pass`] moves it.
    pub async fn next(
        &mut self,
        conn: &mut PgConnection,
        consumer: &str,
        limit: usize,
    ) -> Result<Vec<Listed>> {
        let mut fresh = false;
        loop {
            let upto = match &self.upto {
                Some(upto) => upto.clone(),
                None if fresh => return Ok(Vec::new()),
                None => {
                    let upto: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
                        .fetch_one(&mut *conn)
                        .await?;
                    fresh = true;
                    self.upto = Some(upto.clone());
                    self.after_seq = 0;
                    self.listed.clear();
                    self.complete = false;
                    upto
                }
            };
            if self.listed.is_empty() && !self.complete {
                // Planned at each call, as the relay's windows (a generic
                // plan made while the table was empty may read another
                // index: see `relay::progress::LIST_MANY`).
                let rows: Vec<Listed> = sqlx::query_as(&LIST)
                    .persistent(false)
                    .bind(consumer)
                    .bind(&self.topic)
                    .bind(self.partition)
                    .bind(&self.done)
                    .bind(&upto)
                    .bind(self.after_seq)
                    .bind(LIST_CAP)
                    .fetch_all(&mut *conn)
                    .await?;
                self.complete = (rows.len() as i64) < LIST_CAP;
                self.listed = rows.into();
            }
            if !self.listed.is_empty() {
                let n = limit.max(1).min(self.listed.len());
                return Ok(self.listed.iter().take(n).cloned().collect());
            }
            // The window is done.
            if fresh {
                // Nothing stored since `done`: keep standing there (no
                // position to record).
                self.upto = None;
                return Ok(Vec::new());
            }
            self.done = upto;
            self.upto = None;
            self.after_seq = 0;
            self.complete = false;
            self.moved = true;
        }
    }

    /// The rows up to `seq` (handed over by [`Window::next`]) are passed.
    pub fn pass(&mut self, seq: i64) {
        while self.listed.front().is_some_and(|(s, _, _)| *s <= seq) {
            self.listed.pop_front();
        }
        if seq > self.after_seq {
            self.after_seq = seq;
            self.moved = true;
        }
        if self.listed.is_empty()
            && self.complete
            && let Some(upto) = self.upto.take()
        {
            self.done = upto;
            self.after_seq = 0;
            self.complete = false;
            self.moved = true;
        }
    }

    /// The position to record: (`done`, `upto`, `after_seq`).
    pub fn position(&self) -> (String, Option<String>, Option<i64>) {
        (
            self.done.clone(),
            self.upto.clone(),
            self.upto.as_ref().map(|_| self.after_seq),
        )
    }
}

/// Most pending rows counted per partition by [`pending`].
pub const PENDING_CAP: i64 = 10_000;

/// A partition's rows its position (`$4` done, `$5` upto, `$6` after_seq)
/// does not pass and without a state of their own: how many (at most
/// [`PENDING_CAP`]) and the oldest one's age in seconds.
static PENDING: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        r#"
SELECT count(*)::int8, EXTRACT(EPOCH FROM now() - min(received_at))::float8 FROM (
    SELECT e.received_at FROM inbox_event e
    WHERE e.consumer = $1 AND e.topic = $2 AND e."partition" = $3
      AND e.txid >= pg_snapshot_xmin($4::pg_snapshot)
      AND NOT pg_visible_in_snapshot(e.txid, $4::pg_snapshot)
      AND NOT (coalesce(pg_visible_in_snapshot(e.txid, $5::pg_snapshot), false)
               AND e.seq <= $6)
      AND {NO_STATE}
    LIMIT {PENDING_CAP}) x"#
    )
});

/// The rows of each consumer in the progress mode that its positions do
/// not pass (stored, not applied yet): consumer, count (at most
/// [`PENDING_CAP`] per partition), the oldest one's age in seconds. Rows
/// set aside or failed are the default mode's pending rows.
pub async fn pending(pool: &sqlx::PgPool) -> Result<Vec<(String, i64, Option<f64>)>> {
    let consumers: Vec<(String, String)> =
        sqlx::query_as("SELECT consumer, start::text FROM inbox_progress_consumer ORDER BY 1")
            .fetch_all(pool)
            .await?;
    let mut out = Vec::new();
    let mut conn = pool.acquire().await?;
    for (consumer, start) in consumers {
        let partitions: Vec<String> = sqlx::query_scalar(PARTITIONS)
            .bind(&consumer)
            .bind(1_i64)
            .bind(0_i64)
            .fetch_all(&mut *conn)
            .await?;
        let (mut count, mut oldest) = (0, None::<f64>);
        for p in partitions {
            let Some((topic, partition)) = partition_of(&p) else {
                continue;
            };
            let w = Window::load(&mut conn, &consumer, &start, (&topic, partition), None).await?;
            let (n, age): (i64, Option<f64>) = sqlx::query_as(&PENDING)
                .bind(&consumer)
                .bind(&topic)
                .bind(partition)
                .bind(&w.done)
                .bind(&w.upto)
                .bind(w.after_seq)
                .fetch_one(&mut *conn)
                .await?;
            count += n;
            oldest = match (oldest, age) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
        }
        out.push((consumer, count, oldest));
    }
    Ok(out)
}

/// Up to `$6` rows of a partition (`$1`, `$2`, `$3`) its position passed
/// (stored by a transaction visible in `done`, `$4`), without a state of
/// their own and received before `$5`, deleted.
static CLEANUP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        r#"
DELETE FROM inbox_event d
WHERE d.consumer = $1 AND d.event_id = ANY(ARRAY(
    SELECT e.event_id FROM inbox_event e
    WHERE e.consumer = $1 AND e.topic = $2 AND e."partition" = $3
      AND e.txid < pg_snapshot_xmax($4::pg_snapshot)
      AND pg_visible_in_snapshot(e.txid, $4::pg_snapshot)
      AND e.received_at < $5 AND {NO_STATE}
    LIMIT $6 FOR UPDATE SKIP LOCKED))
  AND pg_visible_in_snapshot(d.txid, $4::pg_snapshot) AND d.received_at < $5
  AND num_nonnulls(d.processed_at, d.next_attempt_at, d.dead_lettered_at) = 0"#
    )
});

/// Positions recorded before `$1` that are not their partition's newest.
const PRUNE: &str = r#"
DELETE FROM inbox_progress q
WHERE q.id = ANY(ARRAY(
    SELECT q.id FROM inbox_progress q
    WHERE q.recorded_at < $1
      AND EXISTS (SELECT 1 FROM inbox_progress n
                  WHERE n.consumer = q.consumer AND n.topic = q.topic
                    AND n."partition" = q."partition" AND n.id > q.id)
    LIMIT $2))"#;

/// The cleanup of consumers in the progress mode: their rows the positions
/// passed, received before `cutoff`, and their positions recorded before
/// it that are not the newest. Returns the rows deleted and the statements
/// run.
pub(crate) async fn cleanup(
    pool: &sqlx::PgPool,
    cutoff: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    retention: &crate::cleanup::Retention,
) -> Result<(u64, u64)> {
    let consumers: Vec<(String, String)> =
        sqlx::query_as("SELECT consumer, start::text FROM inbox_progress_consumer ORDER BY 1")
            .fetch_all(pool)
            .await?;
    let (mut rows, mut statements) = (0, 0);
    if consumers.is_empty() {
        // No group in the mode: no row to delete, no position to prune.
        return Ok((rows, statements));
    }
    let batch = retention.batch_size.max(1);
    for (consumer, start) in consumers {
        let mut conn = pool.acquire().await?;
        let partitions: Vec<String> = sqlx::query_scalar(PARTITIONS)
            .bind(&consumer)
            .bind(1_i64)
            .bind(0_i64)
            .fetch_all(&mut *conn)
            .await?;
        for p in partitions {
            let Some((topic, partition)) = partition_of(&p) else {
                continue;
            };
            let w = Window::load(&mut conn, &consumer, &start, (&topic, partition), None).await?;
            loop {
                let n = sqlx::query(&CLEANUP)
                    .bind(&consumer)
                    .bind(&topic)
                    .bind(partition)
                    .bind(&w.done)
                    .bind(cutoff)
                    .bind(batch)
                    .execute(&mut *conn)
                    .await?
                    .rows_affected();
                rows += n;
                statements += 1;
                if (n as i64) < batch {
                    break;
                }
                tokio::time::sleep(retention.pause).await;
            }
        }
    }
    loop {
        let n = sqlx::query(PRUNE)
            .bind(cutoff)
            .bind(batch)
            .execute(pool)
            .await?
            .rows_affected();
        statements += 1;
        if (n as i64) < batch {
            break;
        }
    }
    Ok((rows, statements))
}

/// Whether the inbox row `e` is passed by its partition's newest position:
/// stored by a transaction visible in `done`, or in the window up to
/// `after_seq` (a row of a partition without a position is not).
pub(crate) fn passed(e: &str) -> String {
    format!(
        r#"EXISTS (SELECT 1 FROM (SELECT q.done, q.upto, q.after_seq FROM inbox_progress q
                         WHERE q.consumer = {e}.consumer AND q.topic = {e}.topic
                           AND q."partition" = {e}."partition"
                         ORDER BY q.id DESC LIMIT 1) n
        WHERE {e}.txid IS NOT NULL
          AND (pg_visible_in_snapshot({e}.txid, n.done)
               OR (n.upto IS NOT NULL AND pg_visible_in_snapshot({e}.txid, n.upto)
                   AND {e}.seq <= n.after_seq)))"#
    )
}
