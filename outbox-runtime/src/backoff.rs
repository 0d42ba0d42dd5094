//! Exponential back-off, capped (backon's `ExponentialBuilder`), and the
//! up/down state of a dependency (logged on changes only): shared by the
//! relay and the consumers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Doubling from `first`, capped at `max`, without end.
fn doubling(first: Duration, max: Duration) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_factor(2.0)
        .with_min_delay(first)
        .with_max_delay(max)
        .without_max_times()
}

/// The delay before retry number `attempt` (1-based): `first * 2^(attempt-1)`,
/// capped at `max`. Deterministic (no jitter): per-key retries are
/// scheduled from a row's stored attempt count.
pub(crate) fn delay(first: Duration, max: Duration, attempt: u32) -> Duration {
    // From the 64th step on the cap has long been reached.
    let step = attempt.saturating_sub(1).min(64) as usize;
    doubling(first, max)
        .build()
        .nth(step)
        .unwrap_or(max)
        .min(max)
}

/// A back-off sequence: `next()` grows, `reset()` starts over.
#[derive(Debug)]
pub(crate) struct Backoff {
    builder: ExponentialBuilder,
    steps: ExponentialBackoff,
    /// The cap of each delay (none with jitter: a capped delay stretched).
    cap: Option<Duration>,
}

impl Backoff {
    /// Doubling from `first` up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self::of(doubling(first, max), Some(max))
    }

    /// Doubling from `first` up to `max`, each delay stretched by a random
    /// share of itself (so up to twice as long): holders of the same
    /// schedule (relays, topics) spread out instead of retrying together.
    pub fn jittered(first: Duration, max: Duration) -> Self {
        Self::of(doubling(first, max).with_jitter(), None)
    }

    fn of(builder: ExponentialBuilder, cap: Option<Duration>) -> Self {
        Self {
            builder,
            steps: builder.build(),
            cap,
        }
    }

    pub fn next(&mut self) -> Duration {
        let next = self.steps.next().unwrap_or(Duration::MAX);
        self.cap.map_or(next, |cap| next.min(cap))
    }

    pub fn reset(&mut self) {
        self.steps = self.builder.build();
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
        let steps: Vec<u128> = (1..=6)
            .map(|n| delay(Duration::from_millis(250), Duration::from_secs(2), n).as_millis())
            .collect();
        assert_eq!(steps, vec![250, 500, 1000, 2000, 2000, 2000]);
        assert_eq!(
            delay(Duration::from_millis(250), Duration::from_secs(2), 0),
            Duration::from_millis(250)
        );
        // A cap below the first delay: the cap.
        assert_eq!(
            delay(Duration::from_secs(2), Duration::from_secs(1), 3),
            Duration::from_secs(1)
        );
        let mut low = Backoff::new(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(low.next(), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stretches_each_step_by_up_to_itself() {
        let (first, max) = (Duration::from_secs(5), Duration::from_secs(30));
        let mut spread = std::collections::HashSet::new();
        for _ in 0..50 {
            let mut b = Backoff::jittered(first, max);
            let steps: Vec<Duration> = (0..6).map(|_| b.next()).collect();
            for (step, base) in steps.iter().zip([5, 10, 20, 30, 30, 30]) {
                let base = Duration::from_secs(base);
                assert!(*step >= base && *step < base * 2, "{steps:?}");
            }
            spread.insert(steps[0].as_millis());
            b.reset();
            let again = b.next();
            assert!(again >= first && again < first * 2);
        }
        assert!(spread.len() > 10, "jittered: {spread:?}");
    }
}
