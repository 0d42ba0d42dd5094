//! Waking an idle relay: LISTEN for the NOTIFY that `outbox_event`'s trigger
//! sends at commit, with a poll interval as the fallback (and the only
//! mechanism when LISTEN is off or its connection is down). The channel and
//! the lock below are the outbox's own ([`OutboxScope`]): another schema's
//! outbox in the same database has others.
//!
//! NOTIFY is not free: PostgreSQL serializes committing transactions that
//! notified. So writers notify only while a relay is *waiting*: a waiting
//! relay holds the advisory lock [`OutboxScope::wake_lock`] exclusively on its LISTEN
//! connection ("armed"); the trigger takes it shared, and notifies only when
//! it cannot. A relay that finds work releases the lock ("disarmed"), and
//! writers stop paying for NOTIFY while relays are busy.
//!
//! No commit is missed: arming succeeds only when no writer holds the lock
//! shared, i.e. when every writer that inserted without notifying has
//! committed or rolled back; the relay then claims once more before waiting.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use crate::scope::OutboxScope;

/// How soon to look again when writers are mid-transaction.
const WRITERS_IN_FLIGHT_RECHECK: Duration = Duration::from_millis(1);

pub(crate) struct Waker {
    /// A pool of one connection, for LISTEN (and, while there is no
    /// listener, the look-up of the next hold's end): the waker never takes
    /// a connection from the relay's (or the application's) pool.
    pool: PgPool,
    /// The outbox's channel and wake-up lock.
    channel: String,
    wake_lock: i64,
    listen: bool,
    poll: Duration,
    listener: Option<PgListener>,
    armed: bool,
    lanes: Option<Arc<super::lanes::Shared>>,
}

impl Waker {
    pub fn new(pool: &PgPool, scope: OutboxScope, listen: bool, poll: Duration) -> Self {
        Self {
            pool: listen_pool(pool),
            channel: scope.channel(),
            wake_lock: scope.wake_lock(),
            listen,
            poll,
            listener: None,
            armed: false,
            lanes: None,
        }
    }

    /// Also wakes when the relay gains lanes.
    pub fn also_wake_on(&mut self, lanes: Arc<super::lanes::Shared>) {
        self.lanes = Some(lanes);
    }

    async fn connect(&mut self) {
        if !self.listen || self.listener.is_some() {
            return;
        }
        let result = async {
            let mut listener = PgListener::connect_with(&self.pool).await?;
            listener.listen(&self.channel).await?;
            Ok::<_, sqlx::Error>(listener)
        }
        .await;
        match result {
            Ok(listener) => {
                self.listener = Some(listener);
                self.armed = false;
            }
            Err(error) => {
                tracing::warn!(%error, "LISTEN unavailable; polling only until it is back");
            }
        }
    }

