//! The consumer-side handler contract: [`InboxHandler`] (implemented by
//! `#[inbox_handler]`) and the [`HandlerContext`] a handler receives; and
//! [`HandlerArg`], the sealed set of first arguments any handler (inbox or
//! command) may take.
//!
//! A handler gets the consumer's transaction and an event recorder — no pool,
//! no producer, no way to commit. Its database work, the deduplication (or
//! inbox) bookkeeping and any follow-up events it records commit together,
//! or not at all.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::Result;
use crate::event::DomainEvent;
use crate::message::{Headers, OutboxMessage};
use crate::trace::TraceParent;

/// The error type handlers return, boxed (any `std::error::Error`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The future an [`InboxHandler`] returns.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>>;

/// What the consumer knows about the message being handled.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IncomingEvent {
    /// The event's id (deduplication key).
    pub event_id: Uuid,
    /// The event type named by the message.
    pub event_type: String,
    /// Schema version named by the message.
    pub event_version: u32,
    /// The topic it came from.
    pub topic: String,
    /// The Kafka key (the producer's partition key).
    pub partition_key: String,
    /// The message's headers (correlation id, trace context, custom entries).
    pub headers: Headers,
}

impl IncomingEvent {
    /// Builds the description of a received event.
    pub fn new(
        event_id: Uuid,
        event_type: impl Into<String>,
        event_version: u32,
        topic: impl Into<String>,
        partition_key: impl Into<String>,
        headers: Headers,
    ) -> Self {
        Self {
            event_id,
            event_type: event_type.into(),
            event_version,
            topic: topic.into(),
            partition_key: partition_key.into(),
            headers,
        }
    }
}

/// What a handler may touch: the consumer's transaction (it derefs to
/// [`PgConnection`]: `query.execute(&mut **ctx)`) and an outbox recorder for
/// follow-up events.
///
/// Follow-up events inherit the handled event's correlation id, get its
/// event id as their causation id, and continue its trace (same trace id,
/// a new parent span id, or the handling span's with OpenTelemetry: see
/// [`trace_context`](Self::trace_context)). They are written to `outbox_event` in the
/// same transaction as the handler's work and the deduplication row, so they
/// exist if and only if the handling committed.
pub struct HandlerContext<'c> {
    conn: &'c mut PgConnection,
    incoming: &'c IncomingEvent,
    recorded: Vec<OutboxMessage>,
    error: Option<crate::Error>,
    trace: Option<(TraceParent, Option<String>)>,
    /// The handler was given the connection (mutably): it may have run a
    /// statement. See [`touched`](Self::touched).
    touched: bool,
    /// The batch's saga instances (dedup mode), see `with_prefetched`.
    prefetched: Option<&'c crate::saga::Prefetched>,
}

impl std::fmt::Debug for HandlerContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerContext")
            .field("incoming", &self.incoming)
            .field("recorded", &self.recorded.len())
            .finish_non_exhaustive()
    }
}

impl<'c> HandlerContext<'c> {
    /// A context over the consumer's transaction. Used by the consumer
    /// runtime; applications receive contexts, they do not build them.
    #[doc(hidden)]
    pub fn new(conn: &'c mut PgConnection, incoming: &'c IncomingEvent) -> Self {
        Self {
            conn,
            incoming,
            recorded: Vec::new(),
            error: None,
            trace: None,
            touched: false,
            prefetched: None,
        }
    }

    /// The saga instances the consumer locked and read for the batch
    /// before its handlers ran: a saga step reads its instance from there
    /// and leaves its result there, for the consumer to write at the end
    /// of the segment. Used by the consumer runtime.
    #[doc(hidden)]
    pub fn with_prefetched(mut self, prefetched: Option<&'c crate::saga::Prefetched>) -> Self {
        self.prefetched = prefetched;
        self
    }

