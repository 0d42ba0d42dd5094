//! The progress mode's batches: what a claim reads (the held rows whose
//! hold has ended, then each owned lane's window, in the claim's
//! transaction, behind the lanes' "in use" locks) and what finishing a batch
//! writes (the lanes' positions, appended; the rare paths' row states) in
//! one transaction. A finish that does not commit is carried: written with
//! the next one, or alone before the next claim (see the relay loop's
//! progress state).
//!
//! A position must never pass a row that was neither delivered nor given a
//! state of its own (held, failed, parked): the loop stops a lane's position
//! before the first such row and reads the lane again from there (a
//! rewind; see `cycle/progress.rs`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::super::claim::{self, Batch, CLAIM_MARK, Failure, Row};
use super::super::lanes::{self, Claimable};
use super::{Listed, Skip, Window, load};
use crate::error::{Error, Result};
use crate::refusal::{Statement, Trouble};
use crate::scope::{Lock, OutboxScope};

/// Recording positions.
pub(crate) const RECORD: Statement = Statement {
    name: "relay: record progress",
    needs: "INSERT ON outbox_progress",
};

/// How often an idle lane's position is recorded at most: a window read
/// empty moves the position without any row to publish; recording it keeps
/// the next window's range of transaction ids short after a restart.
const IDLE_RECORD: Duration = Duration::from_secs(5);

/// Where a lane stands after a batch's rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stand {
    pub lane: i32,
    /// The lane's generation when the batch was claimed: a rewind after it
    /// makes the batch's rows of the lane stale.
    pub generation: u64,
    pub slots: Vec<i16>,
    pub done: String,
    pub upto: Option<String>,
    pub after_id: i64,
    /// The lane's first row of the batch that needs a state of its own (a
    /// failure, a hold, a held topic): where the position stops if the
    /// database refuses those states (see [`Batch::finish_progress`]).
    pub stated: Option<i64>,
    /// The lane's rows of the batch after `stated` that were delivered
    /// (event ids): marked published if the position stops short, so that
    /// they are not sent again.
    pub delivered_after: Vec<Uuid>,
}

impl Stand {
    fn of(lane: i32, generation: u64, window: &Window) -> Stand {
        Stand {
            stated: None,
            delivered_after: Vec::new(),
            lane,
            generation,
            slots: window.slots.clone(),
            done: window.done.clone(),
            upto: window.upto.clone(),
            after_id: if window.upto.is_some() {
                window.after_id
            } else {
                0
            },
        }
    }
}

/// What a batch read in the progress mode, beside its rows.
#[derive(Debug, Default)]
pub(crate) struct Read {
    /// Where each lane read stands after the batch.
    pub stands: Vec<Stand>,
    /// Per row of the batch: the lane of a window's row; `None` for a held
    /// row whose hold had ended.
    pub lanes: Vec<Option<i32>>,
    /// Positions of idle lanes were written in the claim's transaction: it
    /// is committed even without rows.
    pub commit: bool,
    /// The topics held as missing when the batch was claimed (see
    /// [`Skip`]): their rows in the batch are not sent.
    pub held_topics: Vec<String>,
    /// Rows of held topics the windows passed over, per topic.
    pub skipped: HashMap<String, i64>,
}

/// Reading the held topics.
pub(crate) const HELD_TOPICS: Statement = Statement {
    name: "relay: read the topics held as missing",
    needs: "SELECT ON outbox_held_topic",
};

/// Recording and releasing held topics.
pub(crate) const HOLD_TOPICS: Statement = Statement {
    name: "relay: hold or release a topic missing on the broker",
    needs: "SELECT, INSERT, UPDATE, DELETE ON outbox_held_topic",
};

