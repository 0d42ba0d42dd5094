//! The relay in both modes, with the broker: the default mode (a mark per
//! event) against the progress mode (positions per batch and lane; see the
//! guide's "The progress mode"). Each mode drains the same backlog through
//! a real `Relay` (16 lanes, the default batch) to the broker, from a
//! table emptied and vacuumed first; then rounds of inserts and drains
//! while a transaction holds the xmin horizon (each round's rate counts
//! from the relay's start: a relay is started per drain). Printed per
//! mode: events per second, WAL and dead row versions per event, the
//! rounds' rates. `BENCH_MODE=marks|progress` runs one mode;
//! `RUST_LOG=outbox_runtime::relay::cycle=trace` prints each relay step's
//! claim and delivery times.
//!
//! ```sh
//! cargo bench -p outbox-runtime --bench relay_modes -- [--events N] [--json PATH]
//! ```

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use outbox_runtime::Relay;
use outbox_runtime::relay::progress;
use serde::Serialize;
use sqlx::{Connection, PgConnection, PgPool};

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// The backlog each mode drains.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// Rounds (insert, then drain) with a transaction holding the xmin
    /// horizon.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Events per round.
    #[arg(long, default_value_t = 100_000)]
    round_events: u64,
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
    dead_tuples_per_event: f64,
    rounds_held_xmin_events_per_s: Vec<f64>,
}

const INSERT: &str = "
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
SELECT {uuid}, 'order', 'o' || g, 'placed',
       jsonb_build_object('n', g, 'note', repeat('x', 200)), $2, 'k' || (g % 500)
FROM generate_series(1, $1) AS g";

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

/// Runs a relay until it has published `n` events; the seconds it took.
async fn drain(pool: &PgPool, n: u64) -> f64 {
    let t = Instant::now();
    let relay = Relay::builder(pool.clone())
        .brokers(common::brokers())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    while relay.counts().published < n {
        assert!(
            Instant::now() < deadline,
            "the relay stalled: {:?}",
            relay.counts()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    relay.shutdown().await.unwrap();
    secs
}

async fn reset(pool: &PgPool, mode: Mode) {
    for sql in [
        "TRUNCATE outbox_event, outbox_progress",
        "VACUUM ANALYZE outbox_event",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
    if mode == Mode::Progress {
        progress::enable(pool).await.unwrap();
    }
}

async fn stage(pool: &PgPool, mode: Mode, a: &Args) -> Stage {
    let topic = format!("bench-relay-modes-{}", uuid::Uuid::new_v4().simple());
    outbox_runtime::kafka::create_topics(
        &common::brokers(),
        &[],
        std::slice::from_ref(&topic),
        16,
        1,
    )
    .await
    .unwrap();
    reset(pool, mode).await;
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    let w0 = lsn(pool).await;
    insert(pool, &topic, a.events).await;
    let insert_wal = (lsn(pool).await - w0) as f64 / a.events as f64;
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    let (w1, v1) = (lsn(pool).await, versions(pool).await);
    let secs = drain(pool, a.events).await;
    let publish_wal = (lsn(pool).await - w1) as f64 / a.events as f64;
    let dead = (versions(pool).await - v1) as f64 / a.events as f64;

    reset(pool, mode).await;
    let mut holder = PgConnection::connect_with(&pool.connect_options())
        .await
        .unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut holder)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM outbox_event")
        .execute(&mut holder)
        .await
        .unwrap();
    let mut rounds = Vec::new();
    for _ in 0..a.rounds {
        insert(pool, &topic, a.round_events).await;
        let s = drain(pool, a.round_events).await;
        rounds.push((a.round_events as f64 / s).round());
    }
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    Stage {
        mode,
        events: a.events,
        secs,
        events_per_s: (a.events as f64 / secs).round(),
        insert_wal_bytes_per_event: insert_wal.round(),
        publish_wal_bytes_per_event: publish_wal.round(),
        dead_tuples_per_event: dead,
        rounds_held_xmin_events_per_s: rounds,
    }
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
            "ALTER DATABASE outbox_bench_relay_modes SET auto_explain.log_min_duration = '40ms'",
            "ALTER DATABASE outbox_bench_relay_modes SET auto_explain.log_analyze = on",
        ] {
            sqlx::query(sql).execute(&pool).await?;
        }
    }
    println!(
        "relay modes, with the broker: {} events backlog; {} rounds of {} with a held xmin",
        a.events, a.rounds, a.round_events
    );
    let mut stages = Vec::new();
    let modes = match std::env::var("BENCH_MODE").as_deref() {
        Ok("progress") => vec![Mode::Progress],
        Ok("marks") => vec![Mode::Marks],
        _ => vec![Mode::Marks, Mode::Progress],
    };
    for mode in modes {
        let s = stage(&pool, mode, &a).await;
        println!(
            "{:>8}: {:>6.0} ev/s ({:.1} s); WAL {:>4.0} B/event to publish ({:.2}x the insert's {:.0}); \
             {:.2} dead row versions/event; rounds with a held xmin {:?} ev/s",
            format!("{mode:?}").to_lowercase(),
            s.events_per_s,
            s.secs,
            s.publish_wal_bytes_per_event,
            s.publish_wal_bytes_per_event / s.insert_wal_bytes_per_event,
            s.insert_wal_bytes_per_event,
            s.dead_tuples_per_event,
            s.rounds_held_xmin_events_per_s,
        );
        stages.push(s);
    }
    let json = serde_json::json!({
        "benchmark": "relay_modes",
        "events": a.events,
        "rounds": a.rounds,
        "round_events": a.round_events,
        "stages": stages,
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    db.drop_database().await?;
    Ok(())
}
