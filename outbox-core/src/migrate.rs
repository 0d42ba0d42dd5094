//! The embedded schema migrations (`outbox-core/migrations/`, also reached as
//! `migrations/` at the workspace root), and
//! how schema changes wait for their locks ([`LockPolicy`]).
//!
//! They live in sqlx's `_sqlx_migrations` table under timestamped versions.
//! [`MIGRATOR`] ignores versions it does not know, so an application may keep
//! its own sqlx migrations in the same database; the application's migrator
//! needs `set_ignore_missing(true)` for the same reason.

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::error::{Error, Result};

/// The outbox's migrations, embedded at compile time. Usable with
/// `#[sqlx::test(migrator = "outbox::MIGRATOR")]`.
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};

/// How a schema change (a migration, `outbox notify on|off`) waits for the
/// locks it needs on the outbox's tables.
///
/// `ALTER TABLE outbox_event` needs the table's `ACCESS EXCLUSIVE` lock, so
/// it waits for the relays' open claim transactions; and while it waits in
/// the lock queue, every writer's `INSERT` waits behind it. So each attempt
/// waits at most `lock_timeout` (PostgreSQL's `lock_timeout`), then leaves
/// the queue — writers and relays go on — and the change is tried again
/// after `retry_delay` (doubling up to 10 s), for at most `max_wait` in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockPolicy {
    /// How long one attempt may wait for a lock (default 2 s).
    pub lock_timeout: Duration,
    /// The first pause between attempts (default 500 ms).
    pub retry_delay: Duration,
    /// How long to keep trying (default 5 min).
    pub max_wait: Duration,
}

impl Default for LockPolicy {
    fn default() -> Self {
        Self {
            lock_timeout: Duration::from_secs(2),
            retry_delay: Duration::from_millis(500),
            max_wait: Duration::from_secs(300),
        }
    }
}

/// Longest pause between two attempts.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(10);

impl LockPolicy {
    /// A policy with these per-attempt and total waits.
    pub fn new(lock_timeout: Duration, max_wait: Duration) -> Self {
        Self {
            lock_timeout,
            max_wait,
            ..Self::default()
        }
    }

    /// Runs `attempt` until it succeeds, fails with something other than a
    /// lock timeout (SQLSTATE `55P03`), or `max_wait` has passed; then the
    /// error says how long it tried. `what` names the change in logs.
    pub async fn retry<T, F, Fut>(&self, what: &str, mut attempt: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let start = Instant::now();
        let mut delay = self.retry_delay;
        let mut attempts = 0_u32;
        loop {
            attempts += 1;
            match attempt().await {
                Err(error) if is_lock_timeout(&error) => {
                    if start.elapsed() + delay >= self.max_wait {
                        return Err(Error::LockTimeout {
                            what: what.to_owned(),
                            attempts,
                            waited: start.elapsed(),
                        });
                    }
                    tracing::warn!(
                        what,
                        attempts,
                        lock_timeout_ms = self.lock_timeout.as_millis() as u64,
                        "a lock the change needs is held (open transactions on the table); \
                         gave up the wait so that writers go on, trying again"
                    );
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(MAX_RETRY_DELAY);
                }
                other => return other,
            }
        }
    }

    /// A connection of its own (not from `pool`: its session settings and
    /// advisory locks end with it) whose statements wait at most
    /// `lock_timeout` for a lock. Connecting waits at most the pool's
    /// acquire timeout.
    pub async fn connect(&self, pool: &PgPool) -> Result<PgConnection> {
        let options = pool
            .connect_options()
            .as_ref()
            .clone()
            .options([("lock_timeout", self.lock_timeout.as_millis().to_string())]);
        let timeout = pool.options().get_acquire_timeout();
        match tokio::time::timeout(timeout, options.connect()).await {
            Ok(conn) => Ok(conn?),
            Err(_) => Err(Error::Database(sqlx::Error::PoolTimedOut)),
        }
    }
}

/// True for PostgreSQL's "could not obtain lock" (`lock_timeout` expired).
pub(crate) fn is_lock_timeout(error: &Error) -> bool {
    let database = match error {
        Error::Database(e) => e,
        Error::Migrate(MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _)) => e,
        _ => return false,
    };
    matches!(database, sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03"))
}

/// Creates or upgrades `outbox_event`, `inbox_event`, `processed_event` and
/// `dead_letter`, waiting for locks as [`LockPolicy::default`] says.
///
/// Idempotent: applied versions are skipped; concurrent callers are
/// serialized by sqlx's advisory lock. Each migration commits on its own, so
/// a retry after a lock timeout resumes where the last attempt stopped.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    migrate_with(pool, &LockPolicy::default()).await
}

/// [`migrate`] with another lock policy. Runs on a connection of its own
/// (not one of `pool`'s).
pub async fn migrate_with(pool: &PgPool, policy: &LockPolicy) -> Result<()> {
    policy
        .retry("migrations", || async {
            let mut conn = policy.connect(pool).await?;
            // On error the connection is dropped, and with it the
            // migrator's advisory lock.
            MIGRATOR.run_direct(&mut conn).await?;
            let _ = conn.close().await;
            Ok(())
        })
        .await
}
