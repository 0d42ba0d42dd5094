//! Running an event's handlers inside the caller's transaction: each handler
//! gets a [`HandlerContext`] on that transaction, and its follow-up events
//! are flushed to the outbox right after it returns `Ok`. Also the verdicts
//! the callers act on, and the retry delays.

use std::time::Duration;

use outbox_core::HandlerContext;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

use super::db::{handler_error_is_outage, is_outage};
use super::dispatch::Registry;
use super::record::{Event, Rejected};

/// Why a transaction over events did not commit.
pub(crate) enum Failure {
    /// The database is unavailable: back off, retry, count nothing.
    Outage(String),
    /// A handler failed on the event at index `at` of the transaction's
    /// range: counts as an attempt of that event.
    Handler {
        at: usize,
        handler: &'static str,
        error: String,
    },
    /// The event at `at` turned out not to decode (dead-letter it).
    Rejected { at: usize, rejected: Box<Rejected> },
}

impl Failure {
    /// The same failure, located at index `at`.
    pub fn at(self, at: usize) -> Self {
        match self {
            Self::Handler { handler, error, .. } => Self::Handler { at, handler, error },
            Self::Rejected { rejected, .. } => Self::Rejected { at, rejected },
            outage => outage,
        }
    }
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        Self::Outage(error.to_string())
    }
}

/// Runs every handler of `event`, in order, on `conn` (the caller's
/// transaction), flushing each handler's follow-up events. The caller rolls
/// back on any error.
pub(crate) async fn run_handlers(
    conn: &mut PgConnection,
    registry: &Registry,
    event: &mut Event,
) -> Result<(), Failure> {
    for i in 0..event.handlers.len() {
        let value = event
            .take_decoded(i, registry)
            .map_err(|rejected| Failure::Rejected { at: 0, rejected })?;
        let handler = registry.handler(event.handlers[i]);
        let mut ctx = HandlerContext::new(&mut *conn, &event.incoming);
        if let Err(error) = handler.handle(&mut ctx, value).await {
            return Err(if handler_error_is_outage(&error) {
                Failure::Outage(error.to_string())
            } else {
                Failure::Handler {
                    at: 0,
                    handler: handler.name(),
                    error: error.to_string(),
                }
            });
        }
        match ctx.flush().await {
            Ok(_) => {}
            Err(outbox_core::Error::Database(db)) if is_outage(&db) => {
                return Err(Failure::Outage(db.to_string()));
            }
            Err(error) => {
                return Err(Failure::Handler {
                    at: 0,
                    handler: handler.name(),
                    error: format!("writing the handler's follow-up events failed: {error}"),
                });
            }
        }
    }
    Ok(())
}

/// Sleeps `d` unless `shutdown` comes first; returns false on shutdown.
pub(crate) async fn pause(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = shutdown.cancelled() => false,
    }
}