/// The topics held as missing on the broker, their `since` and a fence
/// (see [`Skip`]), read under the shared lock their release takes
/// exclusively. An empty table (the usual case) costs one probe.
pub(crate) async fn held_topics(pool: &PgPool, scope: OutboxScope) -> Result<Skip> {
    let any: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_held_topic)")
        .fetch_one(pool)
        .await?;
    if !any {
        return Ok(Skip::default());
    }
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind(scope.key(Lock::HeldTopics, 0))
        .execute(&mut *tx)
        .await?;
    let held: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT topic, since::text, pg_current_snapshot()::text FROM outbox_held_topic
         ORDER BY topic",
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let fence = held.first().map(|h| h.2.clone());
    let (topics, since) = held.into_iter().map(|(t, s, _)| (t, s)).unzip();
    Ok(Skip {
        topics,
        since,
        fence,
    })
}

/// A lane's window and when its position was last recorded.
#[derive(Debug)]
struct Lane {
    window: Window,
    /// The `done` last recorded by an idle claim, and when.
    recorded: (String, Instant),
    /// Rows were handed over since: the window's end is recorded at the
    /// next idle claim, not [`IDLE_RECORD`] later (the due held rows of the
    /// window's last rows wait for it: see [`DUE`]).
    handed: bool,
}

/// The windows of the lanes a relay reads, by lane (loaded when a lane is
/// first read, dropped when it is no longer owned).
#[derive(Debug, Default)]
pub(crate) struct Windows {
    lanes: HashMap<i32, Lane>,
    /// Which lane the next batch reads first (each in turn).
    turn: usize,
    /// When a probe last found no topic held (see [`Windows::held_topics`]).
    none_held: Option<Instant>,
}

/// How long claims go by a probe that found no topic held before probing
/// again (see [`Windows::held_topics`]).
const NONE_HELD_FOR: Duration = Duration::from_millis(250);

impl Windows {
    /// The held topics for the next claim ([`held_topics`]): read at each
    /// claim while topics are held; while none is, probed at most every
    /// [`NONE_HELD_FOR`]. The probe is a round trip on a connection of its
    /// own, about a fifth of a claim's time at 1,000 events/s. A claim that
    /// goes by an older probe passes over none of a topic held since: it
    /// reads its rows as any rows, as a claim does whose probe ran just
    /// before the hold committed (the relay that meets them withholds them,
    /// and the broker's answer joins them to the topic's hold, no row
    /// written). Passing over only what a probe allowed keeps the release's
    /// promise (see [`Skip`]).
    pub async fn held_topics(&mut self, pool: &PgPool, scope: OutboxScope) -> Result<Skip> {
        if self
            .none_held
            .is_some_and(|at| at.elapsed() < NONE_HELD_FOR)
        {
            return Ok(Skip::default());
        }
        let skip = held_topics(pool, scope).await?;
        self.none_held = skip.topics.is_empty().then(Instant::now);
        Ok(skip)
    }

    /// Puts a lane's window back where `stand` says (a rewind), if this
    /// relay still reads the lane.
    pub fn rewind(&mut self, stand: &Stand) {
        if let Some(lane) = self.lanes.get_mut(&stand.lane) {
            lane.window = Window::at(stand);
        }
    }
}

/// The lanes of this outbox (`$1` oid) the lane session (pid `$2`) owns,
/// lane 0's `objid` `$3`, `$4` lanes; and the snapshot the claim's new
/// windows end at (one for every lane: one statement, not one per lane);
/// whether any held row's hold has ended (else [`DUE`] is not run); and
/// whether the outbox is partitioned (the fetch's statement: see
/// [`super::fetch`]; read at each claim, as the table may be converted
/// while relays run). It starts with the claim's mark ([`CLAIM_MARK`]), as
/// the claim's other statements do: waiting for a lock on the table, it is
/// the claim in `pg_stat_activity`.
static OWNED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{CLAIM_MARK} SELECT coalesce(array_agg((objid::int8 - $3)::int4), '{{}}'),
       pg_current_snapshot()::text,
       EXISTS (SELECT 1 FROM outbox_event
               WHERE held_until <= statement_timestamp() AND published_at IS NULL),
       coalesce((SELECT c.relkind = 'p' FROM pg_class c
                 WHERE c.oid = to_regclass('outbox_event')), false)
FROM pg_locks
WHERE {} AND pid = $2 AND objid::int8 >= $3 AND objid::int8 < $3 + $4",
        lanes::SCOPE_LOCKS
    )
});

