//! Operations on the outbox table used by the `outbox` CLI and by
//! applications: status (with the relays of this outbox, see
//! [`OutboxScope`]), parked rows (list, requeue, drop), the NOTIFY switch,
//! the topics the stored events name, and the duration syntax of the CLI
//! (`30d`, `1h30m`). The outbox is the one the pool's `search_path` finds.
//! Replay and retention have their own modules ([`replay`](crate::replay),
//! [`cleanup`](crate::cleanup)); saga instances theirs ([`sagas`]).
//!
//! Status reads what it can without scanning the table, so that `outbox
//! status` answers in milliseconds whatever the backlog and the history:
//! the backlog's rows (queue, held, parked and dropped) are read over their
//! partial indexes, exactly up to [`BACKLOG_EXACT_UP_TO`] rows of each
//! kind and estimated beyond ([`Status::backlog_estimated`], see
//! `ops/backlog.rs`); published rows are counted exactly only while the
//! table is small ([`EXACT_BELOW`] rows), and estimated from the planner's
//! statistics beyond (`reltuples` and the `topic` column's most common
//! values, over every partition; [`Status::estimated`]).
//!
//! Dropping a parked row does not delete it: the row is marked discarded
//! (`discarded_at`, `discard_reason`), stays out of the relay's queue and of
//! the parked list, and is kept for the audit trail; the retention job
//! never deletes it; `requeue_parked` with its id puts it back.

use std::time::Duration;

use outbox_core::LockPolicy;
use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::relay::lanes::SCOPE_LOCKS;
use crate::scope::{Lock, OutboxScope};

pub(crate) mod backlog;
pub(crate) mod lag;
pub mod sagas;

pub use backlog::{BACKLOG_COUNTED_UP_TO, BACKLOG_EXACT_UP_TO};
pub use lag::{HoldingTransaction, LAG_EXACT_UP_TO, LaneLag, ProgressLag, progress_lag};

/// Backlog of one topic.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct TopicStatus {
    /// The topic.
    pub topic: String,
    /// Rows not yet published (parked ones excluded, held ones included).
    pub unpublished: i64,
    /// Of those, rows held back for a while (a missing topic, a failing
    /// key, or behind a held row of their key).
    pub held: i64,
    /// Age in seconds of the oldest unpublished row, if any.
    pub oldest_unpublished_secs: Option<f64>,
    /// Parked rows (given up after repeated failures), dropped ones excluded.
    pub parked: i64,
    /// Parked rows dropped by an operator (kept, never published).
    pub discarded: i64,
    /// Published rows still kept (an estimate when [`Status::estimated`]).
    pub published: i64,
    /// Scheduled rows waiting for their time (not in `unpublished`).
    pub scheduled: i64,
}

/// Scheduled events (`UnitOfWork::record_at`) waiting for their time: not
/// part of the backlog (`unpublished`, `held`) until they are due.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Scheduled {
    /// Rows waiting (an estimate when [`Status::backlog_estimated`] and
    /// more than [`BACKLOG_COUNTED_UP_TO`]).
    pub total: i64,
    /// Seconds until the next one is due; negative when it is overdue (no
    /// relay has released it: none is running?).
    pub next_due_secs: Option<f64>,
}

/// The outbox's backlog, in total and per topic.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Status {
    /// Unpublished rows (parked ones excluded, held ones included).
    pub unpublished: i64,
    /// Of those, rows held back for a while.
    pub held: i64,
    /// Age in seconds of the oldest unpublished row, if any.
    pub oldest_unpublished_secs: Option<f64>,
    /// Parked rows, dropped ones excluded.
    pub parked: i64,
    /// Parked rows dropped by an operator (cancelled scheduled events
    /// included).
    pub discarded: i64,
    /// Published rows still kept (an estimate when `estimated`).
    pub published: i64,
    /// Scheduled rows waiting for their time, apart from the backlog.
    pub scheduled: Scheduled,
    /// The published counts are estimates from the planner's statistics
    /// (the table holds [`EXACT_BELOW`] rows or more).
    pub estimated: bool,
    /// The backlog's counts (unpublished, held, parked, dropped, in total
    /// and per topic, and the oldest row's age) are estimates: one of the
    /// kinds holds more than [`BACKLOG_EXACT_UP_TO`] rows (see
    /// `backlog` for how they are estimated). Otherwise
    /// they are exact.
    pub backlog_estimated: bool,
    /// Whether commits NOTIFY idle relays.
    pub notify_enabled: bool,
    /// Per topic.
    pub topics: Vec<TopicStatus>,
    /// Relays running on this outbox, and their lanes.
    pub relays: Vec<RelayLanes>,
    /// The schema of this outbox's table (several services may keep their
    /// outboxes in one database, one schema each).
    pub schema: String,
    /// The NOTIFY channel of this outbox's wake-up trigger.
    pub channel: String,
    /// In the progress mode: each lane's lag and position, and the
    /// transaction holding windows back (`None` in the default mode).
    pub progress: Option<ProgressLag>,
}

