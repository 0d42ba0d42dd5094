//! The polling thread: owns the Kafka consumer, turns messages into
//! [`Record`]s (parsing and, in dedup mode, decoding off the database task),
//! hands them over in batches, and commits offsets.
//!
//! Batching is adaptive: a batch is handed over when it is full (its row
//! count, or its byte budget: the message that reaches the budget ends it),
//! or when it has waited `linger` and the database task is idle; while the
//! database task is busy the next batch keeps filling, so batches grow under
//! load. At most four batches are held: the one being applied, one handed
//! over (the channel holds one), one waiting to be handed over and one
//! filling (besides librdkafka's own prefetch queue).
//! When one batch waits and the next is full, the thread waits for the
//! database task; after 30 s of that (a database outage) it pauses the
//! assigned partitions and polls again, so that the group membership and
//! rebalances are served, and resumes them once the database task catches
//! up.
//!
//! A consumer that receives nothing for `stall_timeout` while there are
//! messages to read is reported stalled, and rejoins the group when
//! partitions with messages to read do not move ([`super::stall`]).
//!
//! Offsets are committed only here, and only what the database task
//! reported as committed ([`Shared::completed`]): per partition the offset
//! after the last message whose transaction committed, if the partition is
//! still owned by the same assignment generation the message was polled in,
//! and never past a message the database task holds in memory
//! ([`Shared::pin`]: a failing key's retries from memory).
//! Before partitions are revoked, the batch being applied is given time to
//! commit (up to 10 s) and what is committable is committed synchronously;
//! messages polled for revoked partitions and not yet applied are dropped
//! (their new owner reads them). The final commit at shutdown is synchronous
//! too.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

use super::Stats;
use super::dispatch::Registry;
use super::raw_headers;
use super::record::{self, Check, Raw, Record};
use super::stall::{Action, Probe, Watchdog};
use crate::error::Result;

/// How long the polling thread waits for a busy database task before it
/// pauses the partitions and polls again.
const PAUSE_AFTER: Duration = Duration::from_secs(30);

/// How long a revocation waits for the batch being applied.
const REVOKE_WAIT: Duration = Duration::from_secs(10);

/// How long reading a partition again from an offset may take to set up.
const SEEK_TIMEOUT: Duration = Duration::from_secs(5);

/// What the polling thread needs to know.
pub(crate) struct PollerSettings {
    pub client: ClientConfig,
    pub topics: Vec<String>,
    pub max_batch: usize,
    /// A batch is full once its messages (key, headers, payload) reach this.
    pub max_batch_bytes: usize,
    pub linger: Duration,
    pub max_bytes: usize,
    pub check: Check,
    /// The group, for the lag metric.
    pub group: String,
    /// Quiet for this long with messages to read: stalled (see `stall`).
    pub stall_timeout: Duration,
    /// Read a partition again from the expected offset when a message
    /// arrives past it (once per gap).
    pub recheck_offset_gaps: bool,
}

type Partition = (Arc<str>, i32);

#[derive(Default)]
struct Assignment {
    /// Bumped on every assignment.
    generation: u64,
    /// Owned partitions and the generation that assigned them.
    owned: HashMap<Partition, u64>,
    /// Last offset committed (or queued for commit) per owned partition.
    committed: HashMap<Partition, i64>,
    /// Per owned partition, the offset after the last message whose
    /// transaction committed: what is committed, unless a pin holds it
    /// back ([`Shared::pin`]).
    applied: HashMap<Partition, i64>,
    /// Owned partitions being revoked: still committable, but no new batch
    /// may start applying their records.
    revoking: std::collections::HashSet<Partition>,
    /// Interned topic names.
    topics: HashMap<String, Arc<str>>,
}

/// A partition's progress: every message before `next` has committed.
struct Progress {
    partition: Partition,
    generation: u64,
    next: i64,
}