/// Held rows of slots `$1` whose hold has ended, not of the keys `$2`, in
/// id order, at most `$3`, locked. With each, whether an earlier row of its
/// key on its topic is held and not due yet (an earlier due one is in this
/// claim, before it); scheduled rows hold back no key (the held-key index
/// leaves them out).
///
/// Only rows their slot's recorded position has reached (its newest, as
/// committed: [`reached`](super::reached)). A scheduled row due while rows
/// of its key committed before it are not yet published waits for them, as
/// the default mode's claim takes it in id order after them; a row held
/// after its window passed it (a failure, a key held) is reached. Not the
/// windows' positions in memory: those count rows handed to batches still
/// open, which a rewind may send again (after a due row of their key).
static DUE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{CLAIM_MARK} WITH RECURSIVE {positions}
SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version,
       created_at, topic, partition_key, payload::text AS payload, headers::text AS headers,
       attempts, ctid::text AS tid,
       (SELECT EXTRACT(EPOCH FROM h.held_until - statement_timestamp())::float8
        FROM outbox_event h
        WHERE h.held_until > statement_timestamp() AND h.published_at IS NULL
          AND h.due_at IS NULL AND h.topic = o.topic AND h.partition_key = o.partition_key AND h.id < o.id
        ORDER BY h.topic, h.partition_key, h.id LIMIT 1) AS behind_held_secs
FROM outbox_event o
WHERE held_until <= statement_timestamp() AND published_at IS NULL AND parked_at IS NULL
  AND lane_slot = ANY($1::int2[]) AND partition_key <> ALL($2::text[])
  AND (txid IS NULL
       OR EXISTS (SELECT 1 FROM pos WHERE pos.slot = o.lane_slot AND {reached}))
ORDER BY id LIMIT $3 FOR UPDATE OF o SKIP LOCKED",
        positions = super::POSITIONS,
        reached = super::reached("o"),
    )
});

/// Reading the mode.
pub(crate) const MODE: Statement = Statement {
    name: "relay: read the outbox's mode",
    needs: "SELECT ON outbox_progress",
};

/// Whether the outbox is in the progress mode (its positions table has
/// rows). `None`: the table does not exist (a schema from before it).
pub(crate) async fn enabled(pool: &PgPool) -> std::result::Result<Option<bool>, sqlx::Error> {
    match sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM outbox_progress)")
        .fetch_one(pool)
        .await
    {
        Ok(on) => Ok(Some(on)),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Ok(None),
        Err(e) => Err(e),
    }
}

