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
//! A window's rows are listed once (id, event id and `ctid`) and fetched a
//! chunk at a time by their `ctid` (a TID scan: one page read for many
//! rows), by `event_id` for those that moved since: a backlog of millions
//! in one window is read in one pass, not once per chunk. A claim's windows
//! that fit in its batch (the steady state) are listed with the rows'
//! columns instead, and need no fetch: a claim's time is mostly its round
//! trips. The windows of a
//! claim's lanes that stand at the same place are listed in one scan of all
//! their slots (`LIST_GROUPS`: a slot's rows are spread over the table,
//! one page per row when read slot by slot); a window with more rows than
//! [`LIST_CAP`] is listed slot by slot, up to the cap at a time, in id
//! order (`LIST_MANY`).
//!
//! Rows with their own state (published, parked or held by the rare paths,
//! which still write the row) are skipped: they were handled where they
//! are, or will be by those paths.
//!
//! Turning the mode on is `enable`'s (its own module); what the positions
//! say is published, for the readers beside the claim (`status`, the
//! cleanup, replay, the tests), is `published`'s.

use std::collections::VecDeque;

use sqlx::PgConnection;
use uuid::Uuid;

pub use super::claim::Row;
use crate::error::{Error, Result};

/// Most rows of a window listed at once.
pub const LIST_CAP: i64 = 100_000;

/// The index the progress mode reads windows through (created when the
/// mode is enabled: the rows' slots, by transaction id).
pub const INDEX: &str = "ix_outbox_event_progress";

/// A snapshot, as `pg_snapshot`'s text gives it (`xmin:xmax:xip,…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Every transaction before it is finished.
    pub xmin: u64,
    /// Every transaction from it on is not finished.
    pub xmax: u64,
    /// The transactions between them in flight when it was taken.
    pub xip: Vec<u64>,
}

impl Snapshot {
    /// Parses `pg_snapshot`'s text form.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?,
        };
        parts.next().is_none().then_some(Self { xmin, xmax, xip })
    }

    /// Whether transaction `txid` is visible in it (finished, if it
    /// committed, when the snapshot was taken).
    pub fn visible(&self, txid: u64) -> bool {
        txid < self.xmin || (txid < self.xmax && !self.xip.contains(&txid))
    }

    /// The snapshot in which exactly the transactions visible in both are
    /// visible: the position of slots that stand at `self` and `other`.
    pub fn intersect(&self, other: &Snapshot) -> Snapshot {
        let xmin = self.xmin.min(other.xmin);
        let xmax = self.xmax.min(other.xmax);
        let mut xip: Vec<u64> = self
            .xip
            .iter()
            .chain(&other.xip)
            .copied()
            .filter(|t| *t >= xmin && *t < xmax)
            .collect();
        // Below both `xmax`, a transaction is invisible in a snapshot only
        // if it is in its `xip` list (below its `xmin`, it is visible).
        xip.sort_unstable();
        xip.dedup();
        Snapshot { xmin, xmax, xip }
    }
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let xip: Vec<String> = self.xip.iter().map(u64::to_string).collect();
        write!(f, "{}:{}:{}", self.xmin, self.xmax, xip.join(","))
    }
}

/// A recorded position.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
struct Position {
    slots: Vec<i16>,
    done: String,
    upto: Option<String>,
    after_id: Option<i64>,
}

/// The newest position recorded for exactly these slots, unless one of
/// them was recorded in another set since (the lane count changed, and
/// changed back).
const NEWEST: &str = "
SELECT p.* FROM (
    SELECT id, slots, done::text AS done, upto::text AS upto, after_id FROM outbox_progress
    WHERE slots = $1 ORDER BY id DESC LIMIT 1) p
WHERE NOT EXISTS (SELECT 1 FROM outbox_progress q WHERE q.id > p.id AND q.slots && $1)";

/// The newest position of each slot of `$1`, whatever set it was recorded
/// for (after a change of the lane count: a scan of the positions).
const NEWEST_PER_SLOT: &str = "
SELECT ARRAY[s] AS slots, p.done::text AS done, p.upto::text AS upto, p.after_id
FROM unnest($1::int2[]) AS s
CROSS JOIN LATERAL (SELECT * FROM outbox_progress p WHERE s = ANY(p.slots)
                    ORDER BY p.id DESC LIMIT 1) p";

