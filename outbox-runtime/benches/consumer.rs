//! Consumer benchmark: a topic preloaded with N ~200-byte messages carrying
//! the relay's headers, read in the same run by (a) a raw rdkafka consumer
//! (the limit), (b) the consumer in dedup mode with a trivial handler, (c)
//! the consumer in inbox mode storing only (no processor), and (d) the inbox
//! processor applying what (c) stored; then (e) and (f), the same two for a
//! group whose processor is in the progress mode (a position per partition
//! and round instead of a mark per row). Printed for (d) and (f): the WAL
//! and the row versions made dead per event processed.
//!
//! `cargo bench -p outbox-runtime --bench consumer -- [--events N] [--batch N] [--writers N] [-X key=value]... [--json PATH]`
//!
//! `-X` passes a librdkafka setting to every consumer (raw and ours).
//!
//! Needs PostgreSQL (DATABASE_URL names the server; the benchmark creates
//! its own database `outbox_bench_consumer`) and a broker (KAFKA_BROKERS).
//! Each stage uses a fresh consumer group and starts at the beginning of the
//! topic; rates are from start (group join included) to the last event.

mod common;

use clap::Parser;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, ConsumerHandle, Mode};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Headers as _, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

const TOPIC: &str = "bench-consumer-orders";
const PARTITIONS: i32 = 4;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// Messages produced and consumed per stage.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// Messages per consumer batch.
    #[arg(long, default_value_t = 2000)]
    batch: usize,
    /// Inbox-mode writer connections.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// A librdkafka setting for the consumers, `key=value` (repeatable).
    #[arg(short = 'X', value_name = "KEY=VALUE", value_parser = setting)]
    settings: Vec<(String, String)>,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn setting(s: &str) -> Result<(String, String), String> {
    outbox_runtime::kafka::parse_setting(s).map_err(|e| e.to_string())
}

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    seq: u64,
    amount_cents: i64,
    note: String,
}

impl DomainEvent for OrderPlaced {
    const TOPIC: &'static str = TOPIC;
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

/// The trivial handler: counts.
struct Count(Arc<AtomicU64>);

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
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }
}

