//! Exponential back-off, capped (backon's `ExponentialBuilder`), and the
//! state of a dependency — up, unavailable, or refusing a statement (see
//! [`crate::refusal`]), logged on changes only: shared by the relay and the
//! consumers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

use crate::refusal::{Refusal, Statement, Trouble};

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

/// What a component's [`Health`] values report while something fails, by
/// dependency (read by the relay's and the consumer's `health()`).
pub(crate) type Problems = Arc<Mutex<BTreeMap<&'static str, Problem>>>;

/// What fails about one dependency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Problem {
    /// The last error (each refused statement, when refused).
    pub error: String,
    /// The statements the database refuses (see [`crate::refusal`]), by
    /// [`Refusal::key`]; empty when it is only unavailable.
    pub refused: Vec<String>,
}

/// Whether any of `problems` is a refusal, and all of them as one text
/// (`dependency: error; …`); `None` when nothing fails.
pub(crate) fn summary(problems: &Problems) -> Option<(bool, String)> {
    let problems = problems.lock().unwrap_or_else(|p| p.into_inner());
    if problems.is_empty() {
        return None;
    }
    let refused = problems.values().any(|p| !p.refused.is_empty());
    let text: Vec<String> = problems
        .iter()
        .map(|(what, p)| format!("{what}: {}", p.error))
        .collect();
    Some((refused, text.join("; ")))
}

/// Up/down state of a dependency, with logging on state changes only.
///
/// Two ways to fail: unavailable ([`Trouble::Outage`]: warned once, retried
/// after a growing back-off) and refusing a statement ([`Trouble::Refused`]:
/// reported once per statement at error level, retried after the back-off's
/// cap, and reported as refused until that statement goes through, see
/// [`crate::refusal`]).
pub(crate) struct Health {
    what: &'static str,
    down_since: Option<Instant>,
    /// The last outage's error, while down.
    outage: Option<String>,
    backoff: Backoff,
    /// The back-off's cap: the delay after a refusal.
    max: Duration,
    report: Option<Problems>,
    /// The statements refused now, by [`Refusal::key`].
    refused: BTreeMap<String, Refusal>,
}

impl Health {
    pub fn new(what: &'static str, first: Duration, max: Duration) -> Self {
        Self {
            what,
            down_since: None,
            outage: None,
            backoff: Backoff::new(first, max),
            max,
            report: None,
            refused: BTreeMap::new(),
        }
    }

    /// Also reports the state in `problems` (the last error while down).
    pub fn reporting(mut self, problems: Problems) -> Self {
        self.report = Some(problems);
        self
    }

    /// Records a failure; returns how long to wait before retrying: the
    /// next step of the back-off after an outage, its cap after a refusal.
    pub fn down(&mut self, error: impl Into<Trouble>) -> Duration {
        let wait = match error.into() {
            Trouble::Outage(error) => {
                if self.down_since.is_none() {
                    self.down_since = Some(Instant::now());
                    tracing::warn!(%error, "{} unavailable: backing off and retrying", self.what);
                }
                self.outage = Some(error);
                self.backoff.next()
            }
            Trouble::Refused(refusal) => {
                let key = refusal.key();
                // Once per process: a sibling task may have reported it.
                if !self.refused.contains_key(&key) && !self.reported_elsewhere(&key) {
                    tracing::error!(
                        statement = refusal.statement.map(|s| s.name),
                        needs = refusal.statement.map(|s| s.needs),
                        sqlstate = refusal.code.as_deref(),
                        error = %refusal.error,
                        hint = refusal.hint(),
                        retry_after_ms = self.max.as_millis() as u64,
                        "{}: the database refuses a statement; retrying slowly until it is fixed",
                        self.what
                    );
                }
                self.refused.insert(key, refusal);
                self.max
            }
        };
        self.publish();
        wait
    }

    /// True while the dependency is considered down (unavailable).
    pub fn is_down(&self) -> bool {
        self.down_since.is_some()
    }