    pub(crate) fn prefetched(&self) -> Option<&'c crate::saga::Prefetched> {
        self.prefetched
    }

    /// Whether the handler was given the transaction's connection to run
    /// statements on (through `&mut **ctx`, [`connection`](Self::connection)
    /// or a flush). A handler that failed without it changed nothing in the
    /// transaction: the consumer runtime then skips its event without
    /// taking the transaction back.
    #[doc(hidden)]
    pub fn touched(&self) -> bool {
        self.touched
    }

    /// The event being handled.
    pub fn incoming(&self) -> &IncomingEvent {
        self.incoming
    }

    /// The transaction's connection, for the handler's queries.
    pub fn connection(&mut self) -> &mut PgConnection {
        self.touched = true;
        self.conn
    }

    /// The trace context follow-up events carry: the handled event's trace
    /// id with a new parent span id (the handling), or a new trace when the
    /// handled event carried no valid `traceparent`. The same for every
    /// follow-up of one handling.
    ///
    /// With the `otel` feature, when the current span (the consumer's
    /// `handle_event` span, a child of the handled event's context) has an
    /// OpenTelemetry context, it is that span's: the next handler's span is
    /// then its child.
    pub fn trace_context(&mut self) -> TraceParent {
        self.trace_and_state().0
    }

    fn trace_and_state(&mut self) -> &(TraceParent, Option<String>) {
        let incoming = self.incoming;
        self.trace.get_or_insert_with(|| {
            #[cfg(feature = "otel")]
            if let Some(current) = TraceParent::current() {
                return current;
            }
            let trace = incoming
                .headers
                .traceparent
                .as_deref()
                .and_then(|t| t.parse::<TraceParent>().ok())
                .map_or_else(TraceParent::new_root, |t| t.child());
            (trace, incoming.headers.tracestate.clone())
        })
    }

    /// Records a follow-up event for the outbox; returns its event id.
    pub fn record<E: DomainEvent>(&mut self, event: E) -> Uuid {
        record_into(&mut self.recorded, &mut self.error, &event)
    }

    /// Records an already serialized follow-up message (a saga step's).
    #[doc(hidden)]
    pub fn record_message(&mut self, message: OutboxMessage) -> Uuid {
        let id = message.event_id;
        self.recorded.push(message);
        id
    }

    /// Takes every event an aggregate root recorded, in record order, as
    /// follow-up events (like [`UnitOfWork::collect`](crate::UnitOfWork::collect)).
    pub fn collect<R: crate::AggregateRoot + ?Sized>(&mut self, root: &mut R) {
        let (messages, error) = root.pending_events().take();
        self.recorded.extend(messages);
        if let Some(error) = error {
            self.error.get_or_insert(error);
        }
    }

    /// Number of follow-up events recorded so far.
    pub fn recorded_events(&self) -> usize {
        self.recorded.len()
    }

    /// Writes the recorded follow-up events to the outbox on the context's
    /// transaction (correlation carried over, causation = the handled event,
    /// the trace continued).
    /// Called by the consumer runtime after the handler returned `Ok`.
    #[doc(hidden)]
    pub async fn flush(&mut self) -> Result<Vec<Uuid>> {
        let messages = self.take_follow_ups()?;
        self.touched = true;
        crate::uow::insert_messages(self.conn, &messages, &Headers::default()).await
    }

    /// Takes the recorded follow-up events, each with its headers completed
    /// (correlation carried over, causation = the handled event, the trace
    /// continued), for the caller to write to the outbox later in the same
    /// transaction. The consumer runtime writes the follow-ups of a whole
    /// batch with one statement at its end, so that the statement takes its
    /// key locks in one consistent order (see
    /// [`insert_messages`](crate::insert_messages)).
    #[doc(hidden)]
    pub fn take_follow_ups(&mut self) -> Result<Vec<OutboxMessage>> {
        if let Some(error) = self.error.take() {
            return Err(error);
        }
        if self.recorded.is_empty() {
            return Ok(Vec::new());
        }
        let (trace, tracestate) = self.trace_and_state().clone();
        let defaults = Headers {
            correlation_id: self
                .incoming
                .headers
                .correlation_id
                .or(Some(self.incoming.event_id)),
            causation_id: Some(self.incoming.event_id),
            traceparent: Some(trace.to_string()),
            tracestate,
            extra: Default::default(),
        };
        let mut messages = std::mem::take(&mut self.recorded);
        for message in &mut messages {
            message.headers.check()?;
            message.headers.fill_from(&defaults);
        }
        Ok(messages)
    }
}

impl Deref for HandlerContext<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn
    }
}

impl DerefMut for HandlerContext<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.touched = true;
        self.conn
    }
}