/// State shared by the polling thread, its consumer context and the
/// database task.
pub(crate) struct Shared {
    completed: Mutex<Vec<Progress>>,
    /// Offsets the committed offset may not pass, per partition and
    /// assignment generation, with a count each: messages the database task
    /// holds in memory (a failing key's first retries, see `dedup.rs`).
    pins: Mutex<HashMap<(Partition, u64), std::collections::BTreeMap<i64, u32>>>,
    assignment: Mutex<Assignment>,
    stop: AtomicBool,
    idle: AtomicBool,
    /// True while the database task applies a batch.
    applying: Mutex<bool>,
    applied: Condvar,
    commit_offsets: bool,
    /// Each partition's high watermark as the fetches report it
    /// (librdkafka's statistics), for the stall watchdog.
    fetched_ends: Mutex<HashMap<(String, i32), i64>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    pub fn new(commit_offsets: bool) -> Self {
        Self {
            completed: Mutex::default(),
            pins: Mutex::default(),
            assignment: Mutex::default(),
            stop: AtomicBool::new(false),
            idle: AtomicBool::new(true),
            applying: Mutex::new(false),
            applied: Condvar::new(),
            commit_offsets,
            fetched_ends: Mutex::default(),
        }
    }

    /// Reports that the transactions of `records` committed: their offsets
    /// may be committed to Kafka. Called in order of processing.
    pub fn completed(&self, records: &[Record]) {
        if records.is_empty() {
            return;
        }
        let mut latest: Vec<Progress> = Vec::new();
        for r in records {
            match latest
                .iter_mut()
                .find(|p| p.partition.1 == r.partition && *p.partition.0 == *r.topic)
            {
                Some(p) => {
                    p.next = p.next.max(r.offset + 1);
                    p.generation = r.generation;
                }
                None => latest.push(Progress {
                    partition: (r.topic.clone(), r.partition),
                    generation: r.generation,
                    next: r.offset + 1,
                }),
            }
        }
        lock(&self.completed).extend(latest);
    }

    /// Holds the committed offset of `record`'s partition at or before
    /// its offset until [`unpin`](Self::unpin): the database task keeps the
    /// message in memory, not committed anywhere, so that a crash or a
    /// revocation has the partition read again from it.
    pub fn pin(&self, record: &Record) {
        let key = ((record.topic.clone(), record.partition), record.generation);
        *lock(&self.pins)
            .entry(key)
            .or_default()
            .entry(record.offset)
            .or_insert(0) += 1;
    }

    /// Releases a [`pin`](Self::pin) (once the message's transaction
    /// committed); a record not pinned changes nothing.
    pub fn unpin(&self, record: &Record) {
        let key = ((record.topic.clone(), record.partition), record.generation);
        let mut pins = lock(&self.pins);
        let Some(offsets) = pins.get_mut(&key) else {
            return;
        };
        if let Some(n) = offsets.get_mut(&record.offset) {
            *n -= 1;
            if *n == 0 {
                offsets.remove(&record.offset);
            }
        }
        if offsets.is_empty() {
            pins.remove(&key);
        }
    }

    /// Drops the pins of `partitions`, in every generation: called once a
    /// revocation has committed their offsets (which the pins held back).
    /// The database task forgets their records held in memory without
    /// unpinning them ([`super::held`]): had it unpinned one while the
    /// revocation was under way, the revocation's commit could pass it.
    fn unpin_revoked(&self, partitions: &[Partition]) {
        if partitions.is_empty() {
            return;
        }
        lock(&self.pins).retain(|(partition, _), _| !partitions.contains(partition));
    }

    /// Whether `record`'s partition is still owned by the generation it
    /// was polled in, and not being revoked.
    pub fn owns(&self, record: &Record) -> bool {
        let a = lock(&self.assignment);
        let partition = (record.topic.clone(), record.partition);
        a.owned.get(&partition) == Some(&record.generation) && !a.revoking.contains(&partition)
    }

