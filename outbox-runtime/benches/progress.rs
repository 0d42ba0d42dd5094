//! Publishing by marks against progress per batch, the database's side
//! only (docs/design/progress-per-batch.md). No broker: the rows are read
//! the way each mode reads them and handed over to nothing, so what is
//! measured is what the database writes and spends to publish them, and
//! what that costs the writers beside it.
//!
//! - marks: the claim's shape (`FOR UPDATE SKIP LOCKED`, id order, over the
//!   partial index of unpublished rows) and an `UPDATE … SET published_at`
//!   per batch, one transaction per batch;
//! - progress: the progress mode's reader (`relay::progress`), a position
//!   appended per batch; its schema: the `(lane_slot, txid)` index instead
//!   of the two partial indexes of unpublished rows.
//!
//! Each stage starts from an empty, vacuumed table; autovacuum is off on
//! the outbox but in the rounds (where it can clean up only without the
//! transaction holding the xmin horizon).
//!
//! ```sh
//! cargo bench -p outbox-runtime --bench progress -- [--events N] [--json PATH]
//! ```

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_runtime::relay::progress::{self, Chunk};
use serde::Serialize;
use sqlx::{Connection, PgPool};

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// The backlog drained by each mode.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// Rows per batch.
    #[arg(long, default_value_t = 500)]
    batch: i64,
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

#[derive(Debug, Default, Serialize)]
struct Drain {
    events: u64,
    secs: f64,
    events_per_s: f64,
    wal_bytes_per_event: f64,
    /// CPU time of the draining session's backend per event.
    backend_cpu_us_per_event: f64,
    /// Row versions of `outbox_event` made dead (updated or deleted), per
    /// event.
    dead_tuples_per_event: f64,
}

#[derive(Debug, Serialize)]
struct Stage {
    mode: Mode,
    insert_wal_bytes_per_event: f64,
    drain: Drain,
    publish_wal_over_insert_wal: f64,
    writers_alone_commits_per_s: f64,
    writers_during_drain_commits_per_s: f64,
    writers_ratio: f64,
    rounds_held_xmin_events_per_s: Vec<f64>,
    rounds_free_events_per_s: Vec<f64>,
}

const INSERT: &str = "
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
SELECT {uuid}, 'order', 'o' || g, 'placed',
       jsonb_build_object('n', g, 'note', repeat('x', 200)), 'orders', 'k' || (g % 500)
FROM generate_series(1, $1) AS g";

const MARKS_CLAIM: &str = "
SELECT id, event_id, payload::text AS payload, headers::text AS headers, ctid::text AS tid
FROM outbox_event
WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

const MARK: &str = "UPDATE outbox_event SET published_at = statement_timestamp()
WHERE ctid = ANY($1::text[]::tid[]) AND event_id = ANY($2::uuid[])";

