//! Sagas under the testing kit: an instance read back typed
//! ([`SagaInstance`], [`TestBus::saga`](super::TestBus::saga)) and what the
//! messages of one delivery did to it ([`SagaHistory`],
//! [`Delivery::saga_history`]), each with assertions whose failure
//! messages show the instance or its history.

use std::collections::BTreeMap;
use std::fmt;

use outbox_core::saga::{StepOutcome, TIMEOUT_EVENT_TYPE, stage_name};
use outbox_core::{DomainEvent, Saga};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::report::{Delivered, Delivery, Outcome};
use crate::inbox::DeadLetterReason;

/// What one delivered message did to a saga instance it correlates to, in
/// the consumer that runs the saga.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SagaOutcome {
    /// A start message created the instance and its start step ran.
    Started,
    /// A step ran and the state was written back.
    Applied,
    /// Nothing changed: the instance was in a stage no step of the message
    /// accepts (and the saga ignores such messages).
    OtherStage,
    /// Nothing changed: a timeout that was no longer pending (cancelled,
    /// replaced, already fired).
    StaleTimeout,
    /// Nothing changed: the instance was completed.
    AfterCompletion,
    /// Nothing changed: no instance, and the message starts none.
    Missing,
    /// Skipped by the consumer as a duplicate: no step ran.
    Duplicate,
    /// Dead-lettered: nothing changed.
    DeadLettered {
        /// Why.
        reason: DeadLetterReason,
        /// The error, as the dead letter holds it.
        error: String,
    },
    /// Not applied otherwise.
    NotApplied,
}

impl SagaOutcome {
    /// Whether the message changed the instance (it started it or a step
    /// ran).
    pub fn changed(&self) -> bool {
        matches!(self, Self::Started | Self::Applied)
    }

    /// The outcome of a message whose delivery ended in `delivered` and
    /// whose handler noted `step` (last attempt) for the instance.
    pub(super) fn of(delivered: &Outcome, step: Option<StepOutcome>) -> Self {
        match delivered {
            Outcome::Handled => match step {
                Some(StepOutcome::Started) => Self::Started,
                Some(StepOutcome::Applied) => Self::Applied,
                Some(StepOutcome::OtherStage) => Self::OtherStage,
                Some(StepOutcome::StaleTimeout) => Self::StaleTimeout,
                Some(StepOutcome::Completed) => Self::AfterCompletion,
                Some(StepOutcome::Missing) => Self::Missing,
                Some(_) | None => Self::NotApplied,
            },
            Outcome::Duplicate => Self::Duplicate,
            Outcome::DeadLettered { reason, error, .. } => Self::DeadLettered {
                reason: *reason,
                error: error.clone(),
            },
            Outcome::Ignored | Outcome::Pending => Self::NotApplied,
        }
    }
}

impl fmt::Display for SagaOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Started => f.write_str("started"),
            Self::Applied => f.write_str("applied"),
            Self::OtherStage => f.write_str("ignored (another stage)"),
            Self::StaleTimeout => f.write_str("ignored (stale timeout)"),
            Self::AfterCompletion => f.write_str("ignored (completed)"),
            Self::Missing => f.write_str("ignored (no instance)"),
            Self::Duplicate => f.write_str("duplicate"),
            Self::DeadLettered { reason, error } => write!(f, "dead-lettered ({reason}: {error})"),
            Self::NotApplied => f.write_str("not applied"),
        }
    }
}

/// A saga instance a delivered message correlates to in its consumer
/// ([`Delivered::sagas`]), and what the message did to it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SagaEffect {
    /// The saga type (`Saga::NAME`).
    pub saga_type: String,
    /// The instance.
    pub saga_id: String,
    /// What the message did.
    pub outcome: SagaOutcome,
}

/// One message of a [`SagaHistory`]: the delivery and what it did to the
/// instance.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SagaEntry {
    /// The delivery.
    pub delivered: Delivered,
    /// What it did to the instance.
    pub outcome: SagaOutcome,
}

impl SagaEntry {
    /// The timeout's name, if the message is one of the saga's timeouts.
    pub fn timeout(&self) -> Option<String> {
        if self.delivered.event_type != TIMEOUT_EVENT_TYPE {
            return None;
        }
        let value: serde_json::Value = serde_json::from_slice(&self.delivered.payload).ok()?;
        value.get("name")?.as_str().map(str::to_owned)
    }

    /// The message's event type, or `timeout:NAME` for a timeout.
    pub fn label(&self) -> String {
        match self.timeout() {
            Some(name) => format!("timeout:{name}"),
            None => self.delivered.event_type.clone(),
        }
    }
}

/// What the messages of one delivery did to one saga instance, in the
/// order delivered ([`Delivery::saga_history`]): every copy and
/// redelivery, with its [`SagaOutcome`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SagaHistory {
    /// The saga type.
    pub saga_type: String,
    /// The instance.
    pub saga_id: String,
    /// The messages, in order.
    pub entries: Vec<SagaEntry>,
}