/// A running relay and the lanes it owns, read from the advisory locks it
/// holds.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct RelayLanes {
    /// Backend pid of the relay's lane connection.
    pub pid: i32,
    /// Client address of that connection (none over a Unix socket).
    pub client: Option<String>,
    /// The relay's lane count (0: a relay without lanes, claiming every row).
    pub lane_count: Option<i32>,
    /// The lanes it owns right now.
    pub lanes: Vec<i32>,
}

/// The relays of this outbox (the `outbox_event` table `pool`'s
/// `search_path` finds) and their lanes; relays of other schemas' outboxes
/// in the same database are not listed.
pub async fn relays(pool: &PgPool) -> Result<Vec<RelayLanes>> {
    let scope = OutboxScope::of(pool).await?;
    let sql = format!(
        "WITH l AS (
             SELECT pid, (objid::int8 >> 24)::int4 AS kind, (objid::int8 & 16777215)::int4 AS value
             FROM pg_locks WHERE {SCOPE_LOCKS})
         SELECT m.pid, host(a.client_addr) AS client,
                (SELECT max(c.value) FROM l c WHERE c.pid = m.pid AND c.kind = {count})
                    AS lane_count,
                COALESCE((SELECT array_agg(x.value ORDER BY x.value) FROM l x
                          WHERE x.pid = m.pid AND x.kind = {lane}), '{{}}') AS lanes
         FROM l m LEFT JOIN pg_stat_activity a ON a.pid = m.pid
         WHERE m.kind = {member}
         ORDER BY m.pid",
        count = Lock::Count as u8,
        lane = Lock::Lane as u8,
        member = Lock::Member as u8,
    );
    let rows = sqlx::query_as(&sql)
        .bind(i64::from(scope.oid()))
        .fetch_all(pool)
        .await?;
    Ok(rows)
}

/// The query behind the backlog gauges (`outbox_backlog_events`, …; see
/// [`crate::metrics`]): backlog, oldest age in seconds, parked and held
/// rows. Public for the benchmarks that time it.
#[doc(hidden)]
pub const GAUGES_SQL: &str = crate::metrics::BACKLOG;

/// [`GAUGES_SQL`] in the progress mode (for the tests).
#[doc(hidden)]
pub fn progress_gauges_sql() -> &'static str {
    crate::metrics::PROGRESS_BACKLOG.as_str()
}

/// Up to this many rows (by the table's statistics) `status` counts
/// published rows exactly; beyond, it estimates them.
pub const EXACT_BELOW: f64 = 100_000.0;

/// Exact published rows per topic: a scan, for small tables only.
const PUBLISHED_EXACT: &str = "\
SELECT topic, count(*) FROM outbox_event WHERE published_at IS NOT NULL GROUP BY topic";

/// Exact rows per topic: a scan, for small tables only.
const ROWS_EXACT: &str = "SELECT topic, count(*) FROM outbox_event GROUP BY topic";

/// Rows of the table (`$1`: its oid) and of every partition, by the
/// statistics (`reltuples`; -1 when never analyzed, taken as 0).
const ROWS_ESTIMATE: &str = "\
SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::float8
FROM pg_class c
WHERE c.relkind = 'r'
  AND (c.oid = $1::int8::oid
       OR c.oid IN (SELECT relid FROM pg_partition_tree($1::int8::oid::regclass)))";

/// Rows per topic (`$1`: the table's oid) by the statistics: the `topic`
/// column's most common values and their frequencies, over every partition.
const ROWS_BY_TOPIC_ESTIMATE: &str = "\
SELECT v.topic, sum(v.freq * greatest(c.reltuples, 0))::float8
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = c.relname
               AND s.attname = 'topic' AND NOT s.inherited
CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs) AS v(topic, freq)
WHERE c.relkind = 'r'
  AND (c.oid = $1::int8::oid
       OR c.oid IN (SELECT relid FROM pg_partition_tree($1::int8::oid::regclass)))
GROUP BY v.topic";

/// A topic's published rows estimated from its share of the table by the
/// statistics (`of_topic` rows of `rows`) less its backlog (`backlog`, read
/// or counted). What is left within the sampling error of that share
/// (three standard errors of a frequency measured on ANALYZE's sample of
/// up to 30,000 rows) is not evidence of published rows: it is shown as 0,
/// so a topic whose rows are all held or parked is never shown published
/// rows it has none of.
fn published_estimate(of_topic: f64, rows: f64, backlog: i64) -> i64 {
    let left = of_topic - backlog as f64;
    if rows <= 0.0 {
        return 0;
    }
    let share = (of_topic / rows).clamp(0.0, 1.0);
    let sample = rows.min(30_000.0);
    let noise = 3.0 * (share * (1.0 - share) / sample).sqrt() * rows;
    if left <= noise {
        0
    } else {
        left.round() as i64
    }
}

/// Reads the outbox's status (see the module docs for what is exact).
pub async fn status(pool: &PgPool) -> Result<Status> {
    let scope = OutboxScope::of(pool).await?;
    let oid = i64::from(scope.oid());
    let progress = crate::relay::progress::batch::enabled(pool)
        .await?
        .unwrap_or(false);
    let backlog = backlog::read(pool, oid, progress).await?;
    let mut topics: Vec<TopicStatus> = Vec::new();
    for kind in [
        &backlog.queue,
        &backlog.held,
        &backlog.parked,
        &backlog.scheduled,
    ] {
        for topic in kind.topics.keys() {
            if !topics.iter().any(|t| &t.topic == topic) {
                let get = |k: &backlog::Kind| k.topics.get(topic).cloned().unwrap_or_default();
                let (queue, held, parked) = (
                    get(&backlog.queue),
                    get(&backlog.held),
                    get(&backlog.parked),
                );
                let first = queue.first.into_iter().chain(held.first).min();
                topics.push(TopicStatus {
                    topic: topic.clone(),
                    unpublished: queue.rows + held.rows,
                    held: held.rows,
                    oldest_unpublished_secs: first.and_then(|id| backlog.ages.get(&id).copied()),
                    parked: parked.rows - parked.discarded,
                    discarded: parked.discarded,
                    published: 0,
                    scheduled: get(&backlog.scheduled).rows,
                });
            }
        }
    }
    let rows: f64 = sqlx::query_scalar(ROWS_ESTIMATE)
        .bind(oid)
        .fetch_one(pool)
        .await?;
    let estimated = rows >= EXACT_BELOW;
    let published_by_topic: Vec<(String, i64)> = if estimated {
        let by_topic: Vec<(String, f64)> = sqlx::query_as(ROWS_BY_TOPIC_ESTIMATE)
            .bind(oid)
            .fetch_all(pool)
            .await?;
        by_topic
            .into_iter()
            .map(|(topic, n)| {
                let others = topics
                    .iter()
                    .find(|t| t.topic == topic)
                    .map_or(0, |t| t.unpublished + t.parked + t.discarded + t.scheduled);
                (topic.clone(), published_estimate(n, rows, others))
            })
            .collect()
    } else if progress {
        // Rows are not marked in this mode: all but the others.
        let by_topic: Vec<(String, i64)> = sqlx::query_as(ROWS_EXACT).fetch_all(pool).await?;
        by_topic
            .into_iter()
            .map(|(topic, n)| {
                let others = topics
                    .iter()
                    .find(|t| t.topic == topic)
                    .map_or(0, |t| t.unpublished + t.parked + t.discarded);
                (topic, (n - others).max(0))
            })
            .collect()
    } else {
        sqlx::query_as(PUBLISHED_EXACT).fetch_all(pool).await?
    };
    for (topic, n) in published_by_topic {
        match topics.iter_mut().find(|t| t.topic == topic) {
            Some(t) => t.published = n,
            None if n > 0 => topics.push(TopicStatus {
                topic,
                unpublished: 0,
                held: 0,
                oldest_unpublished_secs: None,
                parked: 0,
                discarded: 0,
                published: n,
                scheduled: 0,
            }),
            None => {}
        }
    }
    topics.sort_by(|a, b| a.topic.cmp(&b.topic));
    let unpublished = backlog.queue.total + backlog.held.total;
    let held = backlog.held.total;
    let discarded = backlog.parked.discarded;
    let parked = backlog.parked.total - discarded;
    let scheduled = Scheduled {
        total: backlog.scheduled.total,
        next_due_secs: backlog.next_due_secs,
    };
    let published = if estimated {
        (rows.round() as i64 - unpublished - parked - discarded - scheduled.total).max(0)
    } else {
        topics.iter().map(|t| t.published).sum()
    };
    let oldest_unpublished_secs = topics
        .iter()
        .filter_map(|t| t.oldest_unpublished_secs)
        .fold(None, |acc: Option<f64>, v| {
            Some(acc.map_or(v, |a| a.max(v)))
        });
    let backlog_estimated = backlog.estimated();
    let schema: String = sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.oid = $1::int8::oid",
    )
    .bind(oid)
    .fetch_one(pool)
    .await?;
    Ok(Status {
        schema,
        channel: scope.channel(),
        unpublished,
        held,
        oldest_unpublished_secs,
        parked,
        discarded,
        published,
        scheduled,
        estimated,
        backlog_estimated,
        notify_enabled: notify_enabled(pool).await?,
        topics,
        relays: relays(pool).await?,
        progress: if progress {
            progress_lag(pool).await?
        } else {
            None
        },
    })
}