async fn lsn(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Row versions of `outbox_event` made dead so far (updated or deleted).
async fn versions(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT (n_tup_upd + n_tup_del)::int8 FROM pg_stat_user_tables WHERE relname = 'outbox_event'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// User and system CPU time of process `pid`, in seconds.
fn cpu_secs(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th of the line.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Inserts `n` events, 1,000 per transaction.
async fn insert(pool: &PgPool, n: u64) {
    let sql = INSERT.replace("{uuid}", common::UUID_V7_SQL);
    let mut left = n;
    while left > 0 {
        let now = left.min(1000);
        sqlx::query(&sql)
            .bind(now as i32)
            .execute(pool)
            .await
            .unwrap();
        left -= now;
    }
}

/// Empties the outbox and gives it `mode`'s schema.
async fn reset(pool: &PgPool, mode: Mode) {
    for sql in [
        "TRUNCATE outbox_event, outbox_progress",
        "ALTER TABLE outbox_event SET (autovacuum_enabled = off)",
        "DROP INDEX IF EXISTS ix_outbox_event_progress",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
    match mode {
        Mode::Marks => {
            for sql in [
                "CREATE INDEX IF NOT EXISTS ix_outbox_event_unpublished ON outbox_event (id)
                 WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL",
                "CREATE INDEX IF NOT EXISTS ix_outbox_event_unpublished_slot ON outbox_event (lane_slot, id)
                 WHERE coalesce(published_at, parked_at, held_until) IS NULL",
            ] {
                sqlx::query(sql).execute(pool).await.unwrap();
            }
        }
        Mode::Progress => {
            for sql in [
                "DROP INDEX IF EXISTS ix_outbox_event_unpublished",
                "DROP INDEX IF EXISTS ix_outbox_event_unpublished_slot",
            ] {
                sqlx::query(sql).execute(pool).await.unwrap();
            }
            progress::enable(pool).await.unwrap();
        }
    }
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(pool)
        .await
        .unwrap();
}

/// Publishes (to nothing) until `target` events are read, or, with no
/// target, until nothing is left.
async fn drain(pool: &PgPool, mode: Mode, batch: i64, target: Option<u64>) -> Drain {
    let mut conn = pool.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let versions0 = versions(pool).await;
    let (cpu0, wal0, t0) = (cpu_secs(pid), lsn(pool).await, Instant::now());
    let mut events = 0u64;
    let done = |events: u64| target.is_some_and(|t| events >= t);
    match mode {
        Mode::Marks => loop {
            let mut tx = conn.begin().await.unwrap();
            let rows: Vec<(i64, uuid::Uuid, String, String, String)> = sqlx::query_as(MARKS_CLAIM)
                .bind(batch)
                .fetch_all(&mut *tx)
                .await
                .unwrap();
            if rows.is_empty() {
                tx.commit().await.unwrap();
                if target.is_none() || done(events) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            let tids: Vec<&str> = rows.iter().map(|r| r.4.as_str()).collect();
            let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.1).collect();
            sqlx::query(MARK)
                .bind(&tids)
                .bind(&ids)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            events += rows.len() as u64;
            if done(events) {
                break;
            }
        },
        Mode::Progress => {
            let slots: Vec<i16> = (0..64).collect();
            let mut window = progress::load(&mut conn, &slots).await.unwrap();
            let mut empty = true;
            loop {
                match window
                    .next(&mut conn, batch as usize, 1 << 24)
                    .await
                    .unwrap()
                {
                    Chunk::Rows(rows) => {
                        empty = false;
                        events += rows.len() as u64;
                        window.record(&mut conn).await.unwrap();
                        if done(events) {
                            break;
                        }
                    }
                    Chunk::Finished => {
                        window.advance();
                        window.record(&mut conn).await.unwrap();
                        if empty && (target.is_none() || done(events)) {
                            break;
                        }
                        empty = true;
                    }
                }
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let (cpu, wal) = (cpu_secs(pid) - cpu0, lsn(pool).await - wal0);
    // The session's counts reach the statistics when it goes idle.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dead = versions(pool).await - versions0;
    let per = |x: f64| if events == 0 { 0.0 } else { x / events as f64 };
    Drain {
        events,
        secs,
        events_per_s: events as f64 / secs,
        wal_bytes_per_event: per(wal as f64),
        backend_cpu_us_per_event: per(cpu * 1e6),
        dead_tuples_per_event: per(dead as f64),
    }
}

/// Application writers: `n` sessions committing one event per transaction
/// until `stop`; the commits.
fn writers(pool: &PgPool, n: usize, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<u64>> {
    let sql = INSERT.replace("{uuid}", common::UUID_V7_SQL);
    (0..n)
        .map(|_| {
            let (pool, stop, sql) = (pool.clone(), stop.clone(), sql.clone());
            tokio::spawn(async move {
                let mut commits = 0;
                while !stop.load(Ordering::Relaxed) {
                    sqlx::query(&sql).bind(1).execute(&pool).await.unwrap();
                    commits += 1;
                }
                commits
            })
        })
        .collect()
}

async fn stop_writers(stop: &AtomicBool, handles: Vec<tokio::task::JoinHandle<u64>>) -> u64 {
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for h in handles {
        total += h.await.unwrap();
    }
    total
}

async fn stage(pool: &PgPool, mode: Mode, a: &Args) -> Stage {
    // The backlog: what inserting it writes, then what publishing it does.
    reset(pool, mode).await;
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    let w0 = lsn(pool).await;
    insert(pool, a.events).await;
    let insert_wal = (lsn(pool).await - w0) as f64 / a.events as f64;
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    let drain_backlog = drain(pool, mode, a.batch, None).await;

    // Writers alone, then beside a drain of the same backlog.
    reset(pool, mode).await;
    let stop = Arc::new(AtomicBool::new(false));
    let alone_for = Duration::from_secs(3);
    let handles = writers(pool, 4, stop.clone());
    tokio::time::sleep(alone_for).await;
    let alone = stop_writers(&stop, handles).await as f64 / alone_for.as_secs_f64();
    reset(pool, mode).await;
    insert(pool, a.events).await;
    let stop = Arc::new(AtomicBool::new(false));
    let t = Instant::now();
    let handles = writers(pool, 4, stop.clone());
    drain(pool, mode, a.batch, Some(a.events)).await;
    let during = stop_writers(&stop, handles).await as f64 / t.elapsed().as_secs_f64();

    // Rounds, with a transaction holding the xmin horizon, and without.
    let mut rounds = [Vec::new(), Vec::new()];
    for (i, held) in [true, false].into_iter().enumerate() {
        reset(pool, mode).await;
        // Vacuum as in production: it can clean up only without the holder.
        sqlx::query("ALTER TABLE outbox_event SET (autovacuum_enabled = on)")
            .execute(pool)
            .await
            .unwrap();
        let mut holder = if held {
            Some(common::hold_xmin(pool).await)
        } else {
            None
        };
        for _ in 0..a.rounds {
            insert(pool, a.round_events).await;
            let d = drain(pool, mode, a.batch, None).await;
            rounds[i].push(d.events_per_s.round());
        }
        if let Some(c) = holder.as_mut() {
            sqlx::query("ROLLBACK").execute(&mut *c).await.unwrap();
        }
    }
    let [held, free] = rounds;
    Stage {
        mode,
        insert_wal_bytes_per_event: insert_wal.round(),
        publish_wal_over_insert_wal: drain_backlog.wal_bytes_per_event / insert_wal,
        drain: drain_backlog,
        writers_alone_commits_per_s: alone.round(),
        writers_during_drain_commits_per_s: during.round(),
        writers_ratio: during / alone,
        rounds_held_xmin_events_per_s: held,
        rounds_free_events_per_s: free,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let db = common::BenchDb::create("outbox_bench_progress", 8).await?;
    let pool = db.pool.clone();
    println!(
        "progress benchmark (database only): {} events backlog, batches of {}, {} rounds of {} with and without a held xmin",
        a.events, a.batch, a.rounds, a.round_events
    );
    let mut stages = Vec::new();
    for mode in [Mode::Marks, Mode::Progress] {
        let s = stage(&pool, mode, &a).await;
        println!(
            "{:>8}: insert {:>4} B/event WAL; publish {:>5.0} ev/s, {:>4.0} B/event WAL ({:.2}x insert), \
             {:.1} us backend CPU/event, {:.2} dead tuples/event; writers {:.2}x alone ({} vs {} commits/s); \
             rounds with a held xmin {:?} ev/s, without {:?}",
            format!("{mode:?}").to_lowercase(),
            s.insert_wal_bytes_per_event,
            s.drain.events_per_s,
            s.drain.wal_bytes_per_event,
            s.publish_wal_over_insert_wal,
            s.drain.backend_cpu_us_per_event,
            s.drain.dead_tuples_per_event,
            s.writers_ratio,
            s.writers_during_drain_commits_per_s,
            s.writers_alone_commits_per_s,
            s.rounds_held_xmin_events_per_s,
            s.rounds_free_events_per_s,
        );
        stages.push(s);
    }
    let json = serde_json::json!({
        "benchmark": "progress",
        "events": a.events,
        "batch": a.batch,
        "rounds": a.rounds,
        "round_events": a.round_events,
        "stages": stages,
    });
    println!("{json}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    db.drop_database().await?;
    Ok(())
}
