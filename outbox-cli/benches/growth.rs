//! Growth benchmark: what every operation costs as the history grows. For
//! each history size (published outbox rows and dedup rows, filled with
//! `generate_series`, created over the past 180 days) it measures, in one
//! run:
//!
//! - the relay's drain rate of a fresh backlog, and its claim p99;
//! - the same with a backlog of a missing topic (never created) held back
//!   ahead of it;
//! - Unit of Work commits/s (1 event, 16 clients) and the dedup consumer's
//!   events/s;
//! - `status`, `replay --dry-run` with a time filter, and a cleanup pass
//!   that finds nothing to delete: their times;
//! - writers' commit rate (Unit of Work, 1 event, 16 clients) while a relay
//!   drains a large backlog at full speed (and at each rate limit of
//!   `--relay-rates`), against writers alone, with where the CPU goes
//!   (see `profile`);
//! - writers' commit p99 while a cleanup deletes the whole history, against
//!   writers alone (last: it empties the history).
//!
//! The claim times are the relay's own: its per-step trace event
//! (`relay step`, `claim_ms`), read by a tracing layer in this process.
//!
//! `cargo bench -p outbox-cli --bench growth -- [--history 0,1000000,10000000] [--backlog N] [--held N] [--seconds S] [--json PATH]`;
//! `--only-ops` measures the operations alone (no broker needed).
//!
//! Needs PostgreSQL (DATABASE_URL names the server; the benchmark creates
//! its own database `outbox_growth`) and a broker (KAFKA_BROKERS).

#[path = "../../outbox-runtime/benches/common/mod.rs"]
mod common;
#[path = "growth/profile.rs"]
mod profile;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_core::{
    DomainEvent, HandlerContext, HandlerFuture, InboxHandler, OutboxMessage, UnitOfWork,
};
use outbox_runtime::cleanup::{self, Retention};
use outbox_runtime::replay::{self, ReplayFilter};
use outbox_runtime::{Consumer, Relay, RelayHandle, ops};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use sqlx::types::chrono::{DateTime, Utc};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use uuid::Uuid;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// History sizes (published outbox rows, and as many dedup rows).
    #[arg(long, value_delimiter = ',', default_value = "0,1000000,10000000")]
    history: Vec<i64>,
    /// Rows of the fresh backlog the relay drains.
    #[arg(long, default_value_t = 200_000)]
    backlog: i64,
    /// Rows of a missing topic held back ahead of the backlog.
    #[arg(long, default_value_t = 200_000)]
    held: i64,
    /// Rows of the large backlog drained while writers commit.
    #[arg(long, default_value_t = 1_000_000)]
    large_backlog: i64,
    /// Messages the dedup consumer reads.
    #[arg(long, default_value_t = 100_000)]
    consume: u64,
    /// Length of each writers' run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Longest a drain is waited for.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Longest writers run beside the cleanup of the history (it is then
    /// stopped).
    #[arg(long, default_value_t = 30.0)]
    cleanup_seconds: f64,
    /// One dedup row per this many history rows (1: as many as outbox rows;
    /// more to fit a large history on the disk).
    #[arg(long, default_value_t = 1)]
    dedup_every: i64,
    /// Rows per history-filling statement.
    #[arg(long, default_value_t = 1_000_000)]
    chunk: i64,
    /// Rate limits (events/s) of the relay draining beside the writers; 0:
    /// none. Each is one writers' run.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    relay_rates: Vec<u32>,
    /// Only the writers beside a draining relay (at each of `--relay-rates`).
    #[arg(long)]
    only_writers_relay: bool,
    /// Only the relay's drains (without and behind held rows).
    #[arg(long)]
    only_drains: bool,
    /// Runs the relay's drains in the progress mode (`outbox progress
    /// enable` before the first).
    #[arg(long)]
    progress: bool,
    /// Only the operations' latencies (status, the gauges' query, replay's
    /// dry run, an idle cleanup pass), without a broker: with an empty
    /// backlog, then with `--ops-backlog` rows waiting (half of them held).
    #[arg(long)]
    only_ops: bool,
    /// Rows waiting during the second round of `--only-ops`.
    #[arg(long, default_value_t = 200_000)]
    ops_backlog: i64,
    /// Keeps the database (`outbox_growth`) and its history at the end, and
    /// reuses them when the next run asks for the same history size
    /// (`--only-ops` at 10M rows without filling them again).
    #[arg(long)]
    keep: bool,
    /// Runs of each operation (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The history's span: `created_at` runs from this long ago to now.
const SPAN_DAYS: i64 = 180;

/// Writers of the Unit of Work measurements.
const WRITERS: usize = 16;

/// A ~200-byte payload, as the relay benchmark's.
const PAYLOAD_SQL: &str = "jsonb_build_object('order_id', 'order-' || (g % 1000), 'seq', g, \
     'amount_cents', 1999, 'note', repeat('x', 120))";