/// A parked row.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ParkedEvent {
    /// Outbox row id.
    pub id: i64,
    /// Event id.
    pub event_id: uuid::Uuid,
    /// Topic.
    pub topic: String,
    /// Event type.
    pub event_type: String,
    /// Partition key.
    pub partition_key: String,
    /// Failed attempts.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
}

/// Lists parked rows, oldest first.
pub async fn parked(pool: &PgPool, limit: i64) -> Result<Vec<ParkedEvent>> {
    parked_page(pool, &ParkedFilter::new().limit(limit)).await
}

/// Longest filter text [`ParkedFilter`] accepts (topic, key, error text).
pub const MAX_FILTER_LEN: usize = 256;

/// Most rows one page of [`parked_page`] returns.
pub const MAX_PAGE: i64 = 1000;

/// Which parked rows [`parked_page`] returns: filters, and a keyset page
/// (rows after `after_id`, at most `limit`).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ParkedFilter {
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this partition key.
    pub key: Option<String>,
    /// Only rows whose last error contains this text (case-insensitive).
    pub error_contains: Option<String>,
    /// Only rows with an id above this one (the last id of the previous page).
    pub after_id: Option<i64>,
    /// At most this many rows (default 100, at most [`MAX_PAGE`]).
    pub limit: Option<i64>,
}

impl ParkedFilter {
    /// Every parked row not dropped, the first 100.
    pub fn new() -> Self {
        Self::default()
    }
    /// Only the topic `topic`.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }
    /// Only the partition key `key`.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
    /// Only rows whose last error contains `text` (case-insensitive).
    pub fn error_contains(mut self, text: impl Into<String>) -> Self {
        self.error_contains = Some(text.into());
        self
    }
    /// Only rows after the id `id`.
    pub fn after_id(mut self, id: i64) -> Self {
        self.after_id = Some(id);
        self
    }
    /// At most `n` rows.
    pub fn limit(mut self, n: i64) -> Self {
        self.limit = Some(n);
        self
    }

    /// Refuses filters no row can match for being malformed: texts longer
    /// than [`MAX_FILTER_LEN`] or holding NUL, a limit outside
    /// 1..=[`MAX_PAGE`], a negative id.
    pub fn validate(&self) -> Result<()> {
        for (what, text) in [
            ("topic", &self.topic),
            ("key", &self.key),
            ("error text", &self.error_contains),
        ] {
            if let Some(text) = text {
                check_filter_text(what, text)?;
            }
        }
        if let Some(n) = self.limit
            && !(1..=MAX_PAGE).contains(&n)
        {
            return Err(Error::Config(format!(
                "invalid limit {n}: between 1 and {MAX_PAGE}"
            )));
        }
        if let Some(id) = self.after_id
            && id < 0
        {
            return Err(Error::Config(format!("invalid id {id}: ids are positive")));
        }
        Ok(())
    }
}

