//! Failing-keys benchmark: what failing events cost the rest of the stream
//! in dedup mode. A topic preloaded with N ~200-byte messages over 1000 keys
//! (one key in ten hot: the hot keys carry half the events) is read, in the
//! same run, by fresh consumer groups whose handler fails 0 %, 0.1 %, 1 %
//! and 5 % of the events (chosen among the hot keys' events, or with
//! `--spread all` among all events) on every
//! attempt until they are dead-lettered. For each: events/s until every
//! event is applied or dead-lettered, as a ratio of the all-good stage, and
//! the time until every event of the keys that never fail was applied, and
//! the back-off floor: the busiest failing key's failing events times the
//! back-offs each waits before its dead letter (no run can finish sooner).
//!
//! `--mode inbox` runs the consumer in inbox mode, `--mode inbox-progress`
//! in inbox mode with the processor in the progress mode.
//!
//! With `--memory-retries-ms 0,1000` every stage runs twice: failing
//! events set aside in `inbox_event` (0, the default), then retried from
//! the consumer's memory within a 1,000 ms window
//! (`ConsumerBuilder::memory_retries`).
//!
//! `--handler-writes` has the handler write a row per event it applies, as
//! a projection would; without it the handler does nothing but fail the
//! chosen events.
//!
//! `cargo bench -p outbox-runtime --bench failing_keys -- [--events N] [--partitions N] [--stages 0,0.1,1,5] [--max-attempts N] [--backoff-ms N] [--spread hot|all] [--memory-retries-ms 0,1000] [--memory-max-events N] [--handler-writes] [--control] [--mode dedup|inbox|inbox-progress] [--json PATH]`
//!
//! Needs PostgreSQL (DATABASE_URL names the server; the benchmark creates
//! its own database `outbox_bench_failing_keys`) and a broker (KAFKA_BROKERS).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::Consumer;
use rdkafka::producer::FutureRecord;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

const TOPIC: &str = "bench-failing-keys";
const KEYS: u64 = 1000;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// Messages produced, read by each stage.
    #[arg(long, default_value_t = 50_000)]
    events: u64,
    /// Partitions of the topic. The test broker serves a preloaded topic's
    /// partitions in bursts, one or two at a time, so a consumer reads them
    /// one after another (the control prints when each partition's first
    /// message came): with 1 the stream is read in production order, as
    /// fetches that interleave partitions give it.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Attempts before a failing event is dead-lettered.
    #[arg(long, default_value_t = 3)]
    max_attempts: u32,
    /// The first retry's back-off (doubling, at most ten times this).
    #[arg(long, default_value_t = 100)]
    backoff_ms: u64,
    /// The stages: percentages of failing events (the first is the
    /// reference the others are compared with).
    #[arg(long, value_delimiter = ',', default_values_t = [0.0, 0.1, 1.0, 5.0])]
    stages: Vec<f64>,
    /// Which events may fail: `hot` (the default) chooses them among the hot
    /// keys' events only, the worst case (each hot key then fails about once
    /// in 45 of its events at 1 %, and its later events wait behind each
    /// failure); `all` chooses them among all events alike (half of them
    /// still on the hot keys, which carry half the stream).
    #[arg(long, value_enum, default_value_t = Spread::Hot)]
    spread: Spread,
    /// Inbox processors of the consumer (they split the partitions).
    #[arg(long, default_value_t = 1)]
    processors: usize,
    /// Windows of retries from memory to run the stages with, in ms (0:
    /// off, failing events set aside in `inbox_event`).
    #[arg(long, value_delimiter = ',', default_values_t = [0])]
    memory_retries_ms: Vec<u64>,
    /// Most events held in memory with retries from memory (the consumer's
    /// default, 10,000, if not given).
    #[arg(long)]
    memory_max_events: Option<usize>,
    /// The consumer's mode: `dedup` (the default), `inbox`, or
    /// `inbox-progress` (inbox mode, the processor in the progress mode).
    #[arg(long, value_enum, default_value_t = RunMode::Dedup)]
    mode: RunMode,
    /// Rows an inbox processor claims per round (the consumer's default
    /// if not given).
    #[arg(long)]
    processor_batch: Option<usize>,
    /// The handler writes a row per event it applies (into a table of the
    /// benchmark, as a projection would), in the consumer's transaction.
    /// Without it the handler does no work at all: the all-good stage then
    /// measures the consumer's own cost per event, against which a failing
    /// event's cost weighs most.
    #[arg(long)]
    handler_writes: bool,
    /// Beside each stage, a plain rdkafka consumer (a group of its own)
    /// reads the whole topic: its time tells a slow broker from a slow
    /// consumer.
    #[arg(long)]
    control: bool,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// How the consumer runs (see `Args::mode`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum RunMode {
    /// Dedup mode: failing events set aside in the inbox (or retried from
    /// memory).
    Dedup,
    /// Inbox mode, the processor marking each row.
    Inbox,
    /// Inbox mode, the processor in the progress mode.
    InboxProgress,
}