/// A typed handler of one event type, implemented by `#[inbox_handler]`.
///
/// The consumer dispatches messages by topic (`Self::Event::TOPIC`) and event
/// type (`Self::Event::EVENT_TYPES`) and decodes the payload with
/// [`DomainEvent::from_payload`] before calling [`handle`](Self::handle).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an inbox handler",
    label = "not an `InboxHandler`",
    note = "annotate the function with `#[inbox_handler]`: `async fn name(ctx: &mut HandlerContext<'_>, event: E) -> Result<(), Err>`"
)]
pub trait InboxHandler: Send + Sync + 'static {
    /// The event type handled.
    type Event: DomainEvent;

    /// A stable name for logs and dead letters (the function's name).
    const NAME: &'static str;

    /// Applies the event inside the consumer's transaction.
    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: Self::Event,
    ) -> HandlerFuture<'a>
    where
        'c: 'a;

    /// The saga instance (saga type, id) the event moves, if this handler
    /// is a saga's: a consumer's batch locks its instances in one order
    /// before any handler runs.
    #[doc(hidden)]
    fn saga_instance(&self, event: &Self::Event) -> Option<(&'static str, String)> {
        let _ = event;
        None
    }
}

pub(crate) mod sealed {
    /// Implemented only in this crate: the traits it bounds are sealed.
    pub trait Sealed {}

    impl<T, E> Sealed for Result<T, E> {}
}

/// The first argument a handler may take: `&mut HandlerContext<'_>` for an
/// `#[inbox_handler]` (`Source` = [`HandlerContext`]), `&mut UnitOfWork` for a
/// `#[command_handler]` (`Source` = [`UnitOfWork`](crate::UnitOfWork)).
///
/// Sealed: nothing else can be handed to a handler, in particular no Kafka
/// producer. The code generated by the handler attributes obtains the first
/// argument through this trait, so a function declaring anything else fails to
/// compile with a message naming the allowed argument.
#[diagnostic::on_unimplemented(
    message = "a handler's first argument must be `&mut {Source}`, not `{Self}`",
    label = "not `&mut {Source}`",
    note = "an `#[inbox_handler]` takes `&mut HandlerContext<'_>`, a `#[command_handler]` takes `&mut UnitOfWork`",
    note = "both give the transaction and an event recorder, nothing else: record events there; the relay publishes them"
)]
pub trait HandlerArg<'a, Source: ?Sized + 'a>: Sized + sealed::Sealed {
    /// The argument, borrowed from what the runner holds.
    fn from_source(source: &'a mut Source) -> Self;
}

impl sealed::Sealed for &mut HandlerContext<'_> {}

impl<'a, 'c> HandlerArg<'a, HandlerContext<'c>> for &'a mut HandlerContext<'c> {
    #[inline]
    fn from_source(source: &'a mut HandlerContext<'c>) -> Self {
        source
    }
}

impl sealed::Sealed for &mut crate::uow::UnitOfWork {}

impl<'a> HandlerArg<'a, crate::uow::UnitOfWork> for &'a mut crate::uow::UnitOfWork {
    #[inline]
    fn from_source(source: &'a mut crate::uow::UnitOfWork) -> Self {
        source
    }
}

/// What an `#[inbox_handler]` function returns: `Result<(), E>` where `E`
/// converts into [`BoxError`] (any `std::error::Error + Send + Sync`,
/// `String`, `&str`, `Box<dyn Error + Send + Sync>`, `anyhow::Error`).
///
/// Used by the generated code; sealed.
#[diagnostic::on_unimplemented(
    message = "an `#[inbox_handler]` must return `Result<(), E>`, not `{Self}`",
    label = "expected `Result<(), E>`",
    note = "`E` is any error that converts into `BoxError` (`std::error::Error + Send + Sync + 'static`, `anyhow::Error`, `String`)",
    note = "a handler's effects are its queries and the events it records; it returns nothing else"
)]
pub trait InboxOutput: sealed::Sealed {
    /// The result with the error boxed.
    fn into_result(self) -> std::result::Result<(), BoxError>;
}

impl<E: Into<BoxError>> InboxOutput for std::result::Result<(), E> {
    #[inline]
    fn into_result(self) -> std::result::Result<(), BoxError> {
        self.map_err(Into::into)
    }
}

/// Records `event` in `recorded` for the outbox and returns its event id;
/// an event that cannot be encoded leaves its error in `error` (the first
/// one kept), for the commit to fail with.
pub(crate) fn record_into<E: DomainEvent>(
    recorded: &mut Vec<OutboxMessage>,
    error: &mut Option<crate::Error>,
    event: &E,
) -> Uuid {
    match OutboxMessage::from_event(event) {
        Ok(message) => {
            let id = message.event_id;
            recorded.push(message);
            id
        }
        Err(e) => {
            error.get_or_insert(e);
            event.event_id().unwrap_or_else(Uuid::now_v7)
        }
    }
}
