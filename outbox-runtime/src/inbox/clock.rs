//! The clock a dedup consumer waits on between a failing handler's retries:
//! the real one, or (the `testing` feature) a [`TestClock`] that moves
//! forward by each back-off at once, so a retry-then-dead-letter test takes
//! milliseconds while the delays are still computed and recorded.

#![cfg_attr(not(feature = "testing"), allow(dead_code))]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// A clock that never sleeps: waiting on it advances it by the wait, which
/// it records. Clones share one clock.
///
/// ```
/// # #[cfg(feature = "testing")] {
/// use std::time::Duration;
/// let clock = outbox_runtime::testing::TestClock::default();
/// assert_eq!(clock.elapsed(), Duration::ZERO);
/// assert!(clock.waits().is_empty());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TestClock {
    origin: Instant,
    state: Arc<Mutex<ClockState>>,
}

#[derive(Debug, Default)]
struct ClockState {
    elapsed: Duration,
    waits: Vec<Duration>,
}

impl Default for TestClock {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            state: Arc::default(),
        }
    }
}

impl TestClock {
    fn state(&self) -> std::sync::MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How far the clock has moved: the sum of the waits.
    pub fn elapsed(&self) -> Duration {
        self.state().elapsed
    }

    /// Every wait so far, in order (each retry's back-off).
    pub fn waits(&self) -> Vec<Duration> {
        self.state().waits.clone()
    }

    /// Moves the clock forward by `d`, recording it as a wait.
    pub fn advance(&self, d: Duration) {
        let mut state = self.state();
        state.elapsed += d;
        state.waits.push(d);
    }

    pub(crate) fn now(&self) -> Instant {
        self.origin + self.elapsed()
    }
}

/// The clock of a consumer's handler retries.
#[derive(Debug, Clone, Default)]
pub(crate) enum RetryClock {
    /// Real time: a back-off sleeps.
    #[default]
    Real,
    /// A [`TestClock`]: a back-off moves it forward at once.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    Test(TestClock),
}

impl RetryClock {
    pub fn now(&self) -> Instant {
        match self {
            Self::Real => Instant::now(),
            Self::Test(clock) => clock.now(),
        }
    }

    /// Waits `d` unless `shutdown` comes first; returns false on shutdown.
    pub async fn pause(&self, d: Duration, shutdown: &CancellationToken) -> bool {
        match self {
            Self::Real => super::apply::pause(d, shutdown).await,
            Self::Test(clock) => {
                clock.advance(d);
                !shutdown.is_cancelled()
            }
        }
    }
}
