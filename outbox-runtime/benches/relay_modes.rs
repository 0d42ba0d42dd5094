//! The relay in both modes, with the broker: the default mode (a mark per
//! event) against the progress mode (positions per batch and lane; see the
//! guide's "The progress mode"). Each mode, in one run:
//!
//! - drains a backlog through a real `Relay` (16 lanes, the default batch)
//!   to the broker, from a table emptied and vacuumed first: its rate, the
//!   WAL and the dead row versions per event, and the CPU time of the
//!   PostgreSQL backends serving the relay (its connections carry the
//!   `application_name` `bench-relay`; read from `/proc`) per event;
//! - writers (sessions committing one event per Unit of Work) alone for a
//!   while, then while a relay drains a backlog at full speed: their
//!   commits per second in both, and the ratio;
//! - the writers' control: the same writers beside a plain producer
//!   sending as many messages of the same size at full speed (run once,
//!   before both modes), what the broker's and a producer's use of the
//!   cores costs the writers with no database work beside them; and again
//!   after both modes' stages, the producer paced at the mean rate the
//!   relays drained at beside the writers;
//! - rounds of inserts and drains while a transaction holds the xmin
//!   horizon, and as many without in a second database, the two in turns
//!   (each round's rate counts from the relay's start: a relay is started
//!   per drain);
//! - commit → consumed at a steady rate with a relay running: the writer
//!   notes the time its commit returned, a plain consumer (partitions
//!   assigned from the start, no group) the time it receives the message:
//!   an upper bound of commit → published, the same in both modes; split
//!   at the message's timestamp, which the relay's producer sets when the
//!   relay hands the message over: commit → sent (the relay's part, where
//!   the modes differ) and sent → consumed (the producer's, the broker's
//!   and the consumer's; wall clocks of one machine, in whole ms). These
//!   stages run last, after both modes' other stages, four times per mode
//!   in the order marks, progress, progress, marks, marks, progress,
//!   progress, marks (`--latency-runs`; each mode's samples pooled): the broker
//!   slows as its topics grow, and a mode measured after the other's stages
//!   would be measured on a slower broker.
//!
//! After both modes' stages and before the latency stages, each mode drains
//! a fresh backlog twice more, in the order progress, marks, marks,
//! progress: the drain's rate and CPU per event are each mode's mean over
//! its three drains (its stage's and these two), the ratio of the modes'
//! drains the ratio of those means. One drain per mode moved with the
//! machine and the broker from run to run (the marks' 37,557 ev/s in one
//! run, 52,731 in the next).
//!
//! `--latency-only` runs the latency stages alone;
//! `BENCH_MODE=marks|progress` runs one mode; `BENCH_CPU_DETAIL=1` prints
//! each drain's backends, their CPU time and the statements seen on them;
//! `RUST_LOG=outbox_runtime::relay::cycle=trace` prints each relay step's
//! claim and delivery times.
//!
//! ```sh
//! cargo bench -p outbox-runtime --bench relay_modes -- [--events N] [--json PATH]
//! ```

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_core::{OutboxMessage, UnitOfWork};
use outbox_runtime::Relay;
use outbox_runtime::relay::progress;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// The backlog each mode drains.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// Rounds (insert, then drain) with a transaction holding the xmin
    /// horizon, and as many without.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Events per round.
    #[arg(long, default_value_t = 100_000)]
    round_events: u64,
    /// Writer sessions (one event per transaction) of the writers' stage.
    #[arg(long, default_value_t = 8)]
    writers: usize,
    /// Seconds the writers run alone.
    #[arg(long, default_value_t = 5)]
    writers_secs: u64,
    /// The backlog a relay drains beside the writers.
    #[arg(long, default_value_t = 200_000)]
    writers_backlog: u64,
    /// Events per second of the latency stage.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of the latency stage.
    #[arg(long, default_value_t = 10)]
    latency_secs: u64,
    /// Runs of the latency stage per mode, in turns (marks, progress,
    /// progress, marks, marks, …): one pair of runs moved with the machine
    /// (the progress mode's p99 13 ms above the marks' in one run, 14 ms
    /// below in the next).
    #[arg(long, default_value_t = 4)]
    latency_runs: usize,
    /// Only the latency stages (both modes', or `BENCH_MODE`'s), none of
    /// the others: a longer comparison of the latencies alone.
    #[arg(long)]
    latency_only: bool,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Marks,
    Progress,
}

