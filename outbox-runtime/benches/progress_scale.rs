//! What an operator's reads cost on a large outbox in the progress mode,
//! and what the default mode's indexes of unpublished rows would cost its
//! writers there. No broker.
//!
//! - **Reads**: `ops::status`, `ops::progress_lag` (lag per lane, the
//!   transaction holding the windows back) and the backlog gauges'
//!   statement (on the pool, and as the relays sample it: without JIT),
//!   timed `--runs` times each (median and maximum), on an
//!   outbox of `--history` rows the positions passed (16 lanes' positions,
//!   rows spread over ten days) and `--backlog` rows they have not, with a
//!   transaction left open inside lane 0's window. A cleanup pass (30-day
//!   retention: nothing to delete) is timed too.
//! - **Writers**: `--wal-rows` events inserted (1,000 per transaction, one
//!   connection) on a fresh outbox in the progress mode, with the default
//!   mode's two partial indexes of unpublished rows (as `enable` left them
//!   before it dropped them: every row stays in them) and without: WAL per
//!   event and rows per second.
//!
//! ```sh
//! cargo bench -p outbox-runtime --bench progress_scale -- [--history N] [--backlog N]
//!     [--runs N] [--wal-rows N] [--reuse] [--json PATH]
//! ```
//!
//! `--reuse` keeps the filled database of an earlier run with the same
//! `--history` (filling ten million rows takes minutes).

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use outbox_runtime::cleanup::{self, Retention};
use outbox_runtime::ops;
use outbox_runtime::relay::progress;
use serde::Serialize;
use sqlx::PgPool;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// Rows the positions passed.
    #[arg(long, default_value_t = 10_000_000)]
    history: u64,
    /// Rows they have not.
    #[arg(long, default_value_t = 200_000)]
    backlog: u64,
    /// Timings of each read.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Events inserted per writers' stage (0: no writers' stages).
    #[arg(long, default_value_t = 200_000)]
    wal_rows: u64,
    /// Keep the filled database of an earlier run with the same history.
    #[arg(long)]
    reuse: bool,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Serialize)]
struct Timing {
    read: &'static str,
    median_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Serialize)]
struct Writers {
    marks_indexes: bool,
    events_per_s: f64,
    wal_bytes_per_event: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    history: u64,
    backlog: u64,
    table_mb: f64,
    indexes_mb: Vec<(String, f64)>,
    reads: Vec<Timing>,
    writers: Vec<Writers>,
}

const HISTORY: &str = "
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic,
                          partition_key, created_at)
SELECT {uuid}, 'order', 'o-' || (g % 50000), 'placed',
       '{\"n\":1,\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}',
       'topic-' || (g % 5), 'k-' || (g % 50000),
       now() - interval '10 days' + g * (interval '10 days' / $2)
FROM generate_series($1 + 1, $1 + $3) g";

const FRESH: &str = "
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
SELECT {uuid}, 'order', 'o-' || g, 'placed', jsonb_build_object('n', g, 'note', repeat('x', 200)),
       'fresh', 'k-' || (g % 500)
FROM generate_series(1, $1) g";

/// One position per lane of 16 at the current snapshot: every row
/// committed so far is passed.
const POSITIONS: &str = "
INSERT INTO outbox_progress (slots, done)
SELECT ARRAY(SELECT s::int2 FROM generate_series(l, 63, 16) s), pg_current_snapshot()
FROM generate_series(0, 15) l";

