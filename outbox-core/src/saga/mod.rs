//! Sagas: long-running processes whose state lives in `outbox_saga`, moved
//! by messages in the consumer's transaction. This module owns the
//! contract: the [`Saga`] trait (implemented by `#[outbox::saga]` on an
//! `impl` block, or by hand), the
//! [`SagaContext`] a step receives, the step tables ([`MessageSteps`]) and
//! the policy for a message arriving in another stage ([`OtherStage`]).
//! Applying a message (locking, stage checks, writing back) is in
//! `apply.rs`; the counters in `counts.rs`; what each message did, for
//! the testing kit, in `journal.rs`.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::Result;
use crate::event::DomainEvent;
use crate::handler::BoxError;
use crate::message::OutboxMessage;

mod apply;
mod batch;
mod counts;
mod journal;

pub use apply::SagaHandler;
pub use batch::Prefetched;
pub use counts::{SagaCounts, all_saga_counts, saga_counts};
pub use journal::StepOutcome;
#[doc(hidden)]
pub use journal::{StepNote, observe_steps};

/// What a saga step returns: the saga's next stage.
pub type StepFuture<'a, S> =
    Pin<Box<dyn Future<Output = std::result::Result<<S as Saga>::Stage, BoxError>> + Send + 'a>>;

/// A step: runs on the instance's context and the message.
pub type StepFn<S, M> = for<'a> fn(&'a mut SagaContext<S>, M) -> StepFuture<'a, S>;

/// What a saga does with a message that arrives while the instance is in a
/// stage no step of that message accepts (and no fallback step, one
/// registered for any stage, exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OtherStage {
    /// Changes nothing, counted ([`SagaCounts::other_stage`]).
    #[default]
    Ignore,
    /// Fails the message: it is retried, then dead-lettered.
    DeadLetter,
}

/// A saga: a serde value stored in `outbox_saga`, one row per instance,
/// keyed by [`NAME`](Self::NAME) and the correlation id of the messages
/// that move it. Implemented by `#[outbox::saga]` on an `impl` block of the
/// state's type, or by hand: [`steps`](Self::steps) lists each message
/// type's steps.
pub trait Saga: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The saga type's stable name (`outbox_saga.saga_type`).
    const NAME: &'static str;
    /// The topic of the saga's own timeout messages.
    const TIMEOUT_TOPIC: &'static str;
    /// The saga's stages.
    type Stage: Serialize + DeserializeOwned + PartialEq + Debug + Clone + Send + Sync + 'static;

    /// The instance's stage.
    fn stage(&self) -> &Self::Stage;
    /// Moves the instance to `stage` (the runtime calls it with what a step
    /// returned).
    fn set_stage(&mut self, stage: Self::Stage);
    /// What a message in another stage does (default: ignored, counted).
    fn other_stage() -> OtherStage {
        OtherStage::Ignore
    }
    /// Registers the steps of each message type.
    fn steps<R: SagaRegistrar<Self>>(registrar: &mut R);
}

/// Where [`Saga::steps`] registers its message types (the consumer).
pub trait SagaRegistrar<S: Saga> {
    /// Registers the steps of one message type.
    fn add<M: DomainEvent>(&mut self, steps: MessageSteps<S, M>);
}

/// The name a stage is stored under (`outbox_saga.stage`): a unit variant's
/// name, else its JSON.
pub fn stage_name<T: Serialize>(stage: &T) -> String {
    match serde_json::to_value(stage) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::from("?"),
    }
}

/// What a `#[saga]` step returns: `Result<Stage, E>`, the saga's next
/// stage, where `E` converts into [`BoxError`].
///
/// Used by the generated code; sealed.
#[diagnostic::on_unimplemented(
    message = "a `#[saga]` step must return `Result<{Stage}, E>` (the saga's next stage), not `{Self}`",
    label = "expected `Result<{Stage}, E>`",
    note = "`E` is any error that converts into `BoxError` (`std::error::Error + Send + Sync + 'static`, `anyhow::Error`, `String`)"
)]
pub trait StepOutput<Stage>: crate::handler::sealed::Sealed {
    /// The result with the error boxed.
    fn into_step_result(self) -> std::result::Result<Stage, BoxError>;
}

