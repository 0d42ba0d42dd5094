//! What the positions say is published, for the readers beside the relay's
//! claim: the slots' newest positions as SQL ([`POSITIONS`]), the tests a
//! row passes (`passed`, `reached`, [`Published`]), when a row went out
//! (`published_by`), the positions and held topics as `outbox progress
//! status` lists them, their pruning by the cleanup, and the count of
//! events not yet published.

use super::batch;
use crate::error::Result;

/// `WITH RECURSIVE` common table expressions ending in `pos (slot, done,
/// upto, after_id, id)`: each slot's newest position (none for a slot
/// without one: the mode is off). The slot sets are found by a skip scan
/// of the positions' `(slots, id)` index, then each set's newest row: a
/// few index probes however many positions were recorded.
pub(crate) const POSITIONS: &str = "
sets AS (
    (SELECT slots FROM outbox_progress ORDER BY slots LIMIT 1)
    UNION ALL
    SELECT (SELECT q.slots FROM outbox_progress q WHERE q.slots > sets.slots
            ORDER BY q.slots LIMIT 1)
    FROM sets WHERE sets.slots IS NOT NULL),
newest AS (
    SELECT n.* FROM sets CROSS JOIN LATERAL (
        SELECT q.id, q.slots, q.done, q.upto, q.after_id FROM outbox_progress q
        WHERE q.slots = sets.slots ORDER BY q.id DESC LIMIT 1) n
    WHERE sets.slots IS NOT NULL),
pos AS MATERIALIZED (
    SELECT DISTINCT ON (s) s AS slot, newest.done, newest.upto, newest.after_id, newest.id
    FROM newest, unnest(newest.slots) AS s ORDER BY s, newest.id DESC)";

/// Whether the row `e` (joined to its slot's `pos`) is passed by that
/// position: its transaction visible in `done`, or in the window up to
/// `after_id`.
///
/// A row of a topic held as missing on the broker that the hold's `since`
/// does not see is never passed: the windows passed over it without
/// publishing it (see [`Skip`]). Without held topics (an uncorrelated
/// probe, run once per statement) nothing more is read per row.
pub(crate) fn passed(e: &str) -> String {
    format!(
        "({reached}
          AND (NOT EXISTS (SELECT 1 FROM outbox_held_topic)
               OR NOT EXISTS (SELECT 1 FROM outbox_held_topic ht WHERE ht.topic = {e}.topic
                              AND NOT pg_visible_in_snapshot({e}.txid, ht.since))))",
        reached = reached(e)
    )
}

/// Whether the windows of the row `e`'s slot (joined as `pos`) reached it:
/// [`passed`] without the held topics. A held topic's row they reached and
/// did not publish is counted by its hold (`outbox_held_topic.rows`), not
/// in the queue.
pub(crate) fn reached(e: &str) -> String {
    format!(
        "(pg_visible_in_snapshot({e}.txid, pos.done)
          OR (pos.upto IS NOT NULL AND pg_visible_in_snapshot({e}.txid, pos.upto)
              AND {e}.id <= pos.after_id))"
    )
}

/// How readers of published rows (a replay, an event's page) tell a
/// published row in either mode: a statement's prefix and a condition on
/// an unaliased `outbox_event`. In the default mode a published row has
/// `published_at`; in the progress mode the common path writes nothing per
/// row, so a row is also published once the newest position of its slot
/// passes it and no rare path holds or parked it.
///
/// ```text
/// let p = Published::of(&pool).await?;
/// let sql = format!("{}SELECT count(*) FROM outbox_event WHERE {}", p.with, p.condition);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// `WITH RECURSIVE …` (the positions) or nothing; the statement follows.
    pub with: String,
    /// True for a published row.
    pub condition: String,
    /// Whether the outbox is in the progress mode.
    pub progress: bool,
}

impl Published {
    /// The view of the outbox's mode (read with `enabled`; a schema without
    /// the positions table is in the default mode).
    pub async fn of(pool: &sqlx::PgPool) -> Result<Self> {
        let progress = batch::enabled(pool).await?.unwrap_or(false);
        Ok(Self::in_mode(progress))
    }

    /// The view of the given mode.
    pub fn in_mode(progress: bool) -> Self {
        if !progress {
            return Self {
                with: String::new(),
                condition: "published_at IS NOT NULL".into(),
                progress,
            };
        }
        Self {
            with: format!("WITH RECURSIVE {POSITIONS} "),
            condition: format!(
                "(published_at IS NOT NULL
                  OR (held_until IS NULL AND parked_at IS NULL AND txid IS NOT NULL
                      AND EXISTS (SELECT 1 FROM pos WHERE pos.slot = outbox_event.lane_slot
                                  AND {})))",
                passed("outbox_event")
            ),
            progress,
        }
    }
}

