//! Replay: publishing stored events again, from the outbox, after Kafka lost
//! them or to rebuild a consumer's projection — selected by outbox id range,
//! creation time range, topic, aggregate type or aggregate id, to their
//! original topic or another one.
//!
//! - Only **published** rows are replayed, up to the newest row when the
//!   replay starts: unpublished ones are the relay's (it publishes them
//!   anyway), parked ones wait for an operator. The
//!   outbox is only read — no row is changed or locked — so a replay is safe
//!   while relays run and leaves the audit trail as it was. In the progress
//!   mode a published row is one its lane's position passed (the relay
//!   writes no time per row there): its creation time then stands for its
//!   publication in the dedup window's check below, which refuses more, not
//!   less.
//! - Each message is the original one — same key, payload, event id and
//!   headers — plus a `replay_id` header naming the replay run. Consumers
//!   deduplicate by event id, so a replayed event they already applied is a
//!   duplicate (count it, skip it); a consumer rebuilding from scratch
//!   (new group, empty dedup table) applies it.
//! - In outbox id order, through an idempotent producer (`acks=all`), page
//!   by page, with one event per key in flight: a key's next event is handed
//!   to the producer only once the previous one is acknowledged, so a failed
//!   delivery holds back the later events of its key (other keys go on) until
//!   a retry delivers it; a page is finished before the next one starts. So
//!   per-key order holds. At least once: a replay that stops (error, crash)
//!   can be run again from the id it reports, and some events are then sent
//!   twice.
//! - The selection reads what it selects, not the table: an id range is a
//!   range of the primary key; a time range is read through the BRIN index
//!   on `created_at` (the pages of the range only: counted by the dry run,
//!   exactly up to [`SELECTION_EXACT_UP_TO`] rows and estimated beyond,
//!   first turned into the ids created in it by the replay, which pages in
//!   id order). A topic or aggregate alone (no id or time range) reads
//!   every published row: give a range with them on a large outbox.
//! - Not beyond the dedup window: consumers keep their dedup rows for a
//!   window (the retention job's `--dedup-window`, 7 days by default), so an
//!   event published longer ago than that may no longer be recognised as a
//!   duplicate and would be applied again. A replay selecting any such event
//!   is refused, nothing sent, unless it is forced (a consumer rebuilding
//!   from scratch wants them) or declares a longer window.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;
use sqlx::types::chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::cleanup::DEFAULT_DEDUP_WINDOW;
use crate::error::{Error, Result};
use crate::kafka;
use crate::ops::format_duration;
use crate::relay::claim::Row;
use crate::relay::progress::Published;
use crate::relay::publish::{self, FailureKind, Outcome, Publisher};

/// The Kafka header that marks a replayed message; its value is the replay
/// run's id.
pub const REPLAY_HEADER: &str = "replay_id";

/// Which published events to replay. Every set criterion must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayFilter {
    /// Outbox ids from (inclusive).
    pub from_id: Option<i64>,
    /// Outbox ids up to (inclusive).
    pub to_id: Option<i64>,
    /// Created at or after.
    pub since: Option<DateTime<Utc>>,
    /// Created before.
    pub until: Option<DateTime<Utc>>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only this aggregate id.
    pub aggregate_id: Option<String>,
}

/// A replay run's settings. `Debug` redacts secret Kafka settings.
#[derive(Clone)]
pub struct ReplayOptions {
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// Extra librdkafka settings (TLS, SASL); idempotence and `acks=all`
    /// are enforced.
    pub kafka_settings: Vec<(String, String)>,
    /// The events to replay.
    pub filter: ReplayFilter,
    /// Publish to this topic instead of each event's own.
    pub to_topic: Option<String>,
    /// Rows read and sent per page.
    pub batch_size: i64,
    /// Attempts per page before the replay stops with an error.
    pub max_attempts: u32,
    /// librdkafka `message.timeout.ms`.
    pub delivery_timeout: Duration,
    /// How long consumers keep their dedup rows (default 7 days, as the
    /// retention job's): events published longer ago are refused unless
    /// `force`.
    pub dedup_window: Duration,
    /// Replay events published before the dedup window too (consumers that
    /// lost their dedup rows apply them again).
    pub force: bool,
}

