//! The stall watchdog of a consumer's polling thread.
//!
//! A consumer can stop making progress while every call it makes succeeds:
//! it owns no partition although its group has messages to read (a broker
//! that kept a dead member's assignment, or a rebalance that ended without
//! one); it owns partitions with messages past its position and receives
//! none; or another of the group's partitions is assigned to no live
//! member while this one consumes its own. The watchdog measures:
//!
//! - after `stall_timeout` without a message, the lag on its own
//!   partitions;
//! - every probe interval, quiet or not, the group's committed offsets
//!   against the partitions' log ends. A partition with messages to read
//!   whose committed offset has not moved for `stall_timeout` is stuck
//!   (a busy member does not count its own partitions: it is reading them).
//!
//! With lag it reports the consumer stalled: `health()` is `Degraded` with
//! the reason (naming the stuck partitions), the `outbox_consumer_stalled`
//! gauge is 1. When partitions are stuck, the member rejoins the group as
//! a new member, at most once per `stall_timeout`: the rebalance makes the
//! broker assign every partition to a live member again. A probe cannot
//! tell a dead owner from one that holds a partition longer than
//! `stall_timeout` (a handler retrying one message): then the rejoin costs
//! a rebalance and nothing else. Receiving a message on a member with no
//! stuck partition, or finding no lag, clears the state.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::Offset;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};

use super::Stats;

/// How long one broker request of a probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The dependency name under which a stall shows in `health()`.
const WHAT: &str = "kafka group";

/// What a probe needs besides the member's client.
pub(crate) struct Probe<'a> {
    /// The member's client configuration (a probe of the group's lag runs
    /// a client of its own that does not join the group).
    pub client: &'a rdkafka::ClientConfig,
    /// The subscribed topics.
    pub topics: &'a [String],
    /// The high watermarks of the member's own fetches.
    pub fetched: &'a std::sync::Mutex<std::collections::HashMap<(String, i32), i64>>,
}

/// What the polling thread must do after a check.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Nothing,
    /// Leave the group and join it again as a new member.
    Rejoin,
}

/// A partition: (topic, partition).
type Key = (String, i32);

/// The watchdog's state (one per polling thread).
pub(crate) struct Watchdog {
    timeout: Duration,
    group: String,
    stats: Arc<Stats>,
    /// Since when nothing was received (or the lag was last found 0).
    quiet_since: Instant,
    last_probe: Option<Instant>,
    last_group_probe: Option<Instant>,
    last_rejoin: Option<Instant>,
    stalled: bool,
    /// The stall is the group's (stuck partitions), not this member's own.
    of_group: bool,
    /// Each partition's committed offset at the group's probes, and since
    /// when it has had that value.
    still: HashMap<Key, (i64, Instant)>,
}

/// Stuck partitions found by a probe of the group.
struct Stuck {
    lag: i64,
    partitions: Vec<Key>,
    /// How many of them this member owns.
    own: usize,
}

impl Watchdog {
    pub fn new(timeout: Duration, group: &str, stats: Arc<Stats>) -> Self {
        Self {
            timeout,
            group: group.to_owned(),
            stats,
            quiet_since: Instant::now(),
            last_probe: None,
            last_group_probe: None,
            last_rejoin: None,
            stalled: false,
            of_group: false,
            still: HashMap::new(),
        }
    }

    /// A message was received: the consumer moves (its group may still
    /// have stuck partitions: the next probe of the group tells).
    pub fn received(&mut self) {
        self.quiet_since = Instant::now();
        if self.stalled && !self.of_group {
            self.clear();
        }
    }

    /// How often a quiet consumer measures its lag.
    fn probe_interval(&self) -> Duration {
        (self.timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(15))
    }