/// Where the slots `slots` stand: their newest position, or, when they
/// were recorded in other sets since (the lane count changed), the earliest
/// of their newest positions — the intersection of their `done` snapshots, the
/// windows they were in the middle of read again from the start (at least
/// once). Fails if a slot has no position: the progress mode is not
/// enabled.
pub async fn load(conn: &mut PgConnection, slots: &[i16]) -> Result<Window> {
    let mut slots = slots.to_vec();
    slots.sort_unstable();
    slots.dedup();
    let newest: Option<Position> = sqlx::query_as(NEWEST)
        .bind(&slots)
        .fetch_optional(&mut *conn)
        .await?;
    let position = match newest {
        Some(p) => p,
        None => {
            let each: Vec<Position> = sqlx::query_as(NEWEST_PER_SLOT)
                .bind(&slots)
                .fetch_all(&mut *conn)
                .await?;
            if each.len() < slots.len() {
                return Err(Error::Config(
                    "the outbox's progress mode is not enabled (no position for some lane slots)"
                        .into(),
                ));
            }
            let first = &each[0];
            if each.iter().all(|p| {
                (&p.done, &p.upto, p.after_id) == (&first.done, &first.upto, first.after_id)
            }) {
                first.clone()
            } else {
                let parse = |text: &str| {
                    Snapshot::parse(text).ok_or_else(|| {
                        Error::Config(format!("a recorded position is not a snapshot: {text}"))
                    })
                };
                let mut done = parse(&first.done)?;
                for p in &each[1..] {
                    done = done.intersect(&parse(&p.done)?);
                }
                Position {
                    slots: slots.clone(),
                    done: done.to_string(),
                    upto: None,
                    after_id: None,
                }
            }
        }
    };
    Ok(Window {
        slots,
        done: position.done,
        after_id: position.after_id.unwrap_or(0),
        upto: position.upto,
        listed: VecDeque::new(),
        complete: false,
        capped: false,
        rows: Default::default(),
    })
}

/// The rows of several windows (a claim's lanes', or one window's), in one
/// statement: per slot `$1`, its window's index `$2` in the request,
/// `done` `$3`, `upto` `$4`, `after_id` `$5` and the most rows listed `$6`
/// (the window's share of [`LIST_CAP`]), lowest ids first; the rows come
/// in no order (sorted per window by [`list_windows`]: a sort of a whole
/// listing on the server spilled to disk at 200,000 rows). A window's rows
/// (id, event id, `ctid`, and the topic of a row passed over) are those of
/// its slots after its `after_id` whose transaction is visible in `upto`
/// and not in `done`, without a state of their own. That condition is
/// written with `num_nulls`: the default mode's partial indexes of
/// unpublished rows (whose predicates a `coalesce(…) IS NULL` or `… IS
/// NULL AND …` would match) hold every row of the table in this mode, and
/// a window read through them reads all of the lane's rows (measured: a
/// claim of 2,000 rows went from 20 to 200 ms within a backlog of 20,000);
/// only [`INDEX`] serves this condition. The transactions of `done`'s `xip`
/// list are probed one by one (a lateral subquery the planner cannot
/// flatten: written as `txid = ANY(…)` or a join, it read every row of the
/// slots, the whole history, at each list).
///
/// A row of a held topic (`$7`, each with its `since` in `$8`) is passed
/// over, its topic returned, if its transaction is not visible in the
/// topic's `since` and is visible in the fence `$9` (NULL: the window's
/// `upto`; see [`Skip`]).
///
/// The snapshots are parsed once per slot (cast as arrays), not once per
/// row, and the held topics' test is skipped when there are none: both
/// were a measurable part of the reader's CPU per row (a correlated
/// `EXISTS` over an empty `unnest` costs about 0.7 µs a row, the text's
/// cast 0.2 µs).
///
/// Its plan does not depend on the table's statistics, so that a claim
/// can keep the generic plan of its first execution (a prepared statement,
/// planned once per connection: planning it at each call cost about 0.3 ms
/// of a claim's 3 at 1,000 events/s). The ids are compared as `id + 0`: the
/// primary key then offers neither the `after_id` bound nor the order, and
/// the only index left to read a slot's window through is [`INDEX`] (a
/// plan made while the table was nearly empty, as when a relay starts on a
/// new outbox, read the windows through the primary key instead, every row
/// of the table at each list, until the next `ANALYZE`).
///
/// It starts with the claim's mark ([`super::claim::CLAIM_MARK`]), as the
/// fetches do: the claim's name in `pg_stat_activity`, in either mode.
static LIST_MANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{}
SELECT l.idx, l.slot, w.id, w.event_id, w.tid,
       CASE WHEN cardinality($7::text[]) = 0 THEN NULL
            WHEN EXISTS (SELECT 1 FROM unnest($7::text[], $8::text[]) AS h(topic, since)
                         WHERE h.topic = w.topic
                           AND NOT pg_visible_in_snapshot(w.txid, h.since::pg_snapshot)
                           AND pg_visible_in_snapshot(w.txid, coalesce($9::pg_snapshot, l.upto)))
            THEN w.topic END AS skipped
FROM unnest($1::int2[], $2::int4[], $3::text[]::pg_snapshot[], $4::text[]::pg_snapshot[],
            $5::int8[], $6::int8[])
     AS l(slot, idx, done, upto, after_id, cap)
CROSS JOIN LATERAL (
    SELECT u.* FROM (
        SELECT e.* FROM unnest(ARRAY(SELECT pg_snapshot_xip(l.done))) AS x(txid)
        CROSS JOIN LATERAL (
            SELECT e.id, e.event_id, e.ctid::text AS tid, e.topic, e.txid FROM outbox_event e
            WHERE e.lane_slot = l.slot AND e.txid = x.txid
              AND pg_visible_in_snapshot(e.txid, l.upto)
              AND e.id + 0 > l.after_id AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3
            OFFSET 0) e
        UNION ALL
        SELECT e.id, e.event_id, e.ctid::text AS tid, e.topic, e.txid FROM outbox_event e
        WHERE e.lane_slot = l.slot
          AND e.txid >= pg_snapshot_xmax(l.done)
          AND e.txid < pg_snapshot_xmax(l.upto)
          AND pg_visible_in_snapshot(e.txid, l.upto)
          AND e.id + 0 > l.after_id AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3
    ) u
    ORDER BY u.id + 0 LIMIT l.cap) w",
        super::claim::CLAIM_MARK
    )
});