impl std::fmt::Debug for ReplayOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured without `..`: a new field must be added here.
        let Self {
            brokers,
            kafka_settings,
            filter,
            to_topic,
            batch_size,
            max_attempts,
            delivery_timeout,
            dedup_window,
            force,
        } = self;
        f.debug_struct("ReplayOptions")
            .field("brokers", brokers)
            .field("kafka_settings", &kafka::Redacted(kafka_settings))
            .field("filter", filter)
            .field("to_topic", to_topic)
            .field("batch_size", batch_size)
            .field("max_attempts", max_attempts)
            .field("delivery_timeout", delivery_timeout)
            .field("dedup_window", dedup_window)
            .field("force", force)
            .finish()
    }
}

impl ReplayOptions {
    /// Replays the events `filter` selects through `brokers`.
    pub fn new(brokers: impl Into<String>, filter: ReplayFilter) -> Self {
        Self {
            brokers: brokers.into(),
            kafka_settings: Vec::new(),
            filter,
            to_topic: None,
            batch_size: 1000,
            max_attempts: 5,
            delivery_timeout: Duration::from_secs(30),
            dedup_window: DEFAULT_DEDUP_WINDOW,
            force: false,
        }
    }

    fn validate(&self) -> Result<()> {
        let f = &self.filter;
        if let (Some(a), Some(b)) = (f.from_id, f.to_id)
            && a > b
        {
            return Err(Error::Config(format!(
                "empty id range: --from-id {a} is after --to-id {b}"
            )));
        }
        if let (Some(a), Some(b)) = (f.since, f.until)
            && a >= b
        {
            return Err(Error::Config(format!(
                "empty time range: --since {a} is not before --until {b}"
            )));
        }
        if let Some(t) = &self.to_topic
            && (t.is_empty()
                || t.len() > 249
                || !t
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
        {
            return Err(Error::Config(format!(
                "invalid --to-topic `{t}`: 1-249 characters of [a-zA-Z0-9._-]"
            )));
        }
        if !(1..=100_000).contains(&self.batch_size) {
            return Err(Error::Config(format!(
                "replay batch size must be 1..=100000, got {}",
                self.batch_size
            )));
        }
        if self.max_attempts == 0 {
            return Err(Error::Config("replay max attempts must be >= 1".into()));
        }
        Ok(())
    }
}

/// What a replay did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The run's id (the `replay_id` header of every message sent).
    pub replay_id: Uuid,
    /// Events sent and acknowledged.
    pub replayed: u64,
    /// Lowest and highest outbox id replayed.
    pub first_id: Option<i64>,
    /// Highest outbox id replayed.
    pub last_id: Option<i64>,
}

/// The selection's condition: only the criteria that are set (parameters
/// `$1` from id … `$7` aggregate id are always bound), so that the plan is
/// a range scan of the primary key (ids) and, for a time range alone, of
/// the BRIN index on `created_at` (see [`narrowed`]).
fn filter_sql(f: &ReplayFilter, published: &Published) -> String {
    let mut sql = format!("{} AND id >= $1", published.condition);
    for (set, clause) in [
        (f.to_id.is_some(), " AND id <= $2"),
        (f.since.is_some(), " AND created_at >= $3"),
        (f.until.is_some(), " AND created_at < $4"),
        (f.topic.is_some(), " AND topic = $5"),
        (f.aggregate_type.is_some(), " AND aggregate_type = $6"),
        (f.aggregate_id.is_some(), " AND aggregate_id = $7"),
    ] {
        if set {
            sql.push_str(clause);
        }
    }
    sql
}

