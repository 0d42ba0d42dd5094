//! The consumer groups' lag, read from the broker in the background and
//! kept: a page never creates a Kafka client. At most one reading runs at a
//! time, and a new one starts (when a page asks) only once the last began
//! [`ConsoleConfig::lag_refresh`](crate::ConsoleConfig::lag_refresh) ago; it
//! reads the groups the page shows (at most [`MAX_GROUPS`]) one after the
//! other on a blocking thread, each bounded by [`LAG_TIMEOUT`], and keeps
//! each result as it comes. The page that starts a reading waits at most
//! [`FIRST_WAIT`] for groups never read; every page then shows what is
//! known ("reading…" for the rest).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use outbox_runtime::inbox::groups::{self, PartitionLag};

use crate::html::scrub_urls;

/// Most consumer groups the page shows (the first by name) and reads the
/// lag of.
pub const MAX_GROUPS: usize = 100;

/// How long each broker call of one group's reading may take.
pub const LAG_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a page waits for groups whose lag was never read.
pub const FIRST_WAIT: Duration = Duration::from_secs(2);

/// One group's lag as last read.
#[derive(Debug, Clone)]
pub enum Reading {
    /// Per partition with a committed offset.
    Read(Vec<PartitionLag>),
    /// Why it could not be read (secrets scrubbed).
    Failed(String),
}

/// What a page shows.
pub struct LagView {
    /// The groups read so far (of those asked).
    pub groups: HashMap<String, Reading>,
    /// How often the lag is read at most.
    pub refresh: Duration,
    /// How long ago the last reading began, if one did.
    pub last_read: Option<Duration>,
}

#[derive(Default)]
struct State {
    readings: HashMap<String, Reading>,
    running: bool,
    started: Option<Instant>,
}

struct Inner {
    brokers: String,
    settings: Vec<(String, String)>,
    refresh: Duration,
    state: Mutex<State>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Marks the reading over when dropped, even if reading a group panicked.
struct Running(Weak<Inner>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.state().running = false;
        }
    }
}

/// The kept readings, shared by every request.
pub struct Lag {
    inner: Arc<Inner>,
}

impl Lag {
    /// Readings from `brokers` (with these librdkafka settings), at most
    /// every `refresh`.
    pub fn new(brokers: String, settings: Vec<(String, String)>, refresh: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                brokers,
                settings,
                refresh,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The lag of `groups` as known; starts a reading if due (and then
    /// waits a little for groups never read).
    pub async fn read(&self, groups: &[String]) -> LagView {
        let deadline = if self.start_if_due(groups) {
            Instant::now() + FIRST_WAIT
        } else {
            Instant::now()
        };
        loop {
            {
                let state = self.inner.state();
                let missing = groups.iter().any(|g| !state.readings.contains_key(g));
                if !missing || !state.running || Instant::now() >= deadline {
                    return LagView {
                        groups: groups
                            .iter()
                            .filter_map(|g| Some((g.clone(), state.readings.get(g)?.clone())))
                            .collect(),
                        refresh: self.inner.refresh,
                        last_read: state.started.map(|s| s.elapsed()),
                    };
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a reading of `groups` if none runs and the last began
    /// `refresh` ago or more; whether it did.
    fn start_if_due(&self, groups: &[String]) -> bool {
        let mut state = self.inner.state();
        let due = state
            .started
            .is_none_or(|s| s.elapsed() >= self.inner.refresh);
        if state.running || !due || groups.is_empty() {
            return false;
        }
        state.running = true;
        state.started = Some(Instant::now());
        // Only the groups shown are kept: the map stays bounded.
        state.readings.retain(|g, _| groups.contains(g));
        drop(state);
        let weak = Arc::downgrade(&self.inner);
        let groups = groups.to_vec();
        tokio::task::spawn_blocking(move || read_all(&weak, groups));
        true
    }
}

/// One reading: each group in turn; stops early once the console is gone.
fn read_all(weak: &Weak<Inner>, groups: Vec<String>) {
    let _running = Running(weak.clone());
    for group in groups {
        let Some(inner) = weak.upgrade() else {
            return;
        };
        let reading = match groups::lag(&inner.brokers, &inner.settings, &group, LAG_TIMEOUT) {
            Ok(parts) => Reading::Read(parts),
            Err(error) => Reading::Failed(scrub_urls(&error.to_string())),
        };
        inner.state().readings.insert(group, reading);
    }
}