/// Claims a batch in the progress mode (`skip`: the held topics, read
/// before with [`held_topics`]): held rows of the owned lanes whose
/// hold has ended (locked, up to `limit` and the byte budget), then the
/// next rows of each owned lane's window, lanes in turn, up to `limit` and
/// `max_bytes` in all. `generations` stamps the lanes' positions. With
/// `record_idle` (nothing of this relay in flight), the positions of lanes
/// whose windows moved without rows are recorded now and then.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn claim(
    pool: &PgPool,
    begin: &str,
    limit: i64,
    max_bytes: i64,
    held_keys: &[String],
    lanes: &Claimable,
    windows: &mut Windows,
    generations: &HashMap<i32, u64>,
    record_idle: bool,
    skip: Skip,
) -> Result<Batch> {
    // The claim's common statements (the lanes', the list, the fetch) and
    // the finish's keep the generic plans of their first execution on this
    // connection: their plans do not depend on the table's statistics (see
    // `LIST_MANY`), and planning them at each call was a third of a claim
    // at 1,000 events/s. Those that do depend on them (a lane's position
    // loaded, the held rows due: rare; the fetch on the partitioned layout)
    // are planned with their arguments (`custom_plans`).
    let begin = format!("{begin}; SET LOCAL plan_cache_mode = force_generic_plan");
    let begin = if lanes.count > 0 && !lanes.lanes.is_empty() {
        format!("{begin}; {}", claim::hold_in_use(lanes.scope, &lanes.lanes))
    } else {
        begin
    };
    let mut tx = pool.begin_with(begin).await?;
    let mut read = Read {
        held_topics: skip.topics.clone(),
        ..Read::default()
    };
    if !lanes.any() || lanes.count == 0 {
        windows.lanes.clear();
        return Ok(Batch {
            tx,
            rows: Vec::new(),
            cut: false,
            progress: Some(read),
        });
    }
    let (owned, snapshot, any_due, partitioned): (Vec<i32>, String, bool, bool) =
        sqlx::query_as(&OWNED)
            .bind(i64::from(lanes.scope.oid()))
            .bind(lanes.pid)
            .bind(OutboxScope::objid(Lock::Lane))
            .bind(lanes.count)
            .fetch_one(&mut *tx)
            .await?;
    let owned: Vec<i32> = lanes
        .lanes
        .iter()
        .filter(|l| owned.contains(l))
        .copied()
        .collect();
    // A lane this relay does not own may have been read by another since:
    // read from its recorded position if it comes back.
    windows.lanes.retain(|lane, _| owned.contains(lane));
    let mut custom = false;
    for lane in &owned {
        if !windows.lanes.contains_key(lane) {
            custom_plans(&mut tx, &mut custom).await?;
            let window = load(&mut tx, &slots(lanes.count, *lane)).await?;
            windows.lanes.insert(
                *lane,
                Lane {
                    recorded: (window.done.clone(), Instant::now()),
                    handed: false,
                    window,
                },
            );
        }
    }
    // Every owned lane's window ready, and the rows of those to list
    // listed in one statement.
    let mut to_list: Vec<&mut Window> = windows
        .lanes
        .iter_mut()
        .filter(|(lane, _)| owned.contains(lane))
        .map(|(_, l)| &mut l.window)
        .filter_map(|w| {
            let list = w.ready(&snapshot);
            list.then_some(w)
        })
        .collect();
    let limit_rows = usize::try_from(limit.max(1)).unwrap_or(usize::MAX);
    let all_slots: Vec<i16> = owned
        .iter()
        .flat_map(|lane| slots(lanes.count, *lane))
        .collect();
    // No held row whose hold has ended (the usual case, one probe of the
    // held rows' index): no statement. One that ends later is read by a
    // later claim.
    let mut rows: Vec<Row> = if any_due {
        custom_plans(&mut tx, &mut custom).await?;
        sqlx::query_as(&DUE)
            .bind(&all_slots)
            .bind(held_keys)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?
    } else {
        Vec::new()
    };
    // The byte budget over the held rows: those past it stay locked by this
    // transaction without being in the batch (`cut`).
    let mut bytes = 0i64;
    let keep = rows
        .iter()
        .position(|r| {
            let over = bytes >= max_bytes;
            bytes += r.bytes() as i64;
            over
        })
        .filter(|i| *i > 0)
        .unwrap_or(rows.len());
    let cut = keep < rows.len();
    rows.truncate(keep);
    // The windows' rows, their probe of an earlier held row of their key
    // leaving out the held rows above: those go out first, in this batch.
    // Not a row that failed before: it goes alone, through a producer of
    // its own, and its key's later rows wait for the next batch (see
    // `publish`): a window's row behind it is held, as before, not left
    // without a state (which would send its lane back to it).
    let due: Vec<i64> = rows
        .iter()
        .filter(|r| r.attempts == 0)
        .map(|r| r.id)
        .collect();
    super::list_windows_rows(&mut tx, &mut to_list, &skip, limit, &due).await?;
    let mut bytes: i64 = rows.iter().map(|r| r.bytes() as i64).sum();
    read.lanes = vec![None; rows.len()];
    let n = owned.len();
    let start = windows.turn % n.max(1);
    windows.turn = windows.turn.wrapping_add(1);
    // The lanes' next rows, lanes in turn, up to the limit in all; then
    // fetched in one statement, and handed over in the same order while
    // the byte budget lasts (a lane's rows past it stay in its window).
    let mut takes: Vec<(i32, Vec<Listed>)> = Vec::new();
    let mut room = limit_rows.saturating_sub(rows.len());
    if !cut && (rows.is_empty() || bytes < max_bytes) {
        for i in 0..n {
            if room == 0 {
                break;
            }
            let lane = owned[(start + i) % n];
            let Some(entry) = windows.lanes.get_mut(&lane) else {
                continue;
            };
            // The window was readied above (one finished by earlier
            // batches gave way to a new one): found empty, it ends the
            // lane's turn.
            match entry
                .window
                .take(&mut tx, room, &skip, &mut read.skipped)
                .await?
            {
                Some(taken) => {
                    room -= taken.len();
                    takes.push((lane, taken));
                }
                None => entry.window.advance(),
            }
        }
    }
    // The rows listed with their columns (windows that fit in the batch),
    // and the others fetched in one statement.
    let mut by_event: HashMap<Uuid, Row> = HashMap::new();
    let mut all: Vec<Listed> = Vec::new();
    for (lane, taken) in &takes {
        let mut window = windows.lanes.get_mut(lane).map(|l| &mut l.window);
        for t in taken {
            match window.as_mut().and_then(|w| w.listed_row(&t.1)) {
                Some(row) => {
                    by_event.insert(row.event_id, row);
                }
                None => all.push(t.clone()),
            }
        }
    }
    for lane in windows.lanes.values_mut() {
        lane.window.drop_rows();
    }
    if partitioned && !all.is_empty() {
        custom_plans(&mut tx, &mut custom).await?;
    }
    let fetched = super::fetch(&mut tx, &all, partitioned, &due).await?;
    by_event.extend(fetched.into_iter().map(|r| (r.event_id, r)));
    let mut full = false;
    for (lane, taken) in takes {
        let generation = generations.get(&lane).copied().unwrap_or(0);
        let Some(entry) = windows.lanes.get_mut(&lane) else {
            continue;
        };
        let found: Vec<Row> = taken
            .iter()
            .filter_map(|(_, event, _)| by_event.remove(event))
            .collect();
        let mut keep = 0;
        for r in &found {
            if full || (!rows.is_empty() || keep > 0) && bytes >= max_bytes {
                full = true;
                break;
            }
            bytes += r.bytes() as i64;
            keep += 1;
        }
        let more = entry.window.hand(&taken, found, keep);
        if !more.is_empty() {
            read.lanes
                .extend(std::iter::repeat_n(Some(lane), more.len()));
            rows.extend(more);
            entry.handed = true;
            read.stands.push(Stand::of(lane, generation, &entry.window));
        }
    }
    if record_idle && rows.is_empty() {
        let idle: Vec<Stand> = windows
            .lanes
            .iter_mut()
            .filter(|(_, l)| {
                l.window.upto.is_none()
                    && l.window.done != l.recorded.0
                    && (l.handed || l.recorded.1.elapsed() >= IDLE_RECORD)
            })
            .map(|(lane, l)| {
                l.recorded = (l.window.done.clone(), Instant::now());
                l.handed = false;
                Stand::of(
                    *lane,
                    generations.get(lane).copied().unwrap_or(0),
                    &l.window,
                )
            })
            .collect();
        if !idle.is_empty() {
            insert_stands(&mut tx, &idle).await?;
            read.commit = true;
        }
    }
    Ok(Batch {
        tx,
        rows,
        cut,
        progress: Some(read),
    })
}

