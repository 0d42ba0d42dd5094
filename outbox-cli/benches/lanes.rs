//! Lanes benchmark: drain throughput of one relay without lanes and of 1, 2
//! and 3 relay processes sharing the lanes of one outbox; then the time the
//! survivors take over the lanes of a relay that is SIGKILLed (lane locks
//! back to full coverage, and an event of every lane, committed right after
//! the kill, published).
//!
//! `cargo bench -p outbox-cli --bench lanes -- [--events N] [--batch N] [--kills N] [--json PATH]`
//!
//! Needs PostgreSQL (DATABASE_URL names the server; the benchmark creates
//! its own database `outbox_bench_lanes`) and a broker (KAFKA_BROKERS).

#[path = "../../outbox-runtime/benches/common/mod.rs"]
mod common;

use clap::Parser;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use uuid::Uuid;

const LANES: i64 = 16;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// Rows preloaded and drained per relay count.
    #[arg(long, default_value_t = 100_000)]
    events: i64,
    /// Rows per claim.
    #[arg(long, default_value_t = 2000)]
    batch: i64,
    /// Relays SIGKILLed in the takeover measurement.
    #[arg(long, default_value_t = 5)]
    kills: usize,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

async fn preload(pool: &PgPool, n: i64, topic: &str) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, topic, partition_key, payload, headers)
         SELECT {}, 'Order', 'order-' || (g % 1000), 'OrderPlaced', $2, 'order-' || (g % 1000),
                jsonb_build_object('seq', g, 'note', repeat('x', 150)), '{{}}'::jsonb
         FROM generate_series(1, $1) AS g",
        common::UUID_V7_SQL
    ))
    .bind(n)
    .bind(topic)
    .execute(pool)
    .await?;
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await?;
    Ok(())
}

fn relay(url: &str, brokers: &str, batch: i64) -> std::io::Result<tokio::process::Child> {
    relay_with_lanes(url, brokers, batch, LANES)
}

fn relay_with_lanes(
    url: &str,
    brokers: &str,
    batch: i64,
    lanes: i64,
) -> std::io::Result<tokio::process::Child> {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["relay", "--batch-size", &batch.to_string()])
        .args(["--lanes", &lanes.to_string()])
        .env("DATABASE_URL", url)
        .env("KAFKA_BROKERS", brokers)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
}

fn signal(child: &tokio::process::Child, sig: &str) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status();
    }
}

async fn stop(mut children: Vec<tokio::process::Child>) {
    for c in &children {
        signal(c, "-TERM");
    }
    for c in &mut children {
        let _ = tokio::time::timeout(Duration::from_secs(20), c.wait()).await;
    }
}

/// Lane locks held, and by how many distinct sessions: the outbox's
/// advisory locks (`classid` = the table's oid) of kind 1 (lanes).
async fn lane_holders(pool: &PgPool) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(DISTINCT objid)::int8, count(DISTINCT pid)::int8 FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND objsubid = 1
           AND classid = 'outbox_event'::regclass AND objid::int8 >> 24 = 1
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(pool)
    .await
}