/// Published rows `$1..=$2` of a history of `$3` rows, oldest first,
/// `created_at` spread evenly over the span, published a second later.
const FILL_OUTBOX: &str = "\
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, topic, partition_key,
                          payload, headers, created_at, published_at)
SELECT {uuid}, 'Order', 'order-' || (g % 1000), 'OrderPlaced', 'growth.history',
       'order-' || (g % 1000), {payload},
       jsonb_build_object('correlation_id', gen_random_uuid()),
       t, t + interval '1 second'
FROM generate_series($1::int8, $2::int8) AS g,
     LATERAL (SELECT now() - make_interval(secs => ($3 - g + 1) * ({span} * 86400.0 / $3))) AS c(t)";

/// The dedup rows of the consumer group `$4`, the same way: one per `$5`
/// history rows.
const FILL_PROCESSED: &str = "\
INSERT INTO processed_event (consumer, event_id, processed_at)
SELECT $4, {uuid}, now() - make_interval(secs => ($3 - g + 1) * ({span} * 86400.0 / $3))
FROM generate_series($1::int8, $2::int8) AS g
WHERE g % $5 = 0";

/// `$1` unpublished rows of topic `$2`.
const BACKLOG: &str = "\
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, topic, partition_key,
                          payload, headers)
SELECT {uuid}, 'Order', 'order-' || (g % 1000), 'OrderPlaced', $2, 'order-' || (g % 1000),
       {payload}, jsonb_build_object('correlation_id', gen_random_uuid())
FROM generate_series(1, $1) AS g";

fn sql(template: &str) -> String {
    template
        .replace("{uuid}", common::UUID_V7_SQL)
        .replace("{payload}", PAYLOAD_SQL)
        .replace("{span}", &SPAN_DAYS.to_string())
}

/// The relay's claim times (ms) of claims that returned rows, from its
/// `relay step` trace events.
#[derive(Clone, Default)]
struct ClaimTimes(Arc<Mutex<Vec<f64>>>);