/// A filter text: at most [`MAX_FILTER_LEN`] characters, no NUL (which
/// PostgreSQL's text cannot hold).
pub fn check_filter_text(what: &str, text: &str) -> Result<()> {
    if text.chars().count() > MAX_FILTER_LEN {
        return Err(Error::Config(format!(
            "the {what} filter is too long: at most {MAX_FILTER_LEN} characters"
        )));
    }
    if text.contains('\0') {
        return Err(Error::Config(format!(
            "the {what} filter holds a NUL character"
        )));
    }
    Ok(())
}

/// Parked rows (dropped ones excluded), oldest first, filtered and paged by
/// id: the query walks the parked rows' partial index in id order from
/// `after_id`, so a page costs about its rows, however large the table.
pub async fn parked_page(pool: &PgPool, filter: &ParkedFilter) -> Result<Vec<ParkedEvent>> {
    filter.validate()?;
    Ok(sqlx::query_as(PARKED_PAGE)
        .bind(filter.topic.as_deref())
        .bind(filter.key.as_deref())
        .bind(filter.error_contains.as_deref().map(str::to_lowercase))
        .bind(filter.after_id.unwrap_or(0))
        .bind(filter.limit.unwrap_or(100))
        .fetch_all(pool)
        .await?)
}

/// The page of [`parked_page`] (`$1` topic, `$2` key, `$3` lower-case error
/// text, `$4` after this id, `$5` limit).
pub const PARKED_PAGE: &str = "\
SELECT id, event_id, topic, event_type, partition_key, attempts, last_error
FROM outbox_event
WHERE parked_at IS NOT NULL AND published_at IS NULL AND discarded_at IS NULL
  AND id > $4
  AND ($1::text IS NULL OR topic = $1)
  AND ($2::text IS NULL OR partition_key = $2)
  AND ($3::text IS NULL OR strpos(lower(last_error), $3) > 0)
ORDER BY id LIMIT $5";

/// Where an outbox row stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RowState {
    /// Waiting for a relay.
    Unpublished,
    /// Held back for a while (a missing topic, a failing key).
    Held,
    /// Parked after repeated failures.
    Parked,
    /// Parked and dropped by an operator.
    Discarded,
    /// Published.
    Published,
}

impl RowState {
    /// The state's name (`unpublished`, `held`, `parked`, `discarded`,
    /// `published`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unpublished => "unpublished",
            Self::Held => "held",
            Self::Parked => "parked",
            Self::Discarded => "discarded",
            Self::Published => "published",
        }
    }
}

/// One outbox row, whole: what an operator looks at before acting on it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct OutboxRow {
    /// Outbox row id.
    pub id: i64,
    /// Event id.
    pub event_id: uuid::Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Schema version of the event.
    pub event_version: i32,
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
    /// The payload (JSON).
    pub payload: serde_json::Value,
    /// The headers (a JSON object).
    pub headers: serde_json::Value,
    /// Failed attempts.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was written (UTC, RFC 3339).
    pub created_at: String,
    /// When it was published (UTC, RFC 3339).
    pub published_at: Option<String>,
    /// When it was parked.
    pub parked_at: Option<String>,
    /// Held until then.
    pub held_until: Option<String>,
    /// When it was dropped.
    pub discarded_at: Option<String>,
    /// Why it was dropped.
    pub discard_reason: Option<String>,
    /// Published in the progress mode: its lane's position passed it (the
    /// relay writes no time per row there; `published_at` stays empty).
    pub passed: bool,
    /// For a row [`passed`](Self::passed): when it was published at the
    /// latest (UTC, RFC 3339), the time of the first position recorded
    /// past it — exact to its batch while the positions are fresh, at most
    /// a minute late once the cleanup thinned them to one a minute, and
    /// unknown (`None`) for a row older than the positions kept (those of
    /// the retention window).
    pub published_by: Option<String>,
}

impl OutboxRow {
    /// Where the row stands.
    pub fn state(&self) -> RowState {
        if self.published_at.is_some() || self.passed {
            RowState::Published
        } else if self.discarded_at.is_some() {
            RowState::Discarded
        } else if self.parked_at.is_some() {
            RowState::Parked
        } else if self.held_until.is_some() {
            RowState::Held
        } else {
            RowState::Unpublished
        }
    }
}

