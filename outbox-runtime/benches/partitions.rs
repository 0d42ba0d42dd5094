//! The conversion to the partitioned layout (`partition::enable`) of tables
//! holding rows, while writers insert: how long each table stays locked
//! against the writers.
//!
//! `cargo bench -p outbox-runtime --bench partitions -- [--rows 200000,1000000] [--foreign 0.1] [--json PATH]`
//!
//! Per size: `outbox_event`, `processed_event` and `inbox_event` get `rows`
//! rows each (ids: UUIDv7 of the last three days, and a share `--foreign`
//! of random ids, as events from other producers bring; 5 consumers),
//! vacuumed and analyzed; then one writer per table inserts a row at a
//! time (a fresh UUIDv7, every 2 ms; `--no-writers`: none) while `enable`
//! converts the tables. Printed: the conversion's time, and per table the
//! time it was held exclusively, as `enable` reports it and as seen from
//! outside (`pg_locks`, polled every millisecond or so), and the writer's
//! longest insert.
//!
//! Needs PostgreSQL (DATABASE_URL names the server; the benchmark creates
//! its own database `outbox_bench_partitions` and drops it at the end).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_runtime::partition::{self, PartitionPlan};
use serde::Serialize;
use sqlx::PgPool;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// Rows per table, one run per size (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "200000,1000000")]
    rows: Vec<u64>,
    /// Share of the ids that are not UUIDv7 (random).
    #[arg(long, default_value_t = 0.1)]
    foreign: f64,
    /// No writers during the conversion.
    #[arg(long)]
    no_writers: bool,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

const TABLES: [&str; 3] = ["outbox_event", "processed_event", "inbox_event"];

/// A UUIDv7 of a time in the last three days, or (share `$1`) a random id.
const MIXED_ID: &str = "CASE WHEN random() < $1 THEN gen_random_uuid() ELSE \
     encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) \
     placing substring(int8send(floor(extract(epoch FROM now() - random() * interval '3 days') * 1000)::bigint) FROM 3) \
     FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid END";

#[derive(Debug, Serialize)]
struct TableResult {
    table: String,
    exclusive_ms: Option<u64>,
    observed_exclusive_ms: f64,
    longest_insert_ms: Option<f64>,
    inserts: u64,
}

#[derive(Debug, Serialize)]
struct Run {
    rows: u64,
    foreign: f64,
    moved_rows: u64,
    enable_ms: f64,
    tables: Vec<TableResult>,
}

