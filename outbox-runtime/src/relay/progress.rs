//! Progress per batch: reading a lane's events by snapshot windows, and
//! recording how far they are published, instead of marking each row (see
//! `docs/design/progress-per-batch.md`). This module owns the SQL of the
//! progress mode's common path: which rows come next, and the progress
//! record. The rows are never written on that path.
//!
//! Every `outbox_event` row stores the id of the transaction that wrote it
//! (`txid`, a column default). A lane slot's progress (`outbox_progress`)
//! is a snapshot `done`: every event of the slot whose transaction is
//! visible in it is published. The next window is the slot's events visible
//! in a later snapshot `upto` and not in `done`: they all committed after
//! the events of earlier windows, and before those of later ones (a
//! transaction in flight when `upto` was taken is in its `xip` list: its
//! events belong to a later window, whatever their ids). Inside a window,
//! events go out in `id` order, which is commit order for a key (the Unit
//! of Work takes the key's lock before it draws the id); not in `txid`
//! order (a transaction may draw its transaction id before it waits for a
//! key's lock another holds). A window's position `after_id` says how far
//! into it the events are published, so a large window (a backlog) is read
//! in chunks and a relay that stops resumes inside it: at least once, as
//! with marks.
//!
//! A window is read in two parts (after PgQ): the events of the
//! transactions of `done`'s `xip` list (in flight when `done` was taken: a
//! few, found by their `txid`), and those of the transactions that started
//! after `done` (`txid` from `done`'s `xmax` to `upto`'s). A plain id cursor
//! would lose the events of a transaction that drew its ids before another
//! and committed after it; a `txid` range from `done`'s `xmin` would read
//! everything published since a long transaction began, at every window.
//!
//! A window's ids are listed once (up to [`LIST_CAP`] at a time, id order)
//! and its rows fetched a chunk at a time by `event_id`: a backlog of
//! millions in one window is read in one pass, not once per chunk.
//!
//! Rows with their own state (published, parked or held by the rare paths,
//! which still write the row) are skipped: they were handled where they
//! are, or will be by those paths.

use std::collections::VecDeque;

use sqlx::PgConnection;
use uuid::Uuid;

use super::claim::Row;
use crate::error::Result;

/// Most ids of a window listed at once.
pub(crate) const LIST_CAP: i64 = 100_000;

/// The index the progress mode reads windows through (created when the
/// mode is enabled: the rows' slots, by transaction id).
pub(crate) const INDEX: &str = "ix_outbox_event_progress";

/// One lane slot's recorded progress.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub(crate) struct SlotProgress {
    pub slot: i16,
    pub done: String,
    pub upto: Option<String>,
    pub after_id: Option<i64>,
}

/// Reads the recorded progress of `slots` (those with a progress row).
pub(crate) async fn load(conn: &mut PgConnection, slots: &[i16]) -> Result<Vec<SlotProgress>> {
    Ok(sqlx::query_as(
        "SELECT slot, done::text AS done, upto::text AS upto, after_id
         FROM outbox_progress WHERE slot = ANY($1) ORDER BY slot",
    )
    .bind(slots)
    .fetch_all(conn)
    .await?)
}

/// The ids of a window's rows after `$4`, in id order, at most `$5`: the
/// rows of slots `$1` whose transaction is visible in `$3` (`upto`) and not
/// in `$2` (`done`), without a state of their own.
const LIST: &str = "
SELECT w.id, w.event_id FROM (
    SELECT e.id, e.event_id FROM outbox_event e
    WHERE e.lane_slot = ANY($1::int2[])
      AND e.txid = ANY(ARRAY(SELECT pg_snapshot_xip($2::pg_snapshot)))
      AND pg_visible_in_snapshot(e.txid, $3::pg_snapshot)
      AND e.id > $4 AND coalesce(e.published_at, e.parked_at, e.held_until) IS NULL
    UNION ALL
    SELECT e.id, e.event_id FROM outbox_event e
    WHERE e.lane_slot = ANY($1::int2[])
      AND e.txid >= pg_snapshot_xmax($2::pg_snapshot)
      AND e.txid < pg_snapshot_xmax($3::pg_snapshot)
      AND pg_visible_in_snapshot(e.txid, $3::pg_snapshot)
      AND e.id > $4 AND coalesce(e.published_at, e.parked_at, e.held_until) IS NULL
) w
ORDER BY w.id LIMIT $5";

/// The rows of the ids `$1` still without a state of their own, in id
/// order, cut at the byte budget `$3` (see `claim::bounded`); `$2` is the
/// claim's list of keys to leave out, always empty here: a row left out
/// would be passed over by the position.
fn fetch_sql() -> String {
    super::claim::bounded(
        &format!(
            "{} AND event_id = ANY($1::uuid[]) ORDER BY id",
            super::claim::CLAIM_COLUMNS
        ),
        "$3",
    )
}

static FETCH: std::sync::LazyLock<String> = std::sync::LazyLock::new(fetch_sql);

/// Records the progress of slots `$1`.
const RECORD: &str = "
UPDATE outbox_progress
SET done = $2::pg_snapshot, upto = $3::pg_snapshot, after_id = $4, updated_at = now()
WHERE slot = ANY($1)";

/// The slots of one progress (slots that share `done`, `upto` and
/// `after_id`, read and recorded together), and what is known of its window
/// in memory.
#[derive(Debug)]
pub(crate) struct Window {
    pub slots: Vec<i16>,
    pub done: String,
    /// The window being read; `None` until the first read takes it.
    pub upto: Option<String>,
    /// Rows of the window up to this id are handed over.
    pub after_id: i64,
    /// Ids listed and not handed over yet, in id order.
    listed: VecDeque<(i64, Uuid)>,
    /// Whether `listed` holds every remaining row of the window.
    complete: bool,
}

