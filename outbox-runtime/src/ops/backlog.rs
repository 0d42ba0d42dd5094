//! The backlog counts of [`status`](super::status): rows in the claim's
//! queue, held rows, parked rows and scheduled rows waiting for their time, each read over its partial index, at
//! most [`BACKLOG_EXACT_UP_TO`] + 1 rows of each kind. Up to the bound the
//! counts (in total and per topic) are exact; beyond, the kind's total is
//! estimated and its per-topic split is that of the rows read, so that
//! `status` costs about the same with a backlog of ten thousand rows or of
//! ten million:
//!
//! - the queue's total from the span of its ids (its index's first and last
//!   entries) and the density of the ids read (rows are numbered as they
//!   are written, so a backlog is a range of ids, less what other lanes
//!   already published);
//! - held and parked rows from the entries their partial index held when
//!   the table was last analyzed or vacuumed (`reltuples`, over every
//!   partition), never below the rows read; when those statistics are
//!   below twice the rows read (rows held since, e.g. a missing topic's
//!   held by the relay's updates), counted over the index instead, up to
//!   [`BACKLOG_COUNTED_UP_TO`] rows.
//!
//! In the relay's progress mode the queue is the rows after each lane
//! slot's position, and has no index in id order: each slot's first rows
//! are read (its share of the bound, [`PROGRESS_SLOT_READ`]), a slot read
//! to its end counted exactly, a longer one (truncated) estimated from the
//! span of its ids (the first read to the slot's last row by the progress
//! index) and the density of the ids read, its topics split as its rows
//! read; when the rows read are within the bound yet some slot was
//! truncated (one hot key), the truncated slots are read again in one scan
//! up to the bound in all, and counted exactly if they hold no more. About
//! the bound's rows are read however large the backlog.

use std::collections::BTreeMap;

use sqlx::PgPool;

use crate::error::Result;

/// Rows of each kind (queue, held, parked) `status` reads and counts
/// exactly; a kind with more is estimated (see the module docs).
pub const BACKLOG_EXACT_UP_TO: i64 = 10_000;

/// The queue's first rows in id order (its index's order), per topic:
/// rows, lowest and highest id.
pub(super) const QUEUE_SAMPLE: &str = "\
WITH s AS (SELECT id, topic FROM outbox_event
           WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
           ORDER BY id LIMIT $1)
SELECT topic, count(*)::int8, min(id), max(id), 0::int8 FROM s GROUP BY topic";

/// The queue's last id (its index's last entry).
pub(super) const QUEUE_LAST: &str = "\
SELECT id FROM outbox_event
WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
ORDER BY id DESC LIMIT 1";

/// In the progress mode (see [`crate::relay::progress`]): the rows (id,
/// topic, created_at) of the slot `pos.slot` in the windows after its
/// position (joined as `pos`, from [`POSITIONS`]) that `passed` (a
/// condition on the row `e` and `pos`) does not pass, in no particular
/// order. They are read over the progress index from the position's
/// snapshot on (the transactions in flight then, and those after), as the
/// relay reads them (the transactions of the `xip` list probed one by one:
/// see the relay's window list); a `LIMIT` over them, or over a nested loop
/// of slots joined to them, stops the scan.
///
/// [`POSITIONS`]: crate::relay::progress::POSITIONS
pub(crate) fn progress_slot_rows(passed: &str) -> String {
    format!(
        "(SELECT e.id, e.topic, e.created_at FROM pg_snapshot_xip(pos.done) AS x(txid)
     CROSS JOIN LATERAL (
         SELECT e.id, e.topic, e.txid, e.created_at FROM outbox_event e
         WHERE e.lane_slot = pos.slot AND e.txid = x.txid
           AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3
         OFFSET 0) e
     WHERE NOT {passed})
    UNION ALL
    (SELECT e.id, e.topic, e.created_at FROM outbox_event e
     WHERE e.lane_slot = pos.slot AND e.txid >= pg_snapshot_xmax(pos.done)
       AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3 AND NOT {passed})"
    )
}

/// The queue's rows of a slot in the progress mode: those the windows did
/// not reach (a held topic's rows they reached and did not publish are
/// counted by the topic's hold, `outbox_held_topic.rows`).
fn progress_queue_rows() -> String {
    progress_slot_rows(&crate::relay::progress::reached("e"))
}