/// Which events a stage fails (see `Args::spread`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Spread {
    Hot,
    All,
}

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    seq: u64,
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

/// The key of event `seq`: even events go to the hot keys (one in ten),
/// odd ones to all keys.
fn key_of(seq: u64) -> u64 {
    let mix = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20;
    if seq.is_multiple_of(2) {
        (mix % (KEYS / 10)) * 10
    } else {
        mix % KEYS
    }
}

/// Whether event `seq` fails, for a stage failing `per_million` of all
/// events (chosen among the hot keys' events, or among all of them).
fn fails(seq: u64, per_million: u64, spread: Spread) -> bool {
    let draw = (seq.wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 11) % 1_000_000;
    match spread {
        // The hot keys carry half the events: twice the rate among them.
        Spread::Hot => key_of(seq).is_multiple_of(10) && draw % 500_000 < per_million,
        Spread::All => draw < per_million,
    }
}

/// Applies events; fails the chosen ones; counts the events of keys that
/// never fail.
struct Stage {
    writes: bool,
    per_million: u64,
    spread: Spread,
    failing_keys: Arc<std::collections::HashSet<u64>>,
    clean_applied: Arc<AtomicU64>,
}

impl InboxHandler for Stage {
    type Event = OrderPlaced;
    const NAME: &'static str = "stage";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: OrderPlaced,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            if fails(event.seq, self.per_million, self.spread) {
                return Err(format!("order {} refused", event.seq).into());
            }
            if self.writes {
                sqlx::query("INSERT INTO bench_applied (seq, order_id) VALUES ($1, $2)")
                    .bind(event.seq as i64)
                    .bind(&event.order_id)
                    .execute(ctx.connection())
                    .await?;
            }
            if !self.failing_keys.contains(&key_of(event.seq)) {
                self.clean_applied.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    }
}

/// What the control saw: the seconds it took to read the topic, and when
/// each partition's first message came (seconds, by partition).
struct ControlRead {
    secs: f64,
    first: std::collections::BTreeMap<i32, f64>,
}

/// The control: a plain rdkafka consumer of a group of its own reads the
/// `n` messages of the topic, join included.
fn plain_read(brokers: &str, n: u64) -> Result<ControlRead, String> {
    use rdkafka::Message as _;
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("bench-failing-control-{}", Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    consumer.subscribe(&[TOPIC]).map_err(|e| e.to_string())?;
    let mut seen = 0_u64;
    let mut first = std::collections::BTreeMap::new();
    while seen < n {
        if start.elapsed() > Duration::from_secs(300) {
            return Err(format!("the control read only {seen} of {n} in 300 s"));
        }
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            first
                .entry(m.partition())
                .or_insert_with(|| start.elapsed().as_secs_f64());
            seen += 1;
        }
    }
    Ok(ControlRead {
        secs: start.elapsed().as_secs_f64(),
        first,
    })
}