/// From here on, the claim's transaction plans each statement with its
/// arguments (`custom`: it already does), for the statements whose plans
/// depend on the table's statistics ([`load`]'s, [`DUE`], the fetch on the
/// partitioned layout); rare (or, for the last, the layout's choice), so
/// the claim's common path keeps its generic plans.
async fn custom_plans(
    tx: &mut Transaction<'static, Postgres>,
    custom: &mut bool,
) -> std::result::Result<(), sqlx::Error> {
    if !*custom {
        sqlx::query("SET LOCAL plan_cache_mode = force_custom_plan")
            .execute(&mut **tx)
            .await?;
        *custom = true;
    }
    Ok(())
}

/// The slots of `lane` of `count`.
fn slots(count: i32, lane: i32) -> Vec<i16> {
    lanes::slots_of(count, &[lane])
        .into_iter()
        .filter_map(|s| i16::try_from(s).ok())
        .collect()
}

/// Appends positions, in order (`$1` slots as `int2[]` texts).
const INSERT_STANDS: &str = "
INSERT INTO outbox_progress (slots, done, upto, after_id)
SELECT s::int2[], d::pg_snapshot, u::pg_snapshot, CASE WHEN u IS NOT NULL THEN a END
FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[]) WITH ORDINALITY AS p(s, d, u, a, n)
ORDER BY n";