/// Rows of each slot the progress mode's queue sample reads: its share
/// (of 64 slots) of [`BACKLOG_EXACT_UP_TO`], + 1 (a slot with that many has
/// more: it is truncated).
pub(crate) const PROGRESS_SLOT_READ: i64 = (BACKLOG_EXACT_UP_TO + 63) / 64 + 1;

/// In the progress mode: the queue's first rows of each slot (at most
/// [`PROGRESS_SLOT_READ`]), per slot and topic: rows, lowest and highest
/// id.
static PROGRESS_SLOT_SAMPLE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH RECURSIVE {}
SELECT pos.slot, e.topic, count(*)::int8, min(e.id), max(e.id)
FROM pos CROSS JOIN LATERAL (SELECT u.id, u.topic FROM ({}) u LIMIT {PROGRESS_SLOT_READ}) e
GROUP BY pos.slot, e.topic",
        crate::relay::progress::POSITIONS,
        progress_queue_rows()
    )
});

/// In the progress mode: the queue's rows of the slots `$1` read again, at
/// most `$2` in all (one nested loop over the slots under one `LIMIT`),
/// per topic: rows, lowest and highest id.
static PROGRESS_SLOTS_READ: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH RECURSIVE {}
SELECT e.topic, count(*)::int8, min(e.id), max(e.id)
FROM (SELECT e.id, e.topic FROM pos CROSS JOIN LATERAL ({}) e
      WHERE pos.slot = ANY($1) LIMIT $2) e
GROUP BY e.topic",
        crate::relay::progress::POSITIONS,
        progress_queue_rows()
    )
});

/// The last row of each slot of `$1` by the progress index (its newest
/// transaction's last entry): the id the slot's rows reach.
const PROGRESS_SLOT_LAST: &str = "\
SELECT s, (SELECT e.id FROM outbox_event e WHERE e.lane_slot = s AND e.txid IS NOT NULL
           ORDER BY e.txid DESC LIMIT 1)
FROM unnest($1::int2[]) AS s";

/// The estimated rows of a truncated slot: the `read` rows from `first` to
/// `upto` (ids) hold the slot's density; its rows reach `last`.
pub(crate) fn slot_estimate(read: i64, first: i64, upto: i64, last: i64) -> f64 {
    let span = (last.max(upto) - first + 1) as f64;
    let density = read as f64 / (upto - first + 1) as f64;
    (span * density).max(read as f64)
}

/// Held rows in the order of their index (the time they may go again),
/// scheduled rows waiting for their time excluded (their hold ends at their
/// `due_at`: [`SCHEDULED_SAMPLE`]).
pub(super) const HELD_SAMPLE: &str = "\
WITH s AS (SELECT id, topic FROM outbox_event
           WHERE held_until IS NOT NULL AND published_at IS NULL
             AND held_until IS DISTINCT FROM due_at
           ORDER BY held_until, id LIMIT $1)
SELECT topic, count(*)::int8, min(id), max(id), 0::int8 FROM s GROUP BY topic";

/// Scheduled rows waiting for their time (held until their `due_at`, not
/// yet released), in the order of the held rows' index.
pub(super) const SCHEDULED_SAMPLE: &str = "\
WITH s AS (SELECT id, topic FROM outbox_event
           WHERE held_until IS NOT NULL AND published_at IS NULL AND held_until = due_at
           ORDER BY held_until, id LIMIT $1)
SELECT topic, count(*)::int8, min(id), max(id), 0::int8 FROM s GROUP BY topic";

/// Scheduled rows counted over the held rows' index, at most `$1`.
const SCHEDULED_COUNT: &str = "\
SELECT count(*)::float8 FROM (SELECT 1 FROM outbox_event
                              WHERE held_until IS NOT NULL AND published_at IS NULL
                                AND held_until = due_at
                              LIMIT $1) AS s";

/// Seconds until the next scheduled row is due (negative: overdue, not yet
/// released by a relay).
const NEXT_DUE: &str = "\
SELECT EXTRACT(EPOCH FROM held_until - now())::float8 FROM outbox_event
WHERE held_until IS NOT NULL AND published_at IS NULL AND held_until = due_at
ORDER BY held_until, id LIMIT 1";

/// Parked rows in id order; the last column counts the dropped ones.
pub(super) const PARKED_SAMPLE: &str = "\
WITH s AS (SELECT id, topic, discarded_at FROM outbox_event
           WHERE parked_at IS NOT NULL AND published_at IS NULL
           ORDER BY id LIMIT $1)
SELECT topic, count(*)::int8, min(id), max(id),
       count(*) FILTER (WHERE discarded_at IS NOT NULL)::int8