async fn wait_for<F, Fut>(
    limit: Duration,
    mut check: F,
) -> Result<Duration, Box<dyn std::error::Error>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool, sqlx::Error>>,
{
    let start = Instant::now();
    while !check().await? {
        if start.elapsed() > limit {
            return Err(format!("condition not reached within {limit:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(start.elapsed())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let brokers = common::brokers();
    let db = common::BenchDb::create("outbox_bench_lanes", 4).await?;
    let pool = db.pool.clone();
    let bench_url = db.url.clone();
    let run = Uuid::new_v4().simple().to_string();

    println!(
        "lanes benchmark: {} events over 1000 keys, {LANES} lanes, batch {}",
        a.events, a.batch
    );
    // One relay without lanes first: the cost of lanes, in the same run.
    let mut throughput = Vec::new();
    for (relays, lanes) in [(1_usize, 0_i64), (1, LANES), (2, LANES), (3, LANES)] {
        let topic = format!("bench-lanes-{relays}-{lanes}-{run}");
        outbox_runtime::kafka::create_topics(&brokers, &[], std::slice::from_ref(&topic), 4, 1)
            .await?;
        sqlx::query("TRUNCATE outbox_event").execute(&pool).await?;
        preload(&pool, a.events, &topic).await?;
        let children = (0..relays)
            .map(|_| relay_with_lanes(&bench_url, &brokers, a.batch, lanes))
            .collect::<Result<Vec<_>, _>>()?;
        wait_for(Duration::from_secs(60), || common::any_published(&pool)).await?;
        let first = Instant::now();
        wait_for(Duration::from_secs(300), || common::drained(&pool)).await?;
        let rate = a.events as f64 / first.elapsed().as_secs_f64();
        stop(children).await;
        println!("{relays} relay(s), {lanes:>2} lanes   {rate:>10.0} events/s");
        throughput.push(
            serde_json::json!({ "relays": relays, "lanes": lanes, "events_per_s": rate.round() }),
        );
    }

    // Takeover: three relays on an idle outbox; one is SIGKILLed; a key of
    // every lane gets an event right after the kill.
    let topic = format!("bench-lanes-takeover-{run}");
    outbox_runtime::kafka::create_topics(&brokers, &[], std::slice::from_ref(&topic), 4, 1).await?;
    sqlx::query("TRUNCATE outbox_event").execute(&pool).await?;
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT ON (lane) k FROM
           (SELECT 'key-' || g AS k, (hashtext('key-' || g) & 2147483647) % $1 AS lane
            FROM generate_series(1, 1000) g) t ORDER BY lane, k",
    )
    .bind(LANES)
    .fetch_all(&pool)
    .await?;
    let mut children = (0..3)
        .map(|_| relay(&bench_url, &brokers, a.batch))
        .collect::<Result<Vec<_>, _>>()?;
    let mut locks_ms = Vec::new();
    let mut publish_ms = Vec::new();
    for round in 0..a.kills {
        wait_for(Duration::from_secs(30), || async {
            lane_holders(&pool).await.map(|(l, p)| l == LANES && p == 3)
        })
        .await?;
        // Let the three settle on their shares.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let victim = round % children.len();
        let killed = Instant::now();
        signal(&children[victim], "-KILL");
        let _ = children[victim].wait().await;
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, topic, partition_key, payload, headers)
             SELECT gen_random_uuid(), 'Order', k, 'OrderPlaced', $2, k, '{}'::jsonb, '{}'::jsonb
             FROM unnest($1::text[]) AS k",
        )
        .bind(&keys)
        .bind(&topic)
        .execute(&pool)
        .await?;
        wait_for(Duration::from_secs(30), || async {
            lane_holders(&pool).await.map(|(l, p)| l == LANES && p == 2)
        })
        .await?;
        locks_ms.push(killed.elapsed().as_secs_f64() * 1e3);
        wait_for(Duration::from_secs(30), || common::drained(&pool)).await?;
        publish_ms.push(killed.elapsed().as_secs_f64() * 1e3);
        children[victim] = relay(&bench_url, &brokers, a.batch)?;
    }
    stop(children).await;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let max = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
    let (lock_med, lock_max) = (median(&mut locks_ms), max(&locks_ms));
    let (pub_med, pub_max) = (median(&mut publish_ms), max(&publish_ms));
    println!(
        "takeover after SIGKILL ({} kills): lanes re-owned median {lock_med:.0} ms (max {lock_max:.0}); an event of every lane published median {pub_med:.0} ms (max {pub_max:.0})",
        a.kills
    );
    let json = serde_json::json!({
        "benchmark": "lanes",
        "events": a.events,
        "lanes": LANES,
        "batch": a.batch,
        "throughput": throughput,
        "takeover_kills": a.kills,
        "takeover_lanes_reowned_ms_median": lock_med.round(),
        "takeover_lanes_reowned_ms_max": lock_max.round(),
        "takeover_all_lanes_published_ms_median": pub_med.round(),
        "takeover_all_lanes_published_ms_max": pub_max.round(),
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    db.drop_database().await?;
    Ok(())
}
