//! The progress mode's lag, as an operator sees it (see
//! [`crate::relay::progress`]): per lane (a set of lane slots, as its
//! positions are recorded), the events its position has not passed and the
//! age of the oldest, and where it stands; and the transaction that holds
//! the lanes' windows back — the oldest transaction in flight in their
//! newest snapshots, with its backend pid and its age. Read by `status`,
//! the relay's gauges and the console.
//!
//! The events are read as the backlog gauges read the progress mode's
//! queue: over the progress index, from each slot's position on (the
//! transactions of its snapshot's `xip` list probed one by one, then the
//! range after its `xmax`), its slots one after the other in one scan under
//! one `LIMIT`: counted up to [`LAG_EXACT_UP_TO`] + 1 per lane (1,001:
//! more), so that a sample of 16 lanes reads at most about 16,000 rows
//! however large the backlog (tens of milliseconds on a table of ten
//! million rows). The oldest event's age is that of the oldest of the rows
//! counted and of each slot's first rows (its `xip` list's transactions',
//! and its first after them). Rows with a state
//! of their own (held, parked) are not counted here: `status` counts them
//! per topic.
//!
//! A transaction in flight when a lane's snapshot was taken is in the
//! snapshot's `xip` list: its events, if it writes any, go out only in a
//! later window, after it commits; until then nobody can see them, not even
//! to count them. Snapshots are the whole cluster's: only a transaction of
//! this database (its backend's `datid`, or a prepared transaction's
//! database) is reported as holding the lanes back; another database's
//! cannot write this outbox. Its backend is found by its transaction id: the pid from
//! `pg_locks` (a transaction holds the lock on its own id; `pg_locks` is
//! open to every role), its start, state and application from
//! `pg_stat_activity`, which shows them for another role's sessions only
//! to superusers and members of `pg_read_all_stats` (otherwise the age and
//! the state are unknown: `None`).

use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use crate::error::Result;

/// Events of a lane counted exactly; a lane with more shows this + 1.
pub const LAG_EXACT_UP_TO: i64 = 1_000;

/// Where a lane stands and what it has not passed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LaneLag {
    /// The lane (`l` of [`LaneLag::lane_count`] lanes: the slots `l`,
    /// `l + 64 / lane_count`, …), or the slots' list when the set is not a
    /// lane's.
    pub lane: String,
    /// The lane count its slots were recorded with (1: the single position
    /// `enable` records for every slot; `None`: not a lane's set).
    pub lane_count: Option<i32>,
    /// The slots as recorded (`{3,19,35,51}`); only those still standing at
    /// this position are counted.
    pub slots: String,
    /// Events of those slots the position has not passed, without a state
    /// of their own; at most [`LAG_EXACT_UP_TO`] + 1 (more).
    pub events: i64,
    /// Age in seconds of the oldest of them (of those read, past the bound).
    pub oldest_secs: Option<f64>,
    /// Every event of the slots visible in this snapshot is published.
    pub done: String,
    /// The window being published, if one is.
    pub upto: Option<String>,
    /// Events of the window up to this id are published.
    pub after_id: Option<i64>,
    /// Seconds since the position was recorded.
    pub recorded_secs_ago: f64,
    /// The oldest transaction in flight in the position's snapshots (its
    /// `xid8`), still running: it holds the lane's window back.
    pub held_back_by: Option<i64>,
}

/// A transaction holding windows back (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HoldingTransaction {
    /// Its transaction id (`xid8`).
    pub xid: i64,
    /// Its backend's pid (`None`: a prepared transaction, which has none).
    pub pid: Option<i32>,
    /// Seconds since it began (`None`: another role's session, and this
    /// role is neither superuser nor a member of `pg_read_all_stats`).
    pub age_secs: Option<f64>,
    /// Its backend's state (`idle in transaction`, `active`, …), if shown.
    pub state: Option<String>,
    /// Its backend's `application_name`, if shown.
    pub application_name: Option<String>,
    /// Its role, if shown.
    pub user: Option<String>,
    /// How many lanes it holds back.
    pub lanes: usize,
}