impl<Stage, E: Into<BoxError>> StepOutput<Stage> for std::result::Result<Stage, E> {
    #[inline]
    fn into_step_result(self) -> std::result::Result<Stage, BoxError> {
        self.map_err(Into::into)
    }
}

/// A start: the initial state's builder and the first step.
pub(crate) type Start<S, M> = (fn(&M) -> S, StepFn<S, M>);

/// One step of a message type: the stage it accepts (`None`: any, a
/// fallback), the timeout it answers (timeout messages only), the function.
pub(crate) struct Step<S: Saga, M> {
    pub(crate) from: Option<S::Stage>,
    pub(crate) timeout: Option<&'static str>,
    pub(crate) run: StepFn<S, M>,
}

/// The steps of one message type `M` in saga `S`: how a message finds its
/// instance (`correlate`), whether it starts one, and the step per stage.
pub struct MessageSteps<S: Saga, M> {
    pub(crate) correlate: fn(&M) -> String,
    pub(crate) start: Option<Start<S, M>>,
    pub(crate) steps: Vec<Step<S, M>>,
}

impl<S: Saga, M: DomainEvent> MessageSteps<S, M> {
    /// Steps of messages whose instance is `correlate(message)`.
    pub fn new(correlate: fn(&M) -> String) -> Self {
        Self {
            correlate,
            start: None,
            steps: Vec::new(),
        }
    }

    /// The message starts an instance: `init` builds its state, `run` is the
    /// first step. A start message for an instance that exists is handled
    /// as a message in another stage.
    pub fn start(mut self, init: fn(&M) -> S, run: StepFn<S, M>) -> Self {
        self.start = Some((init, run));
        self
    }

    /// The message's step in stage `from` (`None`: in any stage no other
    /// step of the message accepts, a fallback).
    pub fn handle(mut self, from: Option<S::Stage>, run: StepFn<S, M>) -> Self {
        self.steps.push(Step {
            from,
            timeout: None,
            run,
        });
        self
    }
}

impl<S: Saga> MessageSteps<S, SagaTimeout<S>> {
    /// The steps of the saga's timeouts (messages to itself).
    pub fn timeouts() -> Self {
        Self::new(|t| t.saga_id.clone())
    }

    /// The step of timeout `name` in stage `from`.
    pub fn on(
        mut self,
        name: &'static str,
        from: Option<S::Stage>,
        run: StepFn<S, SagaTimeout<S>>,
    ) -> Self {
        self.steps.push(Step {
            from,
            timeout: Some(name),
            run,
        });
        self
    }
}

/// A saga's timeout, a scheduled message to its own topic
/// ([`Saga::TIMEOUT_TOPIC`]); its event id is the timeout's id.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct SagaTimeout<S> {
    /// The saga type.
    pub saga_type: String,
    /// The instance.
    pub saga_id: String,
    /// The timeout's name (`schedule_timeout`).
    pub name: String,
    /// The timeout's id (the message's event id).
    pub timeout_id: Uuid,
    #[serde(skip)]
    _saga: PhantomData<fn() -> S>,
}

impl<S> Debug for SagaTimeout<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaTimeout")
            .field("saga_type", &self.saga_type)
            .field("saga_id", &self.saga_id)
            .field("name", &self.name)
            .field("timeout_id", &self.timeout_id)
            .finish()
    }
}

/// The event type of every saga timeout message.
pub const TIMEOUT_EVENT_TYPE: &str = "saga.timeout";

impl<S: Saga> DomainEvent for SagaTimeout<S> {
    const TOPIC: &'static str = S::TIMEOUT_TOPIC;
    const AGGREGATE_TYPE: &'static str = "saga";
    const EVENT_TYPES: &'static [&'static str] = &[TIMEOUT_EVENT_TYPE];

    fn event_type(&self) -> &'static str {
        TIMEOUT_EVENT_TYPE
    }

    fn event_version(&self) -> u32 {
        1
    }

    fn aggregate_id(&self) -> String {
        self.saga_id.clone()
    }

    fn event_id(&self) -> Option<Uuid> {
        Some(self.timeout_id)
    }
}

