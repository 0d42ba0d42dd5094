//! Running an event's handlers inside the caller's transaction: each handler
//! gets a [`HandlerContext`] on that transaction; a panic, a timeout or an
//! error counts as a failure; an error that only shows an earlier handler
//! broke the transaction makes the caller check event by event (see
//! `txn.rs`). The follow-up events of the handlers that returned `Ok` are
//! gathered in [`FollowUps`] and written to the outbox with one statement at
//! the end of the transaction. Also the verdicts the callers act on.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::task::Poll;
use std::time::Duration;

use futures_util::FutureExt as _;
use outbox_core::{HandlerContext, Headers, OutboxMessage};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::db::{is_outage, sqlx_error_in};
use super::dispatch::Registry;
use super::record::{Event, Rejected};
use super::txn::{self, Broken};
use crate::refusal::{Statement, Trouble, about_the_data, retrying_cures};

/// Why a transaction over events did not commit.
pub(crate) enum Failure {
    /// The database is unavailable, or refuses one of the consumer's own
    /// statements (see `crate::refusal`): back off, retry, count nothing —
    /// never the event's fault.
    Outage(Trouble),
    /// A handler failed on the event at index `at` of the transaction's
    /// range: counts as an attempt of that event. `clean`: no handler of
    /// the event was given the connection (see
    /// [`HandlerContext::touched`]), so the transaction holds nothing of
    /// the event's but its dedup row: the caller may skip the event without
    /// taking the transaction back.
    Handler {
        at: usize,
        handler: &'static str,
        error: String,
        clean: bool,
    },
    /// The event at `at` turned out not to decode (dead-letter it).
    Rejected { at: usize, rejected: Box<Rejected> },
    /// A handler broke the transaction (aborted or ended it) without
    /// saying so; which one is not known yet. The caller rolls back and
    /// runs the range again, checking after each event
    /// ([`Handling::careful`]). Counts nothing.
    Suspect(String),
}

impl Failure {
    /// The same failure, located at index `at`.
    pub fn at(self, at: usize) -> Self {
        match self {
            Self::Handler {
                handler,
                error,
                clean,
                ..
            } => Self::Handler {
                at,
                handler,
                error,
                clean,
            },
            Self::Rejected { rejected, .. } => Self::Rejected { at, rejected },
            other => other,
        }
    }
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        Self::Outage(error.into())
    }
}

/// The follow-up events' insert, as a refusal names it.
const FOLLOW_UPS: Statement = Statement {
    name: "consumer: write follow-up events",
    needs: "INSERT ON outbox_event",
};

/// A failed follow-up insert that is not the handler's doing: an outage, or
/// a refusal of our setup (a missing privilege, say) rather than of the
/// events' data.
fn not_the_handlers(error: &sqlx::Error) -> Option<Failure> {
    if is_outage(error) || !(retrying_cures(error) || about_the_data(error)) {
        Some(Failure::Outage(Trouble::from(error).during(FOLLOW_UPS)))
    } else {
        None
    }
}

/// The follow-up events recorded by the handlers of one transaction, in
/// record order, each with the handler (and the event's index in the
/// transaction's range, `at`) that recorded it.
///
/// They are written with one statement at the end of the transaction, not
/// one per handler: the outbox insert takes the key-bucket locks of all its
/// rows in bucket order, so a consumer transaction and a writer (or another
/// consumer) can never deadlock on them, as two inserts taking the buckets
/// of different events one after the other could.
#[derive(Default)]
pub(crate) struct FollowUps {
    /// Index of the event whose handlers run now.
    pub at: usize,
    messages: Vec<OutboxMessage>,
    owners: Vec<(usize, &'static str)>,
}

impl FollowUps {
    /// Adds `other`'s events after these.
    pub fn append(&mut self, other: Self) {
        self.messages.extend(other.messages);
        self.owners.extend(other.owners);
    }

    /// Forgets the events recorded for the event at `at` (its handlers
    /// failed after an earlier one of them recorded some).
    pub fn forget(&mut self, at: usize) {
        let mut owners = self.owners.iter();
        self.messages
            .retain(|_| owners.next().is_some_and(|(owner, _)| *owner != at));
        self.owners.retain(|(owner, _)| *owner != at);
    }

    fn push(&mut self, handler: &'static str, messages: Vec<OutboxMessage>) {
        self.owners
            .extend(std::iter::repeat_n((self.at, handler), messages.len()));
        self.messages.extend(messages);
    }