/// The progress mode's lag: every lane, and the oldest transaction holding
/// one back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProgressLag {
    /// Per lane, by slots.
    pub lanes: Vec<LaneLag>,
    /// The oldest transaction still running in the lanes' newest snapshots.
    pub holding: Option<HoldingTransaction>,
}

impl ProgressLag {
    /// Events the lanes' positions have not passed (each lane's count up to
    /// its bound).
    pub fn events(&self) -> i64 {
        self.lanes.iter().map(|l| l.events).sum()
    }
}

/// Per lane (the newest position of each slot, grouped by position): the
/// rows not passed, counted up to the bound in one scan of the lane's slots
/// (a nested loop over them under one `LIMIT`), the oldest `created_at` of
/// those and of each slot's first rows (those of the transactions of its
/// snapshot's `xip` list, and its first after its `xmax`), and the oldest
/// transaction of the position's snapshots still in progress. Each lane's
/// position is then read by its id (a lateral probe the planner cannot
/// turn into a join: as a join, in the plan a connection kept from when
/// the table was small, it walked every position recorded, in `slots`
/// order: 120 ms of the relay's gauges' sample at 24,000 positions, every
/// 5 s).
pub(crate) static LANES: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let passed = crate::relay::progress::passed("e");
    let rows = crate::ops::backlog::progress_slot_rows(&passed);
    let cap = LAG_EXACT_UP_TO + 1;
    format!(
        "WITH RECURSIVE {positions},
per_lane AS (
    SELECT l.id, c.n, least(c.oldest, f.oldest) AS oldest
    FROM (SELECT DISTINCT id FROM pos) l
    CROSS JOIN LATERAL (
        SELECT count(*) AS n, min(r.created_at) AS oldest FROM (
            SELECT e.created_at FROM pos CROSS JOIN LATERAL ({rows}) e
            WHERE pos.id = l.id LIMIT {cap}) r) c
    CROSS JOIN LATERAL (
        SELECT min(e.created_at) AS oldest FROM pos CROSS JOIN LATERAL (
            (SELECT e.created_at FROM pg_snapshot_xip(pos.done) AS x(txid)
             CROSS JOIN LATERAL (
                 SELECT e.id, e.topic, e.txid, e.created_at FROM outbox_event e
                 WHERE e.lane_slot = pos.slot AND e.txid = x.txid
                   AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3
                 OFFSET 0) e
             WHERE NOT {passed})
            UNION ALL
            (SELECT e.created_at FROM outbox_event e
             WHERE e.lane_slot = pos.slot AND e.txid >= pg_snapshot_xmax(pos.done)
               AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3 AND NOT {passed}
             ORDER BY e.txid LIMIT 1)) e
        WHERE pos.id = l.id) f)
SELECT p.slots, p.slots::text AS slots_text, p.done::text AS done, p.upto::text AS upto,
       p.after_id, EXTRACT(EPOCH FROM now() - p.recorded_at)::float8 AS recorded_secs_ago,
       s.n::int8 AS events,
       EXTRACT(EPOCH FROM now() - s.oldest)::float8 AS oldest_secs,
       (SELECT min(x.txid)::text::int8
        FROM (SELECT pg_snapshot_xip(p.done) UNION ALL SELECT pg_snapshot_xip(p.upto)) AS x(txid)
        WHERE pg_xact_status(x.txid) = 'in progress'
          AND (EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                       WHERE l.locktype = 'transactionid' AND l.granted
                         AND l.transactionid = (x.txid::text::int8 % 4294967296)::text::xid
                         AND a.datid = (SELECT oid FROM pg_database
                                        WHERE datname = current_database()))
               OR EXISTS (SELECT 1 FROM pg_prepared_xacts t
                          WHERE t.transaction = (x.txid::text::int8 % 4294967296)::text::xid
                            AND t.database = current_database()))) AS held_back_by