async fn fill(pool: &PgPool, rows: u64, foreign: f64) -> Result<(), sqlx::Error> {
    let n = rows as i64;
    sqlx::query(&format!(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key, published_at)
         SELECT {MIXED_ID}, 'Order', 'o' || g, 'OrderPlaced',
                jsonb_build_object('order', g, 'note', repeat('x', 100)), 'orders', 'o' || g,
                now() - interval '1 hour'
         FROM generate_series(1, $2) AS g"
    ))
    .bind(foreign)
    .bind(n)
    .execute(pool)
    .await?;
    sqlx::query(&format!(
        "INSERT INTO processed_event (consumer, event_id)
         SELECT 'consumer-' || (g % 5), {MIXED_ID} FROM generate_series(1, $2) AS g"
    ))
    .bind(foreign)
    .bind(n)
    .execute(pool)
    .await?;
    sqlx::query(&format!(
        "INSERT INTO inbox_event (consumer, event_id, payload, processed, processed_at)
         SELECT 'consumer-' || (g % 5), {MIXED_ID}, '{{}}', true, now()
         FROM generate_series(1, $2) AS g"
    ))
    .bind(foreign)
    .bind(n)
    .execute(pool)
    .await?;
    for table in TABLES {
        sqlx::query(&format!("VACUUM ANALYZE {table}"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// Inserts one row into `table` every 2 ms until `stop`; the longest
/// insert and the count.
async fn probe(
    pool: PgPool,
    table: &'static str,
    stop: Arc<AtomicBool>,
) -> Result<(Duration, u64), sqlx::Error> {
    let sql = match table {
        "outbox_event" => {
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key)
             VALUES ($1, 'Order', 'probe', 'OrderPlaced', '{}', 'orders', 'probe')"
        }
        "processed_event" => {
            "INSERT INTO processed_event (consumer, event_id) VALUES ('probe', $1)"
        }
        _ => "INSERT INTO inbox_event (consumer, event_id, payload) VALUES ('probe', $1, '{}')",
    };
    let mut longest = Duration::ZERO;
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        sqlx::query(sql)
            .bind(uuid::Uuid::now_v7())
            .execute(&pool)
            .await?;
        longest = longest.max(started.elapsed());
        n += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok((longest, n))
}

/// Polls `pg_locks` until `stop` for the exclusive locks on the tables of
/// `oids` (the tables before the conversion: the legacy partitions after
/// it); per table, the time from the first poll that saw it to the last.
async fn watch(
    pool: PgPool,
    oids: Vec<i64>,
    stop: Arc<AtomicBool>,
) -> Result<Vec<Duration>, sqlx::Error> {
    let mut seen: Vec<Option<(Instant, Instant)>> = vec![None; oids.len()];
    while !stop.load(Ordering::Relaxed) {
        let held: Vec<i64> = sqlx::query_scalar(
            "SELECT relation::int8 FROM pg_locks
             WHERE locktype = 'relation' AND granted AND mode = 'AccessExclusiveLock'
               AND relation::int8 = ANY($1)",
        )
        .bind(&oids)
        .fetch_all(&pool)
        .await?;
        let now = Instant::now();
        for (i, oid) in oids.iter().enumerate() {
            if held.contains(oid) {
                let first = seen[i].map_or(now, |s| s.0);
                seen[i] = Some((first, now));
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(seen
        .into_iter()
        .map(|s| s.map_or(Duration::ZERO, |(a, b)| b - a))
        .collect())
}

async fn run(rows: u64, foreign: f64, writers: bool) -> Result<Run, Box<dyn std::error::Error>> {
    let db = common::BenchDb::create("outbox_bench_partitions", 8).await?;
    let filled = Instant::now();
    fill(&db.pool, rows, foreign).await?;
    eprintln!(
        "{rows} rows per table filled in {:.1} s",
        filled.elapsed().as_secs_f64()
    );
    let own_pool = || {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with((*db.pool.connect_options()).clone())
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut probes = Vec::new();
    if writers {
        for table in TABLES {
            probes.push(tokio::spawn(probe(own_pool().await?, table, stop.clone())));
        }
    }
    let mut oids = Vec::new();
    for table in TABLES {
        oids.push(
            sqlx::query_scalar::<_, i64>("SELECT $1::regclass::oid::int8")
                .bind(table)
                .fetch_one(&db.pool)
                .await?,
        );
    }
    let watcher = tokio::spawn(watch(own_pool().await?, oids, stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let report = partition::enable(&db.pool, &PartitionPlan::default()).await;
    let enable_ms = started.elapsed().as_secs_f64() * 1000.0;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let report = report?;
    let observed = watcher.await??;
    let mut probes = probes.into_iter();
    let mut tables = Vec::new();
    for (table, observed) in TABLES.into_iter().zip(observed) {
        let (longest, inserts) = match probes.next() {
            Some(probe) => {
                let (longest, inserts) = probe.await??;
                (Some(longest.as_secs_f64() * 1000.0), inserts)
            }
            None => (None, 0),
        };
        tables.push(TableResult {
            table: table.to_owned(),
            exclusive_ms: report
                .exclusive_ms
                .iter()
                .find(|(t, _)| t == table)
                .map(|(_, ms)| *ms),
            observed_exclusive_ms: observed.as_secs_f64() * 1000.0,
            longest_insert_ms: longest,
            inserts,
        });
    }
    db.drop_database().await?;
    Ok(Run {
        rows,
        foreign,
        moved_rows: report.moved_rows,
        enable_ms,
        tables,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut runs = Vec::new();
    for rows in &args.rows {
        let r = run(*rows, args.foreign, !args.no_writers).await?;
        println!(
            "{} rows per table, {:.0} % foreign ids: enable {:.0} ms, {} rows moved",
            r.rows,
            r.foreign * 100.0,
            r.enable_ms,
            r.moved_rows
        );
        println!(
            "  {:<16} {:>13} {:>13} {:>18} {:>8}",
            "table", "exclusive ms", "(pg_locks)", "longest insert ms", "inserts"
        );
        let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
        for t in &r.tables {
            println!(
                "  {:<16} {:>13} {:>13.0} {:>18} {:>8}",
                t.table,
                or_dash(t.exclusive_ms.map(|ms| ms.to_string())),
                t.observed_exclusive_ms,
                or_dash(t.longest_insert_ms.map(|ms| format!("{ms:.1}"))),
                t.inserts
            );
        }
        runs.push(r);
    }
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&runs)?)?;
    }
    Ok(())
}