/// The rows of groups of windows that stand at the same place (the same
/// `done`, `upto` and `after_id`: a claim's lanes, mostly, which take their
/// windows' snapshots together), in one scan per group: per group, its
/// windows' slots `$1` (each an `int2[]` as text), `done` `$2`, `upto` `$3`,
/// `after_id` `$4`, and the most rows it may list plus one `$5`; the held
/// topics `$6` to `$8` as in [`LIST_MANY`]. The rows come in no order, not
/// even by id within a slot: a group that returns more than its cap is
/// listed again slot by slot ([`LIST_MANY`]), whose per-slot order and cap
/// let a window be read in parts. That costs the group's scan, up to its
/// cap, once per window larger than [`LIST_CAP`] (a backlog of millions):
/// the window stays capped, and is listed slot by slot, until it is done.
///
/// [`LIST_MANY`] reads each slot's window on its own, and a slot's rows
/// are spread over the table (each page holds rows of every slot): in a
/// 200,000-event backlog over 64 slots, its scans visited 173,708 pages
/// (one per row) in 540–680 ms; the same rows read as one group visit each
/// of the table's 9,524 pages once, in 155–190 ms.
static LIST_GROUPS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{}
SELECT l.idx, w.lane_slot, w.id, w.event_id, w.tid,
       CASE WHEN cardinality($6::text[]) = 0 THEN NULL
            WHEN EXISTS (SELECT 1 FROM unnest($6::text[], $7::text[]) AS h(topic, since)
                         WHERE h.topic = w.topic
                           AND NOT pg_visible_in_snapshot(w.txid, h.since::pg_snapshot)
                           AND pg_visible_in_snapshot(w.txid, coalesce($8::pg_snapshot, l.upto)))
            THEN w.topic END AS skipped
FROM unnest($1::text[], $2::text[]::pg_snapshot[], $3::text[]::pg_snapshot[], $4::int8[],
            $5::int8[])
     WITH ORDINALITY AS l(slots, done, upto, after_id, cap, idx)
CROSS JOIN LATERAL (
    SELECT e.* FROM unnest(ARRAY(SELECT pg_snapshot_xip(l.done))) AS x(txid)
    CROSS JOIN LATERAL (
        SELECT e.lane_slot, e.id, e.event_id, e.ctid::text AS tid, e.topic, e.txid
        FROM outbox_event e
        WHERE e.lane_slot = ANY(l.slots::int2[]) AND e.txid = x.txid
          AND pg_visible_in_snapshot(e.txid, l.upto)
          AND e.id + 0 > l.after_id AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3
        OFFSET 0) e
    UNION ALL
    SELECT e.lane_slot, e.id, e.event_id, e.ctid::text AS tid, e.topic, e.txid FROM outbox_event e
    WHERE e.lane_slot = ANY(l.slots::int2[])
      AND e.txid >= pg_snapshot_xmax(l.done)
      AND e.txid < pg_snapshot_xmax(l.upto)
      AND pg_visible_in_snapshot(e.txid, l.upto)
      AND e.id + 0 > l.after_id AND num_nulls(e.published_at, e.parked_at, e.held_until) = 3
    LIMIT l.cap) w",
        super::claim::CLAIM_MARK
    )
});

/// The probe's bound in [`super::claim::CLAIM_COLUMNS`]: held rows of the
/// key before the row. In this mode the probe leaves out the held rows
/// claimed in the same batch (their ids bound as an `int8[]`): they go out
/// before the window's rows, in the same batch (see [`fetch`]).
const PROBED: &str = "AND h.id < outbox_event.id";

/// [`LIST_GROUPS`] with each row's columns, as the fetch returns them
/// ([`COLUMNS`]: the probe of an earlier held row of its key included, the
/// held rows of the claim `$9` left out), for groups of windows that fit
/// in a batch, the steady state (a few rows a claim): the list and the
/// fetch in one round trip. `$5` is the most rows a group may list plus
/// one; a group that has more is listed again without the columns
/// ([`list_windows_rows`]).
static LIST_GROUPS_ROWS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let inner = "e.topic, e.txid";
    assert_eq!(LIST_GROUPS.matches(inner).count(), 2);
    let outer = "SELECT l.idx, w.lane_slot, w.id, w.event_id, w.tid,";
    assert!(LIST_GROUPS.contains(outer));
    // The probe as the claim's columns write it, over `w`.
    let columns = super::claim::CLAIM_COLUMNS;
    let start = columns.find("CASE WHEN (SELECT EXISTS").expect("the probe");
    let end = columns
        .find("END AS behind_held_secs")
        .expect("the probe's end");
    let probe = columns[start..end]
        .replace("outbox_event.topic", "w.topic")
        .replace("outbox_event.partition_key", "w.partition_key")
        .replace(PROBED, &format!("{PROBED} AND h.id <> ALL($9::int8[])"))
        .replace("outbox_event.id", "w.id");
    assert!(probe.contains("$9"));
    LIST_GROUPS
        .replace(
            inner,
            "e.topic, e.txid, e.aggregate_type, e.aggregate_id, e.event_type, e.event_version,
               e.created_at, e.partition_key, e.payload, e.headers, e.attempts",
        )
        .replace(
            outer,
            &format!(
                "SELECT l.idx, w.lane_slot, w.id, w.event_id, w.tid, w.aggregate_type,
       w.aggregate_id, w.event_type, w.event_version, w.created_at, w.topic, w.partition_key,
       w.payload::text AS payload, w.headers::text AS headers, w.attempts,
       {probe}END AS behind_held_secs,"
            ),
        )
});