/// `filter` with its id range narrowed to the ids of its time range: the
/// lowest and highest id created in it, read through the BRIN index on
/// `created_at` (the pages of the range only; `OFFSET 0` keeps the planner
/// from walking the primary key from either end instead). The time
/// criteria stay in the filter: ids are not strictly in creation order.
async fn narrowed(pool: &PgPool, filter: &ReplayFilter) -> Result<ReplayFilter> {
    let mut f = filter.clone();
    if f.since.is_none() && f.until.is_none() {
        return Ok(f);
    }
    let mut range = String::from("TRUE");
    if f.since.is_some() {
        range.push_str(" AND created_at >= $1");
    }
    if f.until.is_some() {
        range.push_str(" AND created_at < $2");
    }
    let (low, high): (Option<i64>, Option<i64>) = sqlx::query_as(&format!(
        "SELECT min(id), max(id) FROM (SELECT id FROM outbox_event WHERE {range} OFFSET 0) AS r"
    ))
    .bind(f.since)
    .bind(f.until)
    .fetch_one(pool)
    .await?;
    match (low, high) {
        (Some(low), Some(high)) => {
            f.from_id = Some(f.from_id.map_or(low, |a| a.max(low)));
            f.to_id = Some(f.to_id.map_or(high, |b| b.min(high)));
        }
        // Nothing was created in the range: an empty id range.
        _ => {
            f.from_id = Some(1);
            f.to_id = Some(0);
        }
    }
    Ok(f)
}

fn page_sql(filter: &ReplayFilter, published: &Published) -> String {
    let with = &published.with;
    let filter = filter_sql(filter, published);
    format!(
        "{with}SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version, created_at,
                COALESCE($8, topic) AS topic, partition_key, payload::text AS payload,
                (headers || jsonb_build_object('{REPLAY_HEADER}', $9::text))::text AS headers,
                attempts, NULL::float8 AS behind_held_secs, ctid::text AS tid
         FROM outbox_event WHERE {filter} ORDER BY id LIMIT $10"
    )
}

/// Binds `$1`–`$7`, the filter's criteria (see `filter_sql`).
macro_rules! bind_filter {
    ($query:expr, $filter:expr) => {
        $query
            .bind($filter.from_id.unwrap_or(i64::MIN))
            .bind($filter.to_id)
            .bind($filter.since)
            .bind($filter.until)
            .bind($filter.topic.as_deref())
            .bind($filter.aggregate_type.as_deref())
            .bind($filter.aggregate_id.as_deref())
    };
}

/// Binds `$1`–`$8` of a selection's statements: the filter's criteria and
/// the dedup window in seconds.
macro_rules! bind_selection {
    ($query:expr, $filter:expr, $window:expr) => {
        bind_filter!($query, $filter).bind($window.as_secs_f64())
    };
}

/// Rows of a selection [`selection`] counts exactly (of all it selects, and
/// of those beyond the dedup window); a count that reaches it is estimated.
pub const SELECTION_EXACT_UP_TO: i64 = 10_000;

/// What a selection holds, as a dry run reports it and a replay checks it
/// before it sends anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Selection {
    /// Published events selected.
    pub matched: u64,
    /// Of them, published more than the dedup window ago. Zero only when
    /// there is none: this is what a replay refuses.
    pub beyond_window: u64,
    /// A count is an estimate: it passed [`SELECTION_EXACT_UP_TO`] (it is
    /// then the planner's estimate, never below the rows counted; [`shown`]
    /// marks it).
    pub estimated: bool,
    /// One of the events beyond the window (its outbox id), if any.
    pub example_beyond: Option<i64>,
}

/// A count of a [`Selection`] as shown to people: `~` before an estimate
/// (a count above [`SELECTION_EXACT_UP_TO`]).
pub fn shown(count: u64) -> String {
    if count > SELECTION_EXACT_UP_TO as u64 {
        format!("~{count}")
    } else {
        count.to_string()
    }
}

