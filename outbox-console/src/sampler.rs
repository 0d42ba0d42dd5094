//! Throughput, measured by sampling: at most once a second (when a page or
//! the chart asks), the console reads the status (exact backlogs over the
//! partial indexes) and the highest row id. Between two samples, the rows
//! written per topic are the new ids (a short range of the primary key),
//! and the rows published are those written minus the growth of the topic's
//! backlog (unpublished + parked + dropped rows: a row parked or dropped is
//! not counted as published). No query counts the table.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox_runtime::ops::{self, Status};
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::Mutex;

/// Samples kept for the chart (at 2 s a poll: about 8 minutes).
pub const POINTS: usize = 240;

/// Closest two samples may be.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Most new rows counted per topic between two samples; beyond, only the
/// total is known for that interval.
pub const MAX_RANGE: i64 = 200_000;

/// One point of the chart: rates over the interval before `t`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Point {
    /// Unix time in milliseconds.
    pub t: u64,
    /// Rows written per second.
    pub written: f64,
    /// Rows published per second.
    pub published: f64,
    /// The backlog (unpublished rows) at `t`.
    pub backlog: i64,
}

struct Sample {
    at: Instant,
    last_id: i64,
    backlog: HashMap<String, i64>,
}

#[derive(Default)]
struct Inner {
    last: Option<Sample>,
    points: VecDeque<Point>,
    rates: HashMap<String, f64>,
    status: Option<Status>,
}

/// The samples, shared by every request.
#[derive(Default)]
pub struct Sampler {
    inner: Mutex<Inner>,
}

/// What the overview shows.
pub struct Snapshot {
    /// The status as of the last sample.
    pub status: Status,
    /// Published rows per second per topic over the last interval.
    pub rates: HashMap<String, f64>,
    /// The chart's points, oldest first.
    pub points: Vec<Point>,
}

fn backlog_of(status: &Status) -> HashMap<String, i64> {
    status
        .topics
        .iter()
        .map(|t| (t.topic.clone(), t.unpublished + t.parked + t.discarded))
        .collect()
}

impl Sampler {
    /// Samples if the last sample is older than [`MIN_INTERVAL`], and
    /// returns the latest state.
    pub async fn snapshot(&self, pool: &PgPool) -> Result<Snapshot, outbox_runtime::Error> {
        let mut inner = self.inner.lock().await;
        let due = inner
            .last
            .as_ref()
            .is_none_or(|s| s.at.elapsed() >= MIN_INTERVAL);
        if due || inner.status.is_none() {
            let status = ops::status(pool).await?;
            let last_id = ops::last_id(pool).await?;
            let at = Instant::now();
            let backlog = backlog_of(&status);
            if let Some(prev) = &inner.last {
                let secs = at.duration_since(prev.at).as_secs_f64().max(0.001);
                let new_rows = (last_id - prev.last_id).max(0);
                let written: HashMap<String, i64> = if new_rows == 0 {
                    HashMap::new()
                } else if new_rows <= MAX_RANGE {
                    ops::written_by_topic(pool, prev.last_id, last_id)
                        .await?
                        .into_iter()
                        .collect()
                } else {
                    HashMap::new()
                };
                let mut rates = HashMap::new();
                let mut published_total = 0.0;
                let topics: std::collections::HashSet<&String> =
                    backlog.keys().chain(prev.backlog.keys()).collect();
                for topic in topics {
                    let grew = backlog.get(topic).copied().unwrap_or(0)
                        - prev.backlog.get(topic).copied().unwrap_or(0);
                    let published =
                        (written.get(topic).copied().unwrap_or(0) - grew).max(0) as f64 / secs;
                    published_total += published;
                    rates.insert(topic.clone(), published);
                }
                if new_rows > MAX_RANGE {
                    // Per topic unknown: the total from the id range.
                    let grew: i64 =
                        backlog.values().sum::<i64>() - prev.backlog.values().sum::<i64>();
                    published_total = (new_rows - grew).max(0) as f64 / secs;
                }
                let t = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                inner.points.push_back(Point {
                    t,
                    written: new_rows as f64 / secs,
                    published: published_total,
                    backlog: status.unpublished,
                });
                while inner.points.len() > POINTS {
                    inner.points.pop_front();
                }
                inner.rates = rates;
            }
            inner.last = Some(Sample {
                at,
                last_id,
                backlog,
            });
            inner.status = Some(status);
        }
        Ok(Snapshot {
            status: inner.status.clone().expect("sampled above"),
            rates: inner.rates.clone(),
            points: inner.points.iter().copied().collect(),
        })
    }
}
