//! Lanes: per-key order with several relays.
//!
//! Every row belongs to one of `L` lanes, a pure function of its partition
//! key (`(hashtext(partition_key) & 2147483647) % L`), so all events of a key
//! share a lane. Each relay owns a set of lanes, as PostgreSQL session-level
//! advisory locks on a connection of its own (released by the server when the
//! session ends, so a dead relay's lanes come free at once), and claims only
//! rows of lanes it owns. One lane has one owner, so one relay publishes a
//! key's events, in id order.
//!
//! Membership and rebalancing use advisory locks too, no table: each relay
//! holds a member lock keyed by its backend pid and shares a lock naming `L`
//! (a relay configured with another `L` refuses to start). Every
//! [`REBALANCE_INTERVAL`] a relay reads `pg_locks`, computes its fair share
//! (`L / members`, the first `L % members` members by pid one more), lets go
//! of lanes above it and takes free ones below it.
//!
//! Handover: a relay releasing a lane may still have claimed rows of it in
//! flight. Each claim transaction holds a shared "in use" lock on the lanes
//! it claims from (taken *before* it checks, in the claim statement, that it
//! still owns them). A new owner claims from a lane only after it could take
//! that lane's "in use" lock exclusively once: i.e. after every transaction
//! of the previous owner that claimed from the lane has committed or rolled
//! back. Without that barrier, `SKIP LOCKED` would let the new owner publish
//! a key's later event while the old owner still held an earlier one.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{Connection, PgPool};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// Advisory lock class (first key of the two-key form) of lane ownership.
pub(crate) const LANE_CLASS: i32 = 0x6F62_6C00;
/// Class of the per-lane "in use" lock claim transactions hold shared.
pub(crate) const IN_USE_CLASS: i32 = 0x6F62_6C01;
/// Class of relay membership (second key: the backend pid).
pub(crate) const MEMBER_CLASS: i32 = 0x6F62_6C02;
/// Class of the lock naming the lane count (second key: `L`), held shared.
pub(crate) const COUNT_CLASS: i32 = 0x6F62_6C03;

/// How often a relay rebalances its lanes.
pub(crate) const REBALANCE_INTERVAL: Duration = Duration::from_millis(250);

/// The SQL expression of a row's lane, for `L` = `$n`.
pub(crate) fn lane_expr(count_param: usize) -> String {
    format!("((hashtext(partition_key) & 2147483647) % ${count_param})")
}

/// The lanes this relay may claim from right now.
#[derive(Debug, Clone, Default)]
pub(crate) struct Claimable {
    /// Lanes owned and past the handover barrier.
    pub lanes: Vec<i32>,
    /// The lane count `L`.
    pub count: i32,
    /// Backend pid of the connection holding the lane locks.
    pub pid: i32,
}

/// State shared between the lane manager and the relay loop.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    view: Mutex<Claimable>,
    /// Wakes an idle relay when it gains lanes.
    pub gained: Notify,
}

impl Shared {
    /// What the relay may claim from now (an empty set while it owns none).
    pub fn claimable(&self) -> Claimable {
        self.view.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn set(&self, view: Claimable) {
        let grew = {
            let mut current = match self.view.lock() {
                Ok(v) => v,
                Err(poisoned) => poisoned.into_inner(),
            };
            let grew = view.lanes.iter().any(|l| !current.lanes.contains(l));
            *current = view;
            grew
        };
        if grew {
            self.gained.notify_one();
        }
    }
}

/// Keeps this relay's share of the lanes; runs beside the relay loop.
pub(crate) struct LaneManager {
    pool: PgPool,
    count: i32,
    shared: Arc<Shared>,
    conn: Option<Session>,
}

/// The connection holding this relay's locks, and what it holds.
struct Session {
    conn: PgConnection,
    pid: i32,
    /// Owned and past the barrier.
    ready: BTreeSet<i32>,
    /// Owned, waiting for the previous owner's transactions to end.
    pending: BTreeSet<i32>,
}

/// One row of `pg_locks` about lanes and members.
#[derive(sqlx::FromRow)]
struct LockRow {
    class: i64,
    key: i64,
    pid: i32,
}

const LOCKS: &str = "\
SELECT classid::int8 AS class, objid::int8 AS key, pid
FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 2
  AND classid IN (1868721152, 1868721154, 1868721155)
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

impl LaneManager {
    /// Connects, joins as a member and takes a first share of the lanes, so
    /// the relay's first claim already has lanes. A database that is down is
    /// not an error here (the manager keeps trying); another relay running
    /// with a different lane count is.
    pub async fn start(pool: &PgPool, count: u16, shared: Arc<Shared>) -> Result<Self> {
        let mut manager = Self {
            pool: pool.clone(),
            count: i32::from(count),
            shared,
            conn: None,
        };
        match manager.connect().await {
            Ok(()) => {
                if let Err(error) = manager.rebalance().await {
                    manager.lost(&error);
                }
            }
            Err(Error::Config(message)) => return Err(Error::Config(message)),
            Err(error) => manager.lost(&error),
        }
        Ok(manager)
    }