    /// Ends the LISTEN session cleanly (at most a moment's wait: an
    /// unreachable database does not hold the relay's shutdown up).
    pub async fn close(&mut self) {
        if self.armed {
            // Writers stop notifying now, not once the server has noticed
            // the session's end.
            if let Some(listener) = self.listener.as_mut() {
                let unlock = sqlx::query("SELECT pg_advisory_unlock($1)")
                    .bind(self.wake_lock)
                    .execute(&mut *listener);
                let _ = tokio::time::timeout(Duration::from_secs(2), unlock).await;
            }
            self.armed = false;
        }
        self.listener = None;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.pool.close()).await;
    }

    fn lost(&mut self, error: &sqlx::Error) {
        tracing::warn!(%error, "LISTEN connection lost; reconnecting");
        // The server releases the session's advisory lock with it. A fresh
        // pool makes sure the next listener is a new session (dropping the
        // old pool closes whatever it still held).
        self.listener = None;
        self.pool = listen_pool(&self.pool);
        self.armed = false;
    }

    /// The relay found work: writers may stop notifying.
    pub async fn busy(&mut self) {
        if !self.armed {
            return;
        }
        self.armed = false;
        if let Some(listener) = self.listener.as_mut() {
            let released = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
                .bind(self.wake_lock)
                .fetch_one(&mut *listener)
                .await;
            if let Err(error) = released {
                self.lost(&error);
            }
        }
    }

    /// The relay found nothing to claim. Returns right away after arming (so
    /// the relay claims once more), otherwise on a notification, after the
    /// poll interval, or on shutdown.
    pub async fn wait(&mut self, shutdown: &CancellationToken) {
        self.connect().await;
        let lanes = self.lanes.clone();
        let gained = async {
            match &lanes {
                Some(l) => l.gained.notified().await,
                None => std::future::pending().await,
            }
        };
        let Some(listener) = self.listener.as_mut() else {
            let wait = until_next_hold(&self.pool, self.poll).await;
            tokio::select! {
                _ = sleep_or_shutdown(wait, shutdown) => {}
                _ = gained => {}
            }
            return;
        };
        if !self.armed {
            let armed = sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)")
                .bind(self.wake_lock)
                .fetch_one(&mut *listener)
                .await;
            match armed {
                Ok(true) => {
                    self.armed = true;
                    return;
                }
                Ok(false) => {
                    // Held shared by writers mid-transaction (their rows will
                    // be claimable in a moment), or exclusively by another
                    // waiting relay of this outbox (then writers notify us
                    // both). Advisory locks are per database: a relay waiting
                    // on another database's outbox makes nobody notify us.
                    let other_relay_waits = sqlx::query_scalar::<_, bool>(
                        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'
                           AND granted AND mode = 'ExclusiveLock' AND objsubid = 1
                           AND ((classid::bigint << 32) | objid::bigint) = $1
                           AND database = (SELECT oid FROM pg_database
                                           WHERE datname = current_database()))",
                    )
                    .bind(self.wake_lock)
                    .fetch_one(&mut *listener)
                    .await
                    .unwrap_or(false);
                    if !other_relay_waits {
                        sleep_or_shutdown(WRITERS_IN_FLIGHT_RECHECK, shutdown).await;
                        return;
                    }
                }
                Err(error) => {
                    self.lost(&error);
                    sleep_or_shutdown(self.poll, shutdown).await;
                    return;
                }
            }
        }
        let Some(listener) = self.listener.as_mut() else {
            return;
        };
        let poll = until_next_hold(&mut *listener, self.poll).await;
        tokio::select! {
            received = tokio::time::timeout(poll, listener.recv()) => {
                match received {
                    Ok(Err(error)) => self.lost(&error),
                    Ok(Ok(_)) => {
                        // Several commits may have notified: one claim covers them.
                        while listener.next_buffered().is_some() {}
                    }
                    Err(_) => {}
                }
            }
            _ = shutdown.cancelled() => {}
            _ = gained => {}
        }
    }
}

/// The shortest wait for a hold to end: a row whose hold ends in less
/// than this is waited for this long (the relay's release runs about once
/// a [`RELEASE_INTERVAL`](super::held::RELEASE_INTERVAL) anyway); one whose
/// hold has ended, that long at most.
const MIN_HOLD_WAIT: Duration = Duration::from_millis(100);

/// The poll interval, or less if a held row's hold (a scheduled row's due
/// time, see [`held`](super::held)) ends sooner: an idle relay does not
/// sleep past it. A failed look-up leaves the poll interval.
async fn until_next_hold<'c, E>(executor: E, poll: Duration) -> Duration
where
    E: sqlx::PgExecutor<'c>,
{
    if poll <= MIN_HOLD_WAIT {
        return poll;
    }
    let query = sqlx::query_scalar(super::held::NEXT_HOLD).fetch_optional(executor);
    let next: Option<Option<f64>> = match tokio::time::timeout(poll, query).await {
        Ok(Ok(next)) => next,
        _ => None,
    };
    match next.flatten() {
        // Ended already, not yet released (the release runs once a
        // release interval, or was refused): no need to look more often.
        Some(secs) if secs <= 0.0 => poll.min(super::held::RELEASE_INTERVAL),
        Some(secs) if secs.is_finite() && secs < poll.as_secs_f64() => {
            // A few milliseconds past the end: the release compares with
            // its own statement's time.
            Duration::from_secs_f64(secs + 0.005).clamp(MIN_HOLD_WAIT, poll)
        }
        _ => poll,
    }
}

/// A lazily connecting one-connection pool to the database of `pool`.
fn listen_pool(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with((*pool.connect_options()).clone())
}

async fn sleep_or_shutdown(d: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.cancelled() => {}
    }
}