FROM per_lane s
CROSS JOIN LATERAL (SELECT q.slots, q.done, q.upto, q.after_id, q.recorded_at
                    FROM outbox_progress q WHERE q.id = s.id OFFSET 0) p
ORDER BY p.slots",
        positions = crate::relay::progress::POSITIONS,
    )
});

/// Sets the planner up for [`LANES`], in the transaction of `conn`: no
/// bitmap scans. A slot's oldest event is its first row after its position
/// in `txid` order, which only an index scan finds without reading the
/// others; a bitmap scan reads every row of the slot and sorts them. The
/// planner chose the bitmap (it expects the windows' filters to leave a row
/// or two) on a table filled since it was last analyzed, and a connection
/// keeps the plan until the table is analyzed again: each sample then read
/// every waiting row. Returns the setting it replaced, for
/// [`unplan_lanes`].
async fn plan_lanes(conn: &mut PgConnection) -> std::result::Result<String, sqlx::Error> {
    let was: String = sqlx::query_scalar("SELECT current_setting('enable_bitmapscan')")
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query("SET LOCAL enable_bitmapscan = off")
        .execute(&mut *conn)
        .await?;
    Ok(was)
}

/// Puts back the setting [`plan_lanes`] replaced.
async fn unplan_lanes(conn: &mut PgConnection, was: &str) -> std::result::Result<(), sqlx::Error> {
    sqlx::query("SELECT set_config('enable_bitmapscan', $1, true)")
        .bind(was)
        .execute(conn)
        .await
        .map(drop)
}

/// The backend of the transaction `$1` (an `xid8`): the pid holding the
/// lock on its id (its 32-bit form), and what `pg_stat_activity` shows of
/// it to this role.
const HOLDER: &str = "
SELECT l.pid, EXTRACT(EPOCH FROM now() - a.xact_start)::float8 AS age_secs, a.state::text,
       a.application_name::text, a.usename::text
FROM (SELECT ($1::int8 % 4294967296)::text::xid AS xid) t
LEFT JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = t.xid
                    AND l.mode = 'ExclusiveLock' AND l.granted
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LIMIT 1";

type LaneRow = (
    Vec<i16>,
    String,
    String,
    Option<String>,
    Option<i64>,
    f64,
    i64,
    Option<f64>,
    Option<i64>,
);

/// The lane a set of slots is (`l` of `64 / slots`), if it is one.
fn lane_of(slots: &[i16]) -> Option<(i16, i32)> {
    let n = slots.len();
    if n == 0 || 64 % n != 0 {
        return None;
    }
    let count = (64 / n) as i16;
    let first = *slots.first()?;
    let regular = first < count
        && slots
            .iter()
            .enumerate()
            .all(|(i, s)| *s == first + i as i16 * count);
    regular.then_some((first, i32::from(count)))
}

/// Reads the lag of every lane and the transaction holding them back, on
/// `conn`: in a transaction of its own, or a savepoint of the caller's
/// (the planner's setting of [`plan_lanes`] applies only within a
/// transaction). Empty lanes: the progress mode is off.
pub(crate) async fn read(conn: &mut PgConnection) -> std::result::Result<ProgressLag, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let was = plan_lanes(&mut tx).await?;
    let rows: Vec<LaneRow> = sqlx::query_as(&LANES).fetch_all(&mut *tx).await?;
    unplan_lanes(&mut tx, &was).await?;
    tx.commit().await?;
    let lanes: Vec<LaneLag> = rows
        .into_iter()
        .map(
            |(slots, text, done, upto, after_id, recorded, events, oldest, held_back_by)| {
                let (lane, lane_count) = match lane_of(&slots) {
                    Some((lane, count)) => (lane.to_string(), Some(count)),
                    None => (text.clone(), None),
                };
                LaneLag {
                    lane,
                    lane_count,
                    slots: text,
                    events,
                    oldest_secs: oldest,
                    done,
                    upto,
                    after_id,
                    recorded_secs_ago: recorded,
                    held_back_by,
                }
            },
        )
        .collect();
    let oldest = lanes.iter().filter_map(|l| l.held_back_by).min();
    let holding = match oldest {
        None => None,
        Some(xid) => {
            type Holder = (
                Option<i32>,
                Option<f64>,
                Option<String>,
                Option<String>,
                Option<String>,
            );
            let (pid, age_secs, state, application_name, user): Holder = sqlx::query_as(HOLDER)
                .bind(xid)
                .fetch_one(&mut *conn)
                .await?;
            Some(HoldingTransaction {
                xid,
                pid,
                age_secs,
                state,
                application_name,
                user,
                lanes: lanes.iter().filter(|l| l.held_back_by == Some(xid)).count(),
            })
        }
    };
    Ok(ProgressLag { lanes, holding })
}