/// A row of [`LIST_GROUPS_ROWS`].
#[derive(sqlx::FromRow)]
struct ListedRow {
    idx: i64,
    lane_slot: i16,
    skipped: Option<String>,
    #[sqlx(flatten)]
    row: Row,
}

/// The most rows listed of each slot of `w`: a window lists at most
/// `list_cap` ([`LIST_CAP`]) in all, as when listed alone.
fn cap_of(w: &Window, list_cap: i64) -> i64 {
    (list_cap / w.slots.len().max(1) as i64).max(1)
}

/// Lists the rows of `windows` (each with its `upto` taken and nothing
/// listed) in one statement; see [`LIST_MANY`]. A window whose list is cut
/// by a slot's cap keeps its rows up to the lowest last id of its capped
/// slots, and the rest is listed again when those run out.
pub(crate) async fn list_windows(
    conn: &mut PgConnection,
    windows: &mut [&mut Window],
    skip: &Skip,
) -> Result<()> {
    list_windows_capped(conn, windows, skip, LIST_CAP).await
}

/// [`list_windows`] for a claim with room for `room` rows: the windows that
/// stand at the same place and have at most `room` rows in all are listed
/// with their rows' columns ([`LIST_GROUPS_ROWS`]: no fetch for them), the
/// others as [`list_windows`] does (a backlog's window is listed once more,
/// once). `due`: the held rows claimed with them (see [`fetch`]).
pub(crate) async fn list_windows_rows(
    conn: &mut PgConnection,
    windows: &mut [&mut Window],
    skip: &Skip,
    room: i64,
    due: &[i64],
) -> Result<()> {
    list_groups(conn, windows, skip, room.max(1), Some(due)).await?;
    let mut rest: Vec<&mut Window> = windows
        .iter_mut()
        .filter(|w| !w.complete)
        .map(|w| &mut **w)
        .collect();
    list_windows(conn, &mut rest, skip).await
}

/// [`list_windows`] with `list_cap` rows at most per window: the windows
/// that stand at the same place in one scan per group ([`LIST_GROUPS`]);
/// those whose group had more rows than its cap, and those capped before,
/// slot by slot ([`LIST_MANY`]).
async fn list_windows_capped(
    conn: &mut PgConnection,
    windows: &mut [&mut Window],
    skip: &Skip,
    list_cap: i64,
) -> Result<()> {
    list_groups(conn, windows, skip, list_cap, None).await?;
    let mut rest: Vec<&mut Window> = windows
        .iter_mut()
        .filter(|w| w.capped)
        .map(|w| &mut **w)
        .collect();
    list_slots(conn, &mut rest, skip, list_cap).await
}