impl SagaHistory {
    /// The entries whose message changed the instance (started it, or a
    /// step ran), in order.
    pub fn applied(&self) -> impl Iterator<Item = &SagaEntry> {
        self.entries.iter().filter(|e| e.outcome.changed())
    }

    /// The labels ([`SagaEntry::label`]) of the messages that changed the
    /// instance, in order: its steps.
    pub fn steps(&self) -> Vec<String> {
        self.applied().map(SagaEntry::label).collect()
    }

    /// The messages of type `M` that changed the instance, decoded, in
    /// order.
    pub fn applied_events<M: DomainEvent>(&self) -> Vec<M> {
        self.applied()
            .filter_map(|e| e.delivered.decode())
            .collect()
    }

    /// Asserts that the messages that changed the instance are exactly
    /// these, in this order: event types, and `timeout:NAME` for the
    /// saga's timeouts.
    ///
    /// # Panics
    ///
    /// If they are not, showing the history.
    #[track_caller]
    pub fn assert_steps(&self, labels: &[&str]) {
        let steps = self.steps();
        if steps != labels {
            panic!(
                "steps of {}: expected {labels:?}, applied {steps:?}\n{self}",
                self.name()
            );
        }
    }

    /// Asserts that a message of type `M` changed the instance; returns
    /// the first one.
    ///
    /// # Panics
    ///
    /// If none did, showing the history.
    #[track_caller]
    pub fn assert_applied<M: DomainEvent>(&self) -> M {
        match self.applied_events::<M>().into_iter().next() {
            Some(m) => m,
            None => panic!(
                "no `{}` was applied to {}\n{self}",
                M::EVENT_TYPES.join("|"),
                self.name()
            ),
        }
    }

    /// Asserts that the saga's timeout `name` fired: its step ran.
    ///
    /// # Panics
    ///
    /// If it did not, showing the history.
    #[track_caller]
    pub fn assert_timeout_fired(&self, name: &str) {
        if !self.applied().any(|e| e.timeout().as_deref() == Some(name)) {
            panic!("timeout `{name}` of {} did not fire\n{self}", self.name());
        }
    }

    /// Asserts that no message changed the instance more than once: every
    /// copy and redelivery of an applied message changed nothing.
    ///
    /// # Panics
    ///
    /// Naming the messages applied more than once.
    #[track_caller]
    pub fn assert_each_applied_once(&self) {
        let mut times: BTreeMap<Option<Uuid>, (usize, String)> = BTreeMap::new();
        for e in self.applied() {
            times
                .entry(e.delivered.event_id)
                .or_insert((0, e.label()))
                .0 += 1;
        }
        let wrong: Vec<String> = times
            .iter()
            .filter(|(_, (n, _))| *n > 1)
            .map(|(id, (n, label))| format!("  {label} {id:?} applied {n} times"))
            .collect();
        if !wrong.is_empty() {
            panic!(
                "{}: messages applied more than once:\n{}\n{self}",
                self.name(),
                wrong.join("\n")
            );
        }
    }

    fn name(&self) -> String {
        format!("saga `{}` instance `{}`", self.saga_type, self.saga_id)
    }
}

impl fmt::Display for SagaHistory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "history of {}:", self.name())?;
        if self.entries.is_empty() {
            writeln!(f, "  no message delivered")?;
        }
        for e in &self.entries {
            writeln!(
                f,
                "  {} ← {}@{} {}: {}",
                e.delivered.group,
                e.delivered.topic,
                e.delivered.offset,
                e.label(),
                e.outcome
            )?;
        }
        Ok(())
    }
}

impl Delivery {
    /// What the messages of this delivery did to instance `saga_id` of
    /// saga `S`, in order: each message delivered to a consumer running
    /// `S` that correlates to the instance, with its [`SagaOutcome`].
    pub fn saga_history<S: Saga>(&self, saga_id: impl fmt::Display) -> SagaHistory {
        let saga_id = saga_id.to_string();
        let entries = self
            .delivered
            .iter()
            .filter_map(|d| {
                let effect = d
                    .sagas
                    .iter()
                    .find(|s| s.saga_type == S::NAME && s.saga_id == saga_id)?;
                Some(SagaEntry {
                    delivered: d.clone(),
                    outcome: effect.outcome.clone(),
                })
            })
            .collect();
        SagaHistory {
            saga_type: S::NAME.to_owned(),
            saga_id,
            entries,
        }
    }

    /// Asserts that a message of type `M` changed instance `saga_id` of
    /// saga `S` (started it, or its step ran); returns the first one.
    ///
    /// # Panics
    ///
    /// If none did, showing the instance's history.
    #[track_caller]
    pub fn assert_saga_step<S: Saga, M: DomainEvent>(&self, saga_id: impl fmt::Display) -> M {
        self.saga_history::<S>(saga_id).assert_applied::<M>()
    }
}