/// The progress mode's lag (see the module docs); `None` when the outbox is
/// in the default mode.
pub async fn progress_lag(pool: &PgPool) -> Result<Option<ProgressLag>> {
    // No JIT, no sequential scan (see `backlog::PROGRESS_READS`).
    let mut tx = pool.begin_with(super::backlog::PROGRESS_READS).await?;
    let lag = read(&mut tx).await?;
    tx.commit().await?;
    Ok((!lag.lanes.is_empty()).then_some(lag))
}

#[cfg(test)]
mod tests {
    use super::{LANES, lane_of, plan_lanes, read};
    use sqlx::PgPool;

    /// The positions' table grows by one row per claim between cleanups
    /// (some 200 a second at 1,000 events/s). The lag read, prepared once
    /// per connection and without parameters, keeps the plan of its first
    /// execution, made while the table was small: it still probes the
    /// newest position of each lane, and each lane's by its id, at 24,000
    /// positions (as a join of the lanes to the table, that plan walked
    /// every position recorded, in `slots` order: 120 ms of the relay's
    /// gauges' sample at 24,000 positions, every 5 s).
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn the_lag_read_probes_the_newest_positions_only(pool: PgPool) {
        crate::relay::progress::enable(&pool).await.unwrap();
        let append = |n: i32| {
            sqlx::query(
                "INSERT INTO outbox_progress (slots, done)
                 SELECT ARRAY[l, l + 16, l + 32, l + 48]::int2[], pg_current_snapshot()
                 FROM generate_series(1, $1), generate_series(0, 15) AS l",
            )
            .bind(n)
            .execute(&pool)
        };
        append(1).await.unwrap();
        let mut conn = pool.acquire().await.unwrap();
        // The first sample: planned at 17 positions, the plan kept.
        sqlx::raw_sql(&format!("PREPARE lanes AS {}", LANES.as_str()))
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::raw_sql("EXECUTE lanes")
            .execute(&mut *conn)
            .await
            .unwrap();
        append(1500).await.unwrap();
        let lag = read(&mut conn).await.unwrap();
        assert_eq!(lag.lanes.len(), 16, "{lag:?}");
        assert!(
            lag.lanes.iter().all(|l| l.lane_count == Some(16)),
            "{lag:?}"
        );
        let plan: serde_json::Value =
            sqlx::query_scalar("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE lanes")
                .persistent(false)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        /// Rows read from `outbox_progress` by the plan's nodes.
        fn read_rows(node: &serde_json::Value) -> f64 {
            let own = if node["Relation Name"] == "outbox_progress" {
                node["Actual Rows"].as_f64().unwrap_or(0.0)
                    * node["Actual Loops"].as_f64().unwrap_or(1.0)
            } else {
                0.0
            };
            let children = node["Plans"]
                .as_array()
                .map_or(0.0, |plans| plans.iter().map(read_rows).sum::<f64>());
            own + children
        }
        let rows = read_rows(&plan[0]["Plan"]);
        assert!(rows < 500.0, "{rows} positions read of 24,001: {plan:#}");
    }