    /// Tells the database task's state: idle (waiting for a batch) or busy.
    pub fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Release);
    }

    /// The database task starts applying `batch`: returns the records of
    /// partitions still owned by the generation they were polled in, and
    /// the others (revoked since: their new owner reads them again; the
    /// caller forgets what it kept of them, such as a retry from memory).
    pub fn begin_batch(&self, batch: Vec<Record>) -> (Vec<Record>, Vec<Record>) {
        *lock(&self.applying) = true;
        let a = lock(&self.assignment);
        batch.into_iter().partition(|r| {
            let partition = (r.topic.clone(), r.partition);
            a.owned.get(&partition) == Some(&r.generation) && !a.revoking.contains(&partition)
        })
    }

    /// Sets the partition `(topic, partition)` owned by `generation` (or
    /// not owned: `None`), as a rebalance would.
    #[cfg(test)]
    pub(crate) fn set_owned(&self, topic: &Arc<str>, partition: i32, generation: Option<u64>) {
        let mut a = lock(&self.assignment);
        let key = (topic.clone(), partition);
        match generation {
            Some(g) => {
                a.generation = a.generation.max(g);
                a.owned.insert(key, g);
            }
            None => {
                a.owned.remove(&key);
            }
        }
    }

    /// Marks the partition `(topic, partition)` as being revoked (a
    /// rebalance's callback waiting for the batch being applied).
    #[cfg(test)]
    pub(crate) fn set_revoking(&self, topic: &Arc<str>, partition: i32) {
        lock(&self.assignment)
            .revoking
            .insert((topic.clone(), partition));
    }

    /// Ends the revocation of `(topic, partition)`, as the rebalance's
    /// callback does once it has committed.
    #[cfg(test)]
    pub(crate) fn end_revocation(&self, topic: &Arc<str>, partition: i32) {
        let key = (topic.clone(), partition);
        {
            let mut a = lock(&self.assignment);
            a.revoking.remove(&key);
            a.owned.remove(&key);
        }
        self.unpin_revoked(&[key]);
    }

    /// The offsets pinned, in every partition and generation.
    #[cfg(test)]
    pub(crate) fn pinned_offsets(&self) -> Vec<i64> {
        let pins = lock(&self.pins);
        let mut offsets: Vec<i64> = pins.values().flat_map(|o| o.keys().copied()).collect();
        offsets.sort_unstable();
        offsets
    }

    /// The database task finished its batch (committed, or gave up on
    /// shutdown).
    pub fn end_batch(&self) {
        *lock(&self.applying) = false;
        self.applied.notify_all();
    }

    /// Waits (at most `timeout`) for the batch being applied, so that its
    /// offsets can be committed before its partitions are revoked.
    fn wait_for_batch(&self, timeout: Duration) {
        let guard = lock(&self.applying);
        let _ = self
            .applied
            .wait_timeout_while(guard, timeout, |applying| *applying);
    }

    /// Drops the records of partitions revoked since they were polled.
    fn drop_revoked(&self, records: &mut Vec<Record>) {
        let a = lock(&self.assignment);
        records.retain(|r| a.owned.get(&(r.topic.clone(), r.partition)) == Some(&r.generation));
    }

    /// Asks the polling thread to commit and stop.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    fn generation(&self) -> u64 {
        lock(&self.assignment).generation
    }

    /// The interned topic and the generation its partition is owned by.
    fn locate(&self, topic: &str, partition: i32) -> (Arc<str>, u64) {
        let mut a = lock(&self.assignment);
        let topic = match a.topics.get(topic) {
            Some(t) => t.clone(),
            None => {
                let t: Arc<str> = Arc::from(topic);
                a.topics.insert(topic.to_owned(), t.clone());
                t
            }
        };
        let generation = a
            .owned
            .get(&(topic.clone(), partition))
            .copied()
            .unwrap_or(0);
        (topic, generation)
    }

    /// Commits the progress reported since the last call (`everything`:
    /// the whole current position of every owned partition).
    fn commit<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        mode: CommitMode,
        everything: bool,
    ) {
        let completed = std::mem::take(&mut *lock(&self.completed));
        if !self.commit_offsets {
            return;
        }
        // The smallest pinned offset of each partition and generation.
        let pinned: HashMap<(Partition, u64), i64> = lock(&self.pins)
            .iter()
            .filter_map(|(key, offsets)| offsets.keys().next().map(|o| (key.clone(), *o)))
            .collect();
        let mut tpl = TopicPartitionList::new();
        {
            let mut a = lock(&self.assignment);
            for p in completed {
                if a.owned.get(&p.partition) != Some(&p.generation) {
                    continue; // revoked since: the new owner re-reads it
                }
                let applied = a.applied.entry(p.partition).or_insert(-1);
                *applied = (*applied).max(p.next);
            }
            let mut changed: HashMap<Partition, i64> = HashMap::new();
            let applied: Vec<(Partition, i64)> =
                a.applied.iter().map(|(p, n)| (p.clone(), *n)).collect();
            for (partition, next) in applied {
                let Some(&generation) = a.owned.get(&partition) else {
                    continue;
                };
                let next = match pinned.get(&(partition.clone(), generation)) {
                    Some(&pin) => next.min(pin),
                    None => next,
                };
                let current = a.committed.get(&partition).copied().unwrap_or(-1);
                if next > current {
                    a.committed.insert(partition.clone(), next);
                    changed.insert(partition, next);
                }
            }
            let to_commit = if everything {
                a.committed.clone()
            } else {
                changed
            };
            for ((topic, partition), next) in to_commit {
                if let Err(error) =
                    tpl.add_partition_offset(&topic, partition, Offset::Offset(next))
                {
                    tracing::debug!(%error, "offset not added to the commit");
                }
            }
        }
        if tpl.count() == 0 {
            return;
        }
        if let Err(error) = consumer.commit(&tpl, mode) {
            tracing::warn!(%error, "offset commit failed: the messages will be read again (deduplicated)");
        }
    }
}

