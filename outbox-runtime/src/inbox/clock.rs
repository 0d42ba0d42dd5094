//! The testing kit's clock (the `testing` feature): a [`TestClock`] moves
//! forward by each retry's back-off at once, so a retry-then-dead-letter
//! test takes milliseconds while the delays are still computed and
//! recorded.

#![cfg_attr(not(feature = "testing"), allow(dead_code))]

use std::sync::{Arc, Mutex};
use std::time::Duration;

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
#[derive(Debug, Clone, Default)]
pub struct TestClock {
    state: Arc<Mutex<ClockState>>,
}

#[derive(Debug, Default)]
struct ClockState {
    elapsed: Duration,
    waits: Vec<Duration>,
}

impl TestClock {
    fn state(&self) -> std::sync::MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How far the clock has moved: the sum of the waits, and of the jumps
    /// of [`TestBus::deliver`](crate::testing::TestBus::deliver) to
    /// scheduled events.
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

    /// Moves the clock forward by `d` without recording a wait (the test
    /// bus jumping to the next scheduled event).
    pub(crate) fn jump(&self, d: Duration) {
        self.state().elapsed += d;
    }
}