async fn insert_stands(
    tx: &mut Transaction<'static, Postgres>,
    stands: &[Stand],
) -> std::result::Result<(), sqlx::Error> {
    let slots: Vec<String> = stands
        .iter()
        .map(|s| {
            let list: Vec<String> = s.slots.iter().map(i16::to_string).collect();
            format!("{{{}}}", list.join(","))
        })
        .collect();
    let done: Vec<&str> = stands.iter().map(|s| s.done.as_str()).collect();
    let upto: Vec<Option<&str>> = stands.iter().map(|s| s.upto.as_deref()).collect();
    let after: Vec<i64> = stands.iter().map(|s| s.after_id).collect();
    sqlx::query(INSERT_STANDS)
        .bind(&slots)
        .bind(&done)
        .bind(&upto)
        .bind(&after)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// What finishing a batch writes in the progress mode.
#[derive(Debug, Default, Clone)]
pub(crate) struct Work {
    /// Held rows delivered, and a window's rows delivered past where its
    /// lane's position stops (a rewind), by event id: marked published.
    pub published: Vec<Uuid>,
    pub failures: Vec<Failure>,
    /// Rows to hold: id, seconds.
    pub holds: Vec<(i64, f64)>,
    /// The lanes' positions, in order.
    pub stands: Vec<Stand>,
    /// Topics found missing, by topic: their rows in the batch are passed
    /// by the positions without a hold of their own.
    pub topics: HashMap<String, TopicHold>,
    /// Rows of held topics the windows passed over, per topic.
    pub skipped: HashMap<String, i64>,
}

/// A topic held as missing on the broker (a row of `outbox_held_topic`).
#[derive(Debug, Clone)]
pub(crate) struct TopicHold {
    /// Every row of the topic not visible in it waits: at most the `done`
    /// of each lane whose rows of the topic the batch passed.
    pub since: super::Snapshot,
    pub reason: String,
    /// Rows of the batch passed.
    pub rows: i64,
}

impl TopicHold {
    /// Adds another lane's or batch's hold of the same topic.
    pub fn merge(&mut self, other: TopicHold) {
        self.since = self.since.intersect(&other.since);
        self.reason = other.reason;
        self.rows += other.rows;
    }
}

/// Records held topics (`$1` topics, `$2` `since` snapshots, `$3` reasons,
/// `$4` rows): a new row, or one whose `since` becomes the intersection of
/// both (the lowest position of the lanes that met it).
const HOLD_TOPIC: &str = "
INSERT INTO outbox_held_topic AS h (topic, since, reason, rows)
SELECT t, s::pg_snapshot, r, n
FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[]) AS u(t, s, r, n)
ON CONFLICT (topic) DO UPDATE SET
  since = (SELECT (m.lo::text || ':' || m.hi::text || ':' || coalesce((
              SELECT string_agg(d.x::text, ',' ORDER BY d.x) FROM (
                SELECT pg_snapshot_xip(h.since) UNION SELECT pg_snapshot_xip(excluded.since)) AS d(x)
              WHERE d.x >= m.lo AND d.x < m.hi), ''))::pg_snapshot
           FROM (SELECT least(pg_snapshot_xmin(h.since), pg_snapshot_xmin(excluded.since)) AS lo,
                        least(pg_snapshot_xmax(h.since), pg_snapshot_xmax(excluded.since)) AS hi) AS m),
  reason = excluded.reason, rows = h.rows + excluded.rows, updated_at = now()";