/// The consumer's librdkafka context: rebalance bookkeeping and logging.
struct Context {
    shared: Arc<Shared>,
    group: String,
}

impl ClientContext for Context {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        // librdkafka repeats connection errors on every reconnect attempt;
        // the polling loop reports state changes instead.
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical => {
                tracing::warn!(target: "librdkafka", "{fac} {message}")
            }
            _ => tracing::debug!(target: "librdkafka", "{fac} {message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(target: "librdkafka", %error, reason);
    }

    fn stats(&self, statistics: rdkafka::Statistics) {
        crate::metrics::record_lag(&self.group, &statistics);
        let mut ends = lock(&self.shared.fetched_ends);
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && p.hi_offset >= 0 {
                    ends.insert((topic.clone(), *partition), p.hi_offset);
                }
            }
        }
    }
}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Hand over cleanly: no batch may start on these partitions any
            // more (one starting after the wait below would be applied after
            // the new owner had read its records too); let the batch being
            // applied commit, then commit its offsets (and everything before
            // it).
            {
                let mut a = lock(&self.shared.assignment);
                for e in tpl.elements() {
                    if let Some(topic) = a.topics.get(e.topic()).cloned() {
                        a.revoking.insert((topic, e.partition()));
                    }
                }
            }
            self.shared.wait_for_batch(REVOKE_WAIT);
            self.shared.commit(consumer, CommitMode::Sync, false);
            let mut a = lock(&self.shared.assignment);
            let mut revoked = Vec::new();
            for e in tpl.elements() {
                if let Some(topic) = a.topics.get(e.topic()).cloned() {
                    a.owned.remove(&(topic.clone(), e.partition()));
                    a.committed.remove(&(topic.clone(), e.partition()));
                    a.applied.remove(&(topic.clone(), e.partition()));
                    a.revoking.remove(&(topic.clone(), e.partition()));
                    revoked.push((topic, e.partition()));
                }
            }
            self.shared.unpin_revoked(&revoked);
            tracing::info!(
                revoked = tpl.count(),
                owned = a.owned.len(),
                "partitions revoked"
            );
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let mut a = lock(&self.shared.assignment);
                a.generation += 1;
                let generation = a.generation;
                for e in tpl.elements() {
                    let topic = match a.topics.get(e.topic()) {
                        Some(t) => t.clone(),
                        None => {
                            let t: Arc<str> = Arc::from(e.topic());
                            a.topics.insert(e.topic().to_owned(), t.clone());
                            t
                        }
                    };
                    a.owned.insert((topic, e.partition()), generation);
                }
                tracing::info!(
                    assigned = tpl.count(),
                    owned = a.owned.len(),
                    "partitions assigned"
                );
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(error) => tracing::warn!(%error, "rebalance failed"),
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(error) = result {
            tracing::debug!(%error, "asynchronous offset commit failed");
        }
    }
}