/// What a step may do: read and change the instance's state (it derefs to
/// the saga), record events, send commands, schedule and cancel timeouts,
/// complete the saga. Everything it records is written to the outbox in
/// the consumer's transaction, with the state, or not at all.
pub struct SagaContext<S: Saga> {
    pub(crate) saga_id: String,
    pub(crate) state: S,
    pub(crate) recorded: Vec<OutboxMessage>,
    pub(crate) scheduled: Vec<(OutboxMessage, Duration)>,
    pub(crate) cancelled: Vec<Uuid>,
    pub(crate) timeouts: BTreeMap<String, Uuid>,
    pub(crate) completed: bool,
    pub(crate) error: Option<crate::Error>,
}

impl<S: Saga> SagaContext<S> {
    pub(crate) fn new(saga_id: String, state: S, timeouts: BTreeMap<String, Uuid>) -> Self {
        Self {
            saga_id,
            state,
            recorded: Vec::new(),
            scheduled: Vec::new(),
            cancelled: Vec::new(),
            timeouts,
            completed: false,
            error: None,
        }
    }

    /// The instance's id (the correlation value).
    pub fn saga_id(&self) -> &str {
        &self.saga_id
    }

    /// Records an event for the outbox; returns its event id.
    pub fn record<E: DomainEvent>(&mut self, event: E) -> Uuid {
        crate::handler::record_into(&mut self.recorded, &mut self.error, &event)
    }

    /// Sends a command (a message to another service's topic) through the
    /// outbox; returns its event id.
    pub fn send<C: DomainEvent>(&mut self, command: C) -> Uuid {
        self.record(command)
    }

    /// Schedules timeout `name` to arrive `after` from now (the database's
    /// clock), replacing a pending one of that name (which then changes
    /// nothing if it arrives); returns its id.
    pub fn schedule_timeout(&mut self, name: &str, after: Duration) -> Uuid {
        self.cancel_timeout(name);
        let timeout = SagaTimeout::<S> {
            saga_type: S::NAME.to_owned(),
            saga_id: self.saga_id.clone(),
            name: name.to_owned(),
            timeout_id: Uuid::now_v7(),
            _saga: PhantomData,
        };
        let id = timeout.timeout_id;
        match OutboxMessage::from_event(&timeout) {
            Ok(message) => self.scheduled.push((message, after)),
            Err(error) => {
                self.error.get_or_insert(error);
            }
        }
        self.timeouts.insert(name.to_owned(), id);
        id
    }

    /// Cancels the pending timeout `name`: it changes nothing if it
    /// arrives, and its outbox row is cancelled if it has not gone out
    /// (best effort). Returns whether one was pending.
    pub fn cancel_timeout(&mut self, name: &str) -> bool {
        let Some(id) = self.timeouts.remove(name) else {
            return false;
        };
        if let Some(i) = self.scheduled.iter().position(|(m, _)| m.event_id == id) {
            self.scheduled.remove(i);
        } else {
            self.cancelled.push(id);
        }
        true
    }

    /// The names of the pending timeouts.
    pub fn pending_timeouts(&self) -> impl Iterator<Item = &str> {
        self.timeouts.keys().map(String::as_str)
    }

    /// Completes the saga when the step commits: later messages and
    /// timeouts of the instance change nothing.
    pub fn complete(&mut self) {
        self.completed = true;
    }

    /// The instance's state.
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The instance's state, mutably.
    pub fn state_mut(&mut self) -> &mut S {
        &mut self.state
    }

    pub(crate) fn take_error(&mut self) -> Result<()> {
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl<S: Saga> std::ops::Deref for SagaContext<S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.state
    }
}

impl<S: Saga> std::ops::DerefMut for SagaContext<S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.state
    }
}