#[derive(Debug, Serialize)]
struct Stage {
    mode: Mode,
    events: u64,
    secs: f64,
    events_per_s: f64,
    insert_wal_bytes_per_event: f64,
    publish_wal_bytes_per_event: f64,
    publish_wal_over_insert_wal: f64,
    dead_tuples_per_event: f64,
    /// CPU time (user + system) of the backends serving the relay during
    /// the backlog's drain, per event.
    relay_backend_cpu_us_per_event: f64,
    /// How many backends served the relay during that drain.
    relay_backends: usize,
    writers: usize,
    writers_alone_commits_per_s: f64,
    writers_during_drain_commits_per_s: f64,
    writers_ratio: f64,
    /// The relay's rate while the writers run beside it.
    drain_beside_writers_events_per_s: f64,
    rounds_held_xmin_events_per_s: Vec<f64>,
    rounds_free_events_per_s: Vec<f64>,
    /// Mean of the rounds with the xmin held / mean of those without.
    rounds_held_over_free: f64,
    /// The last round with the xmin held / the last without.
    last_round_held_over_free: f64,
    /// The last round with the xmin held / the first.
    rounds_held_last_over_first: f64,
    latency_rate_per_s: f64,
    latency_samples: usize,
    commit_consumed_p50_ms: f64,
    commit_consumed_p99_ms: f64,
    /// Commit → the relay handed the message to its producer (the
    /// message's timestamp, set by the producer when it is handed over;
    /// wall clock, in ms): the relay's own part, mode by mode.
    commit_sent_p50_ms: f64,
    commit_sent_p99_ms: f64,
    /// The message's timestamp → consumed: the producer's, the broker's
    /// and the consumer's part, the same whatever the mode.
    sent_consumed_p50_ms: f64,
    sent_consumed_p99_ms: f64,
    /// Each latency run's p50 and p99 (commit → consumed), in the order
    /// run.
    latency_runs: Vec<[f64; 2]>,
    /// Each latency run's p50 and p99 commit → sent, in the order run.
    latency_runs_sent: Vec<[f64; 2]>,
    /// Each drain of a fresh backlog of `events`, in the order run: the
    /// stage's, then those of [`more_drains`].
    drains: Vec<Drained>,
    /// Their mean rate.
    drains_events_per_s: f64,
    /// Their mean CPU per event.
    drains_cpu_us_per_event: f64,
}

/// One drain of a fresh backlog.
#[derive(Debug, Serialize)]
struct Drained {
    events_per_s: f64,
    cpu_us_per_event: f64,
}

/// `application_name` of the relay's connections.
const RELAY_APP: &str = "bench-relay";
/// `application_name` of the writers' connections.
const WRITERS_APP: &str = "bench-writers";
/// Partitions of the benchmark's topics.
const PARTITIONS: i32 = 16;

const INSERT: &str = "
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
SELECT {uuid}, 'order', 'o' || g, 'placed',
       jsonb_build_object('n', g, 'note', repeat('x', 200)), $2, 'k' || (g % 500)
FROM generate_series(1, $1) AS g";

/// The benchmark's pools: its own queries, the writers'. Each relay has a
/// pool of its own (see [`relay_pool`]).
struct Pools {
    bench: PgPool,
    writers: PgPool,
}

/// A pool for one relay, its connections named [`RELAY_APP`].
async fn relay_pool(p: &Pools) -> PgPool {
    pool_named(&p.bench, RELAY_APP, 8).await
}