/// Lists the windows of `windows` not capped before in groups
/// ([`LIST_GROUPS`]): each group's windows are listed whole, or, if the
/// group has more than `list_cap` rows a window, marked capped and left
/// unlisted. `with_rows` (the claim's held rows, as [`fetch`] takes them):
/// with the rows' columns ([`LIST_GROUPS_ROWS`]), `list_cap` rows at most a
/// group, and a group that has more is left unlisted, not capped.
async fn list_groups(
    conn: &mut PgConnection,
    windows: &mut [&mut Window],
    skip: &Skip,
    list_cap: i64,
    with_rows: Option<&[i64]>,
) -> Result<()> {
    // Each group's place and its windows (a handful: linear searches).
    let mut groups: Vec<((String, String, i64), Vec<usize>)> = Vec::new();
    for (i, w) in windows.iter().enumerate() {
        if w.capped {
            continue;
        }
        let Some(upto) = w.upto.as_deref() else {
            return Err(Error::Config("a window listed before its snapshot".into()));
        };
        let place = (w.done.clone(), upto.to_owned(), w.after_id);
        match groups.iter_mut().find(|(p, _)| *p == place) {
            Some((_, members)) => members.push(i),
            None => groups.push((place, vec![i])),
        }
    }
    if groups.is_empty() {
        return Ok(());
    }
    let caps: Vec<i64> = groups
        .iter()
        .map(|(_, members)| match with_rows {
            Some(_) => list_cap,
            None => list_cap.saturating_mul(members.len() as i64),
        })
        .collect();
    let mut of_slot: std::collections::HashMap<i16, usize> = Default::default();
    let (mut slots, mut done, mut upto, mut after, mut limits) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for ((place, members), cap) in groups.iter().zip(&caps) {
        let mut of_group: Vec<String> = Vec::new();
        for i in members {
            for s in &windows[*i].slots {
                of_slot.insert(*s, *i);
                of_group.push(s.to_string());
            }
        }
        slots.push(format!("{{{}}}", of_group.join(",")));
        done.push(place.0.as_str());
        upto.push(place.1.as_str());
        after.push(place.2);
        limits.push(cap.saturating_add(1));
    }
    // Either list, with the same arguments.
    let bind = |sql: &'static str| {
        sqlx::query(sql)
            .bind(&slots)
            .bind(&done)
            .bind(&upto)
            .bind(&after)
            .bind(&limits)
            .bind(&skip.topics)
            .bind(&skip.since)
            .bind(skip.fence.as_deref())
    };
    let rows: Vec<(i64, i16, Entry, Option<Row>)> = if let Some(due) = with_rows {
        let rows: Vec<ListedRow> = bind(LIST_GROUPS_ROWS.as_str())
            .bind(due)
            .try_map(|row| <ListedRow as sqlx::FromRow<_>>::from_row(&row))
            .fetch_all(&mut *conn)
            .await?;
        rows.into_iter()
            .map(|r| {
                let entry = (r.row.id, r.row.event_id, r.row.tid.clone(), r.skipped);
                (r.idx, r.lane_slot, entry, Some(r.row))
            })
            .collect()
    } else {
        type Listing = (i64, i16, i64, Uuid, String, Option<String>);
        let rows: Vec<Listing> = bind(LIST_GROUPS.as_str())
            .try_map(|row| <Listing as sqlx::FromRow<_>>::from_row(&row))
            .fetch_all(&mut *conn)
            .await?;
        rows.into_iter()
            .map(|(g, s, id, event, tid, skipped)| (g, s, (id, event, tid, skipped), None))
            .collect()
    };
    let mut counts = vec![0i64; groups.len()];
    for (g, ..) in &rows {
        if let Some(c) = usize::try_from(*g - 1).ok().and_then(|g| counts.get_mut(g)) {
            *c += 1;
        }
    }
    let overflowed: Vec<bool> = counts.iter().zip(&caps).map(|(n, cap)| n > cap).collect();
    let mut per: Vec<Vec<(Entry, Option<Row>)>> = (0..windows.len()).map(|_| Vec::new()).collect();
    for (g, s, entry, row) in rows {
        let in_bounds =
            usize::try_from(g - 1).is_ok_and(|g| !overflowed.get(g).copied().unwrap_or(true));
        if let (true, Some(i)) = (in_bounds, of_slot.get(&s)) {
            per[*i].push((entry, row));
        }
    }
    for ((_, members), overflowed) in groups.iter().zip(overflowed) {
        for i in members {
            let w = &mut windows[*i];
            if overflowed {
                // Listed again without the columns (`with_rows`), or slot
                // by slot.
                w.capped |= with_rows.is_none();
                continue;
            }
            let mut list = std::mem::take(&mut per[*i]);
            list.sort_by_key(|(r, _)| r.0);
            let mut listed = VecDeque::with_capacity(list.len());
            for (entry, row) in list {
                if let Some(row) = row.filter(|_| entry.3.is_none()) {
                    w.rows.insert(entry.1, row);
                }
                listed.push_back(entry);
            }
            w.listed = listed;
            w.complete = true;
        }
    }
    Ok(())
}

/// A row as listed: id, event id, `ctid`, the topic of a row passed over.
type Entry = (i64, Uuid, String, Option<String>);

/// Lists `windows` slot by slot ([`LIST_MANY`]), in one statement, each
/// slot's rows up to its share of `list_cap`, in id order: a window whose
/// slots reached it is listed up to the lowest last row of those slots
/// (the rest listed when those run out), and stays capped.
async fn list_slots(
    conn: &mut PgConnection,
    windows: &mut [&mut Window],
    skip: &Skip,
    list_cap: i64,
) -> Result<()> {
    let (mut slot, mut idx, mut done, mut upto, mut after, mut caps) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for (i, w) in windows.iter().enumerate() {
        let Some(u) = &w.upto else {
            return Err(Error::Config("a window listed before its snapshot".into()));
        };
        for s in &w.slots {
            slot.push(*s);
            idx.push(i as i32);
            done.push(w.done.as_str());
            upto.push(u.as_str());
            after.push(w.after_id);
            caps.push(cap_of(w, list_cap));
        }
    }
    if slot.is_empty() {
        return Ok(());
    }
    let rows: Vec<(i32, i16, i64, Uuid, String, Option<String>)> =
        sqlx::query_as(LIST_MANY.as_str())
            .bind(&slot)
            .bind(&idx)
            .bind(&done)
            .bind(&upto)
            .bind(&after)
            .bind(&caps)
            .bind(&skip.topics)
            .bind(&skip.since)
            .bind(skip.fence.as_deref())
            .fetch_all(&mut *conn)
            .await?;
    let mut per: Vec<Vec<(i16, Entry)>> = (0..windows.len()).map(|_| Vec::new()).collect();
    for (i, s, id, event, tid, skipped) in rows {
        if let Some(list) = per.get_mut(i as usize) {
            list.push((s, (id, event, tid, skipped)));
        }
    }
    for (w, mut list) in windows.iter_mut().zip(per) {
        list.sort_by_key(|(_, r)| r.0);
        // A slot that reached the cap may have more rows after its last:
        // the window's list is whole only up to the lowest such last id.
        let mut counts: std::collections::HashMap<i16, (i64, i64)> = Default::default();
        for (s, r) in &list {
            let c = counts.entry(*s).or_insert((0, 0));
            c.0 += 1;
            c.1 = c.1.max(r.0);
        }
        let cut = counts
            .values()
            .filter(|(n, _)| *n >= cap_of(w, list_cap))
            .map(|(_, last)| *last)
            .min();
        if let Some(cut) = cut {
            list.retain(|(_, r)| r.0 <= cut);
        }
        w.complete = cut.is_none();
        w.capped |= cut.is_some();
        w.listed = list.into_iter().map(|(_, r)| r).collect();
    }
    Ok(())
}