/// Rows not published yet in the progress mode: those of each slot its
/// newest position does not pass, those held (a hold to end, or due) and
/// not published, none parked. A scan of the table: for tests and reports.
static PENDING: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH RECURSIVE {POSITIONS}
SELECT count(*) FROM outbox_event e JOIN pos ON pos.slot = e.lane_slot
WHERE e.published_at IS NULL AND e.parked_at IS NULL
  AND (e.held_until IS NOT NULL OR e.txid IS NULL OR NOT {passed})",
        passed = passed("e")
    )
});

/// Deletes the positions no slot stands at any more (every slot of theirs
/// has a newer one), but keeps, of those recorded at or after `$1`, the
/// newest of each set of slots and minute: what [`published_by`] answers
/// from, to the minute, for as long as the rows are kept. Returns how many
/// went. Run by the cleanup pass.
static PRUNE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH RECURSIVE {POSITIONS},
ranked AS (
    SELECT q.id, q.recorded_at,
           row_number() OVER (PARTITION BY q.slots, date_trunc('minute', q.recorded_at)
                              ORDER BY q.id DESC) AS nth
    FROM outbox_progress q)
DELETE FROM outbox_progress p USING ranked r
WHERE p.id = r.id AND p.id < (SELECT max(id) FROM pos)
  AND p.id NOT IN (SELECT id FROM pos)
  AND (r.recorded_at < $1 OR r.nth > 1)"
    )
});

/// When the row `e` was published in the progress mode, at the latest:
/// the time of the first position kept that passes it (a position is
/// recorded once its batch was delivered; the cleanup keeps one a minute
/// of the older ones, so the time is at most a minute late once thinned).
/// NULL for a row no position kept passes.
pub(crate) fn published_by(e: &str) -> String {
    format!(
        "(SELECT min(q.recorded_at) FROM outbox_progress q
          WHERE {e}.lane_slot = ANY(q.slots) AND q.recorded_at >= {e}.created_at
            AND (pg_visible_in_snapshot({e}.txid, q.done)
                 OR (q.upto IS NOT NULL AND pg_visible_in_snapshot({e}.txid, q.upto)
                     AND {e}.id <= q.after_id)))"
    )
}

/// Where a set of lane slots stands (see [`positions`]).
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct PositionStatus {
    /// The slots, as `{s,…}`.
    pub slots: String,
    /// Every event of the slots visible in this snapshot is published.
    pub done: String,
    /// The window being published, if one is.
    pub upto: Option<String>,
    /// Events of the window up to this id are published.
    pub after_id: Option<i64>,
    /// Seconds since it was recorded.
    pub recorded_secs_ago: f64,
}

/// The positions the slots stand at (none: the mode is off), by slots.
pub async fn positions(pool: &sqlx::PgPool) -> Result<Vec<PositionStatus>> {
    Ok(sqlx::query_as(&format!(
        "WITH RECURSIVE {POSITIONS}
SELECT p.slots::text AS slots, p.done::text AS done, p.upto::text AS upto, p.after_id,
       EXTRACT(EPOCH FROM now() - p.recorded_at)::float8 AS recorded_secs_ago
FROM outbox_progress p WHERE p.id IN (SELECT id FROM pos) ORDER BY p.slots"
    ))
    .fetch_all(pool)
    .await?)
}

/// A topic held as missing on the broker (see [`Skip`](super::Skip)).
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct HeldTopic {
    /// The topic.
    pub topic: String,
    /// Every row of the topic its transaction visible in this snapshot is
    /// published; the others wait.
    pub since: String,
    /// Why, as the broker said.
    pub reason: String,
    /// Rows the relays passed over while it was held (a row read again
    /// after a restart counts again).
    pub rows: i64,
    /// Seconds since it was first held.
    pub held_secs_ago: f64,
}

/// The topics held as missing on the broker in the progress mode.
pub async fn held_topics(pool: &sqlx::PgPool) -> Result<Vec<HeldTopic>> {
    Ok(sqlx::query_as(
        "SELECT topic, since::text AS since, reason, rows,
                EXTRACT(EPOCH FROM now() - held_at)::float8 AS held_secs_ago
         FROM outbox_held_topic ORDER BY topic",
    )
    .fetch_all(pool)
    .await?)
}

/// Deletes the positions no slot stands at any more (every slot of theirs
/// has a newer one), but keeps, of those recorded at or after `keep_since`,
/// the newest of each set of slots and minute (the events' publication
/// times, to the minute: see `ops::OutboxRow::published_by`); returns how
/// many went. Run by the cleanup pass, with its retention's cutoff.
pub async fn prune(
    pool: &sqlx::PgPool,
    keep_since: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
) -> Result<u64> {
    Ok(sqlx::query(&PRUNE)
        .bind(keep_since)
        .execute(pool)
        .await?
        .rows_affected())
}

/// How many events are not published yet in the progress mode: those the
/// newest position of their slot does not pass, and those held; not the
/// parked ones. A scan of the table: for tests and reports.
pub async fn pending(pool: &sqlx::PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar(&PENDING).fetch_one(pool).await?)
}