    /// Runs until `stop` is cancelled, then releases every lane.
    pub fn spawn(mut self, stop: CancellationToken) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut failures = 0_u32;
            loop {
                let wait = if failures == 0 {
                    REBALANCE_INTERVAL
                } else {
                    crate::backoff::delay(
                        Duration::from_millis(100),
                        Duration::from_secs(5),
                        failures,
                    )
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => break,
                }
                let result = match self.conn {
                    Some(_) => self.rebalance().await,
                    None => match self.connect().await {
                        Ok(()) => self.rebalance().await,
                        Err(error) => Err(error),
                    },
                };
                match result {
                    Ok(()) => {
                        if failures > 0 {
                            tracing::info!("lane manager reconnected");
                        }
                        failures = 0;
                    }
                    Err(error) => {
                        if failures == 0 {
                            self.lost(&error);
                        }
                        failures = failures.saturating_add(1);
                    }
                }
            }
            self.shared.set(Claimable::default());
            if let Some(session) = self.conn.take() {
                // Closing the session releases its locks.
                let _ = session.conn.close().await;
            }
        })
    }

    fn lost(&mut self, error: &Error) {
        tracing::warn!(%error, "lane manager lost its connection; claiming nothing until it is back");
        self.conn = None;
        self.shared.set(Claimable::default());
    }

    async fn connect(&mut self) -> Result<()> {
        // A server that does not answer fails the connect after the pool's
        // acquire timeout, as the pool's own connections do.
        let timeout = self.pool.options().get_acquire_timeout();
        let mut conn = tokio::time::timeout(
            timeout,
            PgConnection::connect_with(&self.pool.connect_options()),
        )
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
        let pid: i32 = sqlx::query_scalar(
            "SELECT pg_backend_pid() FROM
               (SELECT pg_advisory_lock_shared($1, $2), pg_advisory_lock($3, pg_backend_pid())) AS l",
        )
        .bind(COUNT_CLASS)
        .bind(self.count)
        .bind(MEMBER_CLASS)
        .fetch_one(&mut conn)
        .await?;
        let others: Vec<i32> = sqlx::query_scalar(
            "SELECT DISTINCT objid::int FROM pg_locks
             WHERE locktype = 'advisory' AND granted AND objsubid = 2
               AND classid = 1868721155 AND objid::int <> $1
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(self.count)
        .fetch_all(&mut conn)
        .await?;
        if let Some(other) = others.first() {
            let _ = conn.close().await;
            return Err(Error::Config(format!(
                "other relays run with {other} lanes, this one with {}: all relays of a database must use the same lane count",
                self.count
            )));
        }
        self.conn = Some(Session {
            conn,
            pid,
            ready: BTreeSet::new(),
            pending: BTreeSet::new(),
        });
        Ok(())
    }

    /// One round: read who holds what, let go of lanes above the fair share,
    /// take free lanes below it, pass the barrier of newly taken lanes.
    async fn rebalance(&mut self) -> Result<()> {
        let count = self.count;
        let Some(session) = self.conn.as_mut() else {
            return Ok(());
        };
        let locks: Vec<LockRow> = sqlx::query_as(LOCKS).fetch_all(&mut session.conn).await?;
        let mut members: Vec<i32> = locks
            .iter()
            .filter(|l| l.class == i64::from(MEMBER_CLASS))
            .map(|l| l.pid)
            .collect();
        members.sort_unstable();
        members.dedup();
        let held_by_anyone: BTreeSet<i32> = locks
            .iter()
            .filter(|l| l.class == i64::from(LANE_CLASS))
            .filter_map(|l| i32::try_from(l.key).ok())
            .collect();
        let target = fair_share(count, &members, session.pid);

        let owned = session.ready.len() + session.pending.len();
        if owned > target {
            // Pending lanes go first (nothing claimed from them yet), then
            // the highest ready ones. The relay stops claiming from them
            // before the locks go.
            let mut release = Vec::new();
            while session.ready.len() + session.pending.len() > target {
                let lane = match session.pending.pop_last() {
                    Some(l) => l,
                    None => match session.ready.pop_last() {
                        Some(l) => l,
                        None => break,
                    },
                };
                release.push(lane);
            }
            self.shared.set(Claimable {
                lanes: session.ready.iter().copied().collect(),
                count,
                pid: session.pid,
            });
            sqlx::query("SELECT pg_advisory_unlock($1, l) FROM unnest($2::int4[]) AS l")
                .bind(LANE_CLASS)
                .bind(&release)
                .execute(&mut session.conn)
                .await?;
            tracing::debug!(released = ?release, target, "lanes released");
        } else if owned < target {
            let free: Vec<i32> = (0..count)
                .filter(|l| !held_by_anyone.contains(l))
                .filter(|l| !session.ready.contains(l) && !session.pending.contains(l))
                .collect();
            if !free.is_empty() {
                let want = i64::try_from(target - owned).unwrap_or(i64::MAX);
                let taken: Vec<i32> = sqlx::query_scalar(
                    "SELECT l FROM (SELECT l FROM unnest($2::int4[]) AS l LIMIT $3) AS f
                     WHERE pg_try_advisory_lock($1, l)",
                )
                .bind(LANE_CLASS)
                .bind(&free)
                .bind(want)
                .fetch_all(&mut session.conn)
                .await?;
                session.pending.extend(taken);
            }
        }

        if !session.pending.is_empty() {
            let pending: Vec<i32> = session.pending.iter().copied().collect();
            // Taken (and released right away) only when no transaction of a
            // previous owner still holds the lane's "in use" lock shared.
            let passed: Vec<i32> = sqlx::query_scalar(
                "SELECT l FROM unnest($2::int4[]) AS l
                 WHERE pg_try_advisory_lock($1, l) AND pg_advisory_unlock($1, l)",
            )
            .bind(IN_USE_CLASS)
            .bind(&pending)
            .fetch_all(&mut session.conn)
            .await?;
            for lane in &passed {
                session.pending.remove(lane);
                session.ready.insert(*lane);
            }
            if !passed.is_empty() {
                tracing::debug!(taken = ?passed, target, "lanes taken");
            }
        }
        self.shared.set(Claimable {
            lanes: session.ready.iter().copied().collect(),
            count,
            pid: session.pid,
        });
        Ok(())
    }
}