    /// True while a statement is refused.
    pub fn refusing(&self) -> bool {
        !self.refused.is_empty()
    }

    /// Records a success of everything this component runs: the outage and
    /// every refusal are over.
    pub fn up(&mut self) {
        self.answered();
        let keys: Vec<String> = self.refused.keys().cloned().collect();
        for key in keys {
            self.cleared(&key);
        }
    }

    /// Records an answer: the outage is over (refused statements stay
    /// refused until [`permitted`](Self::permitted)).
    pub fn answered(&mut self) {
        if let Some(since) = self.down_since.take() {
            tracing::info!(
                after_ms = since.elapsed().as_millis() as u64,
                "{} available again: resuming",
                self.what
            );
            self.outage = None;
            self.publish();
        }
        self.backoff.reset();
    }

    /// Records that `statement` went through: its refusal, if any, is over.
    pub fn permitted(&mut self, statement: Statement) {
        self.cleared(statement.name);
    }

    fn cleared(&mut self, key: &str) {
        if let Some(refusal) = self.refused.remove(key) {
            tracing::info!(
                statement = refusal.statement.map(|s| s.name),
                "{}: the refused statement goes through again: resuming",
                self.what
            );
            self.publish();
        }
    }

    /// Whether another component reporting to the same problems has
    /// reported refusal `key` already.
    fn reported_elsewhere(&self, key: &str) -> bool {
        self.report.as_ref().is_some_and(|report| {
            let report = report.lock().unwrap_or_else(|p| p.into_inner());
            report
                .iter()
                .any(|(what, p)| *what != self.what && p.refused.iter().any(|k| k == key))
        })
    }

    /// Puts the current state into the reported problems.
    fn publish(&self) {
        let Some(report) = &self.report else {
            return;
        };
        let mut report = report.lock().unwrap_or_else(|p| p.into_inner());
        let problem = if !self.refused.is_empty() {
            let each: Vec<String> = self.refused.values().map(ToString::to_string).collect();
            Some(Problem {
                error: each.join("; "),
                refused: self.refused.keys().cloned().collect(),
            })
        } else {
            self.outage.clone().map(|error| Problem {
                error,
                refused: Vec::new(),
            })
        };
        match problem {
            Some(problem) => report.insert(self.what, problem),
            None => report.remove(self.what),
        };
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
    fn a_refusal_waits_the_cap_until_its_statement_goes_through() {
        let problems = Problems::default();
        let (first, max) = (Duration::from_millis(10), Duration::from_secs(3));
        let mut health = Health::new("database", first, max).reporting(problems.clone());
        let statement = |name| Statement {
            name,
            needs: "SELECT ON t",
        };
        let refusal = |name| {
            Trouble::Refused(Refusal {
                statement: Some(statement(name)),
                code: Some("42501".into()),
                error: "permission denied for table t".into(),
            })
        };
        assert_eq!(health.down("connection reset"), first);
        assert_eq!(
            summary(&problems),
            Some((false, "database: connection reset".into()))
        );
        assert_eq!(health.down(refusal("hold")), max);
        assert_eq!(health.down(refusal("release")), max);
        let (refused, text) = summary(&problems).unwrap();
        assert!(
            refused && text.contains("hold (needs SELECT ON t)"),
            "{text}"
        );
        // An answer ends the outage, not the refusals.
        health.answered();
        assert!(!health.is_down() && health.refusing());
        health.permitted(statement("hold"));
        assert!(summary(&problems).unwrap().1.contains("release"));
        health.permitted(statement("release"));
        assert_eq!(summary(&problems), None);
        // A sibling reporting to the same problems sees the refusal too.
        let mut sibling = Health::new("database (other)", first, max).reporting(problems.clone());
        health.down(refusal("hold"));
        assert!(sibling.reported_elsewhere("hold"));
        sibling.down(refusal("hold"));
        health.up();
        assert!(summary(&problems).unwrap().0, "the sibling's refusal stays");
        sibling.up();
        assert_eq!(summary(&problems), None);
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
