//! A relay's counters and health, readable while it runs.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backoff::{self, Problems};

/// Counters of one relay, readable while it runs.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub(super) published: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) parked: AtomicU64,
    pub(super) withheld: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) order_violations: AtomicU64,
    /// Failed rounds in a row (see [`RelayStats::consecutive_failures`]).
    pub(super) failing: AtomicU64,
    pub(super) lanes: std::sync::Mutex<Vec<i32>>,
    /// What its tasks are stuck retrying on (dependency → last error).
    pub(super) problems: Problems,
    /// How the relay ended: `Some(None)` stopped, `Some(Some(e))` failed.
    pub(super) ended: std::sync::Mutex<Option<Option<String>>>,
}

/// What a relay's handle reports about it ([`RelayHandle::health`](super::RelayHandle::health)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RelayHealth {
    /// Running; nothing it depends on is failing.
    Running,
    /// Running, but stuck retrying: the database or the broker is
    /// unavailable. `error` names each and its last error.
    Degraded {
        /// What fails, component by component (`database: …`).
        error: String,
    },
    /// Running, but the database refuses one of the relay's statements in
    /// a way retrying cannot cure — a missing privilege (see the guide's
    /// "Roles and privileges"), a missing table or column. Logged once at
    /// error level; the relay retries every outage back-off cap until it is
    /// fixed and never publishes again a row it could not mark published
    /// (it stops publishing until it can). Exported as the
    /// `outbox_relay_refused` gauge.
    Refused {
        /// What is refused, naming each statement and what it needs.
        error: String,
    },
    /// Stopped after a shutdown.
    Stopped,
    /// Stopped on an error (what [`RelayHandle::join`](super::RelayHandle::join) returns).
    Failed {
        /// The error.
        error: String,
    },
}

/// A snapshot of [`RelayStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayCounts {
    /// Rows delivered and marked published.
    pub published: u64,
    /// Delivery failures (each attempt).
    pub failed: u64,
    /// Rows parked after too many failures.
    pub parked: u64,
    /// Rows claimed but held back behind a failed event of the same key.
    pub withheld: u64,
    /// Non-empty batches processed.
    pub batches: u64,
    /// Events delivered although an earlier event of their key in the same
    /// batch failed asynchronously (see the guide's ordering notes, docs/src/relay.md).
    pub order_violations: u64,
}

impl RelayStats {
    /// How the relay is doing.
    pub fn health(&self) -> RelayHealth {
        let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(ended) = ended {
            return match ended {
                None => RelayHealth::Stopped,
                Some(error) => RelayHealth::Failed { error },
            };
        }
        match backoff::summary(&self.problems) {
            None => RelayHealth::Running,
            Some((true, error)) => RelayHealth::Refused { error },
            Some((false, error)) => RelayHealth::Degraded { error },
        }
    }

    /// Where its tasks report what they are stuck on.
    pub(crate) fn problems(&self) -> Problems {
        self.problems.clone()
    }

    /// The lanes this relay claims from right now (empty without lanes).
    pub fn lanes(&self) -> Vec<i32> {
        self.lanes.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Failed rounds in a row: batches of which no event was delivered
    /// while some delivery failed, and claims or marks the database
    /// refused. Back to 0 once a batch delivers an event, or when the
    /// outbox has nothing left to publish (the failing rows were parked).
    /// Exported as the `outbox_relay_consecutive_failures` gauge.
    pub fn consecutive_failures(&self) -> u64 {
        self.failing.load(Ordering::Relaxed)
    }

    /// Counts a failed round.
    pub(super) fn failed_round(&self) {
        self.failing.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends a run of failed rounds: events were delivered, or nothing is
    /// left to deliver.
    pub(crate) fn failing_over(&self) {
        self.failing.store(0, Ordering::Relaxed);
    }

    /// The current counts.
    pub fn snapshot(&self) -> RelayCounts {
        RelayCounts {
            published: self.published.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            parked: self.parked.load(Ordering::Relaxed),
            withheld: self.withheld.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            order_violations: self.order_violations.load(Ordering::Relaxed),
        }
    }
}