/// Counts what `filter` selects, and how much of it was published more than
/// `window` ago, reading at most [`SELECTION_EXACT_UP_TO`] + 1 rows of
/// each: exact up to the bound, estimated beyond, so that a dry run over a
/// month of a large outbox costs what one over a day does. Events beyond the
/// window are looked for among those created before it only (an event is
/// published after it is created): a recent selection costs next to nothing
/// more; an older one with none beyond the window is read whole.
pub async fn selection(
    pool: &PgPool,
    filter: &ReplayFilter,
    window: Duration,
) -> Result<Selection> {
    let published = Published::of(pool).await?;
    let with = &published.with;
    let selected = filter_sql(filter, &published);
    // When it was published: in the progress mode, a row the positions
    // passed has no time of its own; its creation stands for it (earlier:
    // such a row counts as beyond the window if it was created before it).
    let at = if published.progress {
        "coalesce(published_at, created_at)"
    } else {
        "published_at"
    };
    // An event is published after it was created, both times from the
    // database's clock: only events created before the window (less an hour
    // for a clock step) can have been published before it, and the BRIN
    // index on `created_at` skips the rest (a recent selection has none).
    let beyond = format!(
        "{selected} AND {at} < now() - make_interval(secs => $8)
         AND created_at < now() - make_interval(secs => $8) + interval '1 hour'"
    );
    // The first rows of the selection, and how many of them are beyond the
    // window. When they are all it selects, or all beyond the window, that
    // is the whole answer (one read of the selection's index).
    let sample = format!(
        "{with}SELECT count(*), count(*) FILTER (WHERE old), min(id) FILTER (WHERE old)
         FROM (SELECT id, {at} < now() - make_interval(secs => $8) AS old
               FROM outbox_event WHERE {selected} LIMIT $9) AS s"
    );
    let (mut matched, mut old, mut example): (i64, i64, Option<i64>) =
        bind_selection!(sqlx::query_as(&sample), filter, window)
            .bind(SELECTION_EXACT_UP_TO + 1)
            .fetch_one(pool)
            .await?;
    if matched > SELECTION_EXACT_UP_TO && old < matched {
        // More than the sample, not all beyond the window: those beyond it
        // are looked for on their own.
        (old, example) = bind_selection!(
            sqlx::query_as(&format!(
                "{with}SELECT count(*), min(id) FROM (SELECT id FROM outbox_event
                 WHERE {beyond} LIMIT $9) AS s"
            )),
            filter,
            window
        )
        .bind(SELECTION_EXACT_UP_TO + 1)
        .fetch_one(pool)
        .await?;
    }
    let mut estimated = false;
    for (count, condition) in [(&mut matched, &selected), (&mut old, &beyond)] {
        if *count > SELECTION_EXACT_UP_TO {
            estimated = true;
            // A statement of its own, planned with these values (not a
            // cached generic plan, whose estimate ignores them).
            let sql = format!(
                "EXPLAIN (FORMAT JSON) {with}SELECT id FROM outbox_event
                 WHERE {condition} AND $8::float8 IS NOT NULL"
            );
            let plan: sqlx::types::Json<serde_json::Value> =
                bind_selection!(sqlx::query_scalar(&sql).persistent(false), filter, window)
                    .fetch_one(pool)
                    .await?;
            let planned = plan.0[0]["Plan"]["Plan Rows"].as_f64().unwrap_or(0.0) as i64;
            *count = (*count).max(planned);
        }
    }
    Ok(Selection {
        matched: matched.max(old) as u64,
        beyond_window: old as u64,
        estimated,
        example_beyond: example,
    })
}

/// How many published events `filter` selects (a dry run).
pub async fn count(pool: &PgPool, filter: &ReplayFilter) -> Result<u64> {
    // One pass over the selection, exact.
    let published = Published::of(pool).await?;
    let sql = format!(
        "{}SELECT count(*) FROM outbox_event WHERE {}",
        published.with,
        filter_sql(filter, &published)
    );
    let n: i64 = bind_filter!(sqlx::query_scalar(&sql), filter)
        .fetch_one(pool)
        .await?;
    Ok(n as u64)
}

