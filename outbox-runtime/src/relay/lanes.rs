//! Lanes: per-key order with several relays.
//!
//! Every row stores, at insert, its slot: one of [`SLOTS`] (64), a pure
//! function of its partition key (the generated column `lane_slot`,
//! `(hashtext(partition_key) & 2147483647) % 64`). A lane is a fixed set of
//! slots, `lane = slot % L` (so `L` must divide 64: see
//! [`RelayConfig::lanes`](super::RelayConfig::lanes)), and all events of a
//! key share a lane (`slot % L` = `hash % L`, the lane of earlier versions).
//! The claim walks the index ranges of its lanes' slots only (see
//! [`claim`](super::claim)). Each relay owns a set of lanes, as PostgreSQL session-level
//! advisory locks on a connection of its own (released by the server when the
//! session ends, so a dead relay's lanes come free at once), and claims only
//! rows of lanes it owns. One lane has one owner, so one relay publishes a
//! key's events, in id order. The locks are those of one outbox table (see
//! [`OutboxScope`]): relays of another schema's outbox never meet them.
//!
//! Membership and rebalancing use advisory locks too, no table: each relay
//! holds a member lock keyed by its backend pid and shares a lock naming `L`.
//! A relay configured with another `L` refuses to start, and so do a relay
//! without lanes (`L` = 0, which claims every row) beside relays with lanes,
//! and a relay with lanes beside one without. Every [`REBALANCE_INTERVAL`] a
//! relay reads `pg_locks`, computes its fair share (`L / members`, the first
//! `L % members` members by pid one more), lets go of lanes above it and
//! takes free ones below it.
//!
//! Handover: a relay releasing a lane may still have claimed rows of it in
//! flight. Each claim transaction holds a shared "in use" lock on the lanes
//! it claims from (taken *before* it checks, in the claim statement, that it
//! still owns them). A new owner claims from a lane only after it could take
//! that lane's "in use" lock exclusively once: i.e. after every transaction
//! of the previous owner that claimed from the lane has committed or rolled
//! back. Without that barrier, `SKIP LOCKED` would let the new owner publish
//! a key's later event while the old owner still held an earlier one.
//!
//! A relay that stops answering (its host frozen, its connection half-open)
//! must not keep its lanes: the lane session sets `idle_session_timeout` to
//! [`RelayConfig::lane_timeout`](super::RelayConfig::lane_timeout) (it speaks
//! every 250 ms, so only a silent relay hits it) and server-side TCP
//! keepalives and `tcp_user_timeout` within the same time; its claim
//! transactions set `idle_in_transaction_session_timeout` (see
//! [`claim`](super::claim)), so the barrier is passed at the latest then.
//! The relay's own side gives up a round that takes longer than the lane
//! timeout and claims nothing until it has a session again.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{Connection, PgPool};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::scope::{Lock, OutboxScope};

/// How often a relay rebalances its lanes.
pub(crate) const REBALANCE_INTERVAL: Duration = Duration::from_millis(250);

/// The number of slots rows are stored in (the `lane_slot` column); a lane
/// is the slots `s` with `s % L` = the lane, so a lane count must divide it.
/// 64: lane counts up to 64 (relays of one outbox rarely number more), and a
/// relay owning every lane merges 64 index ranges per claim.
pub(crate) const SLOTS: i32 = 64;

/// The slots of `lanes`, for `count` lanes (a divisor of [`SLOTS`]), in order.
pub(crate) fn slots_of(count: i32, lanes: &[i32]) -> Vec<i32> {
    let mut slots: Vec<i32> = lanes
        .iter()
        .flat_map(|lane| (*lane..SLOTS).step_by(usize::try_from(count.max(1)).unwrap_or(1)))
        .collect();
    slots.sort_unstable();
    slots.dedup();
    slots
}