/// What [`Gaps::check`] says of a message.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Take it.
    Take,
    /// Received already in this assignment (read again after a gap's
    /// re-read): the first copy is held.
    Held,
    /// It is past its partition's expected offset, seen for the first
    /// time: read the partition again from that offset (the message is
    /// not taken).
    ReadAgain(i64),
}

/// Per partition, the offset after the last message taken in its current
/// assignment (the generation that assigned it), and the gap already read
/// again. A broker may show an offset before its record can be fetched (see
/// [`ConsumerConfig::recheck_offset_gaps`](super::ConsumerConfig::recheck_offset_gaps)):
/// the first message past the expected offset makes the partition be read
/// again from there, once; the same gap found again is the log's own (a
/// transaction marker, a compacted record) and is taken. A message of a
/// new assignment starts the count afresh: the partition is read from the
/// group's offset again (the rebalance callback runs inside the poll that
/// returns that message).
struct Gaps {
    recheck: bool,
    /// (generation, next offset).
    expected: HashMap<Partition, (u64, i64)>,
    /// (generation, the expected offset read again).
    rechecked: HashMap<Partition, (u64, i64)>,
}

impl Gaps {
    fn new(recheck: bool) -> Self {
        Self {
            recheck,
            expected: HashMap::new(),
            rechecked: HashMap::new(),
        }
    }

    fn check(&mut self, topic: &Arc<str>, partition: i32, offset: i64, generation: u64) -> Verdict {
        let at = (topic.clone(), partition);
        let next = match self.expected.get(&at) {
            Some(&(g, next)) if g == generation => Some(next),
            _ => None,
        };
        match next {
            Some(next) if offset < next => Verdict::Held,
            Some(next)
                if offset > next
                    && self.recheck
                    && self.rechecked.get(&at) != Some(&(generation, next)) =>
            {
                self.rechecked.insert(at, (generation, next));
                Verdict::ReadAgain(next)
            }
            Some(next) => {
                if offset > next {
                    tracing::debug!(
                        topic = %topic,
                        partition,
                        expected = next,
                        received = offset,
                        "offsets not contiguous (read again, or not checked)"
                    );
                }
                self.take(topic, partition, offset, generation);
                Verdict::Take
            }
            None => {
                tracing::debug!(
                    topic = %topic,
                    partition,
                    offset,
                    generation,
                    "first message of the partition in this assignment"
                );
                self.take(topic, partition, offset, generation);
                Verdict::Take
            }
        }
    }

    /// Takes `offset` whatever it follows.
    fn take(&mut self, topic: &Arc<str>, partition: i32, offset: i64, generation: u64) {
        self.expected
            .insert((topic.clone(), partition), (generation, offset + 1));
    }
}

/// Broker errors, logged when they change (not on every poll).
#[derive(Default)]
struct BrokerState {
    failing_since: Option<Instant>,
    last: Option<(String, Instant)>,
    repeated: u64,
}