FROM s GROUP BY topic";

/// Entries of the table's (`$1`: its oid) index `$2`, and of that index on
/// every partition, when the table was last analyzed or vacuumed.
const INDEX_ENTRIES: &str = "\
SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::float8
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid AND ic.relname = $2
JOIN pg_class c ON c.oid = i.indexrelid
                OR c.oid IN (SELECT relid FROM pg_partition_tree(i.indexrelid))
WHERE i.indrelid = $1::int8::oid AND c.relkind = 'i'";

/// Held rows counted over their index, at most `$1`.
const HELD_COUNT: &str = "\
SELECT count(*)::float8 FROM (SELECT 1 FROM outbox_event
                              WHERE held_until IS NOT NULL AND published_at IS NULL
                                AND held_until IS DISTINCT FROM due_at
                              LIMIT $1) AS s";

/// Parked rows counted over their index, at most `$1`.
const PARKED_COUNT: &str = "\
SELECT count(*)::float8 FROM (SELECT 1 FROM outbox_event
                              WHERE parked_at IS NOT NULL AND published_at IS NULL
                              LIMIT $1) AS s";

/// Up to this many held or parked rows are counted when the statistics
/// cannot be trusted (fewer than twice the rows a query just read).
pub const BACKLOG_COUNTED_UP_TO: i64 = 1_000_000;

/// A kind's total from its index's statistics (`stats`), unless they are
/// stale: rows held or parked since the table was last analyzed are not in
/// them (the relay holds a missing topic's rows by updates, and the index
/// may have looked empty then). Statistics below twice the rows just read
/// are not believed: the rows are counted over their index instead, up to
/// [`BACKLOG_COUNTED_UP_TO`] (a few tens of milliseconds per 100,000).
async fn checked(pool: &PgPool, stats: f64, read: i64, count: &str) -> Result<f64> {
    if stats >= 2.0 * read as f64 {
        return Ok(stats);
    }
    let counted: f64 = sqlx::query_scalar(count)
        .bind(BACKLOG_COUNTED_UP_TO)
        .fetch_one(pool)
        .await?;
    Ok(counted.max(stats))
}

/// Ages (seconds) of the rows of the given ids.
const AGES: &str = "\
SELECT id, EXTRACT(EPOCH FROM now() - created_at)::float8 FROM outbox_event
WHERE id = ANY($1)";

/// One kind's rows of one topic, as read.
#[derive(Debug, Clone, Default)]
pub(super) struct TopicRows {
    /// Rows (scaled to the estimate when the kind is estimated).
    pub rows: i64,
    /// Lowest id read.
    pub first: Option<i64>,
    /// Of `rows`, dropped ones (parked rows only).
    pub discarded: i64,
}

/// One kind of backlog rows.
#[derive(Debug, Clone, Default)]
pub(super) struct Kind {
    /// Rows in total (estimated when `estimated`).
    pub total: i64,
    /// Of those, dropped (parked rows only).
    pub discarded: i64,
    /// Per topic.
    pub topics: BTreeMap<String, TopicRows>,
    /// More than [`BACKLOG_EXACT_UP_TO`] rows: the figures are estimates.
    pub estimated: bool,
}

/// The backlog: queue, held and parked rows, and the ages of the topics'
/// oldest rows read.
#[derive(Debug, Clone, Default)]
pub(super) struct Backlog {
    pub queue: Kind,
    pub held: Kind,
    pub parked: Kind,
    /// Scheduled rows waiting for their time (not in `held`).
    pub scheduled: Kind,
    /// Seconds until the next scheduled row is due (negative: overdue).
    pub next_due_secs: Option<f64>,
    /// Age in seconds of the rows of each topic's lowest id read (queue and
    /// held rows).
    pub ages: BTreeMap<i64, f64>,
}

impl Backlog {
    /// Whether any count is an estimate.
    pub fn estimated(&self) -> bool {
        self.queue.estimated
            || self.held.estimated
            || self.parked.estimated
            || self.scheduled.estimated
    }
}

type Row = (String, i64, Option<i64>, Option<i64>, i64);