/// Produces `n` messages as the relay would: key, ~200-byte JSON payload,
/// identity and correlation headers.
async fn preload(brokers: &str, n: u64) -> Result<f64, Box<dyn std::error::Error>> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .set("batch.num.messages", "10000")
        .create()?;
    let start = Instant::now();
    let mut pending = Vec::with_capacity(n as usize);
    for seq in 0..n {
        let key = format!("order-{}", seq % 1000);
        let event_id = Uuid::now_v7().to_string();
        let correlation = Uuid::now_v7().to_string();
        let payload = serde_json::json!({
            "order_id": key, "seq": seq, "amount_cents": 1999, "note": "x".repeat(120)
        })
        .to_string();
        let headers = common::identity_headers(&event_id, "OrderPlaced")
            .insert(Header {
                key: "aggregate_type",
                value: Some("Order".as_bytes()),
            })
            .insert(Header {
                key: "aggregate_id",
                value: Some(key.as_bytes()),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json".as_bytes()),
            })
            .insert(Header {
                key: "correlation_id",
                value: Some(correlation.as_bytes()),
            });
        let record = FutureRecord::to(TOPIC)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(headers);
        pending.push(common::queue(&producer, record).await);
    }
    common::delivered(pending).await?;
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// (a) A raw consumer-group member: subscribe, poll until `n` messages
/// (headers and payload touched), join included.
fn raw_consume(brokers: &str, n: u64, settings: &[(String, String)]) -> Result<f64, String> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("bench-raw-{}", Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest");
    for (k, v) in settings {
        config.set(k, v);
    }
    let consumer: BaseConsumer = config.create().map_err(|e| e.to_string())?;
    let start = Instant::now();
    consumer.subscribe(&[TOPIC]).map_err(|e| e.to_string())?;
    let mut seen = 0_u64;
    let mut bytes = 0_usize;
    while seen < n {
        if start.elapsed() > Duration::from_secs(300) {
            return Err(format!("raw consumer read only {seen} of {n} in 300 s"));
        }
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            bytes +=
                m.payload().map_or(0, <[u8]>::len) + m.headers().map_or(0, |h| h.iter().count());
            seen += 1;
        }
    }
    std::hint::black_box(bytes);
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Waits until `done(counts)` holds; returns the elapsed time since `start`.
async fn wait(
    handle: &ConsumerHandle,
    start: Instant,
    what: &str,
    done: impl Fn(&outbox_runtime::ConsumerCounts) -> bool,
) -> Result<Duration, Box<dyn std::error::Error>> {
    loop {
        let counts = handle.counts();
        if done(&counts) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(600) {
            return Err(format!("{what} did not finish within 600 s: {counts:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn consumer(
    pool: &PgPool,
    brokers: &str,
    group: &str,
    a: &Args,
) -> outbox_runtime::ConsumerBuilder {
    a.settings.iter().fold(
        Consumer::builder(pool.clone())
            .group(group)
            .brokers(brokers)
            .batch_size(a.batch),
        |c, (k, v)| c.kafka_setting(k, v),
    )
}

/// WAL written so far, in bytes.
async fn wal(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// Row versions of `inbox_event` made dead so far (updated or deleted), as
/// the statistics say once the sessions flushed them (they do at most once
/// a second: read after a pause).
async fn dead(pool: &PgPool) -> i64 {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sqlx::query_scalar(
        "SELECT (n_tup_upd + n_tup_del)::int8 FROM pg_stat_user_tables WHERE relname = 'inbox_event'",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let brokers = common::brokers();
    let db = common::BenchDb::create("outbox_bench_consumer", 8).await?;
    let pool = db.pool.clone();

    println!(
        "consumer benchmark: {} events of ~200 bytes on {PARTITIONS} partitions, batch {}, inbox writers {}",
        a.events, a.batch, a.writers
    );
    common::recreate_topic(&brokers, TOPIC, PARTITIONS).await?;
    let produce_rate = preload(&brokers, a.events).await?;
    println!("preload (idempotent producer)       {produce_rate:>10.0} msg/s");

    // (a) The raw consumer.
    let raw_rate = {
        let (brokers, settings) = (brokers.clone(), a.settings.clone());
        let n = a.events;
        tokio::task::spawn_blocking(move || raw_consume(&brokers, n, &settings)).await??
    };
    println!("(a) raw rdkafka consumer            {raw_rate:>10.0} msg/s");

    // (b) Dedup mode, trivial handler.
    let handled = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handle = consumer(&pool, &brokers, "bench-dedup", &a)
        .handler(Count(handled.clone()))
        .spawn()?;
    let n = a.events;
    let took = wait(&handle, start, "dedup", |c| c.processed >= n).await?;
    let dedup_counts = handle.counts();
    handle.shutdown().await?;
    let dedup_rate = a.events as f64 / took.as_secs_f64();
    let dedup_batch = a.events as f64 / dedup_counts.batches.max(1) as f64;
    println!(
        "(b) dedup mode, trivial handler     {dedup_rate:>10.0} events/s   = {:.2} x raw  (mean batch {dedup_batch:.0})",
        dedup_rate / raw_rate
    );
    assert_eq!(handled.load(Ordering::Relaxed), a.events);

    // (c) Inbox mode, storing only.
    let start = Instant::now();
    let handle = consumer(&pool, &brokers, "bench-inbox", &a)
        .mode(Mode::Inbox)
        .writers(a.writers)
        .processors(0)
        .handler(Count(Arc::default()))
        .spawn()?;
    let took = wait(&handle, start, "inbox ingest", |c| c.stored >= n).await?;
    let ingest_counts = handle.counts();
    handle.shutdown().await?;
    let ingest_rate = a.events as f64 / took.as_secs_f64();
    let ingest_batch = a.events as f64 / ingest_counts.batches.max(1) as f64;
    println!(
        "(c) inbox mode, storing only        {ingest_rate:>10.0} events/s   = {:.2} x raw  (mean batch {ingest_batch:.0})",
        ingest_rate / raw_rate
    );

    // (d) The inbox processor, on what (c) stored (offsets are committed:
    // nothing is read from Kafka again).
    sqlx::query("VACUUM ANALYZE inbox_event")
        .execute(&pool)
        .await?;
    let processed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handle = consumer(&pool, &brokers, "bench-inbox", &a)
        .mode(Mode::Inbox)
        .processor_batch_size(a.batch)
        .handler(Count(processed.clone()))
        .spawn()?;
    let (wal0, dead0) = (wal(&pool).await, dead(&pool).await);
    let took = wait(&handle, start, "inbox processing", |c| c.processed >= n).await?;
    let reread = handle.counts().received;
    handle.shutdown().await?;
    let process_rate = a.events as f64 / took.as_secs_f64();
    let (process_wal, process_dead) = (
        (wal(&pool).await - wal0) as f64 / a.events as f64,
        (dead(&pool).await - dead0) as f64 / a.events as f64,
    );
    println!(
        "(d) inbox processor, trivial handler {process_rate:>9.0} events/s   = {:.2} x ingest  \
         (WAL {process_wal:.0} B/event, {process_dead:.2} dead row versions/event, messages read again: {reread})",
        process_rate / ingest_rate
    );

    // (e) and (f): a group whose processor is in the progress mode.
    let group = "bench-inbox-progress";
    outbox_runtime::inbox::progress::enable(&pool, group).await?;
    sqlx::query("VACUUM ANALYZE inbox_event")
        .execute(&pool)
        .await?;
    let start = Instant::now();
    let handle = consumer(&pool, &brokers, group, &a)
        .mode(Mode::Inbox)
        .writers(a.writers)
        .processors(0)
        .handler(Count(Arc::default()))
        .spawn()?;
    let took = wait(&handle, start, "inbox ingest (progress mode)", |c| {
        c.stored >= n
    })
    .await?;
    handle.shutdown().await?;
    let ingest_progress_rate = a.events as f64 / took.as_secs_f64();
    println!(
        "(e) inbox ingest, progress mode     {ingest_progress_rate:>10.0} events/s   = {:.2} x raw",
        ingest_progress_rate / raw_rate
    );
    sqlx::query("VACUUM ANALYZE inbox_event")
        .execute(&pool)
        .await?;
    let processed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handle = consumer(&pool, &brokers, group, &a)
        .mode(Mode::Inbox)
        .processor_batch_size(a.batch)
        .handler(Count(processed.clone()))
        .spawn()?;
    let (wal0, dead0) = (wal(&pool).await, dead(&pool).await);
    let took = wait(&handle, start, "inbox processing (progress mode)", |c| {
        c.processed >= n
    })
    .await?;
    handle.shutdown().await?;
    let progress_rate = a.events as f64 / took.as_secs_f64();
    let (progress_wal, progress_dead) = (
        (wal(&pool).await - wal0) as f64 / a.events as f64,
        (dead(&pool).await - dead0) as f64 / a.events as f64,
    );
    println!(
        "(f) inbox processor, progress mode  {progress_rate:>10.0} events/s   = {:.2} x ingest (e)  \
         (WAL {progress_wal:.0} B/event, {progress_dead:.2} dead row versions/event)",
        progress_rate / ingest_progress_rate
    );

    let json = serde_json::json!({
        "benchmark": "consumer",
        "events": a.events,
        "batch": a.batch,
        "inbox_writers": a.writers,
        "partitions": PARTITIONS,
        "preload_msgs_per_s": produce_rate.round(),
        "raw_consumer_msgs_per_s": raw_rate.round(),
        "dedup_events_per_s": dedup_rate.round(),
        "dedup_over_raw": ((dedup_rate / raw_rate) * 1000.0).round() / 1000.0,
        "dedup_mean_batch": dedup_batch.round(),
        "inbox_ingest_events_per_s": ingest_rate.round(),
        "inbox_ingest_over_raw": ((ingest_rate / raw_rate) * 1000.0).round() / 1000.0,
        "inbox_ingest_mean_batch": ingest_batch.round(),
        "inbox_process_events_per_s": process_rate.round(),
        "inbox_process_over_ingest": ((process_rate / ingest_rate) * 1000.0).round() / 1000.0,
        "inbox_process_wal_bytes_per_event": process_wal.round(),
        "inbox_process_dead_versions_per_event": (process_dead * 100.0).round() / 100.0,
        "progress_ingest_events_per_s": ingest_progress_rate.round(),
        "progress_process_events_per_s": progress_rate.round(),
        "progress_process_over_ingest": ((progress_rate / ingest_progress_rate) * 1000.0).round() / 1000.0,
        "progress_process_wal_bytes_per_event": progress_wal.round(),
        "progress_process_dead_versions_per_event": (progress_dead * 100.0).round() / 100.0,
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    db.drop_database().await?;
    Ok(())
}
