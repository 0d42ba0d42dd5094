//! The maintenance lock: one maintainer of the partitions at a time per
//! outbox, the holder of a session-level advisory lock on the connection
//! doing the work, freed at once when a pass is cancelled.

use sqlx::pool::PoolConnection;
use sqlx::postgres::Postgres;
use sqlx::{PgConnection, PgPool};

use crate::error::{Error, Result};
use crate::scope::OutboxScope;

/// The key of the maintenance lock of the outbox `scope`.
async fn maintenance_lock(conn: &mut PgConnection) -> Result<i64> {
    let scope = OutboxScope::of(&mut *conn).await?;
    Ok(
        sqlx::query_scalar("SELECT hashtextextended('outbox partitions ' || $1::text, 0)")
            .bind(i64::from(scope.oid()))
            .fetch_one(&mut *conn)
            .await?,
    )
}

/// The maintenance lock, held by the session of the connection that does
/// the work. [`Maintainer::release`] unlocks it and gives the connection
/// back to the pool. Dropped unreleased (the pass was cancelled, maybe in
/// the middle of a statement), it closes the connection and cancels what
/// that session still runs: the server then ends the session, and the
/// lock with it, at once — not when a lock wait ends, nor when the pool
/// closes a connection that went back to it holding the lock.
struct Maintainer {
    conn: Option<PoolConnection<Postgres>>,
    pool: PgPool,
    pid: i32,
    lock: i64,
}

impl Maintainer {
    /// Takes the lock if nobody holds it.
    async fn try_take(pool: &PgPool) -> Result<Option<Self>> {
        let mut conn = pool.acquire().await?;
        let lock = maintenance_lock(&mut conn).await?;
        let (taken, pid): (bool, i32) =
            sqlx::query_as("SELECT pg_try_advisory_lock($1), pg_backend_pid()")
                .bind(lock)
                .fetch_one(&mut *conn)
                .await?;
        Ok(taken.then(|| Self {
            conn: Some(conn),
            pool: pool.clone(),
            pid,
            lock,
        }))
    }

    /// Unlocks; the connection goes back to the pool (or is closed, if the
    /// unlock failed: it must not go back holding the lock).
    async fn release(mut self) {
        if let Some(mut conn) = self.conn.take() {
            let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(self.lock)
                .execute(&mut *conn)
                .await;
            if unlocked.is_err() {
                drop(conn.detach());
            }
        }
    }
}

impl Drop for Maintainer {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        // Closing the socket ends an idle session; one in the middle of a
        // statement notices only once the statement is over, hence the
        // cancel (only while that session still holds the lock: a backend
        // pid is reused once its session has ended).
        drop(conn.detach());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (pool, pid, lock) = (self.pool.clone(), self.pid, self.lock);
        runtime.spawn(async move {
            let cancelled = sqlx::query(
                "SELECT pg_cancel_backend(pid) FROM pg_locks
                 WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = $1
                   AND ((classid::int8 << 32) | objid::int8) = $2",
            )
            .bind(pid)
            .bind(lock)
            .execute(&pool)
            .await;
            if let Err(error) = cancelled {
                tracing::debug!(%error, "could not cancel the statement of a dropped maintenance pass");
            }
        });
    }
}

/// Runs `work` holding the maintenance lock (see [`Maintainer`]); `None`
/// when another maintainer holds it.
pub(super) async fn as_leader<T>(
    pool: &PgPool,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T>,
) -> Result<Option<T>> {
    let Some(mut leader) = Maintainer::try_take(pool).await? else {
        return Ok(None);
    };
    let result = match leader.conn.as_deref_mut() {
        Some(conn) => work(conn).await,
        None => Err(Error::Task("maintenance connection lost".into())),
    };
    leader.release().await;
    result.map(Some)
}