/// Topics whose rows a claim's windows pass over: those held as missing on
/// the broker (`outbox_held_topic`), read under a shared lock that the
/// release of a held topic takes exclusively, with a snapshot taken under
/// it, the fence. A window passes over only the rows of a held topic that
/// its `since` does not see and the fence does: the release, which ends the
/// hold and gives a hold to every row of the topic that `since` does not
/// see in one transaction, takes its snapshot after every reader of the
/// hold let go of the lock, so it sees every row a window passed over.
/// Rows the fence does not see are read as any row (the relay then holds
/// them itself, or, the topic created meanwhile, reads them again).
#[derive(Debug, Clone, Default)]
pub struct Skip {
    /// The held topics.
    pub topics: Vec<String>,
    /// Each topic's `since` snapshot.
    pub since: Vec<String>,
    /// The snapshot taken when they were read.
    pub fence: Option<String>,
}

/// The rows at the places `$1` (`ctid`s, as listed) without a state of
/// their own, in no order: a TID scan, a page read for many rows. `$2` is
/// the claim's list of keys to leave out, always empty here: a row left
/// out would be passed over by the position. A place may hold another
/// event than the one listed there (the row moved since, and another took
/// its place; on the partitioned layout, the same place in another
/// partition): [`fetch`] keeps only the events it asked for.
///
/// No test of the event ids and no order in the statement ([`fetch`] sorts
/// the rows): a claim keeps the generic plan of its first execution (see
/// [`LIST_MANY`]), in which an `= ANY` of a parameter is a linear search of
/// the array per row (measured: the CPU per event from 12.6 to 17.0 µs at
/// 2,000 rows a claim), and a plan made on a nearly empty table read the
/// events by their unique index, or the whole table in id order through the
/// primary key, instead of their places. With only the places to go by,
/// and no order to keep, the TID scan is the cheapest plan on any table.
static FETCH_AT: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{} AND ctid = ANY($1::text[]::tid[])", *COLUMNS));

/// [`FETCH_AT`] on the partitioned layout, the places' events between `$3`
/// and `$4`: the partitions they can be in (the others are pruned). Planned
/// with its arguments: a generic plan made while a partition was nearly
/// empty (as one created ahead is) may read the range of event ids through
/// their unique index instead of the places, until the partition's next
/// `ANALYZE`.
static FETCH_AT_PARTITIONED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{} AND ctid = ANY($1::text[]::tid[]) AND event_id BETWEEN $3 AND $4",
        *COLUMNS
    )
});

/// The claim's columns ([`super::claim::CLAIM_COLUMNS`]), rows without a
/// state of their own written with `num_nulls`: no plan may walk the
/// default mode's partial index of unpublished rows, which holds every row
/// in this mode (measured: on a table not analyzed since its backlog was
/// written, the fetch of a chunk walked it in id order, 62 ms for 800 rows
/// instead of a TID scan's 2); after the claim's mark, as in the default
/// mode. Without the rows' places (`ctid`): only the default mode's mark
/// uses them, and turning each into text cost about 0.15 µs a row. Without
/// the default mode's held keys; `$2` is the held rows of the claim, which
/// the probe of an earlier held row of the key leaves out (see [`fetch`]).
static COLUMNS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let unpublished = "WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL";
    assert!(super::claim::CLAIM_COLUMNS.contains(unpublished));
    let place = "ctid::text AS tid";
    assert!(super::claim::CLAIM_COLUMNS.contains(place));
    let keys = "\n  AND partition_key <> ALL($2::text[])";
    assert!(super::claim::CLAIM_COLUMNS.ends_with(keys));
    assert!(super::claim::CLAIM_COLUMNS.contains(PROBED));
    let columns = super::claim::CLAIM_COLUMNS
        .replace(
            unpublished,
            "WHERE num_nulls(published_at, parked_at, held_until) = 3",
        )
        .replace(place, "''::text AS tid")
        .replace(keys, "")
        .replace(PROBED, &format!("{PROBED} AND h.id <> ALL($2::int8[])"));
    format!("{} {columns}", super::claim::CLAIM_MARK)
});

/// The events `$1` without a state of their own, in id order, wherever
/// they are (those that moved since they were listed: a row version
/// written by a rare path, a table rewritten).
static FETCH_BY_ID: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{} AND event_id = ANY($1::uuid[]) ORDER BY id", *COLUMNS));

/// Records the position of slots `$1` (appended).
const RECORD: &str = "
INSERT INTO outbox_progress (slots, done, upto, after_id)
VALUES ($1, $2::pg_snapshot, $3::pg_snapshot, $4)";

/// A row of a window as listed: id, event id, `ctid`.
pub(crate) type Listed = (i64, Uuid, String);