async fn preload(brokers: &str, n: u64, partitions: i32) -> Result<(), Box<dyn std::error::Error>> {
    common::recreate_topic(brokers, TOPIC, partitions).await?;
    let producer = common::preload_producer(brokers)?;
    let mut pending = Vec::with_capacity(n as usize);
    for seq in 0..n {
        let key = format!("order-{}", key_of(seq));
        let id = Uuid::now_v7().to_string();
        let payload =
            serde_json::json!({ "order_id": key, "seq": seq, "note": "x".repeat(140) }).to_string();
        let record = FutureRecord::to(TOPIC)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(common::identity_headers(&id, "OrderPlaced"));
        pending.push(common::queue(&producer, record).await);
    }
    common::delivered(pending).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let brokers = common::brokers();
    let db = common::BenchDb::create("outbox_bench_failing_keys", 8).await?;
    let pool = db.pool.clone();
    println!(
        "failing-keys benchmark: {} events on {} partitions, {KEYS} keys (one in ten hot), \
         mode {:?}, max_attempts {}, back-off {} ms, {} inbox processor(s), failing events among {}, \
         the handler {}",
        a.events,
        a.partitions,
        a.mode,
        a.max_attempts,
        a.backoff_ms,
        a.processors,
        match a.spread {
            Spread::Hot => "the hot keys' events",
            Spread::All => "all events",
        },
        if a.handler_writes {
            "writing a row per event"
        } else {
            "doing nothing else"
        }
    );
    preload(&brokers, a.events, a.partitions).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS bench_applied (seq bigint, order_id text)")
        .execute(&pool)
        .await?;
    let mut stages = Vec::new();
    let mut base_rate = None;
    let runs: Vec<(u64, u64)> = a
        .memory_retries_ms
        .iter()
        .flat_map(|m| {
            a.stages
                .iter()
                .map(move |p| (*m, (p * 10_000.0).round() as u64))
        })
        .collect();
    for (memory_ms, per_million) in runs {
        let failing: Vec<u64> = (0..a.events)
            .filter(|s| fails(*s, per_million, a.spread))
            .collect();
        let failing_keys: Arc<std::collections::HashSet<u64>> =
            Arc::new(failing.iter().map(|s| key_of(*s)).collect());
        let clean = (0..a.events)
            .filter(|s| !failing_keys.contains(&key_of(*s)))
            .count() as u64;
        let keys_failing = failing_keys.len();
        // No run can be faster than its busiest failing key: each of its
        // failing events waits every back-off before its dead letter, and
        // its key waits with it.
        let waits: f64 = (1..a.max_attempts)
            .map(|attempt| {
                (a.backoff_ms as f64 * 2f64.powi(attempt as i32 - 1))
                    .min(a.backoff_ms as f64 * 10.0)
            })
            .sum::<f64>()
            / 1000.0;
        let mut per_key = std::collections::HashMap::new();
        for seq in &failing {
            *per_key.entry(key_of(*seq)).or_insert(0_u32) += 1;
        }
        let floor_s = per_key.values().copied().max().unwrap_or(0) as f64 * waits;
        let clean_applied = Arc::new(AtomicU64::new(0));
        let backoff = Duration::from_millis(a.backoff_ms);
        let control = a.control.then(|| {
            let (brokers, n) = (brokers.clone(), a.events);
            tokio::task::spawn_blocking(move || plain_read(&brokers, n))
        });
        sqlx::query("TRUNCATE bench_applied").execute(&pool).await?;
        let start = Instant::now();
        let mut builder = Consumer::builder(pool.clone());
        if let Some(n) = a.processor_batch {
            builder = builder.processor_batch_size(n);
        }
        if memory_ms > 0 {
            builder = builder.memory_retries(Duration::from_millis(memory_ms));
            if let Some(n) = a.memory_max_events {
                builder = builder.memory_retries_max_events(n);
            }
        }
        let group = format!("bench-failing-{per_million}-{memory_ms}-{:?}", a.mode);
        match a.mode {
            RunMode::Dedup => {}
            RunMode::Inbox => builder = builder.mode(outbox_runtime::Mode::Inbox),
            RunMode::InboxProgress => {
                outbox_runtime::inbox::progress::enable(&pool, &group).await?;
                builder = builder.mode(outbox_runtime::Mode::Inbox);
            }
        }
        let handle = builder
            .group(&group)
            .brokers(&brokers)
            .max_attempts(a.max_attempts)
            .retry_backoff(backoff, backoff * 10)
            .processors(a.processors)
            .handler(Stage {
                writes: a.handler_writes,
                per_million,
                spread: a.spread,
                failing_keys,
                clean_applied: clean_applied.clone(),
            })
            .spawn()?;
        let mut clean_done = None;
        loop {
            let c = handle.counts();
            if clean_done.is_none() && clean_applied.load(Ordering::Relaxed) >= clean {
                clean_done = Some(start.elapsed());
            }
            if c.processed + c.dead_lettered >= a.events {
                break;
            }
            if start.elapsed() > Duration::from_secs(900) {
                return Err(format!("stage {per_million} ppm did not finish: {c:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = start.elapsed();
        let counts = handle.counts();
        handle.shutdown().await?;
        let control = match control {
            Some(read) => Some(read.await??),
            None => None,
        };
        if let Some(c) = &control {
            let first: Vec<String> = c
                .first
                .iter()
                .map(|(p, s)| format!("{p}: {:.0} ms", s * 1000.0))
                .collect();
            println!(
                "  a plain rdkafka consumer beside it read the topic in {:.2} s; each partition's first message after {}",
                c.secs,
                first.join(", ")
            );
        }
        let control_s = control.as_ref().map(|c| c.secs);
        let rate = a.events as f64 / took.as_secs_f64();
        let base = *base_rate.get_or_insert(rate);
        let clean_s = clean_done.unwrap_or(took).as_secs_f64();
        println!(
            "memory retries {memory_ms:>4} ms, {:>5.1} % failing ({:>5} events, {:>3} keys): \
             {rate:>8.0} events/s = {:.2} x all-good; \
             other keys' events all applied after {clean_s:.2} s; dead-lettered {}, set aside {}; \
             took {:.2} s, back-off floor {floor_s:.2} s; {} transactions",
            per_million as f64 / 10_000.0,
            failing.len(),
            keys_failing,
            rate / base,
            counts.dead_lettered,
            counts.stored,
            took.as_secs_f64(),
            counts.batches,
        );
        stages.push(serde_json::json!({
            "memory_retries_ms": memory_ms,
            "mode": a.mode,
            "failing_percent": per_million as f64 / 10_000.0,
            "failing_events": failing.len(),
            "events_per_s": rate.round(),
            "over_all_good": ((rate / base) * 1000.0).round() / 1000.0,
            "other_keys_applied_s": (clean_s * 1000.0).round() / 1000.0,
            "dead_lettered": counts.dead_lettered,
            "set_aside": counts.stored,
            "batches": counts.batches,
            "took_s": (took.as_secs_f64() * 1000.0).round() / 1000.0,
            "control_read_s": control_s.map(|s| (s * 1000.0).round() / 1000.0),
            "control_first_message_s": control.as_ref().map(|c| {
                c.first
                    .iter()
                    .map(|(p, s)| (p.to_string(), (s * 1000.0).round() / 1000.0))
                    .collect::<std::collections::BTreeMap<_, _>>()
            }),
            "backoff_floor_s": (floor_s * 1000.0).round() / 1000.0,
        }));
    }
    let json = serde_json::json!({
        "benchmark": "failing_keys",
        "events": a.events,
        "partitions": a.partitions,
        "keys": KEYS,
        "max_attempts": a.max_attempts,
        "backoff_ms": a.backoff_ms,
        "memory_max_events": a.memory_max_events,
        "processors": a.processors,
        "spread": a.spread,
        "handler_writes": a.handler_writes,
        "stages": stages,
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    db.drop_database().await?;
    Ok(())
}