/// Reads one kind: its first rows (`sample`), and its estimated total
/// (`estimate`, given the rows read, their lowest and highest id) when
/// there are more than the bound.
async fn kind<F>(pool: &PgPool, sample: &str, estimate: F) -> Result<Kind>
where
    F: AsyncFnOnce(i64, i64, i64) -> Result<f64>,
{
    let rows: Vec<Row> = sqlx::query_as(sample)
        .bind(BACKLOG_EXACT_UP_TO + 1)
        .fetch_all(pool)
        .await?;
    let read: i64 = rows.iter().map(|r| r.1).sum();
    let first = rows.iter().filter_map(|r| r.2).min();
    let upto = rows.iter().filter_map(|r| r.3).max();
    let estimated = read > BACKLOG_EXACT_UP_TO;
    let total = match (estimated, first, upto) {
        (true, Some(first), Some(upto)) => {
            (estimate(read, first, upto).await?.round() as i64).max(read)
        }
        _ => read,
    };
    let scale = |n: i64| {
        if estimated {
            (n as f64 * total as f64 / read as f64).round() as i64
        } else {
            n
        }
    };
    let mut kind = Kind {
        total,
        estimated,
        ..Kind::default()
    };
    for (topic, n, first, _, discarded) in rows {
        kind.discarded += scale(discarded);
        kind.topics.insert(
            topic,
            TopicRows {
                rows: scale(n),
                first,
                discarded: scale(discarded),
            },
        );
    }
    Ok(kind)
}

/// A read-only transaction for the progress mode's reads: without JIT,
/// and without sequential scans (a connection's prepared statement planned
/// while the outbox was empty scanned the table once per lane slot from
/// then on; see the relay's gauges' `sample_begin`).
pub(crate) const PROGRESS_READS: &str =
    "BEGIN READ ONLY; SET LOCAL jit = off; SET LOCAL enable_seqscan = off";

/// One slot's rows read, per topic: (topic, rows, lowest id, highest id).
type SlotRows = Vec<(String, i64, Option<i64>, Option<i64>)>;

/// The queue in the progress mode, at about the cost of
/// [`BACKLOG_EXACT_UP_TO`] rows read however large: each slot's first rows
/// ([`PROGRESS_SLOT_READ`] at most, its share of the bound). A slot read to
/// the end is counted exactly. When some are not (truncated), and the rows
/// read are more than the bound, the total is estimated: each truncated
/// slot's rows from the span of its ids (the first read to its last row by
/// the progress index) and the density of the ids read, its topics split
/// as its rows read. When the rows read are within the bound, they cannot
/// tell: the truncated slots are read again in one scan, up to the bound in
/// all — counted exactly if they hold no more, estimated if they do.
async fn progress_queue(pool: &PgPool) -> Result<Kind> {
    // One snapshot; no JIT (the planner cannot tell how few rows the
    // windows' filters leave, and its estimates would compile the
    // statements for longer than they run).
    let mut tx = pool.begin_with(PROGRESS_READS).await?;
    type SlotTopic = (i16, String, i64, Option<i64>, Option<i64>);
    let rows: Vec<SlotTopic> = sqlx::query_as(PROGRESS_SLOT_SAMPLE.as_str())
        .fetch_all(&mut *tx)
        .await?;
    let mut slots: BTreeMap<i16, SlotRows> = BTreeMap::new();
    for (slot, topic, n, first, upto) in rows {
        slots.entry(slot).or_default().push((topic, n, first, upto));
    }
    let count = |rows: &SlotRows| rows.iter().map(|r| r.1).sum::<i64>();
    let truncated: Vec<i16> = slots
        .iter()
        .filter(|(_, rows)| count(rows) >= PROGRESS_SLOT_READ)
        .map(|(slot, _)| *slot)
        .collect();
    let read: i64 = slots.values().map(count).sum();
    let exact: i64 = read - truncated.iter().map(|s| count(&slots[s])).sum::<i64>();
    let mut kind = Kind::default();
    let mut add = |topic: &str, rows: f64, first: Option<i64>| {
        let t = kind.topics.entry(topic.to_owned()).or_default();
        t.rows += rows.round() as i64;
        t.first = match (t.first, first) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    };
    // The truncated slots' rows when they are counted (none truncated:
    // none); `None`: more than the bound, estimated.
    let again: Option<SlotRows> = if truncated.is_empty() {
        Some(Vec::new())
    } else if read <= BACKLOG_EXACT_UP_TO {
        // The rows read cannot tell: the truncated slots read again in one
        // scan, up to the bound in all.
        let room = BACKLOG_EXACT_UP_TO + 1 - exact;
        let rows: SlotRows = sqlx::query_as(PROGRESS_SLOTS_READ.as_str())
            .bind(&truncated)
            .bind(room)
            .fetch_all(&mut *tx)
            .await?;
        (count(&rows) < room).then_some(rows)
    } else {
        None
    };
    let estimated = again.is_none();
    if !estimated {
        for (slot, rows) in &slots {
            if !truncated.contains(slot) {
                for (topic, n, first, _) in rows {
                    add(topic, *n as f64, *first);
                }
            }
        }
        for (topic, n, first, _) in again.unwrap_or_default() {
            add(&topic, n as f64, first);
        }
    } else {
        let lasts: Vec<(i16, Option<i64>)> = sqlx::query_as(PROGRESS_SLOT_LAST)
            .bind(&truncated)
            .fetch_all(&mut *tx)
            .await?;
        for (slot, rows) in &slots {
            let n = count(rows);
            let first = rows.iter().filter_map(|r| r.2).min();
            let upto = rows.iter().filter_map(|r| r.3).max();
            let last = lasts.iter().find(|(s, _)| s == slot).and_then(|(_, l)| *l);
            let scale = match (truncated.contains(slot), first, upto) {
                (true, Some(first), Some(upto)) => {
                    slot_estimate(n, first, upto, last.unwrap_or(upto)) / n as f64
                }
                _ => 1.0,
            };
            for (topic, n, first, _) in rows {
                add(topic, *n as f64 * scale, *first);
            }
        }
    }
    kind.total = kind.topics.values().map(|t| t.rows).sum();
    if estimated {
        kind.total = kind.total.max(BACKLOG_EXACT_UP_TO + 1);
    }
    kind.estimated = estimated;
    tx.commit().await?;
    Ok(kind)
}