/// Replays the published events `options.filter` selects, in id order.
///
/// Refuses ([`Error::Config`], nothing sent) a selection with events
/// published before the dedup window unless `options.force`. On a page that
/// keeps failing it stops with [`Error::ReplayStopped`], which names the
/// outbox id to resume from.
pub async fn replay(pool: &PgPool, options: &ReplayOptions) -> Result<ReplayReport> {
    options.validate()?;
    if !options.force {
        let selected = selection(pool, &options.filter, options.dedup_window).await?;
        if selected.beyond_window > 0 {
            let window = format_duration(options.dedup_window);
            let (old, all) = (shown(selected.beyond_window), shown(selected.matched));
            return Err(Error::Config(format!(
                "refusing to replay: {old} of the {all} events selected were published \
                 more than {window} ago (one of them: outbox id {}), beyond the consumers' dedup window \
                 {window}; their dedup rows may be gone, so consumers would apply them again. \
                 Narrow the selection (--since, --from-id), declare a longer --dedup-window if \
                 every consumer keeps its dedup rows longer, or pass --force to replay them \
                 anyway (e.g. for a consumer rebuilding from scratch)",
                selected.example_beyond.unwrap_or_default()
            )));
        }
    }
    let mut settings: Vec<(String, String)> = vec![
        // One event per key in flight: a key's next event waits for the
        // acknowledgement of its previous one, and lingers again.
        ("linger.ms".into(), "1".into()),
        ("reconnect.backoff.max.ms".into(), "1000".into()),
        (
            "message.timeout.ms".into(),
            options.delivery_timeout.as_millis().to_string(),
        ),
    ];
    settings.extend(options.kafka_settings.iter().cloned());
    let mut publisher = Publisher::new(kafka::client_config(&options.brokers, &settings))?;
    let replay_id = Uuid::now_v7();
    let mut report = ReplayReport {
        replay_id,
        replayed: 0,
        first_id: None,
        last_id: None,
    };
    tracing::info!(%replay_id, filter = ?options.filter, to_topic = ?options.to_topic, "replay started");
    let f = &narrowed(pool, &options.filter).await?;
    let sql = page_sql(f, &Published::of(pool).await?);
    let mut from = f.from_id.unwrap_or(i64::MIN);
    // What the outbox holds now: rows committed during the replay are the
    // relay's business.
    let newest: Option<i64> = sqlx::query_scalar("SELECT max(id) FROM outbox_event")
        .fetch_one(pool)
        .await?;
    let to_id = match (f.to_id, newest) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    loop {
        let page: Vec<Row> = sqlx::query_as(&sql)
            .bind(from)
            .bind(to_id)
            .bind(f.since)
            .bind(f.until)
            .bind(f.topic.as_deref())
            .bind(f.aggregate_type.as_deref())
            .bind(f.aggregate_id.as_deref())
            .bind(options.to_topic.as_deref())
            .bind(replay_id.to_string())
            .bind(options.batch_size)
            .fetch_all(pool)
            .await?;
        let Some(last) = page.last().map(|r| r.id) else {
            break;
        };
        let full = page.len() as i64 == options.batch_size;
        report.first_id.get_or_insert(page[0].id);
        send_page(&mut publisher, page, options, &mut report).await?;
        report.last_id = Some(last);
        if !full {
            break;
        }
        from = last + 1;
    }
    publisher.flush(Duration::from_secs(10));
    metrics::counter!("outbox_replayed_total").increment(report.replayed);
    tracing::info!(%replay_id, replayed = report.replayed, "replay done");
    Ok(report)
}