/// Counts rows passed over (`$1` topics, `$2` rows) on the held topics
/// still held.
const COUNT_SKIPPED: &str = "
UPDATE outbox_held_topic h SET rows = h.rows + u.n, updated_at = now()
FROM unnest($1::text[], $2::int8[]) AS u(t, n) WHERE h.topic = u.t";

impl Work {
    /// Adds a later batch's work after this one's.
    pub fn then(&mut self, later: Work) {
        self.published.extend(later.published);
        self.failures.extend(later.failures);
        self.holds.extend(later.holds);
        self.stands.extend(later.stands);
        for (topic, hold) in later.topics {
            match self.topics.entry(topic) {
                std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().merge(hold),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(hold);
                }
            }
        }
        for (topic, n) in later.skipped {
            *self.skipped.entry(topic).or_default() += n;
        }
    }

    /// Writes it in `tx`, adding the statements that went through to `ran`.
    async fn write(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        ran: &mut Vec<Statement>,
    ) -> std::result::Result<(), Trouble> {
        self.write_marks(tx, ran).await?;
        self.write_states(tx, ran).await?;
        self.write_stands(tx, &self.stands, ran).await
    }

    /// The held rows delivered, marked published.
    async fn write_marks(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        ran: &mut Vec<Statement>,
    ) -> std::result::Result<(), Trouble> {
        if !self.published.is_empty() {
            sqlx::query(claim::MARK_DELIVERED)
                .bind(&self.published)
                .execute(&mut **tx)
                .await
                .map_err(|e| Trouble::from(e).during(claim::MARK))?;
            ran.push(claim::MARK);
        }
        Ok(())
    }

    /// The rows' states of their own: failures, holds, held topics.
    async fn write_states(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        ran: &mut Vec<Statement>,
    ) -> std::result::Result<(), Trouble> {
        claim::record(tx, &self.failures, &self.holds, ran).await?;
        if !self.topics.is_empty() || !self.skipped.is_empty() {
            // In topic order: two finishes lock the rows in the same order.
            let mut held: Vec<(&String, &TopicHold)> = self.topics.iter().collect();
            held.sort_by(|a, b| a.0.cmp(b.0));
            if !held.is_empty() {
                sqlx::query(HOLD_TOPIC)
                    .bind(held.iter().map(|h| h.0.as_str()).collect::<Vec<_>>())
                    .bind(
                        held.iter()
                            .map(|h| h.1.since.to_string())
                            .collect::<Vec<_>>(),
                    )
                    .bind(held.iter().map(|h| h.1.reason.as_str()).collect::<Vec<_>>())
                    .bind(held.iter().map(|h| h.1.rows).collect::<Vec<_>>())
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| Trouble::from(e).during(HOLD_TOPICS))?;
            }
            let mut skipped: Vec<(&String, &i64)> = self.skipped.iter().collect();
            skipped.sort();
            if !skipped.is_empty() {
                sqlx::query(COUNT_SKIPPED)
                    .bind(skipped.iter().map(|s| s.0.as_str()).collect::<Vec<_>>())
                    .bind(skipped.iter().map(|s| *s.1).collect::<Vec<_>>())
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| Trouble::from(e).during(HOLD_TOPICS))?;
            }
            ran.push(HOLD_TOPICS);
        }
        Ok(())
    }

    /// The lanes' positions.
    async fn write_stands(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        stands: &[Stand],
        ran: &mut Vec<Statement>,
    ) -> std::result::Result<(), Trouble> {
        if !stands.is_empty() {
            insert_stands(tx, stands)
                .await
                .map_err(|e| Trouble::from(e).during(RECORD))?;
            ran.push(RECORD);
        }
        Ok(())
    }

    /// The positions when the rows' states are refused: each lane stops
    /// just before its first row that needed one (its rows from there on
    /// are read again), and the stands that stopped short.
    fn short_of_states(&self) -> (Vec<Stand>, Vec<Stand>, Vec<Uuid>) {
        let mut stands = Vec::with_capacity(self.stands.len());
        let mut short = Vec::new();
        let mut delivered = Vec::new();
        for stand in &self.stands {
            // A later stand of a lane stopped short would pass its row.
            if short.iter().any(|s: &Stand| s.lane == stand.lane) {
                continue;
            }
            match stand.stated {
                Some(stated) if stand.upto.is_some() && stated - 1 < stand.after_id => {
                    delivered.extend(stand.delivered_after.iter().copied());
                    let stopped = Stand {
                        after_id: stated - 1,
                        stated: None,
                        delivered_after: Vec::new(),
                        ..stand.clone()
                    };
                    short.push(stopped.clone());
                    stands.push(stopped);
                }
                _ => stands.push(stand.clone()),
            }
        }
        (stands, short, delivered)
    }
}

