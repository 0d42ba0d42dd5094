//! Relay benchmark: drain a preloaded outbox to the broker, and in the same
//! run the two limits it works against: (a) the same claim + mark SQL with no
//! broker, (b) the raw idempotent producer with the same messages and no
//! database. Then commit→consumed latency at a steady rate, and the relay
//! process's peak RSS.
//!
//! `cargo bench -p outbox-cli --bench relay -- [--events N] [--batch N] [--rate N] [--seconds S] [--json PATH]`
//!
//! Needs PostgreSQL (DATABASE_URL names the server; the benchmark creates
//! its own database `outbox_bench_relay`) and a broker (KAFKA_BROKERS).

#[path = "../../outbox-runtime/benches/common/mod.rs"]
mod common;

use clap::Parser;
use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{OutboxMessage, UnitOfWork};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use uuid::Uuid;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// Rows preloaded and drained.
    #[arg(long, default_value_t = 200_000)]
    events: i64,
    /// Rows per claim.
    #[arg(long, default_value_t = 2000)]
    batch: i64,
    /// Events per second of the latency run.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Length of the latency run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

const PRELOAD: &str = "\
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, topic, partition_key, payload, headers)
SELECT {uuid}, 'Order', 'order-' || (g % 1000), 'OrderPlaced', $2, 'order-' || (g % 1000),
       jsonb_build_object('order_id', 'order-' || (g % 1000), 'seq', g, 'amount_cents', 1999,
                          'note', repeat('x', 120)),
       jsonb_build_object('correlation_id', gen_random_uuid())
FROM generate_series(1, $1) AS g";

async fn preload(pool: &PgPool, n: i64, topic: &str) -> Result<(), sqlx::Error> {
    sqlx::query("TRUNCATE outbox_event").execute(pool).await?;
    sqlx::query(&PRELOAD.replace("{uuid}", common::UUID_V7_SQL))
        .bind(n)
        .bind(topic)
        .execute(pool)
        .await?;
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await?;
    // Every timed phase starts right after a checkpoint: otherwise one
    // triggered by the WAL of the earlier phases (max_wal_size) lands in
    // whichever phase happens to be running, and the phases are not
    // comparable (measured: relay 68-99k events/s over three runs).
    checkpoint(pool).await;
    Ok(())
}

/// Flushes the WAL written so far (when the role may).
async fn checkpoint(pool: &PgPool) {
    if let Err(error) = sqlx::query("CHECKPOINT").execute(pool).await {
        eprintln!("(CHECKPOINT not allowed: {error}; a phase may include one)");
    }
}

/// (a) The relay's claim + mark statements alone, no broker.
async fn sql_only(pool: &PgPool, batch: i64) -> Result<f64, sqlx::Error> {
    let start = Instant::now();
    let mut total = 0_usize;
    loop {
        let mut tx = pool.begin().await?;
        type Claimed = (
            i64,
            Uuid,
            String,
            String,
            String,
            String,
            i32,
            String,
            String,
            String,
            i32,
            String,
        );
        // The relay's claim: rows and bytes bounded (its default 16 MiB).
        let rows: Vec<Claimed> = sqlx::query_as(
            "SELECT id, event_id, aggregate_type, aggregate_id, event_type, topic, event_version,
                    partition_key, payload, headers, attempts, tid
             FROM (
               SELECT b.*, count(*) FILTER (WHERE b.bytes_before >= $4::int8)
                           OVER (ROWS UNBOUNDED PRECEDING) AS past_budget
               FROM (
                 SELECT c.*, coalesce(sum(octet_length(c.payload) + octet_length(c.headers)
                                          + octet_length(c.partition_key))
                                      OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
                             AS bytes_before
                 FROM (
                   SELECT id, event_id, aggregate_type, aggregate_id, event_type, topic,
                          event_version, partition_key, payload::text AS payload,
                          headers::text AS headers, attempts, ctid::text AS tid
                   FROM outbox_event
                   WHERE published_at IS NULL AND parked_at IS NULL
                     AND partition_key <> ALL($2::text[]) AND topic <> ALL($3::text[])
                   ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED
                 ) c
               ) b
             ) w WHERE past_budget = 0",
        )
        .bind(batch)
        .bind(Vec::<String>::new())
        .bind(Vec::<String>::new())
        .bind(16_i64 << 20)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            break;
        }
        total += rows.len();
        let tids: Vec<&str> = rows.iter().map(|r| r.11.as_str()).collect();
        sqlx::query(
            "UPDATE outbox_event SET published_at = statement_timestamp()
             WHERE ctid = ANY($1::text[]::tid[])",
        )
        .bind(&tids)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// (b) The raw idempotent producer, same messages, no database.
async fn producer_only(
    brokers: &str,
    topic: &str,
    pool: &PgPool,
) -> Result<f64, Box<dyn std::error::Error>> {
    let rows: Vec<(Uuid, String, String)> = sqlx::query_as(
        "SELECT event_id, partition_key, payload::text FROM outbox_event ORDER BY id",
    )
    .fetch_all(pool)
    .await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .set("batch.num.messages", "10000")
        .create()?;
    let start = Instant::now();
    let mut pending = Vec::with_capacity(rows.len());
    for (id, key, payload) in &rows {
        let event_id = id.to_string();
        let headers = OwnedHeaders::new_with_capacity(7)
            .insert(Header {
                key: "event_id",
                value: Some(event_id.as_bytes()),
            })
            .insert(Header {
                key: "event_type",
                value: Some("OrderPlaced".as_bytes()),
            })
            .insert(Header {
                key: "event_version",
                value: Some("1".as_bytes()),
            })
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
                value: Some(event_id.as_bytes()),
            });
        let record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(headers);
        match producer.send_result(record) {
            Ok(d) => pending.push(d),
            Err((e, _)) => return Err(e.into()),
        }
    }
    for d in pending {
        if let Ok(Err((e, _))) = d.await {
            return Err(e.into());
        }
    }
    Ok(rows.len() as f64 / start.elapsed().as_secs_f64())
}