/// The rows of `taken` (of one window or several), without a state of
/// their own, in id order: by `ctid` (a TID scan; [`FETCH_AT_PARTITIONED`]
/// when `partitioned`), then by event id those that moved since they were
/// listed. One statement for a claim's lanes.
///
/// `due`: the held rows claimed in the same batch that go out before these
/// through the same producer (not one that failed before: see
/// [`batch::claim`]). A row's probe of an earlier held row of its key leaves them out:
/// a key whose only held rows are in the batch sends its window rows after
/// them, in the same batch, instead of holding them too (a hold, then a
/// mark: each batch would hold the key's rows behind the holds of the one
/// before, for as long as the key had rows in every batch).
pub(crate) async fn fetch(
    conn: &mut PgConnection,
    taken: &[Listed],
    partitioned: bool,
    due: &[i64],
) -> Result<Vec<Row>> {
    if taken.is_empty() {
        return Ok(Vec::new());
    }
    let tids: Vec<&str> = taken.iter().map(|(_, _, t)| t.as_str()).collect();
    let ids: std::collections::HashSet<Uuid> = taken.iter().map(|(_, e, _)| *e).collect();
    let query = if partitioned {
        let (low, high) = (ids.iter().min(), ids.iter().max());
        sqlx::query_as(&FETCH_AT_PARTITIONED)
            .bind(&tids)
            .bind(due)
            .bind(low)
            .bind(high)
    } else {
        sqlx::query_as(&FETCH_AT).bind(&tids).bind(due)
    };
    let mut rows: Vec<Row> = query.fetch_all(&mut *conn).await?;
    // Only the events listed at those places.
    rows.retain(|r| ids.contains(&r.event_id));
    rows.sort_unstable_by_key(|r| r.id);
    if rows.len() < ids.len() {
        let found: std::collections::HashSet<Uuid> = rows.iter().map(|r| r.event_id).collect();
        let moved: Vec<Uuid> = taken
            .iter()
            .map(|(_, e, _)| *e)
            .filter(|e| !found.contains(e))
            .collect();
        let more: Vec<Row> = sqlx::query_as(&FETCH_BY_ID)
            .persistent(false)
            .bind(&moved)
            .bind(due)
            .fetch_all(&mut *conn)
            .await?;
        rows.extend(more);
        rows.sort_by_key(|r| r.id);
    }
    Ok(rows)
}

/// A set of lane slots read and recorded together (a lane's), where they
/// stand, and what is known of their window in memory.
#[derive(Debug)]
pub struct Window {
    /// The slots read and recorded together.
    pub slots: Vec<i16>,
    /// Every event of the slots visible in this snapshot is published.
    pub done: String,
    /// The window being read; `None` until the first read takes it.
    pub upto: Option<String>,
    /// Rows of the window up to this id are handed over.
    pub after_id: i64,
    /// Rows listed and not handed over yet (id, event id, `ctid`, the
    /// topic of a row passed over), in id order.
    listed: VecDeque<(i64, Uuid, String, Option<String>)>,
    /// Whether `listed` holds every remaining row of the window.
    complete: bool,
    /// Whether a list of the window found more rows than its cap: the rest
    /// of it is listed slot by slot, in id order ([`LIST_MANY`]), not with
    /// the windows that stand where it does ([`LIST_GROUPS`]).
    capped: bool,
    /// Rows listed with their columns by the claim running now
    /// ([`list_windows_rows`]), by event id: handed over without a fetch.
    /// Dropped when the claim ends ([`Window::drop_rows`]), and when the
    /// next one starts ([`Window::ready`]): a later claim fetches what is
    /// left, as it may have changed since.
    rows: std::collections::HashMap<Uuid, Row>,
}

/// What [`Window::next`] found.
#[derive(Debug)]
pub enum Chunk {
    /// Rows of the window, in id order, ready to hand over.
    Rows(Vec<Row>),
    /// The window has no row left: [`Window::advance`] starts the next.
    Finished,
}

impl Window {
    /// A window standing where `stand` says (a rewind: the rows after
    /// `stand.after_id` are listed again).
    pub(crate) fn at(stand: &batch::Stand) -> Window {
        Window {
            slots: stand.slots.clone(),
            done: stand.done.clone(),
            upto: stand.upto.clone(),
            after_id: stand.after_id,
            listed: VecDeque::new(),
            complete: false,
            capped: false,
            rows: Default::default(),
        }
    }

    /// Readies the window for a claim whose snapshot is `snapshot`: one
    /// finished is advanced, one without a snapshot takes this one. Returns
    /// whether its rows are to be listed (see [`list_windows`]). Rows
    /// listed with their columns by an earlier claim (one that failed before
    /// it could drop them) are dropped: their state may have changed since.
    pub(crate) fn ready(&mut self, snapshot: &str) -> bool {
        self.rows.clear();
        if self.listed.is_empty() && self.complete {
            self.advance();
        }
        if self.upto.is_none() {
            self.upto = Some(snapshot.to_owned());
        }
        self.listed.is_empty() && !self.complete
    }