impl Batch {
    /// Writes `work` (this batch's, after any carried) and commits; if it
    /// does not commit, the work comes back to be carried. If the database
    /// refuses the rows' states of their own (a hold, a failure, a held
    /// topic), the positions stop before the rows that needed one
    /// ([`Finished::short`](claim::Finished::short): the loop reads those
    /// lanes again from there) and the rest commits.
    pub(crate) async fn finish_progress(
        mut self,
        work: Work,
    ) -> std::result::Result<claim::Finished, claim::Unfinished> {
        let mut finished = claim::Finished::default();
        let result = async {
            work.write_marks(&mut self.tx, &mut finished.ran).await?;
            let any_state = !(work.failures.is_empty()
                && work.holds.is_empty()
                && work.topics.is_empty()
                && work.skipped.is_empty());
            if any_state {
                sqlx::query("SAVEPOINT states")
                    .execute(&mut *self.tx)
                    .await
                    .map_err(Trouble::from)?;
            }
            let states = work.write_states(&mut self.tx, &mut finished.ran).await;
            let stands = match states {
                Ok(()) => work.stands.clone(),
                // Refused: the rows that needed a state stop their lanes'
                // positions and are read again; the rest goes on (a relay
                // refused a hold keeps publishing the other lanes).
                Err(trouble @ Trouble::Refused(_)) => {
                    sqlx::query("ROLLBACK TO SAVEPOINT states")
                        .execute(&mut *self.tx)
                        .await
                        .map_err(Trouble::from)?;
                    let (stands, short, delivered) = work.short_of_states();
                    // Rows of those lanes delivered after the row that
                    // needed a state: marked, not sent again.
                    if !delivered.is_empty() {
                        sqlx::query(claim::MARK_DELIVERED)
                            .bind(&delivered)
                            .execute(&mut *self.tx)
                            .await
                            .map_err(|e| Trouble::from(e).during(claim::MARK))?;
                    }
                    finished.refused = Some(trouble);
                    finished.short = short;
                    stands
                }
                Err(outage) => return Err(outage),
            };
            work.write_stands(&mut self.tx, &stands, &mut finished.ran)
                .await?;
            self.tx.commit().await.map_err(Trouble::from)
        }
        .await;
        match result {
            Ok(()) => Ok(finished),
            Err(trouble) => Err(claim::Unfinished {
                trouble,
                delivered: Vec::new(),
                work: Some(Box::new(work)),
            }),
        }
    }
}

/// Writes carried work in a transaction of its own under
/// `statement_timeout` (0: none): the relay claims nothing until it could.
pub(crate) async fn record_carried(
    pool: &PgPool,
    work: &Work,
    statement_timeout: Duration,
) -> std::result::Result<(), Trouble> {
    let mut tx = pool.begin().await.map_err(Trouble::from)?;
    sqlx::query(&format!(
        "SET LOCAL statement_timeout = {}",
        statement_timeout.as_millis()
    ))
    .execute(&mut *tx)
    .await
    .map_err(Trouble::from)?;
    work.write(&mut tx, &mut Vec::new()).await?;
    tx.commit().await.map_err(Trouble::from)
}

/// The error for a relay without lanes on an outbox in the progress mode.
pub(crate) fn needs_lanes() -> Error {
    Error::Config(
        "this outbox is in the progress mode, which needs lanes (one relay reads a lane's \
         window at a time): set lanes to 1 or more"
            .into(),
    )
}