fn rss_peak_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

struct RelayProcess {
    child: tokio::process::Child,
}

impl RelayProcess {
    fn start(url: &str, brokers: &str, batch: i64) -> std::io::Result<Self> {
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args(["relay", "--batch-size", &batch.to_string()])
            .env("DATABASE_URL", url)
            .env("KAFKA_BROKERS", brokers)
            .env(
                "RUST_LOG",
                std::env::var("BENCH_RELAY_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        Ok(Self { child })
    }
    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }
    async fn stop(mut self) -> Option<u64> {
        let pid = self.pid();
        let peak = rss_peak_kib(pid);
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let _ = tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await;
        peak
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let brokers = common::brokers();
    let db = common::BenchDb::create("outbox_bench_relay", 8).await?;
    let pool = db.pool.clone();
    let bench_url = db.url.clone();

    let run = Uuid::new_v4().simple().to_string();
    let topic_sql = format!("bench-relay-{run}");
    let topic_raw = format!("bench-raw-{run}");
    let topic_relay = format!("bench-relay-drain-{run}");
    let topic_latency = format!("bench-latency-{run}");
    outbox_runtime::kafka::create_topics(
        &brokers,
        &[],
        &[
            topic_raw.clone(),
            topic_relay.clone(),
            topic_latency.clone(),
        ],
        4,
        1,
    )
    .await?;

    println!(
        "relay benchmark: {} events of ~200 bytes, batch {}",
        a.events, a.batch
    );
    // (a) SQL only.
    preload(&pool, a.events, &topic_sql).await?;
    let sql_rate = sql_only(&pool, a.batch).await?;
    println!("(a) claim + mark SQL only     {sql_rate:>10.0} rows/s");
    // (b) raw producer.
    preload(&pool, a.events, &topic_raw).await?;
    let raw_rate = producer_only(&brokers, &topic_raw, &pool).await?;
    println!("(b) raw idempotent producer   {raw_rate:>10.0} msg/s");
    // The relay process.
    preload(&pool, a.events, &topic_relay).await?;
    let relay = RelayProcess::start(&bench_url, &brokers, a.batch)?;
    let mut first: Option<Instant> = None;
    let spawned = Instant::now();
    loop {
        if first.is_none() && common::any_published(&pool).await? {
            first = Some(Instant::now());
        }
        if first.is_some() && common::drained(&pool).await? {
            break;
        }
        if spawned.elapsed() > Duration::from_secs(300) {
            return Err("relay did not drain the outbox within 300 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain = first.map_or(spawned.elapsed(), |f| f.elapsed());
    let relay_rate = a.events as f64 / drain.as_secs_f64();
    let limit = sql_rate.min(raw_rate);
    println!(
        "relay (outbox relay process)  {relay_rate:>10.0} events/s   = {:.2} x min(a, b)",
        relay_rate / limit
    );

    // Latency at a steady rate, relay still running (NOTIFY on).
    sqlx::query("TRUNCATE outbox_event").execute(&pool).await?;
    // The phases above wrote a lot of WAL: flush it now (when allowed), not
    // in a checkpoint that stalls commits in the middle of the latency run.
    checkpoint(&pool).await;
    let committed: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let expected = a.rate * a.seconds;
    let consumer_thread = {
        let (committed, latencies, brokers, topic) = (
            committed.clone(),
            latencies.clone(),
            brokers.clone(),
            topic_latency.clone(),
        );
        std::thread::spawn(move || {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", format!("bench-{}", Uuid::new_v4().simple()))
                .set("enable.auto.commit", "false")
                .set("fetch.wait.max.ms", "5")
                .set("fetch.min.bytes", "1")
                .create()
                .expect("consumer");
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in 0..4 {
                tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)
                    .expect("tpl");
            }
            consumer.assign(&tpl).expect("assign");
            let deadline = Instant::now() + Duration::from_secs(a.seconds + 30);
            let mut seen = 0;
            while seen < expected && Instant::now() < deadline {
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(50)) {
                    let now = Instant::now();
                    let id = m.headers().and_then(|h| {
                        h.iter()
                            .find(|x| x.key == "event_id")
                            .and_then(|x| x.value)
                            .map(|v| String::from_utf8_lossy(v).into_owned())
                    });
                    if let Some(id) = id.and_then(|s| s.parse::<Uuid>().ok()) {
                        // The commit time may be recorded a moment after the
                        // message arrives; wait for it.
                        for _ in 0..100 {
                            if let Some(t) = committed.lock().unwrap().get(&id) {
                                latencies
                                    .lock()
                                    .unwrap()
                                    .push(now.saturating_duration_since(*t).as_secs_f64() * 1000.0);
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        seen += 1;
                    }
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let interval = Duration::from_secs_f64(1.0 / a.rate as f64);
    let start = Instant::now();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    // Open loop: each commit is its own task, so a slow commit does not
    // lower the offered rate (at most 64 in flight).
    let in_flight = Arc::new(tokio::sync::Semaphore::new(64));
    let mut writers = tokio::task::JoinSet::new();
    for i in 0..expected {
        ticker.tick().await;
        let permit = in_flight.clone().acquire_owned().await?;
        let (pool, topic, committed) = (pool.clone(), topic_latency.clone(), committed.clone());
        writers.spawn(async move {
            let _permit = permit;
            let mut uow = UnitOfWork::begin(&pool).await?;
            let key = format!("order-{}", i % 100);
            let id = uow.record_message(OutboxMessage {
                event_id: Uuid::now_v7(),
                aggregate_type: "Order".into(),
                aggregate_id: key.clone(),
                event_type: "OrderPlaced".into(),
                event_version: 1,
                topic,
                partition_key: key,
                payload: serde_json::json!({ "seq": i, "note": "x".repeat(150) }).to_string(),
                headers: Default::default(),
            });
            uow.commit().await?;
            committed.lock().unwrap().insert(id, Instant::now());
            Ok::<_, outbox_core::Error>(())
        });
        while let Some(done) = writers.try_join_next() {
            done??;
        }
    }
    while let Some(done) = writers.join_next().await {
        done??;
    }
    let achieved = expected as f64 / start.elapsed().as_secs_f64();
    consumer_thread
        .join()
        .map_err(|_| "consumer thread panicked")?;
    let rss = relay.stop().await;
    // Commit → published (acknowledged by the broker and marked), from the
    // rows themselves: created_at is the writer's transaction start.
    let (db_p50, db_p99): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)
         FROM (SELECT EXTRACT(EPOCH FROM published_at - created_at) * 1000 AS ms
               FROM outbox_event WHERE published_at IS NOT NULL) t",
    )
    .fetch_one(&pool)
    .await?;
    let (db_p50, db_p99) = (db_p50.unwrap_or(f64::NAN), db_p99.unwrap_or(f64::NAN));
    println!("latency commit→published (outbox rows): p50 {db_p50:.1} ms, p99 {db_p99:.1} ms");
    let mut lat = latencies.lock().unwrap().clone();
    lat.sort_by(f64::total_cmp);
    let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
    println!(
        "latency commit→consumed at {achieved:.0} events/s ({} samples): p50 {p50:.1} ms, p99 {p99:.1} ms",
        lat.len()
    );
    let rss_mib = rss.map(|k| k as f64 / 1024.0);
    println!(
        "relay peak RSS: {}",
        rss_mib.map_or("n/a".into(), |m| format!("{m:.1} MiB"))
    );

    let json = serde_json::json!({
        "benchmark": "relay",
        "events": a.events,
        "batch": a.batch,
        "sql_only_rows_per_s": sql_rate.round(),
        "raw_producer_msgs_per_s": raw_rate.round(),
        "relay_events_per_s": relay_rate.round(),
        "relay_over_min_limit": ((relay_rate / limit) * 1000.0).round() / 1000.0,
        "latency_rate_per_s": achieved.round(),
        "latency_samples": lat.len(),
        "published_latency_p50_ms": (db_p50 * 10.0).round() / 10.0,
        "published_latency_p99_ms": (db_p99 * 10.0).round() / 10.0,
        "consumed_latency_p50_ms": (p50 * 10.0).round() / 10.0,
        "consumed_latency_p99_ms": (p99 * 10.0).round() / 10.0,
        "relay_peak_rss_mib": rss_mib.map(|m| (m * 10.0).round() / 10.0),
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    db.drop_database().await?;
    Ok(())
}