    /// The next rows of the window: at most `limit`, past the first at most
    /// `budget` bytes. The position moves past them (in memory: see
    /// [`Window::record`]). Sets `plan_cache_mode = force_custom_plan` on
    /// `conn`'s session (the list and the fetch are prepared, and must be
    /// planned with their arguments).
    pub async fn next(
        &mut self,
        conn: &mut PgConnection,
        limit: usize,
        budget: i64,
    ) -> Result<Chunk> {
        self.next_skipping(
            conn,
            limit,
            budget,
            &Skip::default(),
            &mut Default::default(),
        )
        .await
    }

    /// [`Window::next`], passing over the rows of held topics that `skip`
    /// names: they are not handed over, but counted per topic in `skipped`,
    /// and the position moves past them.
    pub async fn next_skipping(
        &mut self,
        conn: &mut PgConnection,
        limit: usize,
        budget: i64,
        skip: &Skip,
        skipped: &mut std::collections::HashMap<String, i64>,
    ) -> Result<Chunk> {
        // Custom plans for the prepared list and fetch (see `LIST_MANY`):
        // for this session, as no transaction may be open.
        sqlx::query("SET plan_cache_mode = force_custom_plan")
            .execute(&mut *conn)
            .await?;
        loop {
            let Some(taken) = self.take(conn, limit, skip, skipped).await? else {
                return Ok(Chunk::Finished);
            };
            // Planned with its arguments here (see above): the partitions'
            // bounds serve either layout.
            let rows = fetch(conn, &taken, true, &[]).await?;
            let (mut bytes, mut keep) = (0i64, 0);
            for r in &rows {
                if keep > 0 && bytes >= budget {
                    break;
                }
                bytes += r.bytes() as i64;
                keep += 1;
            }
            let rows = self.hand(&taken, rows, keep);
            if !rows.is_empty() {
                return Ok(Chunk::Rows(rows));
            }
        }
    }

    /// The next rows of the window to fetch (id, event id, `ctid`): at
    /// most `limit`, up to the next row passed over; the rows passed over
    /// that lead the list are counted in `skipped` and the position moves
    /// past them. Lists the window when nothing is listed (taking its
    /// snapshot first if it has none). `None`: the window has no row left
    /// ([`Window::advance`] starts the next).
    pub(crate) async fn take(
        &mut self,
        conn: &mut PgConnection,
        limit: usize,
        skip: &Skip,
        skipped: &mut std::collections::HashMap<String, i64>,
    ) -> Result<Option<Vec<Listed>>> {
        if self.upto.is_none() {
            let upto: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
                .fetch_one(&mut *conn)
                .await?;
            self.upto = Some(upto);
        }
        loop {
            if self.listed.is_empty() {
                if self.complete {
                    return Ok(None);
                }
                list_windows(conn, &mut [&mut *self], skip).await?;
                continue;
            }
            // Rows passed over lead the list: the position moves past them.
            if let Some((id, _, _, Some(_))) = self.listed.front() {
                let id = *id;
                if let Some((_, _, _, Some(topic))) = self.listed.pop_front() {
                    *skipped.entry(topic).or_default() += 1;
                }
                self.after_id = id;
                continue;
            }
            return Ok(Some(
                self.listed
                    .iter()
                    .take(limit.max(1))
                    .take_while(|(_, _, _, skipped)| skipped.is_none())
                    .map(|(id, event, tid, _)| (*id, *event, tid.clone()))
                    .collect(),
            ));
        }
    }

    /// Hands over the first `keep` of `rows`, the rows fetched of `taken`
    /// (from [`Window::take`], in id order): the position moves past them,
    /// and past every row taken that was not found (given a state of its
    /// own since it was listed) before the last kept; past all of `taken`
    /// when every row is kept. Keeping none of the rows found changes
    /// nothing.
    pub(crate) fn hand(&mut self, taken: &[Listed], mut rows: Vec<Row>, keep: usize) -> Vec<Row> {
        let Some(last) = taken.last() else {
            return Vec::new();
        };
        if keep == 0 && !rows.is_empty() {
            return Vec::new();
        }
        let through = if keep < rows.len() {
            rows[keep - 1].id
        } else {
            last.0
        };
        rows.truncate(keep);
        while self
            .listed
            .front()
            .is_some_and(|(id, _, _, _)| *id <= through)
        {
            self.listed.pop_front();
        }
        self.after_id = through;
        rows
    }

    /// Records the window's position (in the caller's transaction).
    pub async fn record(&self, conn: &mut PgConnection) -> Result<()> {
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
    pub fn advance(&mut self) {
        if let Some(upto) = self.upto.take() {
            self.done = upto;
        }
        self.after_id = 0;
        self.listed.clear();
        self.complete = false;
        self.capped = false;
        self.rows.clear();
    }

    /// The row of `event` listed with its columns by the claim running now,
    /// if it was.
    pub(crate) fn listed_row(&mut self, event: &Uuid) -> Option<Row> {
        self.rows.remove(event)
    }

    /// Drops the rows listed with their columns (at the end of a claim).
    pub(crate) fn drop_rows(&mut self) {
        self.rows.clear();
    }
}

pub(crate) mod batch;
mod enable;
mod published;

pub use enable::{MARKS_INDEXES, create_index, drop_marks_indexes, enable, switch_on};
pub use published::{HeldTopic, PositionStatus, Published, held_topics, pending, positions, prune};
pub(crate) use published::{POSITIONS, passed, published_by, reached};
#[cfg(test)]
mod tests;