    /// A lane's oldest event is found from each slot's first rows after
    /// its position, in `txid` order through the progress index: a few
    /// rows a slot, however large the backlog. On a table filled since it
    /// was last analyzed (a backlog written while the relays were down,
    /// the table empty at the last analyze), the planner read each slot's
    /// rows with a bitmap scan and sorted them for the first: every waiting
    /// row at each sample until the table was analyzed again (measured:
    /// 300–400 ms of the relay's gauges' sample at a backlog of 200,000).
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn the_lag_read_reads_a_few_rows_a_slot_of_a_large_backlog(pool: PgPool) {
        crate::relay::progress::enable(&pool).await.unwrap();
        // No autovacuum: the table stays as last analyzed (empty), and no
        // worker's reads of it count in the pages read below.
        for sql in [
            "ALTER TABLE outbox_event SET (autovacuum_enabled = off)",
            "VACUUM ANALYZE outbox_event",
        ] {
            sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        }
        // 200 transactions of 1,000 events, over every slot.
        for t in 0..200_i64 {
            sqlx::query(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key)
                 SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k' || g
                 FROM generate_series($1, $1 + 999) AS g",
            )
            .bind(t * 1000)
            .execute(&pool)
            .await
            .unwrap();
        }
        // On a connection outside any transaction, as on one inside: the
        // planner's setting applies there too (it did not: `SET LOCAL`
        // outside a transaction only warns). The pages read, from the
        // table's counters.
        let mut conn = pool.acquire().await.unwrap();
        async fn pages_so_far(conn: &mut sqlx::PgConnection) -> i64 {
            sqlx::query("SELECT pg_stat_force_next_flush()")
                .execute(&mut *conn)
                .await
                .unwrap();
            sqlx::query_scalar(
                "SELECT (coalesce(heap_blks_hit, 0) + coalesce(heap_blks_read, 0)
                         + coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0))::int8
                 FROM pg_statio_user_tables WHERE relname = 'outbox_event'",
            )
            .fetch_one(&mut *conn)
            .await
            .unwrap()
        }
        let before = pages_so_far(&mut conn).await;
        let lag = read(&mut conn).await.unwrap();
        let pages = pages_so_far(&mut conn).await - before;
        assert_eq!(lag.events(), super::LAG_EXACT_UP_TO + 1, "{lag:?}");
        assert!(pages < 3_000, "{pages} pages read on a plain connection");
        drop(conn);
        let mut tx = pool
            .begin_with(crate::ops::backlog::PROGRESS_READS)
            .await
            .unwrap();
        let lag = read(&mut tx).await.unwrap();
        // One lane (every slot) until relays record theirs.
        assert_eq!(lag.events(), super::LAG_EXACT_UP_TO + 1, "{lag:?}");
        assert!(lag.lanes.iter().all(|l| l.oldest_secs.is_some()), "{lag:?}");
        // The same statement as `read` runs it, its plan and buffers.
        plan_lanes(&mut tx).await.unwrap();
        let plan: serde_json::Value = sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}",
            LANES.as_str()
        ))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        let top = &plan[0]["Plan"];
        let pages = top["Shared Hit Blocks"].as_f64().unwrap_or(0.0)
            + top["Shared Read Blocks"].as_f64().unwrap_or(0.0);
        // The count reads 1,001 rows; the oldest, a row or two of each of
        // the 64 slots. The backlog spans some 5,000 pages.
        assert!(pages < 1_500.0, "{pages} pages read: {plan:#}");
    }

    #[test]
    fn slot_sets_name_their_lane() {
        assert_eq!(lane_of(&[3, 19, 35, 51]), Some((3, 16)));
        let all: Vec<i16> = (0..64).collect();
        assert_eq!(lane_of(&all), Some((0, 1)));
        assert_eq!(lane_of(&[5]), Some((5, 64)));
        assert_eq!(lane_of(&[3, 20, 35, 51]), None);
        assert_eq!(lane_of(&[19, 35, 51]), None);
        assert_eq!(lane_of(&[]), None);
    }
}
