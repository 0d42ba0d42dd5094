//! Waking an idle relay: LISTEN for the NOTIFY that `outbox_event`'s trigger
//! sends at commit, with a poll interval as the fallback (and the only
//! mechanism when LISTEN is off or its connection is down).

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

/// The channel the migration's trigger notifies.
pub(crate) const CHANNEL: &str = "outbox_event";

pub(crate) struct Waker {
    pool: PgPool,
    listen: bool,
    poll: Duration,
    listener: Option<PgListener>,
}

impl Waker {
    pub fn new(pool: &PgPool, listen: bool, poll: Duration) -> Self {
        Self {
            pool: pool.clone(),
            listen,
            poll,
            listener: None,
        }
    }

    async fn connect(&mut self) {
        if !self.listen || self.listener.is_some() {
            return;
        }
        let result = async {
            let mut listener = PgListener::connect_with(&self.pool).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        }
        .await;
        match result {
            Ok(listener) => self.listener = Some(listener),
            Err(error) => {
                tracing::warn!(%error, "LISTEN unavailable; polling only until it is back")
            }
        }
    }

    /// Returns on a notification, after the poll interval, or on shutdown.
    pub async fn wait(&mut self, shutdown: &CancellationToken) {
        self.connect().await;
        let poll = self.poll;
        match self.listener.as_mut() {
            Some(listener) => {
                tokio::select! {
                    received = tokio::time::timeout(poll, listener.recv()) => {
                        if let Ok(Err(error)) = received {
                            tracing::warn!(%error, "LISTEN connection lost; reconnecting");
                            self.listener = None;
                        } else if let Some(listener) = self.listener.as_mut() {
                            // Several commits may have notified: one claim covers them.
                            while listener.next_buffered().is_some() {}
                        }
                    }
                    _ = shutdown.cancelled() => {}
                }
            }
            None => {
                tokio::select! {
                    _ = tokio::time::sleep(poll) => {}
                    _ = shutdown.cancelled() => {}
                }
            }
        }
    }
}
