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

/// In the progress mode (see [`crate::relay::progress`]): the queue's
/// rows (id, topic) in the windows after the slots' positions, up to
/// `limit` (a parameter or a number) per slot and in all, lowest ids first.
/// Each slot's rows are read over the progress index from its position's
/// snapshot on (the transactions in flight then, and those after), as the
/// relay reads them (the transactions of the `xip` list probed one by one:
/// see the relay's window list). Written after `WITH RECURSIVE`
/// [`POSITIONS`]`,`.
///
/// [`POSITIONS`]: crate::relay::progress::POSITIONS
pub(crate) fn progress_queue_rows(limit: &str) -> String {
    // Rows the windows reached are out of the queue: published, or (a held
    // topic's) counted by the topic's hold.
    let passed = crate::relay::progress::reached("e");
    format!(
        "SELECT e.id, e.topic FROM pos CROSS JOIN LATERAL (
    (SELECT e.id, e.topic FROM pg_snapshot_xip(pos.done) AS x(txid)
     CROSS JOIN LATERAL (
         SELECT e.id, e.topic, e.txid, e.lane_slot FROM outbox_event e
         WHERE e.lane_slot = pos.slot AND e.txid = x.txid
           AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3
         OFFSET 0) e
     WHERE NOT {passed})
    UNION ALL
    (SELECT e.id, e.topic FROM outbox_event e
     WHERE e.lane_slot = pos.slot AND e.txid >= pg_snapshot_xmax(pos.done)
       AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3 AND NOT {passed}
     LIMIT {limit})) e
ORDER BY e.id LIMIT {limit}"
    )
}

/// [`QUEUE_SAMPLE`] in the progress mode.
pub(super) static PROGRESS_QUEUE_SAMPLE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| {
        format!(
            "WITH RECURSIVE {}, s AS ({})
SELECT topic, count(*)::int8, min(id), max(id), 0::int8 FROM s GROUP BY topic",
            crate::relay::progress::POSITIONS,
            progress_queue_rows("$1")
        )
    });

/// [`QUEUE_LAST`] in the progress mode: the last row (the queue's last,
/// unless published since).
pub(super) const PROGRESS_QUEUE_LAST: &str = "SELECT id FROM outbox_event ORDER BY id DESC LIMIT 1";

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
    let (sample, last) = if progress {
        (PROGRESS_QUEUE_SAMPLE.as_str(), PROGRESS_QUEUE_LAST)
    } else {
        (QUEUE_SAMPLE, QUEUE_LAST)
    };
    let queue = kind(pool, sample, async |read, first, upto| {
        let last: Option<i64> = sqlx::query_scalar(last).fetch_optional(pool).await?;
        let span = (last.unwrap_or(upto).max(upto) - first + 1) as f64;
        let density = read as f64 / (upto - first + 1) as f64;
        Ok(span * density)
    })
    .await?;
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