/// `pg_locks` rows of this database's advisory locks of one outbox (`$1`:
/// the table's oid), one-key form.
pub(crate) const SCOPE_LOCKS: &str = "locktype = 'advisory' AND granted AND objsubid = 1
  AND classid = $1::int8::oid
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// What this relay may claim right now.
#[derive(Debug, Clone)]
pub(crate) struct Claimable {
    /// The outbox.
    pub scope: OutboxScope,
    /// The lane count `L`; 0: no lanes (the relay claims every row).
    pub count: i32,
    /// Lanes owned and past the handover barrier (none without lanes).
    pub lanes: Vec<i32>,
    /// Backend pid of the session holding this relay's locks; 0 while it
    /// has none (then it claims nothing).
    pub pid: i32,
}

impl Claimable {
    /// Whether the relay may claim at all: it has a lock session and, with
    /// lanes, owns some.
    pub fn any(&self) -> bool {
        self.pid != 0 && (self.count == 0 || !self.lanes.is_empty())
    }
}

/// State shared between the lane manager and the relay loop.
#[derive(Debug)]
pub(crate) struct Shared {
    view: Mutex<Claimable>,
    /// Wakes an idle relay when it gains lanes.
    pub gained: Notify,
}

impl Shared {
    pub fn new(scope: OutboxScope, count: u16) -> Self {
        Self {
            view: Mutex::new(Claimable {
                scope,
                count: i32::from(count),
                lanes: Vec::new(),
                pid: 0,
            }),
            gained: Notify::new(),
        }
    }

    /// What the relay may claim from now (nothing while it has no session).
    pub fn claimable(&self) -> Claimable {
        match self.view.lock() {
            Ok(v) => v.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set(&self, lanes: Vec<i32>, pid: i32) {
        let grew = {
            let mut current = match self.view.lock() {
                Ok(v) => v,
                Err(poisoned) => poisoned.into_inner(),
            };
            let grew =
                (pid != 0 && current.pid == 0) || lanes.iter().any(|l| !current.lanes.contains(l));
            current.lanes = lanes;
            current.pid = pid;
            grew
        };
        if grew {
            self.gained.notify_one();
        }
    }
}

/// Keeps this relay's share of the lanes (or, without lanes, its
/// registration); runs beside the relay loop.
pub(crate) struct LaneManager {
    pool: PgPool,
    scope: OutboxScope,
    count: i32,
    timeout: Duration,
    shared: Arc<Shared>,
    conn: Option<Session>,
    /// Reports refusals (a role that may not connect, say): see
    /// [`crate::refusal`].
    health: crate::backoff::Health,
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

/// One row of `pg_locks` about lanes, members and lane counts.
#[derive(sqlx::FromRow)]
struct LockRow {
    kind: i32,
    value: i32,
    pid: i32,
}

/// Lanes, members and lane counts of one outbox (`$1`).
static LOCKS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT (objid::int8 >> 24)::int4 AS kind, (objid::int8 & 16777215)::int4 AS value, pid
         FROM pg_locks WHERE {SCOPE_LOCKS} AND (objid::int8 >> 24) IN ({}, {}, {})",
        Lock::Lane as u8,
        Lock::Member as u8,
        Lock::Count as u8
    )
});

/// Lane counts other relays of the outbox (`$1`) run with, other than `$2`.
static OTHER_COUNTS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT DISTINCT (objid::int8 & 16777215)::int4 FROM pg_locks
         WHERE {SCOPE_LOCKS} AND (objid::int8 >> 24) = {}
           AND (objid::int8 & 16777215)::int4 <> $2",
        Lock::Count as u8
    )
});

/// Relays of versions whose lane locks were per database (two-key locks of
/// classes 0x6F626C00-03) and so invisible to this one's: running beside
/// them would publish the same keys twice over.
const EARLIER_VERSION: &str = "\
SELECT EXISTS (SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 2
      AND classid IN (1868721152, 1868721154, 1868721155)
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))";

/// Server-side timeouts of the lane session (only those the server knows:
/// `idle_session_timeout` is PostgreSQL 14+).
const SESSION_TIMEOUTS: &str = "\
SELECT count(set_config(s.name, s.value, false))
FROM (VALUES ('idle_session_timeout', $1), ('tcp_user_timeout', $1),
             ('tcp_keepalives_idle', $2), ('tcp_keepalives_interval', $3),
             ('tcp_keepalives_count', '3')) AS s(name, value)
WHERE s.name IN (SELECT name FROM pg_settings)";