    /// Looks at the consumer and its group: called on every turn of the
    /// polling loop (cheap unless it is time to probe). `owned` lists the
    /// partitions this member owns.
    pub fn check<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        probe: &Probe<'_>,
        owned: &dyn Fn() -> Vec<Key>,
    ) -> Action {
        let quiet = self.quiet_since.elapsed();
        if quiet < self.timeout {
            // Busy (or not quiet for long): the group's other partitions,
            // every other probe interval.
            if self
                .last_group_probe
                .is_some_and(|at| at.elapsed() < 2 * self.probe_interval())
            {
                return Action::Nothing;
            }
            let own = owned();
            return match self.group_stuck(probe, &own, false) {
                Ok(Some(stuck)) => {
                    let reason = format!(
                        "stalled: the group's partition(s) {} have {} message(s) to read and \
                         their committed offsets have not moved for {} s while this member \
                         consumes its own {} (assigned to no live member?); rejoined the group \
                         {} time(s)",
                        names(&stuck.partitions),
                        stuck.lag,
                        self.timeout.as_secs(),
                        own.len(),
                        self.rejoins_with_this(),
                    );
                    self.stall(reason, true)
                }
                Ok(None) => {
                    if self.stalled {
                        self.clear();
                    }
                    Action::Nothing
                }
                Err(error) => Self::unanswered(&error),
            };
        }
        if self
            .last_probe
            .is_some_and(|at| at.elapsed() < self.probe_interval())
        {
            return Action::Nothing;
        }
        self.last_probe = Some(Instant::now());
        let own = owned();
        // Its own partitions first; a member with nothing left on them (or
        // none) looks at the whole group's, its own included (its own
        // measure may have been answered with ends too low).
        let own_lag = if own.is_empty() {
            Ok(0)
        } else {
            own_lag(consumer, probe.fetched).map_err(crate::error::Error::from)
        };
        match own_lag {
            Ok(0) => match self.group_stuck(probe, &own, true) {
                Ok(Some(stuck)) => {
                    let reason = if own.is_empty() {
                        format!(
                            "stalled: owns no partition and received nothing for {} s while the \
                             group has {} message(s) to read on partition(s) {} that have not \
                             moved; rejoined the group {} time(s)",
                            quiet.as_secs(),
                            stuck.lag,
                            names(&stuck.partitions),
                            self.rejoins_with_this(),
                        )
                    } else {
                        format!(
                            "stalled: received nothing for {} s; partition(s) {} ({} of them its \
                             own) have {} message(s) to read and have not moved; rejoined the \
                             group {} time(s)",
                            quiet.as_secs(),
                            names(&stuck.partitions),
                            stuck.own,
                            stuck.lag,
                            self.rejoins_with_this(),
                        )
                    };
                    self.stall(reason, true)
                }
                Ok(None) => {
                    // Idle: nothing to read, or others consume. Judged
                    // again after another timeout.
                    self.quiet_since = Instant::now();
                    if self.stalled {
                        self.clear();
                    }
                    Action::Nothing
                }
                Err(error) => Self::unanswered(&error),
            },
            Ok(lag) => {
                let reason = format!(
                    "stalled: received nothing for {} s on its {} partition(s), which have \
                     {lag} message(s) past its position",
                    quiet.as_secs(),
                    own.len()
                );
                self.stall(reason, false)
            }
            Err(error) => Self::unanswered(&error),
        }
    }

    /// Rejoins so far, counting the one a stall found now would make.
    fn rejoins_with_this(&self) -> u64 {
        self.stats
            .rejoins
            .load(std::sync::atomic::Ordering::Relaxed)
            + u64::from(self.may_rejoin())
    }

    /// Whether a rejoin is due (none in the last `stall_timeout`).
    fn may_rejoin(&self) -> bool {
        self.last_rejoin
            .is_none_or(|at| at.elapsed() >= self.timeout)
    }

    /// Reports the stall; rejoins the group if `stuck` partitions call for
    /// it and none happened in the last `stall_timeout`.
    fn stall(&mut self, reason: String, stuck: bool) -> Action {
        if !self.stalled {
            tracing::error!(group = %self.group, %reason, "consumer stalled");
        }
        let rejoin = stuck && self.may_rejoin();
        self.stalled = true;
        self.of_group = stuck;
        self.stats
            .problems
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                WHAT,
                crate::backoff::Problem {
                    error: reason,
                    refused: Vec::new(),
                },
            );
        crate::metrics::consumer_stalled(&self.group, true);
        if rejoin {
            self.last_rejoin = Some(Instant::now());
            self.stats
                .rejoins
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            crate::metrics::consumer_rejoined(&self.group);
            tracing::warn!(group = %self.group, "partitions with lag have not moved: rejoining the group");
            return Action::Rejoin;
        }
        Action::Nothing
    }

    /// Probes the group: its partitions with lag whose committed offsets
    /// have not moved for `stall_timeout` (this member's own ones only if
    /// `with_own`), or `None`.
    fn group_stuck(
        &mut self,
        probe: &Probe<'_>,
        own: &[Key],
        with_own: bool,
    ) -> crate::error::Result<Option<Stuck>> {
        self.last_group_probe = Some(Instant::now());
        let parts = super::groups::lag_of(
            probe.client.clone(),
            &self.group,
            Some(probe.topics),
            PROBE_TIMEOUT,
        )?;
        let now = Instant::now();
        let mut stuck = Stuck {
            lag: 0,
            partitions: Vec::new(),
            own: 0,
        };
        let mut seen = HashMap::with_capacity(parts.len());
        for p in parts {
            let key = (p.topic, p.partition);
            let since = match self.still.get(&key) {
                Some((offset, since)) if *offset == p.committed => *since,
                _ => now,
            };
            let is_own = own.contains(&key);
            if p.lag > 0 && now - since >= self.timeout && (with_own || !is_own) {
                stuck.lag += p.lag;
                stuck.own += usize::from(is_own);
                stuck.partitions.push(key.clone());
            }
            seen.insert(key, (p.committed, since));
        }
        self.still = seen;
        Ok((!stuck.partitions.is_empty()).then_some(stuck))
    }

    /// A probe the broker did not answer: its errors are reported by the
    /// polling loop; nothing to judge here.
    fn unanswered(error: &crate::error::Error) -> Action {
        tracing::debug!(%error, "stall probe failed");
        Action::Nothing
    }

    fn clear(&mut self) {
        self.stalled = false;
        self.stats
            .problems
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(WHAT);
        crate::metrics::consumer_stalled(&self.group, false);
        tracing::info!(group = %self.group, "consumer moving again");
    }
}