/// This member's share of `count` lanes: `count / members`, one more for the
/// first `count % members` members in pid order.
fn fair_share(count: i32, members: &[i32], me: i32) -> usize {
    let n = members.len().max(1);
    let count = usize::try_from(count).unwrap_or(0);
    let index = members.iter().position(|m| *m == me).unwrap_or(n - 1);
    count / n + usize::from(index < count % n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_to_the_lane_count() {
        for members in 1..=20_i32 {
            let pids: Vec<i32> = (100..100 + members).collect();
            let total: usize = pids.iter().map(|p| fair_share(16, &pids, *p)).sum();
            assert_eq!(total, 16, "{members} members");
        }
        assert_eq!(fair_share(16, &[7, 9, 11], 7), 6);
        assert_eq!(fair_share(16, &[7, 9, 11], 9), 5);
        assert_eq!(fair_share(16, &[7, 9, 11], 11), 5);
    }

    #[test]
    fn a_member_not_yet_listed_gets_the_smallest_share() {
        assert_eq!(fair_share(16, &[1, 2], 3), 8);
        assert_eq!(fair_share(16, &[], 3), 16);
    }

    #[test]
    fn lock_classes_match_the_sql_literals() {
        assert_eq!(LANE_CLASS, 1_868_721_152);
        assert_eq!(MEMBER_CLASS, 1_868_721_154);
        assert_eq!(COUNT_CLASS, 1_868_721_155);
    }
}