impl LaneManager {
    /// Connects, joins as a member and takes a first share of the lanes, so
    /// the relay's first claim already has lanes. A database that is down is
    /// not an error here (the manager keeps trying); another relay of the
    /// outbox running with a different lane count is.
    pub async fn start(
        pool: &PgPool,
        scope: OutboxScope,
        count: u16,
        timeout: Duration,
        shared: Arc<Shared>,
        problems: crate::backoff::Problems,
    ) -> Result<Self> {
        let mut manager = Self {
            pool: pool.clone(),
            scope,
            count: i32::from(count),
            timeout,
            shared,
            conn: None,
            health: crate::backoff::Health::new(
                "database (lane manager)",
                Duration::from_millis(100),
                Duration::from_secs(5),
            )
            .reporting(problems),
        };
        match manager.round().await {
            Ok(()) => {}
            Err(Error::Config(message)) => return Err(Error::Config(message)),
            Err(error) => manager.lost(&error),
        }
        Ok(manager)
    }

    /// Runs until `stop` is cancelled (or dropped: see the relay), then
    /// releases every lane.
    pub fn spawn(mut self, stop: CancellationToken) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut failures = 0_u32;
            loop {
                let wait = if failures == 0 {
                    REBALANCE_INTERVAL
                } else if self.health.refusing() {
                    Duration::from_secs(5)
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
                match self.round().await {
                    Ok(()) => {
                        if failures > 0 {
                            tracing::info!("lane manager reconnected");
                        }
                        failures = 0;
                        self.health.up();
                    }
                    Err(error) => {
                        if failures == 0 {
                            self.lost(&error);
                        } else {
                            self.conn = None;
                            let trouble = crate::refusal::Trouble::from(&error);
                            if trouble.refusal().is_some() {
                                self.health.down(trouble);
                            }
                        }
                        failures = failures.saturating_add(1);
                    }
                }
            }
            self.shared.set(Vec::new(), 0);
            if let Some(mut session) = self.conn.take() {
                // Released explicitly: closing alone leaves them held until
                // the server has noticed the session's end.
                let unlock =
                    sqlx::query("SELECT pg_advisory_unlock_all()").execute(&mut session.conn);
                let _ = tokio::time::timeout(self.timeout, unlock).await;
                let _ = tokio::time::timeout(self.timeout, session.conn.close()).await;
            }
        })
    }

    /// One round (connecting first if needed), bounded by the lane timeout:
    /// a database that does not answer within it costs the session.
    async fn round(&mut self) -> Result<()> {
        let timeout = self.timeout;
        let round = async {
            if self.conn.is_none() {
                self.connect().await?;
            }
            self.rebalance().await
        };
        match tokio::time::timeout(timeout, round).await {
            Ok(result) => result,
            Err(_) => Err(Error::Task(format!(
                "the database did not answer the lane manager within {timeout:?}"
            ))),
        }
    }

    fn lost(&mut self, error: &Error) {
        let trouble = crate::refusal::Trouble::from(error);
        if trouble.refusal().is_some() {
            self.health.down(trouble);
        } else {
            tracing::warn!(%error, "lane manager lost its connection; claiming nothing until it is back");
        }
        self.conn = None;
        self.shared.set(Vec::new(), 0);
    }

    async fn connect(&mut self) -> Result<()> {
        // A server that does not answer fails the connect after the pool's
        // acquire timeout, as the pool's own connections do.
        let connect_timeout = self.pool.options().get_acquire_timeout();
        let mut conn = tokio::time::timeout(
            connect_timeout,
            PgConnection::connect_with(&self.pool.connect_options()),
        )
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
        let ms = self.timeout.as_millis().max(1).to_string();
        let secs = |d: Duration| d.as_secs().max(1).to_string();
        sqlx::query(SESSION_TIMEOUTS)
            .bind(&ms)
            .bind(secs(self.timeout / 2))
            .bind(secs(self.timeout / 6))
            .execute(&mut conn)
            .await?;
        let pid: i32 = sqlx::query_scalar(
            "SELECT pg_backend_pid() FROM
               (SELECT pg_advisory_lock_shared($1), pg_advisory_lock($2 | pg_backend_pid())) AS l",
        )
        .bind(self.scope.key(Lock::Count, self.count))
        .bind(self.scope.base(Lock::Member))
        .fetch_one(&mut conn)
        .await?;
        let others: Vec<i32> = sqlx::query_scalar(&OTHER_COUNTS)
            .bind(i64::from(self.scope.oid()))
            .bind(self.count)
            .fetch_all(&mut conn)
            .await?;
        let earlier: bool = sqlx::query_scalar(EARLIER_VERSION)
            .fetch_one(&mut conn)
            .await?;
        if earlier {
            let _ = sqlx::query("SELECT pg_advisory_unlock_all()")
                .execute(&mut conn)
                .await;
            let _ = conn.close().await;
            return Err(Error::Config(
                "relays of an earlier version run on this database (their lanes are the whole \
                 database's and cannot be shared with this version's): stop them before \
                 starting relays of this version"
                    .into(),
            ));
        }
        if let Some(other) = others.first() {
            let _ = sqlx::query("SELECT pg_advisory_unlock_all()")
                .execute(&mut conn)
                .await;
            let _ = conn.close().await;
            let describe = |n: i32| match n {
                0 => "without lanes (--lanes 0)".to_owned(),
                n => format!("with {n} lanes"),
            };
            return Err(Error::Config(format!(
                "other relays of this outbox run {}, this one {}: all relays of an outbox must use \
                 the same lane count (a relay without lanes would publish the keys of every lane \
                 beside their owners)",
                describe(*other),
                describe(self.count)
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
    /// Without lanes, only proves the session alive.
    async fn rebalance(&mut self) -> Result<()> {
        let count = self.count;
        let scope = self.scope;
        let Some(session) = self.conn.as_mut() else {
            return Ok(());
        };
        if count == 0 {
            sqlx::query("SELECT 1").execute(&mut session.conn).await?;
            self.shared.set(Vec::new(), session.pid);
            return Ok(());
        }
        let locks: Vec<LockRow> = sqlx::query_as(&LOCKS)
            .bind(i64::from(scope.oid()))
            .fetch_all(&mut session.conn)
            .await?;
        let mut members: Vec<i32> = locks
            .iter()
            .filter(|l| l.kind == Lock::Member as i32)
            .map(|l| l.pid)
            .collect();
        members.sort_unstable();
        members.dedup();
        let held_by_anyone: BTreeSet<i32> = locks
            .iter()
            .filter(|l| l.kind == Lock::Lane as i32)
            .map(|l| l.value)
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
            self.shared
                .set(session.ready.iter().copied().collect(), session.pid);
            sqlx::query("SELECT pg_advisory_unlock($1 | l) FROM unnest($2::int4[]) AS l")
                .bind(scope.base(Lock::Lane))
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
                     WHERE pg_try_advisory_lock($1 | l)",
                )
                .bind(scope.base(Lock::Lane))
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
                 WHERE pg_try_advisory_lock($1 | l) AND pg_advisory_unlock($1 | l)",
            )
            .bind(scope.base(Lock::InUse))
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
        self.shared
            .set(session.ready.iter().copied().collect(), session.pid);
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
    fn a_lane_is_every_slot_of_its_residue() {
        assert_eq!(slots_of(16, &[3]), vec![3, 19, 35, 51]);
        assert_eq!(slots_of(16, &[5, 0]), vec![0, 5, 16, 21, 32, 37, 48, 53]);
        assert_eq!(slots_of(1, &[0]), (0..64).collect::<Vec<_>>());
        assert_eq!(slots_of(64, &[63]), vec![63]);
        // Every slot in exactly one lane.
        for count in [1, 2, 4, 8, 16, 32, 64] {
            let all: Vec<i32> = slots_of(count, &(0..count).collect::<Vec<_>>());
            assert_eq!(all, (0..64).collect::<Vec<_>>(), "{count}");
        }
    }

    #[test]
    fn lock_kinds_match_the_sql_literals() {
        assert!(LOCKS.contains("IN (1, 3, 4)"), "{}", *LOCKS);
        assert!(OTHER_COUNTS.contains(">> 24) = 4"), "{}", *OTHER_COUNTS);
    }
}