/// `topic/partition, …` (the first ten).
fn names(partitions: &[Key]) -> String {
    let mut out: Vec<String> = partitions
        .iter()
        .take(10)
        .map(|(t, p)| format!("{t}/{p}"))
        .collect();
    if partitions.len() > 10 {
        out.push(format!("and {} more", partitions.len() - 10));
    }
    out.join(", ")
}

/// Messages past this member's position on the partitions it owns: each
/// partition's end is the larger of the broker's answer to an offsets
/// request and the high watermark of the member's own fetches (`fetched`,
/// from librdkafka's statistics).
fn own_lag<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    fetched: &std::sync::Mutex<std::collections::HashMap<(String, i32), i64>>,
) -> rdkafka::error::KafkaResult<i64> {
    let fetched = fetched.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let positions = consumer.position()?;
    let committed = consumer.committed(PROBE_TIMEOUT)?;
    let mut lag = 0;
    for e in positions.elements() {
        let (low, listed) = consumer.fetch_watermarks(e.topic(), e.partition(), PROBE_TIMEOUT)?;
        let high = fetched
            .get(&(e.topic().to_owned(), e.partition()))
            .map_or(listed, |f| listed.max(*f));
        let from = match e.offset() {
            Offset::Offset(o) => o,
            _ => match committed
                .find_partition(e.topic(), e.partition())
                .map(|c| c.offset())
            {
                Some(Offset::Offset(o)) => o,
                _ => low,
            },
        };
        lag += (high - from).max(0);
    }
    Ok(lag)
}