/// One outbox row by id (the primary key), if it exists.
pub async fn outbox_row(pool: &PgPool, id: i64) -> Result<Option<OutboxRow>> {
    const TS: &str = r#"'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'"#;
    let ts = |c: &str| format!("to_char({c} AT TIME ZONE 'UTC', {TS}) AS {c}");
    let published = crate::relay::progress::Published::of(pool).await?;
    let sql = format!(
        "{}SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version, topic,
                partition_key, payload, headers, attempts, last_error, {}, {}, {}, {}, {},
                discard_reason, published_at IS NULL AND {} AS passed, {}
         FROM outbox_event WHERE id = $1",
        published.with,
        ts("created_at"),
        ts("published_at"),
        ts("parked_at"),
        ts("held_until"),
        ts("discarded_at"),
        published.condition,
        if published.progress {
            format!(
                "CASE WHEN published_at IS NULL AND {} THEN to_char({} AT TIME ZONE 'UTC', {TS})
                 END AS published_by",
                published.condition,
                crate::relay::progress::published_by("outbox_event"),
            )
        } else {
            "NULL::text AS published_by".into()
        },
    );
    Ok(sqlx::query_as(&sql).bind(id).fetch_optional(pool).await?)
}

/// The highest row id written so far (0 for an empty table): a look at the
/// primary key's last entry.
pub async fn last_id(pool: &PgPool) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT coalesce(max(id), 0)::int8 FROM outbox_event")
            .fetch_one(pool)
            .await?,
    )
}

/// Rows written per topic with ids in `after..=upto`: a range of the
/// primary key, so it costs about the rows written in the range (callers
/// keep the range short: the rows written since their last look).
pub async fn written_by_topic(pool: &PgPool, after: i64, upto: i64) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT topic, count(*) FROM outbox_event WHERE id > $1 AND id <= $2 GROUP BY topic",
    )
    .bind(after)
    .bind(upto)
    .fetch_all(pool)
    .await?)
}

/// Puts parked rows back in the relay's queue (attempts reset); `ids = None`
/// requeues every parked row except dropped ones, explicit ids requeue
/// dropped rows too (undoing the drop). Returns how many were requeued. In
/// the progress mode a requeued row is held until now: the relay reads it
/// with the held rows whose hold has ended (its lane's position is past it).
/// `executor` is a pool or a transaction's connection (to commit an audit
/// record with the change).
pub async fn requeue_parked<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    ids: Option<&[i64]>,
) -> Result<u64> {
    let result = sqlx::query(
        "UPDATE outbox_event
         SET parked_at = NULL, attempts = 0, discarded_at = NULL, discard_reason = NULL,
             held_until = CASE WHEN EXISTS (SELECT 1 FROM outbox_progress)
                               THEN statement_timestamp() END
         WHERE parked_at IS NOT NULL AND published_at IS NULL
           AND (($1::bigint[] IS NULL AND discarded_at IS NULL) OR id = ANY($1))",
    )
    .bind(ids)
    .execute(executor)
    .await?;
    Ok(result.rows_affected())
}

/// Drops parked rows: marks them discarded with `reason` (kept for the
/// audit trail, never published, never deleted by the retention job);
/// `ids = None` drops every parked row. Returns how many were dropped.
/// `executor` is a pool or a transaction's connection.
pub async fn discard_parked<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    ids: Option<&[i64]>,
    reason: &str,
) -> Result<u64> {
    if reason.trim().is_empty() {
        return Err(Error::Config(
            "a reason is required to drop parked rows (--reason)".into(),
        ));
    }
    let result = sqlx::query(
        "UPDATE outbox_event SET discarded_at = now(), discard_reason = $2
         WHERE parked_at IS NOT NULL AND published_at IS NULL AND discarded_at IS NULL
           AND ($1::bigint[] IS NULL OR id = ANY($1))",
    )
    .bind(ids)
    .bind(reason)
    .execute(executor)
    .await?;
    Ok(result.rows_affected())
}