    /// Writes every follow-up event to the outbox on `conn`. If the statement
    /// fails for a reason other than an outage or a refusal of the
    /// consumer's own setup (its role may not insert into the outbox, say:
    /// never an event's fault), finds the event whose follow-ups caused it
    /// (writing them handler by handler) and returns a handler failure
    /// located there.
    pub async fn write(self, conn: &mut PgConnection) -> Result<(), Failure> {
        if self.messages.is_empty() {
            return Ok(());
        }
        sqlx::query("SAVEPOINT outbox_follow_ups")
            .execute(&mut *conn)
            .await?;
        let error =
            match outbox_core::insert_messages(&mut *conn, &self.messages, &Headers::default())
                .await
            {
                Ok(_) => return Ok(()),
                Err(outbox_core::Error::Database(db)) => match not_the_handlers(&db) {
                    Some(failure) => return Err(failure),
                    None => outbox_core::Error::Database(db),
                },
                Err(error) => error,
            };
        sqlx::query("ROLLBACK TO SAVEPOINT outbox_follow_ups")
            .execute(&mut *conn)
            .await?;
        // Handler by handler, in order, to find the one the statement failed on.
        let mut start = 0;
        for run in self.owners.chunk_by(|a, b| a == b) {
            let (at, handler) = run[0];
            let end = start + run.len();
            match outbox_core::insert_messages(
                &mut *conn,
                &self.messages[start..end],
                &Headers::default(),
            )
            .await
            {
                Ok(_) => {}
                Err(error) => {
                    if let outbox_core::Error::Database(db) = &error
                        && let Some(failure) = not_the_handlers(db)
                    {
                        return Err(failure);
                    }
                    return Err(Failure::Handler {
                        at,
                        handler,
                        error: format!("writing the handler's follow-up events failed: {error}"),
                        clean: false,
                    });
                }
            }
            start = end;
        }
        // Each part went in on its own (the whole failed on something else):
        // they are all written now.
        tracing::debug!(%error, "follow-up events written event by event");
        Ok(())
    }
}

/// Starts a segment of a transaction over events: a failing handler takes
/// the transaction back here, and the rest goes on.
pub(crate) const SAVEPOINT: &str = "SAVEPOINT outbox_segment";

/// Most segments (savepoints) of one transaction: a transaction keeps few
/// subtransactions (past 64, every snapshot of every session reads
/// `pg_subtrans`).
pub(crate) const MAX_SEGMENTS: usize = 48;

/// Takes the transaction back to the start of the segment.
pub(crate) async fn undo(conn: &mut PgConnection, statement: Statement) -> Result<(), Failure> {
    sqlx::query("ROLLBACK TO SAVEPOINT outbox_segment")
        .execute(conn)
        .await
        .map(|_| ())
        .map_err(|e| bookkeeping(e, statement))
}

/// A failed statement of the consumer's own between handlers: the symptom
/// of a handler that broke the transaction (aborted or ended it), or an
/// outage or refusal of `statement`.
pub(crate) fn bookkeeping(error: sqlx::Error, statement: Statement) -> Failure {
    if let Some(broken) = txn::symptom_of(&error) {
        return Failure::Suspect(broken.blame());
    }
    match txn::classify(error) {
        Broken::Outage(error) => Failure::Outage(Trouble::from(error).during(statement)),
        broken => Failure::Suspect(broken.blame()),
    }
}

/// How a transaction runs its handlers.
#[derive(Clone, Copy)]
pub(crate) struct Handling<'r> {
    pub registry: &'r Registry,
    /// A handler call taking longer fails its event.
    pub timeout: Duration,
    /// Check the transaction after each event ([`txn::probe`]), so that a
    /// handler that breaks it without saying so is named. Used after a
    /// [`Failure::Suspect`].
    pub careful: bool,
    /// The batch's saga instances, read by its lock plan and written at
    /// each segment's end (dedup mode).
    pub prefetched: Option<&'r outbox_core::saga::Prefetched>,
}

/// Runs every handler of `event`, in order, on `conn` (the caller's
/// transaction), adding each successful handler's follow-up events to
/// `follow_ups` (located at `follow_ups.at`). The caller rolls back on any
/// error.
pub(crate) async fn run_handlers(
    conn: &mut PgConnection,
    handling: Handling<'_>,
    event: &mut Event,
    follow_ups: &mut FollowUps,
) -> Result<(), Failure> {
    let span = handling_span(event);
    run_handlers_inner(conn, handling, event, follow_ups)
        .instrument(span)
        .await
}

/// The span of one handled event: its trace id (from the `traceparent`
/// header, so that logs join the producer's trace), event id and type. The
/// fields are computed only when the span is enabled. With the `otel`
/// feature, the event's `traceparent` is its OpenTelemetry parent.
fn handling_span(event: &Event) -> tracing::Span {
    let incoming = &event.incoming;
    let span = tracing::info_span!(
        "handle_event",
        trace_id = %TraceIdOf(incoming.headers.traceparent.as_deref()),
        event_id = %incoming.event_id,
        event_type = %incoming.event_type,
        correlation_id = incoming.headers.correlation_id.map(tracing::field::display),
    );
    #[cfg(feature = "otel")]
    if let Some(parent) = incoming
        .headers
        .traceparent
        .as_deref()
        .and_then(|t| t.parse::<outbox_core::TraceParent>().ok())
    {
        outbox_core::trace::otel::set_remote_parent(
            &span,
            &parent,
            incoming.headers.tracestate.as_deref(),
        );
    }
    span
}