/// What [`Window::next`] found.
#[derive(Debug)]
pub(crate) enum Chunk {
    /// Rows of the window, in id order, ready to hand over.
    Rows(Vec<Row>),
    /// The window has no row left: [`Window::advance`] starts the next.
    Finished,
}

impl Window {
    /// Groups recorded progress by equal position: one window per group.
    pub(crate) fn group(progress: Vec<SlotProgress>) -> Vec<Window> {
        let mut windows: Vec<Window> = Vec::new();
        for p in progress {
            let after_id = p.after_id.unwrap_or(0);
            match windows
                .iter_mut()
                .find(|w| w.done == p.done && w.upto == p.upto && w.after_id == after_id)
            {
                Some(w) => w.slots.push(p.slot),
                None => windows.push(Window {
                    slots: vec![p.slot],
                    done: p.done,
                    upto: p.upto,
                    after_id,
                    listed: VecDeque::new(),
                    complete: false,
                }),
            }
        }
        windows
    }

    /// The next rows of the window: at most `limit`, past the first at most
    /// `budget` bytes. The position moves past them (in memory: see
    /// [`Window::record`]).
    pub(crate) async fn next(
        &mut self,
        conn: &mut PgConnection,
        limit: usize,
        budget: i64,
    ) -> Result<Chunk> {
        let upto = match &self.upto {
            Some(upto) => upto.clone(),
            None => {
                let upto: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
                    .fetch_one(&mut *conn)
                    .await?;
                self.upto = Some(upto.clone());
                upto
            }
        };
        loop {
            if self.listed.is_empty() {
                if self.complete {
                    return Ok(Chunk::Finished);
                }
                let ids: Vec<(i64, Uuid)> = sqlx::query_as(LIST)
                    .bind(&self.slots)
                    .bind(&self.done)
                    .bind(&upto)
                    .bind(self.after_id)
                    .bind(LIST_CAP)
                    .fetch_all(&mut *conn)
                    .await?;
                self.complete = (ids.len() as i64) < LIST_CAP;
                self.listed = ids.into();
                continue;
            }
            let take = self.listed.len().min(limit.max(1));
            let wanted: Vec<Uuid> = self.listed.iter().take(take).map(|(_, e)| *e).collect();
            let rows: Vec<Row> = sqlx::query_as(&FETCH)
                .bind(&wanted)
                .bind(Vec::<String>::new())
                .bind(budget)
                .fetch_all(&mut *conn)
                .await?;
            // Every id up to the last row returned is handled: returned, or
            // given a state of its own since it was listed. With no row
            // returned, every id asked for had one.
            let through = rows.last().map_or(self.listed[take - 1].0, |r| r.id);
            while self.listed.front().is_some_and(|(id, _)| *id <= through) {
                self.listed.pop_front();
            }
            self.after_id = through;
            if !rows.is_empty() {
                return Ok(Chunk::Rows(rows));
            }
        }
    }

    /// Records the window's position on its slots (in the caller's
    /// transaction).
    pub(crate) async fn record(&self, conn: &mut PgConnection) -> Result<()> {
        sqlx::query(RECORD)
            .bind(&self.slots)
            .bind(&self.done)
            .bind(&self.upto)
            .bind(self.upto.as_ref().map(|_| self.after_id))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// After [`Chunk::Finished`]: the window is done; the next read takes
    /// a new one.
    pub(crate) fn advance(&mut self) {
        if let Some(upto) = self.upto.take() {
            self.done = upto;
        }
        self.after_id = 0;
        self.listed.clear();
        self.complete = false;
    }
}

/// Enables the progress mode on this outbox (relays stopped): the index
/// the windows are read through, and a progress row per slot whose `done`
/// leaves out every event not yet published, those of transactions still in
/// flight included. Rows written before the `txid` column existed and not
/// published yet are given the id of this call's transaction. Events
/// published before stay skipped (`published_at`).
pub(crate) async fn enable(pool: &sqlx::PgPool) -> Result<()> {
    create_index(pool).await?;
    let mut conn = pool.acquire().await?;
    sqlx::query(
        "UPDATE outbox_event SET txid = pg_current_xact_id()
         WHERE txid IS NULL AND published_at IS NULL",
    )
    .execute(&mut *conn)
    .await?;
    // `m:m:` is a snapshot in which exactly the transactions before `m` are
    // visible: `m` is at most the oldest unpublished row's transaction and
    // the oldest transaction in flight now (whose rows this statement
    // cannot see).
    sqlx::query(
        "INSERT INTO outbox_progress (slot, done)
         SELECT s, (m || ':' || m || ':')::pg_snapshot
         FROM generate_series(0, 63) AS s,
              (SELECT least(pg_snapshot_xmin(pg_current_snapshot()),
                            (SELECT min(txid) FROM outbox_event
                             WHERE published_at IS NULL AND parked_at IS NULL)) AS m) b
         ON CONFLICT (slot) DO NOTHING",
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Builds the index the windows are read through, if it is missing. The
/// build waits for the writers' open transactions, and the writers wait for
/// it (one read of the table).
pub(crate) async fn create_index(pool: &sqlx::PgPool) -> Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(INDEX)
        .fetch_one(pool)
        .await?;
    if !exists {
        sqlx::query(&format!(
            "CREATE INDEX IF NOT EXISTS {INDEX} ON outbox_event (lane_slot, txid)
             WHERE txid IS NOT NULL"
        ))
        .execute(pool)
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