impl BrokerState {
    fn error(&mut self, error: &KafkaError) {
        let text = error.to_string();
        let now = Instant::now();
        self.failing_since.get_or_insert(now);
        let log = match &self.last {
            Some((last, at)) => *last != text || at.elapsed() > Duration::from_secs(60),
            None => true,
        };
        if log {
            tracing::warn!(error = %text, repeated = self.repeated, "kafka consumer error: retrying");
            self.last = Some((text, now));
            self.repeated = 0;
        } else {
            self.repeated += 1;
        }
    }

    fn ok(&mut self) {
        if let Some(since) = self.failing_since.take() {
            tracing::info!(
                after_ms = since.elapsed().as_millis() as u64,
                "kafka consumer receiving again"
            );
            self.last = None;
            self.repeated = 0;
        }
    }
}

/// The Kafka consumer of one [`Consumer`](super::Consumer).
pub(crate) struct Poller {
    consumer: BaseConsumer<Context>,
    settings: PollerSettings,
    shared: Arc<Shared>,
}

enum Exit {
    Stop,
    Fatal(KafkaError),
    /// Stalled owning nothing: leave the group and join it again.
    Rejoin,
}

impl Poller {
    /// Creates the consumer and subscribes (fails on invalid settings).
    pub fn new(settings: PollerSettings, shared: Arc<Shared>) -> Result<Self> {
        let consumer = Self::create(&settings, &shared)?;
        Ok(Self {
            consumer,
            settings,
            shared,
        })
    }

    fn create(settings: &PollerSettings, shared: &Arc<Shared>) -> Result<BaseConsumer<Context>> {
        let consumer: BaseConsumer<Context> = crate::kafka::create_with_context(
            &settings.client,
            Context {
                shared: shared.clone(),
                group: settings.group.clone(),
            },
        )?;
        let topics: Vec<&str> = settings.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;
        Ok(consumer)
    }

    /// Polls until [`Shared::stop`] (or the database task is gone), then
    /// commits synchronously and closes the consumer (leaving the group).
    pub fn run(
        mut self,
        registry: Arc<Registry>,
        tx: mpsc::Sender<Vec<Record>>,
        stats: Arc<Stats>,
    ) -> Result<()> {
        let mut watchdog = Watchdog::new(
            self.settings.stall_timeout,
            &self.settings.group,
            stats.clone(),
        );
        loop {
            match self.poll_loop(&registry, &tx, &stats, &mut watchdog) {
                Exit::Stop => break,
                Exit::Fatal(error) => {
                    tracing::error!(%error, "kafka consumer failed fatally: recreating it");
                    self.shared.commit(&self.consumer, CommitMode::Sync, true);
                    self.consumer = Self::create(&self.settings, &self.shared)?;
                }
                Exit::Rejoin => {
                    // Commits what it owns; closing the client leaves the
                    // group; the new one joins as a new member.
                    self.shared.commit(&self.consumer, CommitMode::Sync, true);
                    self.consumer = Self::create(&self.settings, &self.shared)?;
                }
            }
        }
        self.shared.commit(&self.consumer, CommitMode::Sync, true);
        Ok(())
    }

