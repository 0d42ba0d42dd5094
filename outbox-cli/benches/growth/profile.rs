//! Where the time goes while writers and a relay share the machine: CPU
//! seconds per process group (from `/proc`, Linux only), PostgreSQL wait
//! events of the writers' and the relay's backends (sampled from
//! `pg_stat_activity`), and the WAL written.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::PgPool;

/// `application_name` of the writers' connections.
pub const WRITERS_APP: &str = "growth-writers";
/// `application_name` of the relay's connections.
pub const RELAY_APP: &str = "growth-relay";

/// Clock ticks per second of `/proc/*/stat` times (USER_HZ, 100 on Linux).
const TICKS: f64 = 100.0;

/// CPU ticks (user + system) of a `/proc/.../stat` line, and its `comm`.
fn stat(path: &str) -> Option<(String, u64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    let fields: Vec<&str> = text[close + 2..].split_whitespace().collect();
    // Fields after `comm`: state is 0; utime 11, stime 12.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((comm, utime + stime))
}

/// Busy ticks of the whole machine (all CPUs), from `/proc/stat`.
fn machine() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?;
    let n: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    let idle = n.get(3)? + n.get(4)?;
    let total: u64 = n.iter().take(8).sum();
    Some((total - idle, total))
}

/// One snapshot of the CPU ticks of every process (and of this process's
/// threads), with the application name of each PostgreSQL backend.
struct Snapshot {
    at: Instant,
    processes: HashMap<u32, (String, u64)>,
    threads: HashMap<u32, (String, u64)>,
    machine: (u64, u64),
}

fn snapshot() -> Snapshot {
    let mut processes = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if let Some(s) = stat(&format!("/proc/{pid}/stat")) {
                processes.insert(pid, s);
            }
        }
    }
    let mut threads = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
        for entry in dir.flatten() {
            let Ok(tid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if let Some(s) = stat(&format!("/proc/self/task/{tid}/stat")) {
                threads.insert(tid, s);
            }
        }
    }
    Snapshot {
        at: Instant::now(),
        processes,
        threads,
        machine: machine().unwrap_or_default(),
    }
}

/// A running profile: CPU snapshots at both ends, wait events sampled
/// in between.
pub struct Profile {
    start: Snapshot,
    lsn: String,
    stop: Arc<AtomicBool>,
    sampler: tokio::task::JoinHandle<BTreeMap<(String, String), u64>>,
    pool: PgPool,
}

/// Starts profiling (`pool`: a connection for `pg_stat_activity`).
pub async fn start(pool: &PgPool) -> Result<Profile, sqlx::Error> {
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (pool, stop) = (pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
            while !stop.load(Ordering::Relaxed) {
                let rows: Vec<(String, String)> = sqlx::query_as(
                    "SELECT application_name,
                            coalesce(wait_event_type || ':' || wait_event, 'CPU (' || state || ')')
                     FROM pg_stat_activity
                     WHERE application_name IN ($1, $2) AND state <> 'idle'",
                )
                .bind(WRITERS_APP)
                .bind(RELAY_APP)
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
                for row in rows {
                    *counts.entry(row).or_default() += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            counts
        })
    };
    Ok(Profile {
        start: snapshot(),
        lsn,
        stop,
        sampler,
        pool: pool.clone(),
    })
}

impl Profile {
    /// Ends the profile; returns CPU cores used per group, the wait-event
    /// shares, the WAL rate, as JSON, and prints them.
    pub async fn finish(self) -> Result<Value, Box<dyn std::error::Error>> {
        let end = snapshot();
        self.stop.store(true, Ordering::Relaxed);
        let waits = self.sampler.await?;
        let wal: f64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - $1::pg_lsn)::float8")
            .bind(&self.lsn)
            .fetch_one(&self.pool)
            .await?;
        let apps: Vec<(i32, String)> =
            sqlx::query_as("SELECT pid, application_name FROM pg_stat_activity")
                .fetch_all(&self.pool)
                .await?;
        let app: HashMap<u32, String> = apps
            .into_iter()
            .map(|(pid, name)| (pid as u32, name))
            .collect();
        let secs = end.at.duration_since(self.start.at).as_secs_f64();
        let me = std::process::id();
        let mut groups: BTreeMap<String, u64> = BTreeMap::new();
        for (pid, (comm, ticks)) in &end.processes {
            if *pid == me {
                continue;
            }
            let before = self.start.processes.get(pid).map_or(0, |(_, t)| *t);
            let used = ticks.saturating_sub(before);
            let group = if comm == "postgres" {
                match app.get(pid).map(String::as_str) {
                    Some(WRITERS_APP) => "postgres: writers' backends".to_owned(),
                    Some(RELAY_APP) => "postgres: relay's backends".to_owned(),
                    _ => "postgres: other (walwriter, autovacuum, ...)".to_owned(),
                }
            } else if comm.starts_with("tansu") {
                "broker (tansu)".to_owned()
            } else {
                "other processes".to_owned()
            };
            *groups.entry(group).or_default() += used;
        }
        for (tid, (comm, ticks)) in &end.threads {
            let before = self.start.threads.get(tid).map_or(0, |(_, t)| *t);
            let group = if comm.starts_with("rdk:") {
                "this process: librdkafka threads"
            } else {
                "this process: tokio (writers' client, relay)"
            };
            *groups.entry(group.to_owned()).or_default() += ticks.saturating_sub(before);
        }
        let (busy, total) = (
            end.machine.0.saturating_sub(self.start.machine.0),
            end.machine.1.saturating_sub(self.start.machine.1),
        );
        let cores = |ticks: u64| ticks as f64 / TICKS / secs;
        println!(
            "  CPU over {secs:.1} s (cores; the machine: {:.2} busy of {:.0}):",
            cores(busy),
            total as f64 / TICKS / secs
        );
        let mut cpu = serde_json::Map::new();
        for (group, ticks) in &groups {
            println!("    {group}: {:.2}", cores(*ticks));
            cpu.insert(
                group.clone(),
                json!((cores(*ticks) * 100.0).round() / 100.0),
            );
        }
        let mut shares = serde_json::Map::new();
        for who in [WRITERS_APP, RELAY_APP] {
            let all: u64 = waits
                .iter()
                .filter(|((a, _), _)| a == who)
                .map(|(_, n)| n)
                .sum();
            let mut top: Vec<(&String, u64)> = waits
                .iter()
                .filter(|((a, _), _)| a == who)
                .map(|((_, e), n)| (e, *n))
                .collect();
            top.sort_by_key(|b| std::cmp::Reverse(b.1));
            let line: Vec<String> = top
                .iter()
                .take(6)
                .map(|(e, n)| format!("{e} {:.0} %", 100.0 * *n as f64 / all.max(1) as f64))
                .collect();
            println!("    {who} active backends, sampled: {}", line.join(", "));
            shares.insert(
                who.to_owned(),
                json!(
                    top.iter()
                        .map(|(e, n)| (e.to_string(), json!(*n as f64 / all.max(1) as f64)))
                        .collect::<serde_json::Map<_, _>>()
                ),
            );
        }
        let wal_mib_s = wal / 1048576.0 / secs;
        println!("    WAL {wal_mib_s:.1} MiB/s");
        Ok(
            json!({ "cpu_cores": cpu, "waits": shares, "wal_mib_per_s": (wal_mib_s * 10.0).round() / 10.0 }),
        )
    }
}