/// Displays the trace id of a `traceparent` (empty if none or malformed).
struct TraceIdOf<'a>(Option<&'a str>);

impl std::fmt::Display for TraceIdOf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self
            .0
            .and_then(|t| t.parse::<outbox_core::TraceParent>().ok())
        {
            Some(t) => f.write_str(&t.trace_id()),
            None => Ok(()),
        }
    }
}

async fn run_handlers_inner(
    conn: &mut PgConnection,
    handling: Handling<'_>,
    event: &mut Event,
    follow_ups: &mut FollowUps,
) -> Result<(), Failure> {
    let registry = handling.registry;
    // Whether a handler of the event was given the connection so far.
    let mut touched = false;
    for i in 0..event.handlers.len() {
        let value = event
            .take_decoded(i, registry)
            .map_err(|rejected| Failure::Rejected { at: 0, rejected })?;
        let handler = registry.handler(event.handlers[i]);
        let mut ctx =
            HandlerContext::new(&mut *conn, &event.incoming).with_prefetched(handling.prefetched);
        // A handler that panics is a failing handler: retried, then
        // dead-lettered; the consumer goes on.
        let call = AssertUnwindSafe(handler.handle(&mut ctx, value)).catch_unwind();
        let outcome = within(handling.timeout, call).await;
        touched |= ctx.touched();
        let fail = |error: String| Failure::Handler {
            at: 0,
            handler: handler.name(),
            error,
            clean: !touched,
        };
        let outcome = match outcome {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(format!("handler panicked: {}", panic_message(&*panic)).into()),
            Err(_) => {
                return Err(fail(format!(
                    "handler timed out after {} ms (the consumer's handler timeout)",
                    handling.timeout.as_millis()
                )));
            }
        };
        if let Err(error) = outcome {
            let sqlx = sqlx_error_in(&error);
            return Err(match sqlx {
                Some(e) if is_outage(e) => Failure::Outage(error.to_string().into()),
                // The transaction was broken before this handler ran (it
                // only met the consequence), unless every earlier event was
                // checked: then it broke it itself.
                Some(e) => match txn::symptom_of(e) {
                    Some(_) if !handling.careful => Failure::Suspect(error.to_string()),
                    Some(broken) => fail(format!("{} ({error})", broken.blame())),
                    None => fail(error.to_string()),
                },
                _ => fail(error.to_string()),
            });
        }
        let follow_up_messages = ctx.take_follow_ups();
        if handling.careful {
            match txn::probe(&mut *conn).await {
                Ok(()) => {}
                Err(Broken::Outage(error)) => return Err(Failure::Outage(error.into())),
                Err(broken) => {
                    return Err(Failure::Handler {
                        at: 0,
                        handler: handler.name(),
                        error: broken.blame(),
                        clean: false,
                    });
                }
            }
        }
        match follow_up_messages {
            Ok(messages) => follow_ups.push(handler.name(), messages),
            Err(error) => {
                return Err(fail(format!(
                    "recording the handler's follow-up events failed: {error}"
                )));
            }
        }
    }
    Ok(())
}

/// Checks, after the last handler of a transaction, that no handler broke
/// it, and allows its commit (see `txn.rs`). A broken transaction is a
/// [`Failure::Suspect`] (or, in a careful run, where every event was already
/// checked, cannot happen).
pub(crate) async fn seal(conn: &mut PgConnection) -> Result<(), Failure> {
    match txn::seal(conn).await {
        Ok(()) => Ok(()),
        Err(Broken::Outage(error)) => Err(Failure::Outage(error.into())),
        Err(broken) => Err(Failure::Suspect(broken.blame())),
    }
}

/// `future`'s output, or an error once `timeout` passed. The timer is only
/// set when the future does not finish at its first poll: most handlers
/// that touch nothing outside memory do, and a timer per event would cost a
/// measurable share of a fast consumer.
async fn within<F: Future>(
    timeout: Duration,
    future: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut future = std::pin::pin!(future);
    if let Poll::Ready(output) =
        std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
    {
        return Ok(output);
    }
    tokio::time::timeout(timeout, future).await
}

/// The message a panic was raised with.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// Sleeps `d` unless `shutdown` comes first; returns false on shutdown.
pub(crate) async fn pause(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = shutdown.cancelled() => false,
    }
}
