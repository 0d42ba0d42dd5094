//! Aggregates: the `Aggregate` / `AggregateRoot` traits and `PendingEvents`,
//! the storage of events an aggregate root recorded but nobody collected yet.
//!
//! `#[aggregate]` leaves the annotated struct (the aggregate's *state*)
//! untouched, so struct literals, serde and `sqlx::FromRow` work on it as
//! usual, and generates beside it a *root* type (`OrderRoot` for `Order`) that
//! derefs to the state and holds the pending events. Domain methods are
//! written on the root and call `self.record(event)`; the Unit of Work takes
//! the events with `uow.collect(&mut root)`.
//!
//! Events cannot vanish silently: a root dropped while it still holds events
//! logs a `tracing` warning naming them (call `discard_events()` to drop them
//! on purpose, e.g. when a command fails half way).

use uuid::Uuid;

use crate::error::Error;
use crate::event::DomainEvent;
use crate::message::OutboxMessage;

/// Implemented by `#[aggregate]` for the aggregate's state type.
pub trait Aggregate: Sized {
    /// The generated root type that records events for this state.
    type Root: AggregateRoot<State = Self> + From<Self>;

    /// Wraps the state in its root, ready to record events.
    fn into_root(self) -> Self::Root {
        Self::Root::from(self)
    }
}

/// Implemented by the root type `#[aggregate]` generates.
pub trait AggregateRoot {
    /// The aggregate's state type.
    type State;

    /// The events recorded and not yet collected.
    fn pending_events(&mut self) -> &mut PendingEvents;
}

/// Events recorded by an aggregate root, serialized at record time.
///
/// Dropping a non-empty `PendingEvents` logs a warning with the event types
/// and ids: those events never reached a Unit of Work.
#[derive(Default)]
pub struct PendingEvents {
    messages: Vec<OutboxMessage>,
    error: Option<Error>,
    owner: &'static str,
}

impl std::fmt::Debug for PendingEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingEvents")
            .field("len", &self.messages.len())
            .field("error", &self.error)
            .finish()
    }
}

impl PendingEvents {
    /// An empty buffer owned by the named root type (used in warnings).
    pub fn new(owner: &'static str) -> Self {
        Self {
            messages: Vec::new(),
            error: None,
            owner,
        }
    }

    /// Serializes and stores `event`; returns its event id.
    ///
    /// A serialization failure is kept and reported by the Unit of Work's
    /// `commit()`, which then writes nothing.
    pub fn record<E: DomainEvent>(&mut self, event: &E) -> Uuid {
        match OutboxMessage::from_event(event) {
            Ok(message) => {
                let id = message.event_id;
                self.messages.push(message);
                id
            }
            Err(error) => {
                let id = event.event_id().unwrap_or_else(Uuid::now_v7);
                self.error.get_or_insert(error);
                id
            }
        }
    }

    /// Number of events recorded and not yet taken.
    pub fn len(&self) -> usize {
        self.messages.len() + usize::from(self.error.is_some())
    }

    /// True when nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pending messages, in record order.
    pub fn messages(&self) -> &[OutboxMessage] {
        &self.messages
    }

    /// Takes every pending message (and the first serialization error, if any).
    pub fn take(&mut self) -> (Vec<OutboxMessage>, Option<Error>) {
        (std::mem::take(&mut self.messages), self.error.take())
    }

    /// Drops every pending event on purpose; returns how many there were.
    pub fn discard(&mut self) -> usize {
        let n = self.len();
        self.messages.clear();
        self.error = None;
        n
    }
}

impl Drop for PendingEvents {
    fn drop(&mut self) {
        if self.is_empty() {
            return;
        }
        let events: Vec<String> = self
            .messages
            .iter()
            .map(|m| format!("{}({}) {}", m.event_type, m.aggregate_id, m.event_id))
            .collect();
        tracing::warn!(
            aggregate = self.owner,
            count = self.len(),
            events = ?events,
            serialization_error = ?self.error,
            "aggregate root dropped with uncollected events: they were never written to the outbox \
             (pass the root to UnitOfWork::collect, or call discard_events() to drop them on purpose)"
        );
    }
}