/// Whether the commit-time NOTIFY trigger is enabled.
pub async fn notify_enabled(pool: &PgPool) -> Result<bool> {
    let enabled: Option<bool> = sqlx::query_scalar(
        "SELECT tgenabled <> 'D' FROM pg_trigger
         WHERE tgname = 'outbox_event_notify' AND tgrelid = 'outbox_event'::regclass",
    )
    .fetch_optional(pool)
    .await?;
    Ok(enabled.unwrap_or(false))
}

/// Enables or disables the commit-time NOTIFY (relays then poll), waiting
/// for the table lock as [`LockPolicy::default`] says.
pub async fn set_notify(pool: &PgPool, on: bool) -> Result<()> {
    set_notify_with(pool, on, &LockPolicy::default()).await
}

/// [`set_notify`] with another lock policy: `ALTER TABLE` needs the table's
/// exclusive lock; each attempt waits at most `lock_timeout` for it, so
/// writers never queue behind it for longer.
pub async fn set_notify_with(pool: &PgPool, on: bool, policy: &LockPolicy) -> Result<()> {
    let sql = if on {
        "ALTER TABLE outbox_event ENABLE TRIGGER outbox_event_notify"
    } else {
        "ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_notify"
    };
    let what = if on { "notify on" } else { "notify off" };
    policy
        .retry(what, || async {
            let mut conn = policy.connect(pool).await?;
            sqlx::query(sql).execute(&mut conn).await?;
            let _ = sqlx::Connection::close(conn).await;
            Ok(())
        })
        .await?;
    Ok(())
}

/// The distinct topics of the rows in the outbox.
pub async fn outbox_topics(pool: &PgPool) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT DISTINCT topic FROM outbox_event ORDER BY topic")
            .fetch_all(pool)
            .await?,
    )
}

/// Parses a duration: a sequence of `<number><unit>` (`30d`, `1h30m`,
/// `90s`, `1.5h`, `2w`, `500ms`), in the syntax of the `humantime` crate
/// (units `ns`, `us`, `ms`, `s`, `m`, `h`, `d`, `w`, `M` for months and
/// `y` for years, or their long names: `30days`, `1 hour 30 min`).
pub fn parse_duration(text: &str) -> Result<Duration> {
    humantime::parse_duration(text.trim()).map_err(|error| {
        Error::Config(format!(
            "invalid duration `{text}` ({error}): use e.g. 30d, 12h, 1h30m, 90s \
             (units s, m, h, d, w)"
        ))
    })
}