impl ClaimTimes {
    fn take(&self) -> Vec<f64> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

#[derive(Default)]
struct Step {
    is_step: bool,
    claimed: Option<u64>,
    claim_ms: Option<f64>,
}

impl Visit for Step {
    fn record_f64(&mut self, field: &Field, value: f64) {
        if field.name() == "claim_ms" {
            self.claim_ms = Some(value);
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "claimed" {
            self.claimed = Some(value);
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == "claimed" {
            self.claimed = u64::try_from(value).ok();
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" && format!("{value:?}") == "relay step" {
            self.is_step = true;
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ClaimTimes {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut step = Step::default();
        event.record(&mut step);
        if let (true, Some(1..), Some(ms)) = (step.is_step, step.claimed, step.claim_ms) {
            self.0.lock().unwrap().push(ms);
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.99)
}

fn round(x: f64, digits: i32) -> Value {
    if x.is_finite() {
        let f = 10_f64.powi(digits);
        json!((x * f).round() / f)
    } else {
        Value::Null
    }
}

/// Flushes the WAL written so far (when the role may), so that no
/// checkpoint lands in the middle of a timed phase.
async fn checkpoint(pool: &PgPool) {
    if let Err(error) = sqlx::query("CHECKPOINT").execute(pool).await {
        eprintln!("(CHECKPOINT not allowed: {error}; a phase may include one)");
    }
}

/// Empties the tables and fills a history of `n` rows; returns its last id.
async fn fill(
    pool: &PgPool,
    n: i64,
    chunk: i64,
    group: &str,
    dedup_every: i64,
) -> Result<i64, sqlx::Error> {
    sqlx::query("TRUNCATE outbox_event, processed_event, growth_order")
        .execute(pool)
        .await?;
    let (outbox, processed) = (sql(FILL_OUTBOX), sql(FILL_PROCESSED));
    let mut from = 1;
    while from <= n {
        let to = (from + chunk - 1).min(n);
        sqlx::query(&outbox)
            .bind(from)
            .bind(to)
            .bind(n)
            .execute(pool)
            .await?;
        sqlx::query(&processed)
            .bind(from)
            .bind(to)
            .bind(n)
            .bind(group)
            .bind(dedup_every)
            .execute(pool)
            .await?;
        from = to + 1;
    }
    sqlx::query("VACUUM ANALYZE outbox_event, processed_event")
        .execute(pool)
        .await?;
    checkpoint(pool).await;
    last_id(pool).await
}

async fn last_id(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM outbox_event")
        .fetch_one(pool)
        .await
}

/// Rows of the history (outbox and dedup, of every run's group: a kept
/// history's dedup rows belong to the run that filled it) still there.
async fn history_rows(pool: &PgPool, last: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox_event WHERE id <= $1)
              + (SELECT count(*) FROM processed_event WHERE consumer LIKE 'growth-dedup-%')",
    )
    .bind(last)
    .fetch_one(pool)
    .await
}

/// Deletes what a phase added after the history (ids past `last`).
async fn reset(pool: &PgPool, last: i64) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM outbox_event WHERE id > $1")
        .bind(last)
        .execute(pool)
        .await?;
    // A missing topic held in the progress mode.
    sqlx::query("DELETE FROM outbox_held_topic")
        .execute(pool)
        .await?;
    sqlx::query("TRUNCATE growth_order").execute(pool).await?;
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await?;
    checkpoint(pool).await;
    Ok(())
}

async fn backlog(pool: &PgPool, n: i64, topic: &str) -> Result<(), sqlx::Error> {
    sqlx::query(&sql(BACKLOG))
        .bind(n)
        .bind(topic)
        .execute(pool)
        .await?;
    sqlx::query("ANALYZE outbox_event").execute(pool).await?;
    checkpoint(pool).await;
    Ok(())
}

async fn relay_pool(url: &str) -> Result<PgPool, sqlx::Error> {
    pool_named(url, 8, profile::RELAY_APP).await
}

/// A pool whose connections carry `application_name` `name`.
async fn pool_named(url: &str, size: u32, name: &str) -> Result<PgPool, sqlx::Error> {
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .application_name(name);
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await
}

fn relay(pool: &PgPool, brokers: &str) -> Result<RelayHandle, outbox_runtime::Error> {
    relay_at(pool, brokers, None)
}

/// A relay with a rate limit (`None`: none).
fn relay_at(
    pool: &PgPool,
    brokers: &str,
    rate: Option<u32>,
) -> Result<RelayHandle, outbox_runtime::Error> {
    Relay::builder(pool.clone())
        .brokers(brokers)
        .max_events_per_second(rate)
        .spawn()
}

/// Writers while a relay (rate limit `rate`, 0: none) drains a backlog of
/// `backlog` rows: the writers' commits/s, the relay's events/s meanwhile,
/// whether the backlog lasted the run, and the profile of the run.
#[allow(clippy::too_many_arguments)]
async fn writers_beside_relay(
    url: &str,
    pool: &PgPool,
    writers_pool: &PgPool,
    brokers: &str,
    topic: &str,
    backlog_rows: i64,
    rate: u32,
    seconds: Duration,
    timeout: Duration,
) -> Result<(f64, f64, bool, Value), Box<dyn std::error::Error>> {
    backlog(pool, backlog_rows, topic).await?;
    let relay_pool = relay_pool(url).await?;
    let handle = relay_at(&relay_pool, brokers, (rate > 0).then_some(rate))?;
    let wait_start = Instant::now();
    while handle.counts().published == 0 && wait_start.elapsed() < timeout {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = handle.counts().published;
    let t = Instant::now();
    let profile = profile::start(pool).await?;
    let (with_relay_rate, _) = writers(writers_pool, topic, seconds, None).await?;
    let relay_rate = (handle.counts().published - before) as f64 / t.elapsed().as_secs_f64();
    let profiled = profile.finish().await?;
    let lasted = handle.counts().published < backlog_rows as u64;
    handle.shutdown().await?;
    relay_pool.close().await;
    Ok((with_relay_rate, relay_rate, lasted, profiled))
}

/// A relay drain: events/s from its first published event to the `n`th,
/// the p99 of its claims meanwhile, whether it got there within `timeout`
/// (the rate is otherwise over what it published), and events/s from the
/// relay's start (its first claims included).
async fn drain(
    url: &str,
    brokers: &str,
    n: u64,
    claims: &ClaimTimes,
    timeout: Duration,
) -> Result<(f64, f64, bool, f64), Box<dyn std::error::Error>> {
    let relay_pool = relay_pool(url).await?;
    claims.take();
    let handle = relay(&relay_pool, brokers)?;
    let spawned = Instant::now();
    let mut first: Option<Instant> = None;
    let mut complete = true;
    loop {
        let published = handle.counts().published;
        if first.is_none() && published > 0 {
            first = Some(Instant::now());
        }
        if published >= n {
            break;
        }
        if spawned.elapsed() > timeout {
            complete = false;
            break;
        }
        if handle.is_finished() {
            return Err("the relay stopped".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let published = handle.counts().published;
    let took = first.map_or(Duration::MAX, |f| f.elapsed());
    let wall = published as f64 / spawned.elapsed().as_secs_f64();
    handle.shutdown().await?;
    relay_pool.close().await;
    let rate = published as f64 / took.as_secs_f64();
    Ok((rate, p99(claims.take()), complete, wall))
}

/// One Unit of Work commit: a domain row and one ~200-byte event.
async fn commit(pool: &PgPool, topic: &str, i: u64) -> Result<(), outbox_core::Error> {
    let order_id = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(pool).await?;
    sqlx::query("INSERT INTO growth_order (id, amount_cents) VALUES ($1, 1999)")
        .bind(order_id)
        .execute(&mut *uow)
        .await?;
    let key = order_id.to_string();
    uow.record_message(OutboxMessage {
        event_id: Uuid::now_v7(),
        aggregate_type: "Order".into(),
        aggregate_id: key.clone(),
        event_type: "OrderPlaced".into(),
        event_version: 1,
        topic: topic.to_owned(),
        partition_key: key,
        payload:
            json!({ "order_id": order_id, "seq": i, "amount_cents": 1999, "note": "x".repeat(120) })
                .to_string(),
        headers: Default::default(),
    });
    uow.commit().await?;
    Ok(())
}

/// Writers' run: `WRITERS` clients committing for `duration` (or until
/// `stop` is set); returns commits/s and the commit latencies (ms).
async fn writers(
    pool: &PgPool,
    topic: &str,
    duration: Duration,
    stop: Option<Arc<tokio::sync::Notify>>,
) -> Result<(f64, Vec<f64>), Box<dyn std::error::Error>> {
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + duration;
    let stopped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = stop.map(|stop| {
        let stopped = stopped.clone();
        tokio::spawn(async move {
            stop.notified().await;
            stopped.store(true, Ordering::Relaxed);
        })
    });
    let mut tasks = Vec::new();
    for _ in 0..WRITERS {
        let (pool, topic, done, stopped) = (
            pool.clone(),
            topic.to_owned(),
            done.clone(),
            stopped.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while Instant::now() < deadline && !stopped.load(Ordering::Relaxed) {
                let i = done.fetch_add(1, Ordering::Relaxed);
                let t = Instant::now();
                commit(&pool, &topic, i).await?;
                latencies.push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok::<_, outbox_core::Error>(latencies)
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await??);
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(w) = watcher {
        w.abort();
    }
    Ok((latencies.len() as f64 / secs, latencies))
}

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    seq: u64,
    amount_cents: i64,
    note: String,
}

impl DomainEvent for OrderPlaced {
    const TOPIC: &'static str = CONSUME_TOPIC;
    const AGGREGATE_TYPE: &'static str = "Order";
    const EVENT_TYPES: &'static [&'static str] = &["OrderPlaced"];
    fn event_type(&self) -> &'static str {
        "OrderPlaced"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
}

/// The dedup consumer's topic (the handler's event names it), recreated
/// for each history size.
const CONSUME_TOPIC: &str = "growth-consume";

async fn reset_topic(brokers: &str) -> Result<(), Box<dyn std::error::Error>> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let _ = admin.delete_topics(&[CONSUME_TOPIC], &options).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let created =
            outbox_runtime::kafka::create_topics(brokers, &[], &[CONSUME_TOPIC.to_owned()], 4, 1)
                .await?;
        if created.iter().all(|(_, new)| *new) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("could not recreate the consumer's topic".into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The dedup consumer's trivial handler.
struct Count;

impl InboxHandler for Count {
    type Event = OrderPlaced;
    const NAME: &'static str = "count";

    fn handle<'a, 'c>(
        &'a self,
        _ctx: &'a mut HandlerContext<'c>,
        event: OrderPlaced,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            std::hint::black_box(&event);
            Ok(())
        })
    }
}

/// Produces `n` messages to `topic` as the relay would.
async fn produce(brokers: &str, topic: &str, n: u64) -> Result<(), Box<dyn std::error::Error>> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .set("batch.num.messages", "10000")
        .create()?;
    let mut pending = Vec::with_capacity(n as usize);
    for seq in 0..n {
        let key = format!("order-{}", seq % 1000);
        let event_id = Uuid::now_v7().to_string();
        let payload = json!({
            "order_id": key, "seq": seq, "amount_cents": 1999, "note": "x".repeat(120)
        })
        .to_string();
        let mut headers = OwnedHeaders::new_with_capacity(6);
        for (k, v) in [
            ("event_id", event_id.as_str()),
            ("event_type", "OrderPlaced"),
            ("event_version", "1"),
            ("aggregate_type", "Order"),
            ("aggregate_id", key.as_str()),
            ("content-type", "application/json"),
        ] {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(headers);
        pending.push(common::queue(&producer, record).await);
    }
    common::delivered(pending).await?;
    Ok(())
}

/// The dedup consumer's events/s, from its first processed event to the
/// `n`th (the group join left out).
async fn consume(
    pool: &PgPool,
    brokers: &str,
    group: &str,
    n: u64,
    timeout: Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let handle = Consumer::builder(pool.clone())
        .group(group)
        .brokers(brokers)
        .handler(Count)
        .spawn()?;
    let spawned = Instant::now();
    let mut first: Option<(Instant, u64)> = None;
    loop {
        let processed = handle.counts().processed;
        if first.is_none() && processed > 0 {
            first = Some((Instant::now(), processed));
        }
        if processed >= n {
            break;
        }
        if spawned.elapsed() > timeout {
            handle.shutdown().await?;
            return Err(format!("the consumer processed {processed} of {n} in {timeout:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (t, at_first) = first.expect("processed");
    let rate = (n - at_first) as f64 / t.elapsed().as_secs_f64();
    handle.shutdown().await?;
    Ok(rate)
}

/// Runs of each timed operation (`--runs`).
static RUNS: AtomicU64 = AtomicU64::new(3);

/// The median of `--runs` timed runs of `op`, in ms.
async fn timed<F, Fut, T>(mut op: F) -> Result<f64, outbox_runtime::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, outbox_runtime::Error>>,
{
    let mut times = Vec::new();
    for _ in 0..RUNS.load(Ordering::Relaxed).max(1) {
        let t = Instant::now();
        std::hint::black_box(op().await?);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The operations' latencies (ms, medians): `status`, the gauges' backlog
/// query, replay's dry run (one day, 30 days ago) and a cleanup pass with
/// nothing to delete.
async fn operations(pool: &PgPool) -> Result<[f64; 4], Box<dyn std::error::Error>> {
    let status_ms = timed(|| ops::status(pool)).await?;
    let gauges_ms = timed(|| async {
        let row: (i64, Option<f64>, i64, i64) = sqlx::query_as(ops::GAUGES_SQL)
            .fetch_one(pool)
            .await
            .map_err(outbox_runtime::Error::from)?;
        Ok::<_, outbox_runtime::Error>(row)
    })
    .await?;
    let (since, until): (DateTime<Utc>, DateTime<Utc>) =
        sqlx::query_as("SELECT now() - interval '30 days', now() - interval '29 days'")
            .fetch_one(pool)
            .await?;
    let filter = ReplayFilter {
        since: Some(since),
        until: Some(until),
        ..ReplayFilter::default()
    };
    let window = cleanup::DEFAULT_DEDUP_WINDOW;
    let replay_ms = timed(|| replay::selection(pool, &filter, window)).await?;
    // Older than the history: the pass finds nothing to delete.
    let idle_retention = Retention::new(Duration::from_secs(365 * 86400));
    let cleanup_ms = timed(|| cleanup::cleanup(pool, &idle_retention)).await?;
    Ok([status_ms, gauges_ms, replay_ms, cleanup_ms])
}

/// The plans of replay's selection of one day, 30 days ago (the id range
/// through the BRIN index, then the count over the primary key), run.
async fn explain_replay(pool: &PgPool) -> Result<(), sqlx::Error> {
    let range =
        "created_at >= now() - interval '30 days' AND created_at < now() - interval '29 days'";
    let (low, high): (Option<i64>, Option<i64>) = sqlx::query_as(&format!(
        "SELECT min(id), max(id) FROM (SELECT id FROM outbox_event WHERE {range} OFFSET 0) AS r"
    ))
    .fetch_one(pool)
    .await?;
    for sql in [
        format!(
            "SELECT min(id), max(id) FROM (SELECT id FROM outbox_event WHERE {range} OFFSET 0) AS r"
        ),
        format!(
            "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL AND id >= {} \
             AND id <= {} AND {range}",
            low.unwrap_or(1),
            high.unwrap_or(0)
        ),
    ] {
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, COSTS OFF) {sql}"))
            .fetch_all(pool)
            .await?;
        println!("{}", plan.join("\n"));
    }
    Ok(())
}

/// The load average (1, 5, 15 minutes), as `/proc/loadavg` says.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// `--only-ops` at one history size: the operations with an empty backlog,
/// then with `n` rows waiting (half of them held).
async fn ops_only(
    pool: &PgPool,
    history: i64,
    n: i64,
    topic: &str,
    last: i64,
) -> Result<Value, Box<dyn std::error::Error>> {
    let mut rounds = Vec::new();
    for backlog_rows in [0, n] {
        if backlog_rows > 0 {
            backlog(pool, backlog_rows, topic).await?;
            sqlx::query(
                "UPDATE outbox_event SET held_until = now() + interval '1 hour'
                 WHERE id > $1 AND id % 2 = 0",
            )
            .bind(last)
            .execute(pool)
            .await?;
            sqlx::query("VACUUM ANALYZE outbox_event")
                .execute(pool)
                .await?;
            checkpoint(pool).await;
        }
        let load_before = load();
        let [status_ms, gauges_ms, replay_ms, cleanup_ms] = operations(pool).await?;
        let load_after = load();
        println!(
            "history {history}, backlog {backlog_rows}: status {status_ms:.1} ms, gauges' query \
             {gauges_ms:.1} ms, replay --dry-run (1 day, 30 days ago) {replay_ms:.1} ms, cleanup \
             pass (nothing to delete) {cleanup_ms:.1} ms (load average {load_before} -> {load_after})"
        );
        rounds.push(json!({
            "backlog": backlog_rows,
            "status_ms": round(status_ms, 2),
            "gauges_ms": round(gauges_ms, 2),
            "replay_dry_run_ms": round(replay_ms, 2),
            "cleanup_idle_pass_ms": round(cleanup_ms, 2),
            "load_average": load_after,
        }));
    }
    explain_replay(pool).await?;
    reset(pool, last).await?;
    Ok(json!({ "history": history, "ops": rounds }))
}

/// Writers beside a relay draining a large backlog, at each rate limit of
/// `--relay-rates`: one JSON row each.
#[allow(clippy::too_many_arguments)]
async fn writers_curve(
    url: &str,
    pool: &PgPool,
    writers_pool: &PgPool,
    brokers: &str,
    topic: &str,
    a: &Args,
    last: i64,
    alone_rate: f64,
    alone_p99: f64,
) -> Result<Vec<Value>, Box<dyn std::error::Error>> {
    let (seconds, timeout) = (
        Duration::from_secs_f64(a.seconds),
        Duration::from_secs(a.timeout),
    );
    let mut curve = Vec::new();
    for &rate in &a.relay_rates {
        let (with_relay_rate, relay_rate, lasted, profiled) = writers_beside_relay(
            url,
            pool,
            writers_pool,
            brokers,
            topic,
            a.large_backlog,
            rate,
            seconds,
            timeout,
        )
        .await?;
        println!(
            "writers alone {alone_rate:.0} commits/s (p99 {alone_p99:.1} ms); while the relay \
             (limit {}) drains {with_relay_rate:.0} commits/s = {:.2} x, relay meanwhile \
             {relay_rate:.0} events/s{}",
            if rate == 0 {
                "none".to_owned()
            } else {
                format!("{rate}/s")
            },
            with_relay_rate / alone_rate,
            if lasted {
                ""
            } else {
                " (the backlog ran out during the run)"
            }
        );
        curve.push(json!({
            "relay_rate_limit": rate,
            "writers_commits_per_s": round(with_relay_rate, 0),
            "ratio": round(with_relay_rate / alone_rate, 2),
            "relay_events_per_s": round(relay_rate, 0),
            "profile": profiled,
        }));
        reset(pool, last).await?;
    }
    Ok(curve)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    RUNS.store(a.runs as u64, Ordering::Relaxed);
    let claims = ClaimTimes::default();
    tracing_subscriber::registry()
        .with(tracing_subscriber::Layer::with_filter(
            claims.clone(),
            tracing_subscriber::filter::Targets::new()
                .with_target("outbox_runtime::relay", tracing::Level::TRACE),
        ))
        .with(tracing_subscriber::Layer::with_filter(
            tracing_subscriber::fmt::layer().with_writer(std::io::stderr),
            tracing_subscriber::EnvFilter::try_from_env("BENCH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        ))
        .init();

    let brokers = common::brokers();
    let db = common::BenchDb::open("outbox_growth", 20, a.keep).await?;
    let pool = db.pool.clone();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS growth_order (id uuid PRIMARY KEY, amount_cents bigint NOT NULL)",
    )
        .execute(&pool)
        .await?;
    let writers_pool = pool_named(&db.url, WRITERS as u32, profile::WRITERS_APP).await?;

    let run = Uuid::new_v4().simple().to_string();
    let topic = format!("growth-drain-{run}");
    let missing = format!("growth-missing-{run}");
    if !a.only_ops {
        outbox_runtime::kafka::create_topics(&brokers, &[], std::slice::from_ref(&topic), 4, 1)
            .await?;
    }

    let timeout = Duration::from_secs(a.timeout);
    let seconds = Duration::from_secs_f64(a.seconds);
    println!(
        "growth benchmark: history {:?}, backlog {}, held {}, large backlog {}, {} s writers' runs",
        a.history, a.backlog, a.held, a.large_backlog, a.seconds
    );
    let mut results = Vec::new();
    for (level, &history) in a.history.iter().enumerate() {
        // A group of its own per size: its dedup rows are the history.
        let group = format!("growth-dedup-{run}-{level}");
        let t = Instant::now();
        let kept: i64 = if a.keep {
            sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL")
                .fetch_one(&pool)
                .await?
        } else {
            -1
        };
        let last = if kept == history {
            let last = last_id(&pool).await?;
            reset(&pool, last).await?;
            last
        } else {
            fill(&pool, history, a.chunk.max(1), &group, a.dedup_every.max(1)).await?
        };
        let fill_s = t.elapsed().as_secs_f64();
        let size: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('outbox_event')")
            .fetch_one(&pool)
            .await?;
        println!(
            "\n== history {history}: filled in {fill_s:.0} s (outbox_event {:.0} MiB)",
            size as f64 / 1048576.0
        );

        if a.only_ops {
            results.push(ops_only(&pool, history, a.ops_backlog, &topic, last).await?);
            continue;
        }
        if a.only_writers_relay {
            writers(&writers_pool, &topic, Duration::from_millis(500), None).await?;
            reset(&pool, last).await?;
            let (alone_rate, alone_lat) = writers(&writers_pool, &topic, seconds, None).await?;
            reset(&pool, last).await?;
            let curve = writers_curve(
                &db.url,
                &pool,
                &writers_pool,
                &brokers,
                &topic,
                &a,
                last,
                alone_rate,
                p99(alone_lat),
            )
            .await?;
            results.push(json!({
                "history": history,
                "writers_alone_commits_per_s": round(alone_rate, 0),
                "writers_beside_relay": curve,
            }));
            continue;
        }
        // Operations.
        let status_ms = timed(|| ops::status(&pool)).await?;
        let (since, until): (DateTime<Utc>, DateTime<Utc>) =
            sqlx::query_as("SELECT now() - interval '30 days', now() - interval '29 days'")
                .fetch_one(&pool)
                .await?;
        let filter = ReplayFilter {
            since: Some(since),
            until: Some(until),
            ..ReplayFilter::default()
        };
        let window = cleanup::DEFAULT_DEDUP_WINDOW;
        let replay_ms = timed(|| replay::selection(&pool, &filter, window)).await?;
        // Older than the history: the pass finds nothing to delete.
        let idle_retention = Retention::new(Duration::from_secs(365 * 86400));
        let cleanup_ms = timed(|| cleanup::cleanup(&pool, &idle_retention)).await?;
        println!(
            "status {status_ms:.1} ms, replay --dry-run (1 day, 30 days ago) {replay_ms:.1} ms, \
             cleanup pass (nothing to delete) {cleanup_ms:.1} ms"
        );

        // The relay's drain.
        if a.progress {
            // Positions taken now: the history was written by marks, after
            // an earlier history's positions (rows the progress mode would
            // have passed, not marked, in a real outbox).
            sqlx::query("DELETE FROM outbox_progress")
                .execute(&pool)
                .await?;
            outbox_runtime::relay::progress::enable(&pool).await?;
        }
        backlog(&pool, a.backlog, &topic).await?;
        let (drain_rate, claim_p99, drained, _) =
            drain(&db.url, &brokers, a.backlog as u64, &claims, timeout).await?;
        println!(
            "relay drain {drain_rate:.0} events/s, claim p99 {claim_p99:.1} ms{}",
            if drained {
                ""
            } else {
                " (not drained in time)"
            }
        );
        reset(&pool, last).await?;

        // The same behind rows of a missing topic.
        backlog(&pool, a.held, &missing).await?;
        backlog(&pool, a.backlog, &topic).await?;
        let (held_rate, held_p99, held_drained, held_wall) =
            drain(&db.url, &brokers, a.backlog as u64, &claims, timeout).await?;
        println!(
            "relay drain with {} held rows {held_rate:.0} events/s ({held_wall:.0} from the \
             relay's start), claim p99 {held_p99:.1} ms{}",
            a.held,
            if held_drained {
                ""
            } else {
                " (not drained in time)"
            }
        );
        reset(&pool, last).await?;
        if a.only_drains {
            results.push(json!({
                "history": history,
                "mode": if a.progress { "progress" } else { "marks" },
                "relay_drain_events_per_s": round(drain_rate, 0),
                "claim_p99_ms": round(claim_p99, 2),
                "held_relay_drain_events_per_s": round(held_rate, 0),
                "held_relay_drain_from_start_events_per_s": round(held_wall, 0),
                "held_relay_drained": held_drained,
                "held_claim_p99_ms": round(held_p99, 2),
            }));
            continue;
        }

        // Unit of Work commits/s, after a warm-up (connections, statements).
        writers(&writers_pool, &topic, Duration::from_millis(500), None).await?;
        reset(&pool, last).await?;
        let (uow_rate, uow_lat) = writers(&writers_pool, &topic, seconds, None).await?;
        println!(
            "Unit of Work (1 event, {WRITERS} clients) {uow_rate:.0} commits/s, p99 {:.1} ms",
            p99(uow_lat)
        );
        reset(&pool, last).await?;

        // The dedup consumer.
        reset_topic(&brokers).await?;
        produce(&brokers, CONSUME_TOPIC, a.consume).await?;
        let dedup_rate = consume(&pool, &brokers, &group, a.consume, timeout).await?;
        println!("dedup consumer {dedup_rate:.0} events/s");
        reset(&pool, last).await?;

        // Writers alone, then while a relay drains a large backlog (at
        // each rate limit).
        let (alone_rate, alone_lat) = writers(&writers_pool, &topic, seconds, None).await?;
        let alone_p99 = p99(alone_lat);
        reset(&pool, last).await?;
        let curve = writers_curve(
            &db.url,
            &pool,
            &writers_pool,
            &brokers,
            &topic,
            &a,
            last,
            alone_rate,
            alone_p99,
        )
        .await?;
        let with_relay_rate = curve[0]["writers_commits_per_s"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let relay_rate = curve[0]["relay_events_per_s"].as_f64().unwrap_or(f64::NAN);
        // Writers while a cleanup deletes the history (last: it empties it;
        // stopped after `cleanup_seconds`).
        let (during_p99, cleanup_rows, cleanup_s) = if history > 0 {
            let before = history_rows(&pool, last).await?;
            let stop = Arc::new(tokio::sync::Notify::new());
            let job = {
                let (pool, stop) = (pool.clone(), stop.clone());
                tokio::spawn(async move {
                    let retention = Retention::new(cleanup::DEFAULT_DEDUP_WINDOW);
                    let report = cleanup::cleanup(&pool, &retention).await;
                    stop.notify_one();
                    report
                })
            };
            let t = Instant::now();
            let cap = Duration::from_secs_f64(a.cleanup_seconds);
            let (_, lat) = writers(&writers_pool, &topic, cap, Some(stop)).await?;
            let took = t.elapsed().as_secs_f64();
            if job.is_finished() {
                job.await??;
            } else {
                job.abort();
                let _ = job.await;
            }
            let left = history_rows(&pool, last).await?;
            (p99(lat), (before - left) as f64, took)
        } else {
            (f64::NAN, 0.0, 0.0)
        };
        println!(
            "writers' commit p99 while a cleanup runs ({cleanup_rows:.0} rows deleted in {cleanup_s:.1} s): \
             {during_p99:.1} ms = {:.2} x alone",
            during_p99 / alone_p99
        );

        results.push(json!({
            "history": history,
            "fill_s": round(fill_s, 1),
            "outbox_event_mib": round(size as f64 / 1048576.0, 0),
            "relay_drain_events_per_s": round(drain_rate, 0),
            "relay_drained": drained,
            "claim_p99_ms": round(claim_p99, 2),
            "held_relay_drain_events_per_s": round(held_rate, 0),
            "held_relay_drained": held_drained,
            "held_relay_drain_from_start_events_per_s": round(held_wall, 0),
            "held_claim_p99_ms": round(held_p99, 2),
            "uow_commits_per_s": round(uow_rate, 0),
            "dedup_events_per_s": round(dedup_rate, 0),
            "status_ms": round(status_ms, 2),
            "replay_dry_run_ms": round(replay_ms, 2),
            "cleanup_idle_pass_ms": round(cleanup_ms, 2),
            "writers_alone_commits_per_s": round(alone_rate, 0),
            "writers_alone_p99_ms": round(alone_p99, 2),
            "writers_with_relay_commits_per_s": round(with_relay_rate, 0),
            "relay_during_writers_events_per_s": round(relay_rate, 0),
            "writers_beside_relay": curve,
            "writers_during_cleanup_p99_ms": round(during_p99, 2),
            "cleanup_rows": cleanup_rows,
            "cleanup_s": round(cleanup_s, 1),
        }));
    }

    if a.only_ops {
        println!();
        println!(
            "| history | backlog | status ms | gauges' query ms | replay dry run ms | cleanup pass ms | load average |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---|");
        for r in &results {
            for o in r["ops"].as_array().into_iter().flatten() {
                let f = |k: &str| o[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
                    r["history"],
                    o["backlog"],
                    f("status_ms"),
                    f("gauges_ms"),
                    f("replay_dry_run_ms"),
                    f("cleanup_idle_pass_ms"),
                    o["load_average"].as_str().unwrap_or_default(),
                );
            }
        }
        let json = json!({ "benchmark": "growth", "only_ops": true, "results": results });
        println!("{json}");
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        }
        writers_pool.close().await;
        if !a.keep {
            db.drop_database().await?;
        }
        return Ok(());
    }

    // The growth table: each rate beside its ratio to the smallest size's
    // (`--history 10000000,0 --keep` measures a kept history first, then
    // empties it for the baseline).
    let base = results
        .iter()
        .min_by_key(|r| r["history"].as_i64().unwrap_or(i64::MAX))
        .expect("at least one history size");
    let ratio = |r: &Value, k: &str| {
        let (x, b) = (
            r[k].as_f64().unwrap_or(f64::NAN),
            base[k].as_f64().unwrap_or(f64::NAN),
        );
        format!("{x:.0} ({:.2})", x / b)
    };
    println!();
    println!(
        "| history | drain ev/s | claim p99 ms | drain, {} held | claim p99, held | UoW commits/s | dedup ev/s | status ms | replay dry-run ms | cleanup pass ms | writers p99 alone / during cleanup ms | writers commits/s alone / relay draining (relay ev/s) |",
        a.held
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &results {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {:.1} | {} | {:.1} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} / {:.1} ({:.2}) | {:.0} / {:.0} ({:.2}; {:.0}) |",
            r["history"],
            ratio(r, "relay_drain_events_per_s"),
            f("claim_p99_ms"),
            ratio(r, "held_relay_drain_events_per_s"),
            f("held_claim_p99_ms"),
            ratio(r, "uow_commits_per_s"),
            ratio(r, "dedup_events_per_s"),
            f("status_ms"),
            f("replay_dry_run_ms"),
            f("cleanup_idle_pass_ms"),
            f("writers_alone_p99_ms"),
            f("writers_during_cleanup_p99_ms"),
            f("writers_during_cleanup_p99_ms") / f("writers_alone_p99_ms"),
            f("writers_alone_commits_per_s"),
            f("writers_with_relay_commits_per_s"),
            f("writers_with_relay_commits_per_s") / f("writers_alone_commits_per_s"),
            f("relay_during_writers_events_per_s"),
        );
    }
    let json = json!({
        "benchmark": "growth",
        "backlog": a.backlog,
        "held": a.held,
        "large_backlog": a.large_backlog,
        "consume": a.consume,
        "seconds": a.seconds,
        "results": results,
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    writers_pool.close().await;
    if !a.keep {
        db.drop_database().await?;
    }
    Ok(())
}
