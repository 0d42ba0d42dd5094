//! The sagas' counters, per saga type, for the whole process: messages
//! that changed nothing and why, and steps applied.

use std::collections::HashMap;
use std::sync::Mutex;

/// What the messages of one saga type did, since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SagaCounts {
    /// Steps applied (state written back).
    pub steps: u64,
    /// Instances created by a start message.
    pub started: u64,
    /// Messages for no instance (and no start), ignored.
    pub missing: u64,
    /// Messages for a completed instance, ignored.
    pub completed: u64,
    /// Messages in a stage no step accepts, ignored (policy `Ignore`) or
    /// failed (policy `DeadLetter`).
    pub other_stage: u64,
    /// Timeouts that were no longer pending (cancelled, replaced, fired,
    /// or the saga completed), ignored.
    pub stale_timeouts: u64,
    /// Steps that failed on a conflict with another transaction (a
    /// deadlock, a serialization failure, a lock not available): their
    /// message is retried in a new transaction with the consumer's
    /// back-off, like any failure, and dead-lettered after its attempts.
    pub conflicts: u64,
}

static COUNTS: Mutex<Option<HashMap<&'static str, SagaCounts>>> = Mutex::new(None);

pub(crate) fn bump(saga: &'static str, f: impl FnOnce(&mut SagaCounts)) {
    let mut counts = COUNTS.lock().unwrap_or_else(|p| p.into_inner());
    f(counts
        .get_or_insert_with(HashMap::new)
        .entry(saga)
        .or_default());
}

/// The counts of every saga type that handled a message in this process,
/// by name.
pub fn all_saga_counts() -> Vec<(&'static str, SagaCounts)> {
    let counts = COUNTS.lock().unwrap_or_else(|p| p.into_inner());
    let mut all: Vec<_> = counts
        .iter()
        .flatten()
        .map(|(name, c)| (*name, *c))
        .collect();
    all.sort_by_key(|(name, _)| *name);
    all
}

/// The counts of saga type `saga` (its `NAME`).
pub fn saga_counts(saga: &str) -> SagaCounts {
    let counts = COUNTS.lock().unwrap_or_else(|p| p.into_inner());
    counts
        .as_ref()
        .and_then(|c| c.get(saga).copied())
        .unwrap_or_default()
}