/// Sends one page until every row is acknowledged, or fails after
/// `max_attempts` rounds. Each round sends what is left in key order (see
/// [`send_in_key_order`]); what a round did not deliver — failed rows and
/// the later rows of their keys — goes again in the next, in id order.
async fn send_page(
    publisher: &mut Publisher,
    mut rows: Vec<Row>,
    options: &ReplayOptions,
    report: &mut ReplayReport,
) -> Result<()> {
    let mut attempt = 0;
    let mut last_error = String::new();
    while !rows.is_empty() {
        attempt += 1;
        if attempt > options.max_attempts {
            return Err(Error::ReplayStopped {
                replayed: report.replayed,
                resume_from: rows[0].id,
                reason: last_error,
            });
        }
        let round = send_in_key_order(publisher, &rows).await;
        report.replayed += round.delivered;
        if let Some(error) = round.error {
            last_error = error;
        }
        rows = rows
            .into_iter()
            .zip(round.delivered_rows)
            .filter_map(|(row, delivered)| (!delivered).then_some(row))
            .collect();
        if !rows.is_empty() {
            tracing::warn!(
                attempt,
                remaining = rows.len(),
                error = %last_error,
                "replay: deliveries failed, retrying (their keys' later events held back)"
            );
            if round.fatal {
                publisher.recreate(&last_error);
            } else {
                publisher.recover_if_fatal();
            }
            tokio::time::sleep(crate::backoff::delay(
                Duration::from_millis(200),
                Duration::from_secs(5),
                attempt,
            ))
            .await;
        }
    }
    Ok(())
}

/// What one round of [`send_in_key_order`] did.
struct Round {
    /// Per row: acknowledged.
    delivered_rows: Vec<bool>,
    delivered: u64,
    /// The last delivery error.
    error: Option<String>,
    /// The producer reported itself unusable.
    fatal: bool,
}

impl Round {
    fn failed(&mut self, outcome: Outcome) {
        if let Outcome::Failed(kind, error) = outcome {
            self.fatal |= kind == FailureKind::Fatal;
            self.error = Some(error);
        }
    }
}

/// Sends `rows` (in id order) with at most one event of each key in flight:
/// a key's next event is handed to the producer once the previous one is
/// acknowledged; after a failure (or a full producer queue) the key's later
/// events stay unsent in this round. Different keys go in parallel.
async fn send_in_key_order(publisher: &Publisher, rows: &[Row]) -> Round {
    let mut queues: Vec<VecDeque<usize>> = Vec::new();
    let mut queue_of: HashMap<&str, usize> = HashMap::new();
    for (i, row) in rows.iter().enumerate() {
        let q = *queue_of
            .entry(row.partition_key.as_str())
            .or_insert_with(|| {
                queues.push(VecDeque::new());
                queues.len() - 1
            });
        queues[q].push_back(i);
    }
    let mut round = Round {
        delivered_rows: vec![false; rows.len()],
        delivered: 0,
        error: None,
        fatal: false,
    };
    let mut in_flight = InFlight::new();
    for (q, queue) in queues.iter_mut().enumerate() {
        send_next(publisher, rows, q, queue, &mut in_flight, &mut round);
    }
    while let Some(joined) = in_flight.join_next().await {
        let Ok((q, i, delivery)) = joined else {
            // Awaiting a delivery neither panics nor is cancelled; a row
            // lost here is only sent again.
            continue;
        };
        match publish::outcome(delivery, &rows[i].topic) {
            Outcome::Delivered => {
                round.delivered_rows[i] = true;
                round.delivered += 1;
                send_next(
                    publisher,
                    rows,
                    q,
                    &mut queues[q],
                    &mut in_flight,
                    &mut round,
                );
            }
            failed => round.failed(failed),
        }
    }
    round
}

/// Deliveries in flight: each yields its key's queue, its row and its result.
type InFlight = tokio::task::JoinSet<(
    usize,
    usize,
    <rdkafka::producer::DeliveryFuture as std::future::Future>::Output,
)>;

/// Hands the next row of key queue `q` to the producer.
fn send_next(
    publisher: &Publisher,
    rows: &[Row],
    q: usize,
    queue: &mut VecDeque<usize>,
    in_flight: &mut InFlight,
    round: &mut Round,
) {
    let Some(i) = queue.pop_front() else {
        return;
    };
    match publisher.send_one(&rows[i]) {
        Ok(delivery) => {
            in_flight.spawn(async move { (q, i, delivery.await) });
        }
        Err(outcome) => round.failed(outcome),
    }
}