/// A relay's lanes as runs: `0-5,9,12-13` (empty for none). `lanes` in
/// ascending order, as [`RelayLanes::lanes`] holds them.
pub fn lane_ranges(lanes: &[i32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lanes.len() {
        let start = lanes[i];
        while i + 1 < lanes.len() && lanes[i + 1] == lanes[i] + 1 {
            i += 1;
        }
        parts.push(if lanes[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", lanes[i])
        });
        i += 1;
    }
    parts.join(",")
}

/// Formats a duration in the syntax [`parse_duration`] reads (`7d`, `1h30m`).
pub fn format_duration(d: Duration) -> String {
    let mut secs = d.as_secs();
    let millis = d.subsec_millis();
    if secs == 0 && millis == 0 {
        return "0s".into();
    }
    let mut out = String::new();
    for (unit, size) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if secs >= size {
            out.push_str(&format!("{}{unit}", secs / size));
            secs %= size;
        }
    }
    if millis > 0 {
        out.push_str(&format!("{millis}ms"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `status`'s and the gauges' queries read the partial indexes, never
    /// the whole table: 30,000 published rows, a few unpublished, held and
    /// parked ones, fresh statistics; no sequential scan in their plans.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn status_and_gauges_never_scan_the_table(pool: PgPool) {
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key, published_at,
                                       held_until, parked_at)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't' || (g % 3), 'k' || g,
                    CASE WHEN g > 30 THEN now() END,
                    CASE WHEN g <= 10 THEN now() + interval '1 hour' END,
                    CASE WHEN g > 20 AND g <= 30 THEN now() END
             FROM generate_series(1, 30000) AS g",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("VACUUM ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
        for sql in [
            backlog::QUEUE_SAMPLE,
            backlog::QUEUE_LAST,
            backlog::HELD_SAMPLE,
            backlog::PARKED_SAMPLE,
            crate::metrics::BACKLOG,
        ] {
            let sql = sql.replace("$1", "10001");
            let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {sql}"))
                .fetch_all(&pool)
                .await
                .unwrap();
            let plan = plan.join("\n");
            assert!(!plan.contains("Seq Scan on outbox_event"), "{plan}");
        }
        let status = status(&pool).await.unwrap();
        assert_eq!(
            (status.unpublished, status.held, status.parked),
            (20, 10, 10)
        );
        let (backlog, _, parked, held): (i64, Option<f64>, i64, i64) =
            sqlx::query_as(crate::metrics::BACKLOG)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!((backlog, parked, held), (20, 10, 10));
    }

    /// The gauges past their bound (10,000 rows of a kind): estimates near
    /// the counts, the dropped parked rows left out.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn gauges_estimate_a_large_backlog(pool: PgPool) {
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key, held_until, parked_at,
                                       discarded_at)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k' || g,
                    CASE WHEN g % 3 = 1 THEN now() + interval '1 hour' END,
                    CASE WHEN g % 3 = 2 THEN now() END,
                    CASE WHEN g % 6 = 5 THEN now() END
             FROM generate_series(1, 60000) AS g",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("VACUUM ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
        let (backlog, oldest, parked, held): (i64, Option<f64>, i64, i64) =
            sqlx::query_as(crate::metrics::BACKLOG)
                .fetch_one(&pool)
                .await
                .unwrap();
        let near = |n: i64, expected: i64| (n - expected).abs() <= expected / 10;
        assert!(near(backlog, 40_000), "{backlog}");
        assert!(near(held, 20_000), "{held}");
        assert!(near(parked, 10_000), "{parked}");
        assert!(oldest.is_some());
    }

    /// A grown outbox whose rows of a missing topic were held by the relay
    /// after the statistics were last taken (inserted, then held by an
    /// update, as the relay holds them): the estimates stay near the truth
    /// and never show the held topic published rows it has none of.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn status_estimates_never_invent_published_rows(pool: PgPool) {
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key, published_at)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{}',
                    CASE WHEN g % 5 = 0 THEN 'missing' ELSE 'orders' END, 'k' || (g % 100),
                    CASE WHEN g % 5 <> 0 THEN now() END
             FROM generate_series(1, 200000) AS g",
        )
        .execute(&pool)
        .await
        .unwrap();
        // The statistics describe the table before the holds (autovacuum
        // runs when it will): the held rows' index looked empty then.
        sqlx::query("ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(
            "UPDATE outbox_event SET held_until = now() + interval '1 hour'
             WHERE topic = 'missing'",
        )
        .execute(&pool)
        .await
        .unwrap();
        let status = status(&pool).await.unwrap();
        let topic = |name: &str| {
            status
                .topics
                .iter()
                .find(|t| t.topic == name)
                .cloned()
                .unwrap_or_else(|| panic!("no {name} in {:?}", status.topics))
        };
        let near = |n: i64, expected: i64| (n - expected).abs() <= expected / 10;
        let missing = topic("missing");
        assert_eq!(missing.published, 0, "{missing:?}");
        assert!(near(missing.held, 40_000), "{missing:?}");
        assert!(near(status.held, 40_000), "{status:?}");
        assert!(near(topic("orders").published, 160_000), "{status:?}");
        assert!(near(status.published, 160_000), "{status:?}");
    }

    #[test]
    fn durations_parse_and_print() {
        assert_eq!(
            parse_duration("30d").unwrap(),
            Duration::from_secs(30 * 86_400)
        );
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(
            parse_duration("2w").unwrap(),
            Duration::from_secs(14 * 86_400)
        );
        assert_eq!(parse_duration("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(
            parse_duration(" 1h 30min ").unwrap(),
            Duration::from_secs(5400)
        );
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        for bad in [
            "",
            " ",
            "30",
            "d",
            "3x",
            "-1d",
            "1d-",
            "99999999999999999999w",
        ] {
            let error = parse_duration(bad).unwrap_err().to_string();
            assert!(error.contains("invalid duration"), "{bad}: {error}");
        }
        assert_eq!(format_duration(Duration::from_secs(7 * 86_400)), "7d");
        assert_eq!(format_duration(Duration::from_secs(5400)), "1h30m");
        assert_eq!(format_duration(Duration::from_millis(90_500)), "1m30s500ms");
        for d in [
            Duration::from_millis(90_500),
            Duration::from_secs(8 * 86_400 + 1),
        ] {
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }
    }
}
