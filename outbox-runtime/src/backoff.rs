//! Exponential back-off, capped, and the up/down state of a dependency
//! (logged on changes only): shared by the relay and the consumers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The delay before retry number `attempt` (1-based): `first * 2^(attempt-1)`,
/// capped at `max`.
pub(crate) fn delay(first: Duration, max: Duration, attempt: u32) -> Duration {
    let factor = 1_u32
        .checked_shl(attempt.saturating_sub(1).min(20))
        .unwrap_or(u32::MAX);
    first.saturating_mul(factor).min(max)
}

/// A back-off sequence: `next()` grows, `reset()` starts over.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            first,
            max,
            attempt: 0,
        }
    }

    pub fn next(&mut self) -> Duration {
        self.attempt = self.attempt.saturating_add(1);
        delay(self.first, self.max, self.attempt)
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// What a component's [`Health`] values report while down: the dependency
/// and its last error (read by the consumer's `health()`).
pub(crate) type Problems = Arc<Mutex<BTreeMap<&'static str, String>>>;

/// Up/down state of a dependency, with logging on state changes only.
pub(crate) struct Health {
    what: &'static str,
    down_since: Option<Instant>,
    backoff: Backoff,
    report: Option<Problems>,
}

impl Health {
    pub fn new(what: &'static str, first: Duration, max: Duration) -> Self {
        Self {
            what,
            down_since: None,
            backoff: Backoff::new(first, max),
            report: None,
        }
    }

    /// Also reports the state in `problems` (the last error while down).
    pub fn reporting(mut self, problems: Problems) -> Self {
        self.report = Some(problems);
        self
    }

    /// Records a failure; returns how long to wait before retrying.
    pub fn down(&mut self, error: &dyn std::fmt::Display) -> Duration {
        if self.down_since.is_none() {
            self.down_since = Some(Instant::now());
            tracing::warn!(%error, "{} unavailable: backing off and retrying", self.what);
        }
        if let Some(report) = &self.report {
            report
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(self.what, error.to_string());
        }
        self.backoff.next()
    }

    /// True while the dependency is considered down.
    pub fn is_down(&self) -> bool {
        self.down_since.is_some()
    }

    /// Records a success.
    pub fn up(&mut self) {
        if let Some(since) = self.down_since.take() {
            tracing::info!(
                after_ms = since.elapsed().as_millis() as u64,
                "{} available again: resuming",
                self.what
            );
            if let Some(report) = &self.report {
                report
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(self.what);
            }
        }
        self.backoff.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_then_caps_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let seen: Vec<u128> = (0..5).map(|_| b.next().as_millis()).collect();
        assert_eq!(seen, vec![100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next(), Duration::from_millis(100));
        assert_eq!(
            delay(Duration::from_secs(1), Duration::from_secs(60), 1000),
            Duration::from_secs(60)
        );
    }
}