async fn lsn(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn filled(pool: &PgPool, history: u64) -> bool {
    let marker: Option<i64> =
        sqlx::query_scalar("SELECT (obj_description('outbox_event'::regclass, 'pg_class'))::int8")
            .fetch_one(pool)
            .await
            .ok()
            .flatten();
    marker == Some(history as i64)
}

async fn fill(pool: &PgPool, history: u64) {
    progress::enable(pool).await.expect("the progress mode");
    let chunk = 500_000_u64;
    let sql = HISTORY.replace("{uuid}", common::UUID_V7_SQL);
    let started = Instant::now();
    let mut done = 0;
    while done < history {
        let n = chunk.min(history - done);
        sqlx::query(&sql)
            .bind(done as i64)
            .bind(history as i64)
            .bind(n as i64)
            .execute(pool)
            .await
            .expect("history");
        done += n;
        eprintln!(
            "filled {done} of {history} rows ({:.0} s)",
            started.elapsed().as_secs_f64()
        );
    }
    sqlx::query(POSITIONS)
        .execute(pool)
        .await
        .expect("positions");
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await
        .expect("vacuum");
    sqlx::query(&format!("COMMENT ON TABLE outbox_event IS '{history}'"))
        .execute(pool)
        .await
        .expect("marker");
}

/// Inserts `n` fresh events, 1,000 per transaction.
async fn insert(pool: &PgPool, n: u64) {
    let sql = FRESH.replace("{uuid}", common::UUID_V7_SQL);
    let mut left = n;
    while left > 0 {
        let k = left.min(1_000);
        sqlx::query(&sql)
            .bind(k as i64)
            .execute(pool)
            .await
            .expect("insert");
        left -= k;
    }
}

async fn time<F, Fut>(runs: usize, read: &'static str, mut f: F) -> Timing
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut ms = Vec::with_capacity(runs);
    for _ in 0..runs {
        let started = Instant::now();
        f().await;
        ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    let timing = Timing {
        read,
        median_ms: ms[ms.len() / 2],
        max_ms: ms[ms.len() - 1],
    };
    println!(
        "{:<44} median {:>8.1} ms   max {:>8.1} ms",
        timing.read, timing.median_ms, timing.max_ms
    );
    timing
}

/// A writers' stage on a fresh outbox in the progress mode, with the
/// default mode's indexes of unpublished rows or without.
async fn writers(rows: u64, marks_indexes: bool) -> Writers {
    let db = common::BenchDb::create("outbox_progress_scale_writers", 2)
        .await
        .expect("database");
    let pool = db.pool.clone();
    progress::enable(&pool).await.expect("the progress mode");
    if marks_indexes {
        for sql in [
            "CREATE INDEX ix_outbox_event_unpublished ON outbox_event (id)
             WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL",
            "CREATE INDEX ix_outbox_event_unpublished_slot ON outbox_event (lane_slot, id)
             WHERE coalesce(published_at, parked_at, held_until) IS NULL",
        ] {
            sqlx::query(sql).execute(&pool).await.expect("index");
        }
    }
    // Warm up (the first pages, the plan), then measure.
    insert(&pool, 10_000).await;
    let (before, started) = (lsn(&pool).await, Instant::now());
    insert(&pool, rows).await;
    let secs = started.elapsed().as_secs_f64();
    let wal = lsn(&pool).await - before;
    db.drop_database().await.expect("drop");
    let stage = Writers {
        marks_indexes,
        events_per_s: rows as f64 / secs,
        wal_bytes_per_event: wal as f64 / rows as f64,
    };
    println!(
        "writers, {:<34} {:>8.0} events/s   {:>6.0} B of WAL per event",
        if marks_indexes {
            "with the default mode's indexes"
        } else {
            "without them"
        },
        stage.events_per_s,
        stage.wal_bytes_per_event
    );
    stage
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let db = common::BenchDb::open("outbox_progress_scale", 4, args.reuse)
        .await
        .expect("database");
    let pool = db.pool.clone();
    if !(args.reuse && filled(&pool, args.history).await) {
        fill(&pool, args.history).await;
    }
    // The backlog (fresh at each run: not passed by the positions).
    sqlx::query("DELETE FROM outbox_event WHERE topic = 'fresh'")
        .execute(&pool)
        .await
        .expect("old backlog");
    // The positions afresh: 16 lanes' at the current snapshot, passing
    // every row kept (an earlier run's cleanup pass may have pruned a
    // lane's position its window superseded), and the old backlog's dead
    // rows vacuumed away (their index entries are in the lanes' range:
    // rows in that range are never deleted outside a benchmark).
    sqlx::query("DELETE FROM outbox_progress")
        .execute(&pool)
        .await
        .expect("old positions");
    sqlx::query(POSITIONS)
        .execute(&pool)
        .await
        .expect("positions");
    sqlx::query("VACUUM (INDEX_CLEANUP ON) outbox_event")
        .execute(&pool)
        .await
        .expect("vacuum");
    insert(&pool, args.backlog).await;
    // A transaction in flight inside lane 0's window: it holds the window
    // back, and `progress_lag` reports it.
    let mut open = pool.begin().await.expect("open transaction");
    let xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(&mut *open)
        .await
        .expect("xid");
    eprintln!("open transaction {xid}");
    // A later transaction commits: the open one is then in the snapshots'
    // `xip` list (a snapshot's `xmax` is past the last completed one).
    insert(&pool, 1).await;
    sqlx::query(
        "INSERT INTO outbox_progress (slots, done, upto, after_id)
         SELECT slots, done, pg_current_snapshot(), 0 FROM outbox_progress
         WHERE slots = ARRAY(SELECT s::int2 FROM generate_series(0, 63, 16) s)
         ORDER BY id DESC LIMIT 1",
    )
    .execute(&pool)
    .await
    .expect("lane 0's window");
    sqlx::query("ANALYZE outbox_event")
        .execute(&pool)
        .await
        .expect("analyze");

    let table_mb: f64 =
        sqlx::query_scalar("SELECT pg_table_size('outbox_event')::float8 / 1048576")
            .fetch_one(&pool)
            .await
            .expect("size");
    let indexes_mb: Vec<(String, f64)> = sqlx::query_as(
        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)::float8 / 1048576
         FROM pg_index WHERE indrelid = 'outbox_event'::regclass ORDER BY 2 DESC",
    )
    .fetch_all(&pool)
    .await
    .expect("indexes");
    println!(
        "== {} rows passed, {} not; table {table_mb:.0} MB",
        args.history, args.backlog
    );
    for (name, mb) in &indexes_mb {
        println!("   index {name:<40} {mb:>8.0} MB");
    }

    let runs = args.runs.max(1);
    let mut reads = Vec::new();
    reads.push(
        time(runs, "status", || async {
            let status = ops::status(&pool).await.expect("status");
            std::hint::black_box(status);
        })
        .await,
    );
    let lag = ops::progress_lag(&pool)
        .await
        .expect("lag")
        .expect("progress mode");
    println!(
        "   lag: {} lanes, lane 0 {} events; held back by {:?}",
        lag.lanes.len(),
        lag.lanes.first().map_or(0, |l| l.events),
        lag.holding.as_ref().map(|h| (h.xid, h.pid))
    );
    reads.push(
        time(runs, "progress lag (status, gauges, console)", || async {
            std::hint::black_box(ops::progress_lag(&pool).await.expect("lag"));
        })
        .await,
    );
    reads.push(
        time(runs, "backlog gauges' statement", || async {
            std::hint::black_box(
                sqlx::query(ops::progress_gauges_sql())
                    .fetch_all(&pool)
                    .await
                    .expect("gauges"),
            );
        })
        .await,
    );
    reads.push(
        time(
            runs,
            "backlog gauges' statement, as sampled (no JIT)",
            || async {
                let mut tx = pool
                    .begin_with("BEGIN READ ONLY; SET LOCAL jit = off")
                    .await
                    .expect("begin");
                std::hint::black_box(
                    sqlx::query(ops::progress_gauges_sql())
                        .fetch_all(&mut *tx)
                        .await
                        .expect("gauges"),
                );
                tx.commit().await.expect("commit");
            },
        )
        .await,
    );
    reads.push(
        time(
            runs,
            "cleanup pass (30 days: nothing to delete)",
            || async {
                let retention = Retention::new(Duration::from_secs(30 * 86_400));
                std::hint::black_box(cleanup::cleanup(&pool, &retention).await.expect("cleanup"));
            },
        )
        .await,
    );
    open.rollback().await.expect("rollback");

    let mut stages = Vec::new();
    if args.wal_rows > 0 {
        for marks_indexes in [true, false, true, false] {
            stages.push(writers(args.wal_rows, marks_indexes).await);
        }
    }
    let report = Report {
        history: args.history,
        backlog: args.backlog,
        table_mb,
        indexes_mb,
        reads,
        writers: stages,
    };
    let json = serde_json::to_string(&report).expect("json");
    println!("{json}");
    if let Some(path) = args.json {
        std::fs::write(path, &json).expect("write the JSON");
    }
}