    fn poll_loop(
        &self,
        registry: &Registry,
        tx: &mpsc::Sender<Vec<Record>>,
        stats: &Stats,
        watchdog: &mut Watchdog,
    ) -> Exit {
        let consumer = &self.consumer;
        let s = &self.settings;
        let mut batch: Vec<Record> = Vec::with_capacity(s.max_batch);
        // The bytes of `batch`'s messages (an overestimate after records of
        // revoked partitions were dropped from it).
        let mut batch_bytes = 0_usize;
        let full = |batch: &Vec<Record>, bytes: usize| {
            batch.len() >= s.max_batch || bytes >= s.max_batch_bytes
        };
        let mut first_at: Option<Instant> = None;
        let mut ready: Option<Vec<Record>> = None;
        let mut paused_at: Option<u64> = None;
        let mut full_since: Option<Instant> = None;
        let mut seen_generation = self.shared.generation();
        let mut broker = BrokerState::default();
        let mut gaps = Gaps::new(s.recheck_offset_gaps);
        loop {
            if self.shared.stop.load(Ordering::Acquire) || tx.is_closed() {
                return Exit::Stop;
            }
            self.shared.commit(consumer, CommitMode::Async, false);

            if ready.is_none() && !batch.is_empty() {
                let lingered = first_at.is_some_and(|t| t.elapsed() >= s.linger);
                if full(&batch, batch_bytes)
                    || (lingered && self.shared.idle.load(Ordering::Acquire))
                {
                    ready = Some(std::mem::replace(
                        &mut batch,
                        Vec::with_capacity(s.max_batch),
                    ));
                    batch_bytes = 0;
                    first_at = None;
                }
            }
            if let Some(b) = ready.take() {
                match tx.try_send(b) {
                    Ok(()) => {}
                    Err(TrySendError::Full(b)) => ready = Some(b),
                    Err(TrySendError::Closed(_)) => return Exit::Stop,
                }
            }

            if ready.is_none() && full(&batch, batch_bytes) {
                // The waiting batch just went: hand this full one over
                // before polling more into it.
                continue;
            }

            // Backpressure: a batch waits and the next is full. Wait for the
            // database task without polling (librdkafka's own queue bounds
            // what it prefetches); if that lasts, pause the partitions and
            // poll again, so that the group membership and rebalances are
            // served (max.poll.interval.ms).
            if ready.is_some() && full(&batch, batch_bytes) {
                // Waiting for the database is not a stall of the group
                // (a database outage reports itself).
                watchdog.received();
                let since = *full_since.get_or_insert_with(Instant::now);
                if since.elapsed() < PAUSE_AFTER {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                let generation = self.shared.generation();
                if paused_at != Some(generation) {
                    tracing::debug!("database task behind: pausing the partitions");
                    if let Ok(tpl) = consumer.assignment() {
                        let _ = consumer.pause(&tpl);
                    }
                    paused_at = Some(generation);
                }
            } else {
                full_since = None;
                if paused_at.take().is_some()
                    && let Ok(tpl) = consumer.assignment()
                {
                    let _ = consumer.resume(&tpl);
                }
            }

            // After a rebalance, forget what was polled for revoked partitions.
            let generation = self.shared.generation();
            if generation != seen_generation {
                seen_generation = generation;
                self.shared.drop_revoked(&mut batch);
                if let Some(r) = ready.as_mut() {
                    self.shared.drop_revoked(r);
                    if r.is_empty() {
                        ready = None;
                    }
                }
                if batch.is_empty() {
                    first_at = None;
                    batch_bytes = 0;
                }
            }

            let probe = Probe {
                client: &s.client,
                topics: &s.topics,
                fetched: &self.shared.fetched_ends,
            };
            let owned = || {
                lock(&self.shared.assignment)
                    .owned
                    .keys()
                    .map(|(t, p)| (t.to_string(), *p))
                    .collect()
            };
            if watchdog.check(consumer, &probe, &owned) == Action::Rejoin {
                return Exit::Rejoin;
            }

            let timeout = if ready.is_some() || first_at.is_some() {
                Duration::from_millis(2)
            } else {
                Duration::from_millis(100)
            };
            match consumer.poll(timeout) {
                None => {}
                Some(Ok(m)) => {
                    broker.ok();
                    watchdog.received();
                    let raw = Raw {
                        topic: m.topic(),
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key(),
                        payload: m.payload(),
                        headers: Vec::new(),
                        bad_names: 0,
                    }
                    .with_byte_headers(raw_headers::of(&m));
                    let (topic, generation) = self.shared.locate(raw.topic, raw.partition);
                    match gaps.check(&topic, raw.partition, raw.offset, generation) {
                        Verdict::Take => {}
                        Verdict::Held => continue,
                        Verdict::ReadAgain(next) => {
                            match consumer.seek(
                                &topic,
                                raw.partition,
                                Offset::Offset(next),
                                SEEK_TIMEOUT,
                            ) {
                                Ok(()) => {
                                    tracing::debug!(
                                        topic = %topic,
                                        partition = raw.partition,
                                        expected = next,
                                        received = raw.offset,
                                        "offsets not contiguous: reading the partition again from the expected offset"
                                    );
                                    stats.gaps_rechecked.fetch_add(1, Ordering::Relaxed);
                                    crate::metrics::consumer_gap_rechecked(&s.group);
                                    continue;
                                }
                                Err(error) => {
                                    tracing::debug!(
                                        %error,
                                        topic = %topic,
                                        partition = raw.partition,
                                        "offsets not contiguous, and the partition could not be read again"
                                    );
                                    gaps.take(&topic, raw.partition, raw.offset, generation);
                                }
                            }
                        }
                    }
                    batch_bytes += raw.size();
                    let body = record::parse(&raw, registry, s.max_bytes, s.check);
                    batch.push(Record {
                        topic,
                        partition: raw.partition,
                        offset: raw.offset,
                        generation,
                        body,
                    });
                    first_at.get_or_insert_with(Instant::now);
                    stats.received.fetch_add(1, Ordering::Relaxed);
                }
                Some(Err(KafkaError::PartitionEOF(_))) => {}
                Some(Err(error @ KafkaError::MessageConsumptionFatal(_))) => {
                    return Exit::Fatal(error);
                }
                Some(Err(error)) => broker.error(&error),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_is_read_again_once_and_what_was_taken_is_not_taken_twice() {
        let t: Arc<str> = Arc::from("orders");
        let mut gaps = Gaps::new(true);
        assert_eq!(gaps.check(&t, 0, 10, 1), Verdict::Take, "the first message");
        assert_eq!(gaps.check(&t, 0, 11, 1), Verdict::Take);
        // 12 is shown late by the broker: 13 arrives first.
        assert_eq!(gaps.check(&t, 0, 13, 1), Verdict::ReadAgain(12));
        // Read again from 12: it is there now.
        assert_eq!(gaps.check(&t, 0, 12, 1), Verdict::Take);
        assert_eq!(gaps.check(&t, 0, 13, 1), Verdict::Take);
        // A message before the expected offset was taken already.
        assert_eq!(gaps.check(&t, 0, 12, 1), Verdict::Held);
        // The log's own gap (a transaction marker at 14): found again after
        // the re-read, taken.
        assert_eq!(gaps.check(&t, 0, 15, 1), Verdict::ReadAgain(14));
        assert_eq!(gaps.check(&t, 0, 15, 1), Verdict::Take);
        assert_eq!(gaps.check(&t, 0, 16, 1), Verdict::Take);
        // Another partition keeps its own count.
        assert_eq!(gaps.check(&t, 1, 100, 1), Verdict::Take);
        assert_eq!(gaps.check(&t, 1, 102, 1), Verdict::ReadAgain(101));
    }

    #[test]
    fn a_new_assignment_reads_from_the_groups_offset_whatever_was_taken_before() {
        let t: Arc<str> = Arc::from("orders");
        let mut gaps = Gaps::new(true);
        assert_eq!(gaps.check(&t, 0, 700, 1), Verdict::Take);
        // Revoked and assigned again (generation 2) at the committed offset
        // 680: the messages before 700 are new to this assignment.
        assert_eq!(gaps.check(&t, 0, 680, 2), Verdict::Take);
        assert_eq!(gaps.check(&t, 0, 681, 2), Verdict::Take);
        // A gap read again in the old assignment is checked anew.
        assert_eq!(gaps.check(&t, 0, 683, 2), Verdict::ReadAgain(682));
    }

    #[test]
    fn without_the_recheck_a_gap_is_taken_as_it_is() {
        let t: Arc<str> = Arc::from("orders");
        let mut gaps = Gaps::new(false);
        assert_eq!(gaps.check(&t, 0, 10, 1), Verdict::Take);
        assert_eq!(gaps.check(&t, 0, 12, 1), Verdict::Take);
        assert_eq!(gaps.check(&t, 0, 11, 1), Verdict::Held);
    }
}