const READ: &str = "\
SELECT state, version, timeouts, completed_at IS NOT NULL AS completed
FROM outbox_saga WHERE saga_type = $1 AND saga_id = $2";

/// A saga instance as stored in `outbox_saga`, its state decoded.
#[non_exhaustive]
pub struct SagaInstance<S: Saga> {
    /// The instance's id.
    pub saga_id: String,
    /// The state.
    pub state: S,
    /// The stage (the state's).
    pub stage: S::Stage,
    /// Steps applied since it was created (the start step included).
    pub version: i64,
    /// Whether a step completed it.
    pub completed: bool,
    /// The pending timeouts: name → id (the scheduled message's event id).
    pub timeouts: BTreeMap<String, Uuid>,
}

impl<S: Saga> fmt::Debug for SagaInstance<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SagaInstance")
            .field("saga_type", &S::NAME)
            .field("saga_id", &self.saga_id)
            .field("stage", &self.stage)
            .field("version", &self.version)
            .field("completed", &self.completed)
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

impl<S: Saga> fmt::Display for SagaInstance<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = serde_json::to_string(&self.state).unwrap_or_else(|e| format!("<{e}>"));
        write!(
            f,
            "saga `{}` instance `{}`: stage {}, {}, version {}, pending timeouts {:?}, state {state}",
            S::NAME,
            self.saga_id,
            stage_name(&self.stage),
            if self.completed {
                "completed"
            } else {
                "running"
            },
            self.version,
            self.timeouts.keys().collect::<Vec<_>>(),
        )
    }
}

impl<S: Saga> SagaInstance<S> {
    /// Reads instance `saga_id` of saga `S` from the database of `pool`
    /// (`None`: there is none).
    ///
    /// # Errors
    ///
    /// A database error, or a state or timeouts that do not decode
    /// (`sqlx::Error::Decode`).
    pub async fn load(
        pool: &PgPool,
        saga_id: impl fmt::Display,
    ) -> Result<Option<Self>, sqlx::Error> {
        let saga_id = saga_id.to_string();
        let Some(row) = sqlx::query(READ)
            .bind(S::NAME)
            .bind(&saga_id)
            .fetch_optional(pool)
            .await?
        else {
            return Ok(None);
        };
        let decode = |e: serde_json::Error| sqlx::Error::Decode(e.into());
        let state: S = serde_json::from_value(row.try_get("state")?).map_err(decode)?;
        let timeouts = serde_json::from_value(row.try_get("timeouts")?).map_err(decode)?;
        Ok(Some(Self {
            stage: state.stage().clone(),
            state,
            saga_id,
            version: row.try_get("version")?,
            completed: row.try_get("completed")?,
            timeouts,
        }))
    }

    /// The names of the pending timeouts.
    pub fn pending_timeouts(&self) -> Vec<&str> {
        self.timeouts.keys().map(String::as_str).collect()
    }

    /// Asserts the instance's stage.
    ///
    /// # Panics
    ///
    /// If it is in another, showing the instance.
    #[track_caller]
    pub fn assert_stage(&self, stage: S::Stage) -> &Self {
        if self.stage != stage {
            panic!("expected stage {stage:?}, found {:?}\n{self}", self.stage);
        }
        self
    }

    /// Asserts that a step completed the instance.
    ///
    /// # Panics
    ///
    /// If it is running, showing the instance.
    #[track_caller]
    pub fn assert_completed(&self) -> &Self {
        if !self.completed {
            panic!("expected the instance completed, it is running\n{self}");
        }
        self
    }

    /// Asserts that the instance is running (not completed).
    ///
    /// # Panics
    ///
    /// If it is completed, showing the instance.
    #[track_caller]
    pub fn assert_running(&self) -> &Self {
        if self.completed {
            panic!("expected the instance running, it is completed\n{self}");
        }
        self
    }

    /// Asserts that timeout `name` is pending.
    ///
    /// # Panics
    ///
    /// If it is not, showing the instance.
    #[track_caller]
    pub fn assert_pending_timeout(&self, name: &str) -> &Self {
        if !self.timeouts.contains_key(name) {
            panic!("expected timeout `{name}` pending\n{self}");
        }
        self
    }

    /// Asserts that no timeout is pending.
    ///
    /// # Panics
    ///
    /// If one is, showing the instance.
    #[track_caller]
    pub fn assert_no_pending_timeouts(&self) -> &Self {
        if !self.timeouts.is_empty() {
            panic!("expected no pending timeout\n{self}");
        }
        self
    }

    /// Asserts how many steps were applied (the start step included).
    ///
    /// # Panics
    ///
    /// If another number were, showing the instance.
    #[track_caller]
    pub fn assert_version(&self, version: i64) -> &Self {
        if self.version != version {
            panic!(
                "expected version {version} (steps applied), found {}\n{self}",
                self.version
            );
        }
        self
    }
}
