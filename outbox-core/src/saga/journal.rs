//! What each saga message did to its instance, for the testing kit: a
//! step's [`StepOutcome`] is noted in a task-local journal when one is in
//! scope ([`observe_steps`]), and nowhere otherwise (a consumer in
//! production keeps no journal).

use std::cell::RefCell;
use std::future::Future;

use uuid::Uuid;

/// What a message did to the saga instance it correlates to, as its
/// handler returned (its transaction may still roll back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StepOutcome {
    /// A start message created the instance and its start step ran.
    Started,
    /// A step ran and the state was written back.
    Applied,
    /// No instance (and the message starts none): nothing changed.
    Missing,
    /// The instance was completed: nothing changed.
    Completed,
    /// The instance was in a stage no step of the message accepts, and
    /// the saga ignores such messages: nothing changed.
    OtherStage,
    /// A timeout that was no longer pending: nothing changed.
    StaleTimeout,
}

/// A step's outcome, noted by the saga handler ([`observe_steps`]).
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct StepNote {
    /// The saga type (`Saga::NAME`).
    pub saga_type: &'static str,
    /// The instance.
    pub saga_id: String,
    /// The message's event id.
    pub event_id: Uuid,
    /// What it did.
    pub outcome: StepOutcome,
}

tokio::task_local! {
    static JOURNAL: RefCell<Vec<StepNote>>;
}

/// Runs `f` with a journal of the saga steps its handlers run (in this
/// task), and returns them in order, those of attempts that rolled back
/// included. Used by the testing kit.
#[doc(hidden)]
pub async fn observe_steps<F: Future>(f: F) -> (F::Output, Vec<StepNote>) {
    JOURNAL
        .scope(RefCell::new(Vec::new()), async move {
            let output = f.await;
            let notes = JOURNAL.with(|j| std::mem::take(&mut *j.borrow_mut()));
            (output, notes)
        })
        .await
}

/// Whether a journal is in scope.
pub(crate) fn active() -> bool {
    JOURNAL.try_with(|_| ()).is_ok()
}

/// Notes a step's outcome if a journal is in scope.
pub(crate) fn note(saga_type: &'static str, saga_id: String, event_id: Uuid, outcome: StepOutcome) {
    let _ = JOURNAL.try_with(|j| {
        j.borrow_mut().push(StepNote {
            saga_type,
            saga_id,
            event_id,
            outcome,
        });
    });
}
