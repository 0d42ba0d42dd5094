//! The stall watchdog of a consumer's polling thread.
//!
//! A consumer can stop making progress while every call it makes succeeds:
//! it owns no partition although its group has messages to read (a broker
//! that kept a dead member's assignment, or a rebalance that ended without
//! one); it owns partitions with messages past its position and receives
//! none; or it has read everything on its own partitions while another of
//! the group's partitions is assigned to no live member. After
//! `stall_timeout` without a message, the watchdog measures the lag — first
//! on its own partitions; with none left there (or no partition), the
//! group's committed offsets against the partitions' log ends, stalled only
//! if those offsets stood still since its previous probe (else other
//! members consume and this one is spare or done) — and, with lag, reports
//! the consumer stalled: `health()` is `Degraded` with the reason, the
//! `outbox_consumer_stalled` gauge is 1. When it is the group that does not
//! move, the member rejoins the group as a new member, at most once per
//! `stall_timeout`: the rebalance makes the broker assign every partition
//! to a live member again. Receiving a message, or finding no lag, clears
//! the state.

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

/// The watchdog's state (one per polling thread).
pub(crate) struct Watchdog {
    timeout: Duration,
    group: String,
    stats: Arc<Stats>,
    /// Since when nothing was received (or the lag was last found 0).
    quiet_since: Instant,
    last_probe: Option<Instant>,
    last_rejoin: Option<Instant>,
    stalled: bool,
    /// The group's committed offsets at the last probe of a member that
    /// owns nothing: a group whose offsets move is not stalled (its other
    /// members consume; this one is spare).
    group_offsets: Option<Vec<Committed>>,
}

/// A partition's committed offset: (topic, partition, offset).
type Committed = (String, i32, i64);

impl Watchdog {
    pub fn new(timeout: Duration, group: &str, stats: Arc<Stats>) -> Self {
        Self {
            timeout,
            group: group.to_owned(),
            stats,
            quiet_since: Instant::now(),
            last_probe: None,
            last_rejoin: None,
            stalled: false,
            group_offsets: None,
        }
    }

    /// A message was received: the consumer moves.
    pub fn received(&mut self) {
        self.quiet_since = Instant::now();
        if self.stalled {
            self.clear();
        }
    }

    /// How often a quiet consumer measures its lag.
    fn probe_interval(&self) -> Duration {
        (self.timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(15))
    }

    /// Looks at a consumer that has been quiet for `stall_timeout`: called
    /// on every turn of the polling loop (cheap unless it is time to probe).
    pub fn check<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        probe: &Probe<'_>,
        owned: usize,
    ) -> Action {
        let quiet = self.quiet_since.elapsed();
        if quiet < self.timeout
            || self
                .last_probe
                .is_some_and(|at| at.elapsed() < self.probe_interval())
        {
            return Action::Nothing;
        }
        self.last_probe = Some(Instant::now());
        // Its own partitions first; a member with nothing left on them (or
        // none) looks at the whole group's.
        let own = if owned == 0 {
            Ok(0)
        } else {
            own_lag(consumer, probe.fetched).map_err(crate::error::Error::from)
        };
        let (lag, of_group) = match own {
            Ok(0) => match self.group_stalled(probe) {
                Ok(Some(lag)) => (lag, true),
                Ok(None) => return Action::Nothing,
                Err(error) => return Self::unanswered(&error),
            },
            Ok(lag) => {
                self.group_offsets = None;
                (lag, false)
            }
            Err(error) => return Self::unanswered(&error),
        };
        if lag == 0 {
            // Idle: nothing to read. Judged again after another timeout.
            self.quiet_since = Instant::now();
            self.group_offsets = None;
            if self.stalled {
                self.clear();
            }
            return Action::Nothing;
        }
        // A group stalled on partitions this member does not consume: a
        // rejoin makes the broker assign them again (it may keep a dead
        // member's partitions assigned to it until the group rebalances).
        let rejoin = of_group
            && self
                .last_rejoin
                .is_none_or(|at| at.elapsed() >= self.timeout);
        let rejoins = self
            .stats
            .rejoins
            .load(std::sync::atomic::Ordering::Relaxed)
            + u64::from(rejoin);
        let reason = if owned == 0 {
            format!(
                "stalled: owns no partition and received nothing for {} s while the group has \
                 {lag} message(s) to read; rejoined the group {rejoins} time(s)",
                quiet.as_secs()
            )
        } else if of_group {
            format!(
                "stalled: read everything on its {owned} partition(s), and for {} s the group's \
                 other partitions have not moved with {lag} message(s) to read; rejoined the \
                 group {rejoins} time(s)",
                quiet.as_secs()
            )
        } else {
            format!(
                "stalled: received nothing for {} s on its {owned} partition(s), which have \
                 {lag} message(s) past its position",
                quiet.as_secs()
            )
        };
        if !self.stalled {
            tracing::error!(group = %self.group, %reason, "consumer stalled");
        }
        self.stalled = true;
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
            tracing::warn!(group = %self.group, "owning no partition while the group has lag: rejoining the group");
            return Action::Rejoin;
        }
        Action::Nothing
    }

    /// The group's lag, if its committed offsets stood still since the
    /// previous probe (the first probe only records them: offsets that
    /// move mean other members consume, and this one is spare or done).
    fn group_stalled(&mut self, probe: &Probe<'_>) -> crate::error::Result<Option<i64>> {
        let (lag, offsets) = group_lag(probe.client, &self.group, probe.topics)?;
        if lag == 0 {
            return Ok(Some(0));
        }
        let moved = self.group_offsets.as_ref() != Some(&offsets);
        self.group_offsets = Some(offsets);
        Ok(if moved { None } else { Some(lag) })
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

/// Messages of `topics` the group has not committed (see
/// [`super::groups::lag_of`]: the larger of the broker's two answers for
/// each partition's end), and the committed offsets.
fn group_lag(
    client: &rdkafka::ClientConfig,
    group: &str,
    topics: &[String],
) -> crate::error::Result<(i64, Vec<Committed>)> {
    let parts = super::groups::lag_of(client.clone(), group, Some(topics), PROBE_TIMEOUT)?;
    let lag = parts.iter().map(|p| p.lag).sum();
    let offsets = parts
        .into_iter()
        .map(|p| (p.topic, p.partition, p.committed))
        .collect();
    Ok((lag, offsets))
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