/// The index entries of `index` on the table `oid` by its statistics.
async fn index_entries(pool: &PgPool, oid: i64, index: &str) -> Result<f64> {
    Ok(sqlx::query_scalar(INDEX_ENTRIES)
        .bind(oid)
        .bind(index)
        .fetch_one(pool)
        .await?)
}

/// Reads the backlog of the outbox table `oid` (see the module docs); in
/// the progress mode with `progress`.
pub(super) async fn read(pool: &PgPool, oid: i64, progress: bool) -> Result<Backlog> {
    let queue = if progress {
        progress_queue(pool).await?
    } else {
        kind(pool, QUEUE_SAMPLE, async |read, first, upto| {
            let last: Option<i64> = sqlx::query_scalar(QUEUE_LAST).fetch_optional(pool).await?;
            let span = (last.unwrap_or(upto).max(upto) - first + 1) as f64;
            let density = read as f64 / (upto - first + 1) as f64;
            Ok(span * density)
        })
        .await?
    };
    let held = kind(pool, HELD_SAMPLE, async |read, _, _| {
        let stats = index_entries(pool, oid, "ix_outbox_event_held").await?;
        checked(pool, stats, read, HELD_COUNT).await
    })
    .await?;
    let mut held = held;
    if progress {
        // Topics held as missing: their rows, passed over by the windows,
        // are counted when passed (`outbox_held_topic.rows`).
        let topics: Vec<(String, i64)> =
            sqlx::query_as("SELECT topic, rows FROM outbox_held_topic ORDER BY topic")
                .fetch_all(pool)
                .await?;
        for (topic, rows) in topics {
            held.total += rows;
            held.topics.entry(topic).or_default().rows += rows;
        }
    }
    // The held rows' index counts scheduled rows and held ones together:
    // its statistics say nothing of either alone, so they are counted.
    let scheduled = kind(pool, SCHEDULED_SAMPLE, async |read, _, _| {
        checked(pool, 0.0, read, SCHEDULED_COUNT).await
    })
    .await?;
    let next_due_secs: Option<f64> = sqlx::query_scalar(NEXT_DUE).fetch_optional(pool).await?;
    let parked = kind(pool, PARKED_SAMPLE, async |read, _, _| {
        let stats = index_entries(pool, oid, "ix_outbox_event_parked").await?;
        checked(pool, stats, read, PARKED_COUNT).await
    })
    .await?;
    let firsts: Vec<i64> = queue
        .topics
        .values()
        .chain(held.topics.values())
        .filter_map(|t| t.first)
        .collect();
    let ages: Vec<(i64, f64)> = if firsts.is_empty() {
        Vec::new()
    } else {
        sqlx::query_as(AGES).bind(&firsts).fetch_all(pool).await?
    };
    Ok(Backlog {
        queue,
        held,
        parked,
        scheduled,
        next_due_secs,
        ages: ages.into_iter().collect(),
    })
}