/// Closes a relay's pool and waits until its backends have exited: a
/// backend reports its table counts (the dead row versions) when it exits,
/// or at most once a second while it works and ten seconds after it goes
/// idle.
async fn close_relay_pool(p: &Pools, pool: PgPool) {
    pool.close().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !relay_backends(&p.bench).await.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

async fn lsn(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Row versions of `outbox_event` made dead so far (updated or deleted).
async fn versions(pool: &PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT (n_tup_upd + n_tup_del)::int8 FROM pg_stat_user_tables WHERE relname = 'outbox_event'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// User and system CPU time of process `pid`, in seconds; `None` once it
/// has exited.
fn cpu_secs(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th of the line.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

/// The pids of the backends serving the relay.
async fn relay_backends(pool: &PgPool) -> Vec<i32> {
    relay_queries(pool)
        .await
        .into_iter()
        .map(|(pid, _)| pid)
        .collect()
}

/// The backends serving the relay, each with the start of its last
/// statement.
async fn relay_queries(pool: &PgPool) -> Vec<(i32, String)> {
    sqlx::query_as(
        "SELECT pid, left(regexp_replace(query, '\\s+', ' ', 'g'), 70) FROM pg_stat_activity \
         WHERE application_name = $1 AND datname = current_database()",
    )
    .bind(RELAY_APP)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// CPU time of the relay's backends over a stretch of time: each backend
/// alive at the start from its time then, each one that appears later from
/// its start; a backend that exits counts until its last sample.
struct CpuMeter {
    base: HashMap<i32, f64>,
    last: HashMap<i32, f64>,
    /// Each backend's statements seen at the samples (`BENCH_CPU_DETAIL`).
    seen: HashMap<i32, std::collections::BTreeSet<String>>,
}

impl CpuMeter {
    async fn start(pool: &PgPool) -> Self {
        let base: HashMap<i32, f64> = relay_backends(pool)
            .await
            .into_iter()
            .filter_map(|pid| cpu_secs(pid).map(|c| (pid, c)))
            .collect();
        Self {
            last: base.clone(),
            base,
            seen: HashMap::new(),
        }
    }

    async fn sample(&mut self, pool: &PgPool) {
        let queries = relay_queries(pool).await;
        let mut pids: Vec<i32> = queries.iter().map(|(pid, _)| *pid).collect();
        if std::env::var("BENCH_CPU_DETAIL").is_ok() {
            for (pid, q) in queries {
                self.seen.entry(pid).or_default().insert(q);
            }
        }
        pids.extend(self.last.keys().copied());
        for pid in pids {
            if let Some(c) = cpu_secs(pid) {
                self.last.insert(pid, c);
            }
        }
    }

    /// Prints each backend's CPU seconds and the statements seen on it.
    fn detail(&self) {
        let mut rows: Vec<(f64, i32)> = self
            .last
            .iter()
            .map(|(pid, c)| (c - self.base.get(pid).unwrap_or(&0.0), *pid))
            .collect();
        rows.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (secs, pid) in rows {
            let seen = self.seen.get(&pid).cloned().unwrap_or_default();
            println!("  backend {pid}: {secs:.2} s CPU; statements seen: {seen:?}");
        }
    }

    /// Seconds of CPU so far, and the backends counted.
    fn total(&self) -> (f64, usize) {
        let secs = self
            .last
            .iter()
            .map(|(pid, c)| c - self.base.get(pid).unwrap_or(&0.0))
            .sum();
        (secs, self.last.len())
    }
}

/// Inserts `n` events of `topic`, 1,000 per transaction.
async fn insert(pool: &PgPool, topic: &str, n: u64) {
    let sql = INSERT.replace("{uuid}", common::UUID_V7_SQL);
    let mut left = n;
    while left > 0 {
        let now = left.min(1000);
        sqlx::query(&sql)
            .bind(now as i32)
            .bind(topic)
            .execute(pool)
            .await
            .unwrap();
        left -= now;
    }
}

struct Drain {
    secs: f64,
    /// CPU seconds of the relay's backends, and how many there were.
    cpu: (f64, usize),
    /// What `commits` counted from the relay's start until the `n`th event
    /// was published.
    commits: u64,
}

/// Runs a relay until it has published `n` events, sampling its backends'
/// CPU time every 100 ms.
async fn drain(p: &Pools, n: u64, commits: Option<&AtomicU64>) -> Drain {
    let count = || commits.map_or(0, |c| c.load(Ordering::Relaxed));
    let mut meter = CpuMeter::start(&p.bench).await;
    let (t, c0) = (Instant::now(), count());
    let pool = relay_pool(p).await;
    let relay = Relay::builder(pool.clone())
        .brokers(common::brokers())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut next_sample = Instant::now();
    while relay.counts().published < n {
        assert!(
            Instant::now() < deadline,
            "the relay stalled: {:?}",
            relay.counts()
        );
        if Instant::now() >= next_sample {
            meter.sample(&p.bench).await;
            next_sample = Instant::now() + Duration::from_millis(100);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (secs, commits) = (t.elapsed().as_secs_f64(), count() - c0);
    meter.sample(&p.bench).await;
    if std::env::var("BENCH_CPU_DETAIL").is_ok() {
        meter.detail();
    }
    relay.shutdown().await.unwrap();
    close_relay_pool(p, pool).await;
    Drain {
        secs,
        cpu: meter.total(),
        commits,
    }
}

/// The default mode's indexes of unpublished rows as the migrations make
/// them (`CREATE INDEX IF NOT EXISTS …`), read at the start: enabling the
/// progress mode drops them, and [`reset`] makes them again for a drain in
/// the default mode after one in the progress mode.
static MARKS_INDEXES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

async fn read_marks_indexes(pool: &PgPool) {
    let defs: Vec<String> =
        sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE indexname = ANY($1)")
            .bind(progress::MARKS_INDEXES.as_slice())
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(defs.len(), progress::MARKS_INDEXES.len());
    let defs = defs
        .iter()
        .map(|d| d.replacen("CREATE INDEX ", "CREATE INDEX IF NOT EXISTS ", 1))
        .collect();
    let _ = MARKS_INDEXES.set(defs);
}

/// Empties the outbox and lays the table out as `mode` has it: the
/// progress mode enabled (its index made, the default mode's indexes of
/// unpublished rows dropped), or the default mode's indexes there and the
/// progress mode's index gone.
async fn reset(pool: &PgPool, mode: Mode) {
    sqlx::query("TRUNCATE outbox_event, outbox_progress")
        .execute(pool)
        .await
        .unwrap();
    if mode == Mode::Marks {
        let mut sqls = vec![format!("DROP INDEX IF EXISTS {}", progress::INDEX)];
        sqls.extend(
            MARKS_INDEXES
                .get()
                .expect("read at the start")
                .iter()
                .cloned(),
        );
        for sql in sqls {
            sqlx::query(&sql).execute(pool).await.unwrap();
        }
    }
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await
        .unwrap();
    if mode == Mode::Progress {
        progress::enable(pool).await.unwrap();
    }
}

/// An event of `topic` as an application records it (~250 B of payload).
fn message(topic: &str, i: u64) -> OutboxMessage {
    let key = format!("k{}", i % 500);
    OutboxMessage {
        event_id: Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: key.clone(),
        event_type: "placed".into(),
        event_version: 1,
        topic: topic.to_owned(),
        partition_key: key,
        payload: serde_json::json!({ "n": i, "note": "x".repeat(200) }).to_string(),
        headers: Default::default(),
    }
}

/// Writers: `a.writers` sessions committing one event per Unit of Work
/// until stopped, counting their commits.
struct Writers {
    stop: Arc<AtomicBool>,
    commits: Arc<AtomicU64>,
    handles: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    /// Starts the writers on `topic` and lets them warm up ([`WARM`]).
    async fn start(p: &Pools, topic: &str, a: &Args) -> Self {
        let (stop, commits) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let n = a.writers;
        let handles = (0..n)
            .map(|w| {
                let (pool, topic, stop, commits) = (
                    p.writers.clone(),
                    topic.to_owned(),
                    stop.clone(),
                    commits.clone(),
                );
                tokio::spawn(async move {
                    let mut i = w as u64;
                    while !stop.load(Ordering::Relaxed) {
                        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
                        uow.record_message(message(&topic, i));
                        uow.commit().await.unwrap();
                        commits.fetch_add(1, Ordering::Relaxed);
                        i += n as u64;
                    }
                })
            })
            .collect();
        tokio::time::sleep(WARM).await;
        Self {
            stop,
            commits,
            handles,
        }
    }

    /// Their commits so far.
    fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.handles {
            h.await.unwrap();
        }
    }
}

/// The writers alone on an emptied outbox in `mode`: their commits/s over
/// `a.writers_secs`, after half a second to warm up.
async fn writers_alone(p: &Pools, mode: Mode, topic: &str, a: &Args) -> f64 {
    reset(&p.bench, mode).await;
    sqlx::query("CHECKPOINT").execute(&p.bench).await.unwrap();
    let writers = Writers::start(p, topic, a).await;
    let (c0, t0) = (writers.commits(), Instant::now());
    tokio::time::sleep(Duration::from_secs(a.writers_secs)).await;
    let alone = (writers.commits() - c0) as f64 / t0.elapsed().as_secs_f64();
    writers.stop().await;
    alone
}

/// How long the writers run before their commits are counted.
const WARM: Duration = Duration::from_millis(500);

/// Writers alone, then beside a relay draining a backlog: commits/s alone,
/// during the drain, and the relay's rate.
async fn writers_stage(p: &Pools, mode: Mode, topic: &str, a: &Args) -> (f64, f64, f64) {
    let alone = writers_alone(p, mode, topic, a).await;

    reset(&p.bench, mode).await;
    insert(&p.bench, topic, a.writers_backlog).await;
    sqlx::query("CHECKPOINT").execute(&p.bench).await.unwrap();
    let writers = Writers::start(p, topic, a).await;
    let d = drain(p, a.writers_backlog, Some(writers.commits.as_ref())).await;
    writers.stop().await;
    (
        alone,
        d.commits as f64 / d.secs,
        a.writers_backlog as f64 / d.secs,
    )
}

/// The control of the writers' stage, with no database work beside the
/// writers: writers alone, then beside a plain producer (the relay's
/// producer settings) sending `a.writers_backlog` messages of the same size
/// to the broker at full speed. Their commits/s alone, beside it, and the
/// producer's rate: what the broker's and a producer's share of the cores
/// costs the writers, whatever a relay reads or writes. With `rate`, the
/// producer sends at most that many messages a second (the rate a relay
/// drained at beside the writers: the broker's share at the relay's pace).
async fn producer_control(p: &Pools, topic: &str, a: &Args, rate: Option<f64>) -> (f64, f64, f64) {
    let alone = writers_alone(p, Mode::Marks, topic, a).await;

    reset(&p.bench, Mode::Marks).await;
    sqlx::query("CHECKPOINT").execute(&p.bench).await.unwrap();
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", common::brokers())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .set("queue.buffering.max.messages", "100000")
        .create()
        .unwrap();
    let messages: Vec<(String, String, String)> = (0..a.writers_backlog)
        .map(|i| {
            let m = message(topic, i);
            (m.partition_key, m.payload, m.event_id.to_string())
        })
        .collect();
    let writers = Writers::start(p, topic, a).await;
    let (c0, t0) = (writers.commits(), Instant::now());
    let mut deliveries = Vec::with_capacity(messages.len());
    for (i, (key, payload, id)) in messages.iter().enumerate() {
        if let Some(rate) = rate.filter(|_| i % 100 == 0) {
            tokio::time::sleep_until((t0 + Duration::from_secs_f64(i as f64 / rate)).into()).await;
        }
        let record = rdkafka::producer::FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(common::identity_headers(id, "placed"));
        deliveries.push(common::queue(&producer, record).await);
    }
    common::delivered(deliveries).await.unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let during = (writers.commits() - c0) as f64 / secs;
    writers.stop().await;
    (alone, during, a.writers_backlog as f64 / secs)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// One latency run's samples, in ms, each sorted.
#[derive(Default)]
struct Latencies {
    /// Commit → consumed.
    consumed: Vec<f64>,
    /// Commit → the message's timestamp (the relay handed it over).
    sent: Vec<f64>,
    /// The message's timestamp → consumed.
    broker: Vec<f64>,
}

impl Latencies {
    fn extend(&mut self, other: Latencies) {
        self.consumed.extend(other.consumed);
        self.sent.extend(other.sent);
        self.broker.extend(other.broker);
    }

    fn sort(&mut self) {
        for v in [&mut self.consumed, &mut self.sent, &mut self.broker] {
            v.sort_by(f64::total_cmp);
        }
    }
}

/// Milliseconds since the Unix epoch, as a message's timestamp counts.
fn wall_ms(at: std::time::SystemTime) -> f64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
}

/// Commit → consumed at `a.rate` events/s for `a.latency_secs`, a relay
/// running: the offered rate achieved, the latencies (commit → consumed,
/// split at the message's timestamp: when the relay handed it to its
/// producer, which sets it then).
async fn latency_stage(p: &Pools, mode: Mode, topic: &str, a: &Args) -> (f64, Latencies) {
    reset(&p.bench, mode).await;
    // Flush the WAL of the stages before: not in a checkpoint in the middle
    // of this one.
    sqlx::query("CHECKPOINT").execute(&p.bench).await.unwrap();
    let pool = relay_pool(p).await;
    let relay = Relay::builder(pool.clone())
        .brokers(common::brokers())
        .spawn()
        .unwrap();
    let committed: Arc<Mutex<HashMap<Uuid, (Instant, f64)>>> = Arc::default();
    let expected = a.rate * a.latency_secs;
    let consumer = {
        let (committed, brokers, topic, secs) = (
            committed.clone(),
            common::brokers(),
            topic.to_owned(),
            a.latency_secs,
        );
        tokio::task::spawn_blocking(move || {
            // Partitions assigned from their start: no group membership,
            // no rebalance (the group id is never joined).
            let consumer: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", format!("bench-{}", Uuid::new_v4().simple()))
                .set("enable.auto.commit", "false")
                .set("fetch.wait.max.ms", "5")
                .set("fetch.min.bytes", "1")
                .create()
                .expect("consumer");
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in 0..PARTITIONS {
                tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)
                    .expect("partition");
            }
            consumer.assign(&tpl).expect("assign");
            let deadline = Instant::now() + Duration::from_secs(secs + 30);
            let (mut seen, mut latencies) = (0, Latencies::default());
            while seen < expected && Instant::now() < deadline {
                let Some(Ok(m)) = consumer.poll(Duration::from_millis(50)) else {
                    continue;
                };
                let (now, now_ms) = (Instant::now(), wall_ms(std::time::SystemTime::now()));
                let sent_ms = m.timestamp().to_millis().map(|t| t as f64);
                let id = m.headers().and_then(|h| {
                    h.iter()
                        .find(|x| x.key == "event_id")
                        .and_then(|x| x.value)
                        .and_then(|v| std::str::from_utf8(v).ok()?.parse::<Uuid>().ok())
                });
                let Some(id) = id else { continue };
                // The writer notes its commit's time a moment after the
                // commit returns: the message may be here first.
                for _ in 0..100 {
                    if let Some((t, t_ms)) = committed.lock().unwrap().get(&id) {
                        let ms = now.saturating_duration_since(*t).as_secs_f64() * 1000.0;
                        latencies.consumed.push(ms);
                        if let Some(sent_ms) = sent_ms {
                            latencies.sent.push(sent_ms - t_ms);
                            latencies.broker.push(now_ms - sent_ms);
                        }
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                seen += 1;
            }
            latencies
        })
    };
    // The relay's lanes and the consumer's assignment settle first.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / a.rate as f64));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    // Open loop: each commit is its own task, so a slow commit does not
    // lower the offered rate (at most 64 in flight).
    let in_flight = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = tokio::task::JoinSet::new();
    let start = Instant::now();
    for i in 0..expected {
        ticker.tick().await;
        let permit = in_flight.clone().acquire_owned().await.unwrap();
        let (pool, topic, committed) = (p.writers.clone(), topic.to_owned(), committed.clone());
        tasks.spawn(async move {
            let _permit = permit;
            let mut uow = UnitOfWork::begin(&pool).await.unwrap();
            let id = uow.record_message(message(&topic, i));
            uow.commit().await.unwrap();
            let at = (Instant::now(), wall_ms(std::time::SystemTime::now()));
            committed.lock().unwrap().insert(id, at);
        });
        while let Some(done) = tasks.try_join_next() {
            done.unwrap();
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let achieved = expected as f64 / start.elapsed().as_secs_f64();
    let mut latencies = consumer.await.unwrap();
    relay.shutdown().await.unwrap();
    close_relay_pool(p, pool).await;
    latencies.sort();
    (achieved, latencies)
}

/// `a.rounds` rounds (insert `a.round_events`, then drain them with a new
/// relay) with a transaction holding the xmin horizon in the benchmark's
/// database, and as many without in a second database (`free`: a held xmin
/// holds back only its own database's row versions), each from an emptied
/// table. The two alternate round by round, in turns (held first in the
/// odd rounds, free first in the even ones), so that neither runs on a
/// broker or a machine the other did not have; their rates.
async fn rounds(
    p: &Pools,
    free: &Pools,
    mode: Mode,
    topic: &str,
    a: &Args,
) -> (Vec<f64>, Vec<f64>) {
    reset(&p.bench, mode).await;
    reset(&free.bench, mode).await;
    let mut holder = common::hold_xmin(&p.bench).await;
    let (mut held, mut without) = (Vec::new(), Vec::new());
    for i in 0..a.rounds {
        for held_now in if i % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        } {
            let (pools, rates) = if held_now {
                (p, &mut held)
            } else {
                (free, &mut without)
            };
            insert(&pools.bench, topic, a.round_events).await;
            let d = drain(pools, a.round_events, None).await;
            rates.push((a.round_events as f64 / d.secs).round());
        }
    }
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    (held, without)
}

/// Drains of a fresh backlog of `a.events` in each mode of `stages`, in
/// the order progress, marks, marks, progress (one mode: twice), each on a
/// topic of its own: added to each mode's drain of its stage, the drain's
/// rate and the CPU per event are a mean of three drains run at spread
/// times (the marks' first, fourth and fifth, the progress mode's second,
/// third and sixth), not of one run at the place of its mode in the
/// program.
async fn more_drains(p: &Pools, stages: &mut [Stage], a: &Args) {
    let order: Vec<usize> = match stages.len() {
        2 => vec![1, 0, 0, 1],
        n => (0..n).chain(0..n).collect(),
    };
    for i in order {
        let mode = stages[i].mode;
        let topic = new_topic("drain-").await;
        reset(&p.bench, mode).await;
        insert(&p.bench, &topic, a.events).await;
        sqlx::query("CHECKPOINT").execute(&p.bench).await.unwrap();
        let d = drain(p, a.events, None).await;
        let (rate, cpu) = (
            (a.events as f64 / d.secs).round(),
            round1(d.cpu.0 * 1e6 / a.events as f64),
        );
        println!(
            "{:>8}  drain of {}: {rate:.0} ev/s, {cpu:.1} us of the relay's backends' CPU/event",
            format!("{mode:?}").to_lowercase(),
            a.events,
        );
        stages[i].drains.push(Drained {
            events_per_s: rate,
            cpu_us_per_event: cpu,
        });
    }
    for s in stages.iter_mut() {
        let rates: Vec<f64> = s.drains.iter().map(|d| d.events_per_s).collect();
        let cpu: Vec<f64> = s.drains.iter().map(|d| d.cpu_us_per_event).collect();
        s.drains_events_per_s = mean(&rates).round();
        s.drains_cpu_us_per_event = round1(mean(&cpu));
    }
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

async fn stage(p: &Pools, free: &Pools, mode: Mode, a: &Args) -> Stage {
    let topic = new_topic("").await;

    // The backlog: what inserting it writes, then what publishing it
    // writes, leaves dead and costs the relay's backends.
    let pool = &p.bench;
    reset(pool, mode).await;
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    let w0 = lsn(pool).await;
    insert(pool, &topic, a.events).await;
    let insert_wal = (lsn(pool).await - w0) as f64 / a.events as f64;
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    let (w1, v1) = (lsn(pool).await, versions(pool).await);
    let d = drain(p, a.events, None).await;
    let publish_wal = (lsn(pool).await - w1) as f64 / a.events as f64;
    let dead = (versions(pool).await - v1) as f64 / a.events as f64;

    let (alone, during, beside) = writers_stage(p, mode, &topic, a).await;
    let (held, free) = rounds(p, free, mode, &topic, a).await;
    let last = |xs: &[f64]| xs.last().copied().unwrap_or(f64::NAN);
    let cpu = (d.cpu.0 * 1e6 / a.events as f64 * 10.0).round() / 10.0;
    let rate = (a.events as f64 / d.secs).round();
    Stage {
        mode,
        events: a.events,
        secs: d.secs,
        events_per_s: rate,
        insert_wal_bytes_per_event: insert_wal.round(),
        publish_wal_bytes_per_event: publish_wal.round(),
        publish_wal_over_insert_wal: (publish_wal / insert_wal * 1000.0).round() / 1000.0,
        dead_tuples_per_event: dead,
        relay_backend_cpu_us_per_event: cpu,
        relay_backends: d.cpu.1,
        writers: a.writers,
        writers_alone_commits_per_s: alone.round(),
        writers_during_drain_commits_per_s: during.round(),
        writers_ratio: round2(during / alone),
        drain_beside_writers_events_per_s: beside.round(),
        rounds_held_over_free: round2(mean(&held) / mean(&free)),
        last_round_held_over_free: round2(last(&held) / last(&free)),
        rounds_held_last_over_first: round2(
            last(&held) / held.first().copied().unwrap_or(f64::NAN),
        ),
        rounds_held_xmin_events_per_s: held,
        rounds_free_events_per_s: free,
        drains: vec![Drained {
            events_per_s: rate,
            cpu_us_per_event: cpu,
        }],
        drains_events_per_s: rate,
        drains_cpu_us_per_event: cpu,
        ..Stage::new(mode)
    }
}

impl Stage {
    /// A mode's stage before any figure is measured (`--latency-only`
    /// measures only the latency).
    fn new(mode: Mode) -> Self {
        Stage {
            mode,
            events: 0,
            secs: f64::NAN,
            events_per_s: f64::NAN,
            insert_wal_bytes_per_event: f64::NAN,
            publish_wal_bytes_per_event: f64::NAN,
            publish_wal_over_insert_wal: f64::NAN,
            dead_tuples_per_event: f64::NAN,
            relay_backend_cpu_us_per_event: f64::NAN,
            relay_backends: 0,
            writers: 0,
            writers_alone_commits_per_s: f64::NAN,
            writers_during_drain_commits_per_s: f64::NAN,
            writers_ratio: f64::NAN,
            drain_beside_writers_events_per_s: f64::NAN,
            rounds_held_xmin_events_per_s: Vec::new(),
            rounds_free_events_per_s: Vec::new(),
            rounds_held_over_free: f64::NAN,
            last_round_held_over_free: f64::NAN,
            rounds_held_last_over_first: f64::NAN,
            latency_rate_per_s: f64::NAN,
            latency_samples: 0,
            commit_consumed_p50_ms: f64::NAN,
            commit_consumed_p99_ms: f64::NAN,
            commit_sent_p50_ms: f64::NAN,
            commit_sent_p99_ms: f64::NAN,
            sent_consumed_p50_ms: f64::NAN,
            sent_consumed_p99_ms: f64::NAN,
            latency_runs: Vec::new(),
            latency_runs_sent: Vec::new(),
            drains: Vec::new(),
            drains_events_per_s: f64::NAN,
            drains_cpu_us_per_event: f64::NAN,
        }
    }
}

/// The latency stages of `stages`' modes, `a.latency_runs` each, in the
/// order marks, progress, progress, marks, marks, progress, … (one mode:
/// its runs), each on a topic of its own; each mode's figures from its
/// runs' samples pooled.
async fn latencies(p: &Pools, stages: &mut [Stage], a: &Args) {
    let order: Vec<usize> = match stages.len() {
        2 => (0..a.latency_runs.max(1))
            .flat_map(|k| if k % 2 == 0 { [0, 1] } else { [1, 0] })
            .collect(),
        n => (0..a.latency_runs.max(1)).flat_map(|_| 0..n).collect(),
    };
    let mut samples: Vec<Latencies> = stages.iter().map(|_| Latencies::default()).collect();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); stages.len()];
    let p50_p99 = |xs: &[f64]| [round1(percentile(xs, 0.5)), round1(percentile(xs, 0.99))];
    for i in order {
        let topic = new_topic("latency-").await;
        let (achieved, run) = latency_stage(p, stages[i].mode, &topic, a).await;
        let ([c50, c99], [s50, s99], [b50, b99]) = (
            p50_p99(&run.consumed),
            p50_p99(&run.sent),
            p50_p99(&run.broker),
        );
        println!(
            "{:>8}  one run at {achieved:.0} ev/s: commit → consumed p50 {c50:.1} ms, p99 {c99:.1}; \
             commit → sent {s50:.1}, {s99:.1}; sent → consumed {b50:.1}, {b99:.1}",
            format!("{:?}", stages[i].mode).to_lowercase(),
        );
        stages[i].latency_runs.push([c50, c99]);
        stages[i].latency_runs_sent.push([s50, s99]);
        rates[i].push(achieved);
        samples[i].extend(run);
    }
    for (i, s) in stages.iter_mut().enumerate() {
        samples[i].sort();
        s.latency_rate_per_s = mean(&rates[i]).round();
        s.latency_samples = samples[i].consumed.len();
        [s.commit_consumed_p50_ms, s.commit_consumed_p99_ms] = p50_p99(&samples[i].consumed);
        [s.commit_sent_p50_ms, s.commit_sent_p99_ms] = p50_p99(&samples[i].sent);
        [s.sent_consumed_p50_ms, s.sent_consumed_p99_ms] = p50_p99(&samples[i].broker);
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Creates a topic of its own for a stage (`bench-relay-modes-{kind}…`,
/// [`PARTITIONS`] partitions) and returns its name.
async fn new_topic(kind: &str) -> String {
    let topic = format!("bench-relay-modes-{kind}{}", Uuid::new_v4().simple());
    outbox_runtime::kafka::create_topics(
        &common::brokers(),
        &[],
        std::slice::from_ref(&topic),
        PARTITIONS,
        1,
    )
    .await
    .unwrap();
    topic
}

/// A pool on the benchmark's database whose connections carry
/// `application_name` `name`.
async fn pool_named(pool: &PgPool, name: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with((*pool.connect_options()).clone().application_name(name))
        .await
        .unwrap()
}

/// The stages before the latency's, both modes' (or `BENCH_MODE`'s), and
/// the writers' controls: the stages, the control beside a plain producer,
/// the control beside a producer at the relays' pace.
async fn other_stages(
    pools: &Pools,
    free: &Pools,
    modes: Vec<Mode>,
    a: &Args,
) -> (Vec<Stage>, serde_json::Value, serde_json::Value) {
    let control_topic = new_topic("control-").await;
    let (alone, beside, produced) = producer_control(pools, &control_topic, a, None).await;
    println!(
        " control: writers {:.2}x alone beside a plain producer ({:.0} commits/s while it sends {} \
         messages at {:.0} msg/s, {:.0} alone): no database work beside them",
        beside / alone,
        beside,
        a.writers_backlog,
        produced,
        alone
    );
    let control = control_json(alone, beside, produced);
    let mut stages = Vec::new();
    for mode in modes {
        let s = stage(pools, free, mode, a).await;
        println!(
            "{:>8}: {:>6.0} ev/s ({:.1} s); WAL {:>4.0} B/event to publish ({:.3}x the insert's {:.0}); \
             {:.2} dead row versions/event; {:.1} us of the relay's backends' CPU/event ({} backends)\n\
             {:>8}  writers {:.2}x alone ({:.0} commits/s during a drain at {:.0} ev/s, {:.0} alone)\n\
             {:>8}  rounds with a held xmin {:?} ev/s, without {:?} (held/without: {:.2}x mean, {:.2}x last round)",
            format!("{mode:?}").to_lowercase(),
            s.events_per_s,
            s.secs,
            s.publish_wal_bytes_per_event,
            s.publish_wal_over_insert_wal,
            s.insert_wal_bytes_per_event,
            s.dead_tuples_per_event,
            s.relay_backend_cpu_us_per_event,
            s.relay_backends,
            "",
            s.writers_ratio,
            s.writers_during_drain_commits_per_s,
            s.drain_beside_writers_events_per_s,
            s.writers_alone_commits_per_s,
            "",
            s.rounds_held_xmin_events_per_s,
            s.rounds_free_events_per_s,
            s.rounds_held_over_free,
            s.last_round_held_over_free,
        );
        stages.push(s);
    }
    more_drains(pools, &mut stages, a).await;
    // The control again, the producer at the pace the relays drained at
    // beside the writers (their mean over the modes).
    let pace = mean(
        &stages
            .iter()
            .map(|s| s.drain_beside_writers_events_per_s)
            .collect::<Vec<_>>(),
    );
    let paced_topic = new_topic("control-paced-").await;
    let (paced_alone, paced_beside, paced) =
        producer_control(pools, &paced_topic, a, Some(pace)).await;
    println!(
        " control at the relays' pace: writers {:.2}x alone beside a plain producer ({:.0} commits/s \
         while it sends {} messages at {:.0} msg/s, {:.0} alone)",
        paced_beside / paced_alone,
        paced_beside,
        a.writers_backlog,
        paced,
        paced_alone
    );
    let paced_control = control_json(paced_alone, paced_beside, paced);
    (stages, control, paced_control)
}

/// A writers' control as the JSON gives it: the writers' commits per
/// second alone and beside the producer, their ratio, the producer's rate.
fn control_json(alone: f64, beside: f64, produced: f64) -> serde_json::Value {
    serde_json::json!({
        "writers_alone_commits_per_s": alone.round(),
        "writers_beside_producer_commits_per_s": beside.round(),
        "writers_ratio": round2(beside / alone),
        "producer_messages_per_s": produced.round(),
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    // `RUST_LOG=outbox_runtime::relay=trace` shows each relay step's timings.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let db = common::BenchDb::create("outbox_bench_relay_modes", 8).await?;
    let pool = db.pool.clone();
    if std::env::var("BENCH_EXPLAIN").is_ok() {
        sqlx::query(
            "ALTER DATABASE outbox_bench_relay_modes SET session_preload_libraries = 'auto_explain'",
        )
        .execute(&pool)
        .await?;
        for sql in [
            "ALTER DATABASE outbox_bench_relay_modes SET auto_explain.log_min_duration = '5ms'",
            "ALTER DATABASE outbox_bench_relay_modes SET auto_explain.log_analyze = on",
        ] {
            sqlx::query(sql).execute(&pool).await?;
        }
    }
    let pools = Pools {
        writers: pool_named(&pool, WRITERS_APP, a.writers.max(8) as u32).await,
        bench: pool.clone(),
    };
    read_marks_indexes(&pool).await;
    // The rounds without a held xmin run in a database of their own.
    let free_db = common::BenchDb::create("outbox_bench_relay_modes_free", 8).await?;
    let free = Pools {
        writers: pools.writers.clone(),
        bench: free_db.pool.clone(),
    };
    println!(
        "relay modes, with the broker: {} events backlog; {} writers beside a drain of {}; \
         {} rounds of {} with a held xmin and without; commit → consumed at {} ev/s for {} s",
        a.events, a.writers, a.writers_backlog, a.rounds, a.round_events, a.rate, a.latency_secs
    );
    let modes = match std::env::var("BENCH_MODE").as_deref() {
        Ok("progress") => vec![Mode::Progress],
        Ok("marks") => vec![Mode::Marks],
        _ => vec![Mode::Marks, Mode::Progress],
    };
    let (mut stages, control, paced_control) = if a.latency_only {
        (
            modes.into_iter().map(Stage::new).collect(),
            serde_json::Value::Null,
            serde_json::Value::Null,
        )
    } else {
        other_stages(&pools, &free, modes, &a).await
    };
    if a.latency_secs > 0 {
        latencies(&pools, &mut stages, &a).await;
    }
    for s in &stages {
        // None with `--latency-only`.
        if !s.drains.is_empty() {
            println!(
                "{:>8}: drains {:?} ev/s, mean {:.0}; CPU {:?} us/event, mean {:.1}",
                format!("{:?}", s.mode).to_lowercase(),
                s.drains.iter().map(|d| d.events_per_s).collect::<Vec<_>>(),
                s.drains_events_per_s,
                s.drains
                    .iter()
                    .map(|d| d.cpu_us_per_event)
                    .collect::<Vec<_>>(),
                s.drains_cpu_us_per_event,
            );
        }
        println!(
            "{:>8}: commit → consumed at {:.0} ev/s ({} samples, {} runs): p50 {:.1} ms, p99 {:.1} ms; \
             commit → sent p50 {:.1}, p99 {:.1}; sent → consumed p50 {:.1}, p99 {:.1}",
            format!("{:?}", s.mode).to_lowercase(),
            s.latency_rate_per_s,
            s.latency_samples,
            s.latency_runs.len(),
            s.commit_consumed_p50_ms,
            s.commit_consumed_p99_ms,
            s.commit_sent_p50_ms,
            s.commit_sent_p99_ms,
            s.sent_consumed_p50_ms,
            s.sent_consumed_p99_ms,
        );
    }
    if let [m, p] = &stages[..] {
        println!(
            "progress / marks: drain {:.2}x (mean of the drains; {:.2}x of the stages' own); \
             commit → consumed p50 {:.1} vs {:.1} ms, p99 {:.1} vs {:.1} ms; \
             commit → sent p50 {:.1} vs {:.1} ms, p99 {:.1} vs {:.1} ms",
            p.drains_events_per_s / m.drains_events_per_s,
            p.events_per_s / m.events_per_s,
            p.commit_consumed_p50_ms,
            m.commit_consumed_p50_ms,
            p.commit_consumed_p99_ms,
            m.commit_consumed_p99_ms,
            p.commit_sent_p50_ms,
            m.commit_sent_p50_ms,
            p.commit_sent_p99_ms,
            m.commit_sent_p99_ms,
        );
    }
    let ratio = match &stages[..] {
        [m, p] => Some(round2(p.drains_events_per_s / m.drains_events_per_s)),
        _ => None,
    };
    let json = serde_json::json!({
        "benchmark": "relay_modes",
        "events": a.events,
        "rounds": a.rounds,
        "round_events": a.round_events,
        "writers": a.writers,
        "writers_secs": a.writers_secs,
        "writers_backlog": a.writers_backlog,
        "latency_rate": a.rate,
        "latency_secs": a.latency_secs,
        "progress_over_marks_drain": ratio,
        "writers_beside_a_plain_producer": control,
        "writers_beside_a_producer_at_the_relays_pace": paced_control,
        "stages": stages,
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    pools.writers.close().await;
    free.bench.close().await;
    free_db.drop_database().await?;
    db.drop_database().await?;
    Ok(())
}
