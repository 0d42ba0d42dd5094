//! The consumer side: a Kafka consumer group that applies each event's
//! effect once, with typed [`InboxHandler`]s, in one of two modes.
//!
//! ```ignore
//! let handle = Consumer::builder(pool)
//!     .group("billing")                      // also the dedup key's consumer
//!     .brokers("kafka:9092")
//!     .handler(on_order_placed)              // #[inbox_handler] functions
//!     .handler(on_order_cancelled)
//!     .mode(Mode::Dedup)                     // the default
//!     .spawn()?;
//! // ...
//! handle.shutdown().await?;                  // finishes the batch, commits offsets
//! ```
//!
//! - [`Mode::Dedup`] (default): a batch of messages → one transaction
//!   (`processed_event` insert, handlers of the new events, their follow-up
//!   events, dead letters) → `COMMIT` → the offsets (`dedup.rs`).
//! - [`Mode::Inbox`] (critical or bursty flows): messages are only stored in
//!   `inbox_event` (→ offsets); processor tasks apply them from the table,
//!   in per-key order, with retries that hold back only the failing key
//!   (`store.rs`, `processor.rs`).
//!
//! Offsets are committed manually, per partition, never past a message
//! whose transaction has not committed (`poller.rs`, the thread that owns
//! the Kafka consumer). Malformed messages and events whose handler keeps
//! failing go to the `dead_letter` table ([`dead_letter`]); `outbox
//! dead-letters retry` marks them and the consumer of their group runs them
//! again (`redrive.rs`).
//!
//! Other files: `dispatch.rs` (handler registry and routing), `record.rs`
//! (parsing a message), `raw_headers.rs` (header names as bytes),
//! `apply.rs` (running handlers), `txn.rs` (the guarded transactions
//! handlers run in, and how a handler that broke one is found), `db.rs`
//! (which errors are outages), `clock.rs` (what a retry waits on: real
//! time, or a test clock), `harness.rs` (the `testing` feature: this
//! consumer's per-message path driven without a broker).

use crate::backoff;

mod apply;
mod clock;
mod db;
pub mod dead_letter;
mod dedup;
mod dispatch;
pub mod groups;
#[cfg(feature = "testing")]
pub(crate) mod harness;
mod held;
mod poller;
mod processor;
pub mod progress;

/// Whether consumer group `group` is in the progress mode (inbox mode; see
/// [`progress`]); `false` when the database does not answer (its rows are
/// then stored the default mode's way, which the progress mode reads too).
async fn progress_mode(pool: &sqlx::PgPool, group: &str) -> bool {
    let result = async {
        let mut conn = pool.acquire().await?;
        progress::start(&mut conn, group).await
    }
    .await;
    match result {
        Ok(start) => start.is_some(),
        Err(error) => {
            tracing::warn!(%error, group, "could not read whether the consumer is in the progress mode");
            false
        }
    }
}
mod raw_headers;
mod record;
mod redrive;
mod saga;
mod stall;
mod store;
mod txn;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_core::InboxHandler;
use sqlx::PgPool;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[cfg(feature = "testing")]
pub use self::clock::TestClock;
pub use self::dead_letter::{DeadLetter, DeadLetterFilter, DeadLetterReason};
use self::dispatch::Registry;
use self::poller::{Poller, PollerSettings, Shared};
use self::record::Check;
use crate::error::{Error, Result};
use crate::kafka;

/// How a consumer applies events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mode {
    /// Deduplicate on `processed_event` and run the handlers in the same
    /// transaction as the message's bookkeeping (the default).
    #[default]
    Dedup,
    /// Store messages in `inbox_event` first; process them from the table.
    Inbox,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Dedup => "dedup",
            Mode::Inbox => "inbox",
        })
    }
}

/// The default byte budget of a consumer's batch (16 MiB).
pub const DEFAULT_MAX_BATCH_BYTES: usize = 16 << 20;

/// Settings the consumer always applies to its Kafka client: offsets are
/// committed by the consumer, after the database commit.
const ENFORCED: &[(&str, &str)] = &[
    ("enable.auto.commit", "false"),
    ("enable.auto.offset.store", "false"),
];

/// Consumer settings. Build with [`Consumer::builder`]; readable with
/// [`Consumer::config`]. `Debug` redacts secret Kafka settings.
#[derive(Clone)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// The consumer group id, also the `processed_event.consumer` and
    /// `inbox_event.consumer` value. One per service.
    pub group: String,
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// Extra librdkafka settings.
    pub kafka_settings: Vec<(String, String)>,
    /// Dedup (default) or inbox.
    pub mode: Mode,
    /// Most messages per batch (one transaction each).
    pub batch_size: usize,
    /// Most bytes per batch (keys, headers and payloads), about: the message
    /// that reaches it ends its batch. A consumer holds up to four batches
    /// (being applied, handed over, waiting, filling).
    pub max_batch_bytes: usize,
    /// How long a batch may wait to fill while the database is idle.
    pub batch_linger: Duration,
    /// Handler attempts before an event is dead-lettered.
    pub max_attempts: u32,
    /// First delay before a failed handler runs again; doubles up to
    /// `retry_backoff_max`.
    pub retry_backoff: Duration,
    /// Cap of the retry delay.
    pub retry_backoff_max: Duration,
    /// Dedup mode: a failing event whose next retry is due within this
    /// window is retried from the consumer's memory, its key's later events
    /// queued behind it, instead of set aside in `inbox_event` (`None`, the
    /// default: always set aside). The partition's committed offset stays
    /// at the held event until it is applied or dead-lettered, so a crash
    /// or a rebalance reads it again (see `ConsumerBuilder::memory_retries`).
    pub memory_retries: Option<Duration>,
    /// Dedup mode, with `memory_retries`: most events held in memory at
    /// once; past it, failures are set aside in `inbox_event`.
    pub memory_retries_max_events: usize,
    /// A handler call taking longer fails its event (an attempt); also the
    /// `statement_timeout` of the handlers' transactions.
    pub handler_timeout: Duration,
    /// First back-off during a database outage.
    pub outage_backoff: Duration,
    /// Cap of the outage back-off.
    pub outage_backoff_max: Duration,
    /// Larger payloads are dead-lettered as `oversized`.
    pub max_payload_bytes: usize,
    /// How often the consumer looks for dead letters marked for retry.
    pub redrive_interval: Duration,
    /// Inbox mode: connections storing each batch in parallel, split by
    /// partition.
    pub writers: usize,
    /// Inbox mode: rows per processor transaction.
    pub processor_batch_size: usize,
    /// Inbox mode: poll interval of an idle processor (rows stored by this
    /// consumer wake it at once).
    pub processor_poll_interval: Duration,
    /// Inbox mode: processor tasks in this process (0: store only).
    pub processors: usize,
    /// A consumer that receives nothing for this long while its group (or
    /// its own partitions) has messages to read is stalled, and so is one
    /// whose group has a partition with messages to read and a committed
    /// offset that has not moved for this long: `health()` says `Degraded`
    /// with the reason, the `outbox_consumer_stalled` gauge is 1, and in
    /// the second case the member rejoins the group. Keep it above the
    /// group's `session.timeout.ms` (librdkafka's default: 45 s) and above
    /// the longest time a handler may hold one message.
    pub stall_timeout: Duration,
    /// A running instance of one of the consumer's sagas that has taken no
    /// step for this long, and has no timeout still to come, is stuck: the
    /// `outbox_sagas_stuck` gauge counts them per saga type (sampled every
    /// 5 s), and so does `outbox sagas summary --stuck-after`. Default 1 h.
    pub saga_stuck_after: Duration,
    /// Reads a partition again from the expected offset, once, when a
    /// message arrives past it (default on). A broker may show a record's
    /// offset before the record can be fetched (tansu 0.6 advances the high
    /// watermark before it stores the batch: with two producers on one
    /// partition, a fetch between the two can return the later record
    /// alone, and a consumer that takes it skips the earlier one for good).
    /// Kafka leaves gaps of its own (transaction markers, compaction): each
    /// costs one more fetch, and a gap found again is taken as it is. Turn
    /// it off for heavily compacted topics.
    pub recheck_offset_gaps: bool,
    /// Prepended to the handlers' topics (default empty): a handler of
    /// `orders` events reads `{topic_prefix}orders`. The relay takes the
    /// same prefix ([`RelayConfig::topic_prefix`](crate::RelayConfig::topic_prefix));
    /// tests use it to run on topics of their own (`testing::TestTopics`).
    pub topic_prefix: String,
    commit_offsets: bool,
}

impl std::fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured without `..`: a new field must be added here.
        let Self {
            group,
            brokers,
            kafka_settings,
            mode,
            batch_size,
            max_batch_bytes,
            batch_linger,
            max_attempts,
            retry_backoff,
            retry_backoff_max,
            memory_retries,
            memory_retries_max_events,
            handler_timeout,
            outage_backoff,
            outage_backoff_max,
            max_payload_bytes,
            redrive_interval,
            writers,
            processor_batch_size,
            processor_poll_interval,
            processors,
            stall_timeout,
            saga_stuck_after,
            recheck_offset_gaps,
            topic_prefix,
            commit_offsets,
        } = self;
        f.debug_struct("ConsumerConfig")
            .field("group", group)
            .field("brokers", brokers)
            .field("kafka_settings", &kafka::Redacted(kafka_settings))
            .field("mode", mode)
            .field("batch_size", batch_size)
            .field("max_batch_bytes", max_batch_bytes)
            .field("batch_linger", batch_linger)
            .field("max_attempts", max_attempts)
            .field("handler_timeout", handler_timeout)
            .field("retry_backoff", retry_backoff)
            .field("retry_backoff_max", retry_backoff_max)
            .field("memory_retries", memory_retries)
            .field("memory_retries_max_events", memory_retries_max_events)
            .field("outage_backoff", outage_backoff)
            .field("outage_backoff_max", outage_backoff_max)
            .field("max_payload_bytes", max_payload_bytes)
            .field("redrive_interval", redrive_interval)
            .field("writers", writers)
            .field("processor_batch_size", processor_batch_size)
            .field("processor_poll_interval", processor_poll_interval)
            .field("processors", processors)
            .field("stall_timeout", stall_timeout)
            .field("saga_stuck_after", saga_stuck_after)
            .field("recheck_offset_gaps", recheck_offset_gaps)
            .field("topic_prefix", topic_prefix)
            .field("commit_offsets", commit_offsets)
            .finish()
    }
}

impl ConsumerConfig {
    fn new() -> Self {
        Self {
            group: String::new(),
            brokers: kafka::DEFAULT_BROKERS.to_owned(),
            kafka_settings: Vec::new(),
            mode: Mode::Dedup,
            batch_size: 1000,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
            batch_linger: Duration::from_millis(5),
            max_attempts: 5,
            retry_backoff: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(10),
            memory_retries: None,
            memory_retries_max_events: 10_000,
            handler_timeout: Duration::from_secs(30),
            outage_backoff: Duration::from_millis(100),
            outage_backoff_max: Duration::from_secs(5),
            max_payload_bytes: 1024 * 1024,
            redrive_interval: Duration::from_secs(5),
            writers: 2,
            processor_batch_size: 500,
            processor_poll_interval: Duration::from_millis(500),
            processors: 1,
            stall_timeout: Duration::from_secs(60),
            saga_stuck_after: Duration::from_secs(3600),
            recheck_offset_gaps: true,
            topic_prefix: String::new(),
            commit_offsets: true,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.group.trim().is_empty() {
            return bad("the consumer needs a group: .group(\"billing\")".into());
        }
        if self.brokers.trim().is_empty() {
            return bad("brokers must not be empty".into());
        }
        if self.batch_size == 0 || self.batch_size > 100_000 {
            return bad(format!(
                "batch size must be 1..=100000, got {}",
                self.batch_size
            ));
        }
        if self.max_batch_bytes == 0 || self.max_batch_bytes > 1 << 30 {
            return bad(format!(
                "max batch bytes must be 1..=1 GiB, got {}",
                self.max_batch_bytes
            ));
        }
        if self.processor_batch_size == 0 || self.processor_batch_size > 100_000 {
            return bad(format!(
                "processor batch size must be 1..=100000, got {}",
                self.processor_batch_size
            ));
        }
        if self.max_attempts == 0 {
            return bad("max attempts must be >= 1".into());
        }
        if self.memory_retries_max_events == 0 || self.memory_retries_max_events > 10_000_000 {
            return bad(format!(
                "memory retries' max events must be 1..=10000000, got {}",
                self.memory_retries_max_events
            ));
        }
        if self.max_payload_bytes == 0 || self.max_payload_bytes > 1 << 30 {
            return bad(format!(
                "max payload bytes must be 1..=1 GiB, got {}",
                self.max_payload_bytes
            ));
        }
        if self.writers == 0 || self.writers > 64 {
            return bad(format!("writers must be 1..=64, got {}", self.writers));
        }
        if self.processors > 64 {
            return bad(format!(
                "processors must be 0..=64, got {}",
                self.processors
            ));
        }
        if self.handler_timeout < Duration::from_millis(1) {
            return bad("the handler timeout must be at least 1 ms".into());
        }
        if self.redrive_interval.is_zero() || self.processor_poll_interval.is_zero() {
            return bad("re-drive and processor poll intervals must be > 0".into());
        }
        if self.stall_timeout < Duration::from_secs(1) {
            return bad("the stall timeout must be at least 1 s".into());
        }
        if self.saga_stuck_after < Duration::from_secs(1) {
            return bad("the saga stuck time must be at least 1 s".into());
        }
        for (key, value) in &self.kafka_settings {
            if key == "group.id" {
                return bad("set the group with .group(..), not group.id".into());
            }
            if let Some((_, enforced)) = ENFORCED.iter().find(|(k, _)| k == key)
                && value != enforced
            {
                return bad(format!(
                    "{key} must stay {enforced}: the consumer commits offsets itself, after the database commit"
                ));
            }
        }
        Ok(())
    }

    fn client_config(&self) -> rdkafka::ClientConfig {
        let mut settings: Vec<(String, String)> = vec![
            ("auto.offset.reset".into(), "earliest".into()),
            ("enable.partition.eof".into(), "false".into()),
            // Reconnect within a second once the broker is back.
            ("reconnect.backoff.max.ms".into(), "1000".into()),
            // The consumer lag metric comes from librdkafka's statistics.
            ("statistics.interval.ms".into(), "5000".into()),
            (
                "client.id".into(),
                format!("outbox-consumer-{}", self.group),
            ),
        ];
        settings.extend(self.kafka_settings.iter().cloned());
        settings.push(("group.id".into(), self.group.clone()));
        for (k, v) in ENFORCED {
            settings.push(((*k).into(), (*v).into()));
        }
        kafka::client_config(&self.brokers, &settings)
    }
}

/// Builder of a [`Consumer`].
pub struct ConsumerBuilder {
    pool: PgPool,
    config: ConsumerConfig,
    registry: Registry,
    ignored: Vec<(String, String)>,
}

impl std::fmt::Debug for ConsumerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("config", &self.config)
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl ConsumerBuilder {
    /// The consumer group (required); also the consumer's name in
    /// `processed_event`, `inbox_event` and `dead_letter`.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.config.group = group.into();
        self
    }
    /// Kafka bootstrap servers (default `127.0.0.1:9092`).
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.config.brokers = brokers.into();
        self
    }
    /// One librdkafka setting (`key`, `value`), e.g. SASL or TLS options,
    /// `auto.offset.reset` (default `earliest`). `enable.auto.commit` and
    /// `enable.auto.offset.store` stay `false`.
    pub fn kafka_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.kafka_settings.push((key.into(), value.into()));
        self
    }
    /// Registers a handler: it receives the events of `H::Event::TOPIC`
    /// whose type is one of `H::Event::EVENT_TYPES`. Several handlers may
    /// share a topic or an event type (they run in registration order, in
    /// the same transaction). The consumer subscribes to the union of the
    /// handlers' topics.
    pub fn handler<H: InboxHandler>(mut self, handler: H) -> Self {
        self.registry.add(handler);
        self
    }
    /// Opts out of an event type on a subscribed topic: its messages are
    /// skipped (offset committed) instead of dead-lettered as
    /// `unknown_event_type`. `"*"` skips every type without a handler.
    pub fn ignore_event_type(
        mut self,
        topic: impl Into<String>,
        event_type: impl Into<String>,
    ) -> Self {
        self.ignored.push((topic.into(), event_type.into()));
        self
    }
    /// [`Mode::Dedup`] (default) or [`Mode::Inbox`].
    pub fn mode(mut self, mode: Mode) -> Self {
        self.config.mode = mode;
        self
    }
    /// Most messages per batch (default 1000).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.config.batch_size = n;
        self
    }
    /// Most bytes per batch (default 16 MiB): keys, headers and payloads;
    /// the message that reaches it ends its batch.
    pub fn max_batch_bytes(mut self, n: usize) -> Self {
        self.config.max_batch_bytes = n;
        self
    }
    /// How long a batch may wait to fill while the database is idle
    /// (default 5 ms). Under load batches fill while the previous one is
    /// applied.
    pub fn batch_linger(mut self, d: Duration) -> Self {
        self.config.batch_linger = d;
        self
    }
    /// Handler attempts before an event is dead-lettered (default 5).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.config.max_attempts = n;
        self
    }
    /// First and maximum delay between attempts of a failing handler
    /// (default 100 ms doubling up to 10 s).
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config.retry_backoff = first;
        self.config.retry_backoff_max = max;
        self
    }
    /// Dedup mode: retries a failing event from memory while its next
    /// attempt is due within `window` (off by default). The event and the
    /// later events of its key wait in the consumer, the other keys of the
    /// partition go on, and nothing is written for it: no `inbox_event`
    /// row, no inbox processor round. The partition's committed offset
    /// stays at the waiting event, so a crash or a rebalance has the
    /// partition read again from it (the events after it that were applied
    /// are duplicates by their dedup rows, and change nothing). An event
    /// still failing when its next back-off passes the window is set aside
    /// in `inbox_event` as without this setting, with its attempts so far;
    /// at `max_attempts` it is dead-lettered. Once its failed event is
    /// through, a key's waiting events run in chunks (16, then twice as
    /// many each batch), so that a key failing again soon costs at most
    /// its chunk. At most 10,000 events wait in memory
    /// ([`memory_retries_max_events`](Self::memory_retries_max_events));
    /// past that, failures are set aside. Keep `window` well under
    /// the stall timeout (the committed offset does not move meanwhile).
    pub fn memory_retries(mut self, window: Duration) -> Self {
        self.config.memory_retries = Some(window);
        self
    }
    /// With [`memory_retries`](Self::memory_retries): most events waiting
    /// in memory at once (default 10,000); past it, a failing event is set
    /// aside in `inbox_event` with the later events of its key. What waits
    /// grows with the rate read and the back-offs: the failing keys' events
    /// read while their failed event waits. Each waiting event holds its
    /// message (payload and headers) in memory.
    pub fn memory_retries_max_events(mut self, n: usize) -> Self {
        self.config.memory_retries_max_events = n;
        self
    }
    /// How long one handler call may take (default 30 s). A slower call
    /// fails its event like an error (retried, then dead-lettered), and its
    /// transaction's statements are bounded by the same `statement_timeout`,
    /// so that a stuck query stops on the database side too.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.config.handler_timeout = timeout;
        self
    }
    /// First and maximum back-off during a database outage (default 100 ms
    /// up to 5 s).
    pub fn outage_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config.outage_backoff = first;
        self.config.outage_backoff_max = max;
        self
    }
    /// Payloads larger than this are dead-lettered as `oversized` (default
    /// 1 MiB).
    pub fn max_payload_bytes(mut self, n: usize) -> Self {
        self.config.max_payload_bytes = n;
        self
    }
    /// How often the consumer picks up dead letters marked for retry
    /// (default 5 s).
    pub fn redrive_interval(mut self, d: Duration) -> Self {
        self.config.redrive_interval = d;
        self
    }
    /// Inbox mode: connections that store each batch in parallel, split by
    /// partition (default 2; a partition always uses the same one, so its
    /// order is kept).
    pub fn writers(mut self, n: usize) -> Self {
        self.config.writers = n;
        self
    }
    /// Inbox mode: rows per processor transaction (default 500).
    pub fn processor_batch_size(mut self, n: usize) -> Self {
        self.config.processor_batch_size = n;
        self
    }
    /// Inbox mode: poll interval of an idle processor (default 500 ms).
    pub fn processor_poll_interval(mut self, d: Duration) -> Self {
        self.config.processor_poll_interval = d;
        self
    }
    /// Inbox mode: processor tasks in this process (default 1). They share
    /// the work by partition, with the processors of other instances of the
    /// group. 0 only stores: other instances (or a later start) process.
    pub fn processors(mut self, n: usize) -> Self {
        self.config.processors = n;
        self
    }
    /// How long a consumer may receive nothing while there are messages to
    /// read before it is reported stalled (and, owning no partition,
    /// rejoins its group); default 60 s. See [`ConsumerConfig::stall_timeout`].
    pub fn stall_timeout(mut self, d: Duration) -> Self {
        self.config.stall_timeout = d;
        self
    }
    /// How long a running instance of one of the consumer's sagas may go
    /// without a step, with no timeout still to come, before it counts as
    /// stuck; default 1 h. See [`ConsumerConfig::saga_stuck_after`].
    pub fn saga_stuck_after(mut self, d: Duration) -> Self {
        self.config.saga_stuck_after = d;
        self
    }
    /// Whether a message past the expected offset of its partition makes
    /// the consumer read the partition again from that offset, once
    /// (default true). See [`ConsumerConfig::recheck_offset_gaps`].
    pub fn recheck_offset_gaps(mut self, on: bool) -> Self {
        self.config.recheck_offset_gaps = on;
        self
    }
    /// The configuration so far.
    pub(crate) fn current(&self) -> &ConsumerConfig {
        &self.config
    }
    /// Test support: never commit offsets, as if the process died after
    /// each database commit and before the offset commit.
    #[doc(hidden)]
    pub fn skip_offset_commits(mut self, skip: bool) -> Self {
        self.config.commit_offsets = !skip;
        self
    }
    /// Prepended to the handlers' topics (default none). See
    /// [`ConsumerConfig::topic_prefix`].
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.topic_prefix = prefix.into();
        self
    }
    /// Validates the configuration.
    pub fn build(mut self) -> Result<Consumer> {
        self.config.validate()?;
        if self.registry.is_empty() {
            return Err(Error::Config(
                "the consumer has no handler: add one with .handler(..)".into(),
            ));
        }
        self.registry.check().map_err(Error::Config)?;
        for (topic, event_type) in &self.ignored {
            self.registry
                .ignore(topic, event_type)
                .map_err(Error::Config)?;
        }
        self.registry.prefix_topics(&self.config.topic_prefix);
        Ok(Consumer {
            pool: self.pool,
            config: Arc::new(self.config),
            registry: Arc::new(self.registry),
            stats: Arc::default(),
        })
    }
    /// Validates the configuration and runs the consumer on a tokio task.
    pub fn spawn(self) -> Result<ConsumerHandle> {
        Ok(self.build()?.spawn())
    }
}

/// Counters of one consumer, readable while it runs.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    received: AtomicU64,
    processed: AtomicU64,
    stored: AtomicU64,
    duplicates: AtomicU64,
    ignored: AtomicU64,
    dead_lettered: AtomicU64,
    handler_failures: AtomicU64,
    batches: AtomicU64,
    redriven: AtomicU64,
    rejoins: AtomicU64,
    gaps_rechecked: AtomicU64,
    /// What its tasks are stuck retrying on (dependency → last error).
    problems: crate::backoff::Problems,
    /// How the consumer ended: `Some(None)` stopped, `Some(Some(e))` failed.
    ended: std::sync::Mutex<Option<Option<String>>>,
    /// Whether its role may delete its dedup rows, and when that was asked
    /// (see [`ConsumerStats::may_undo_dedup`]).
    undo_dedup: std::sync::Mutex<Option<(bool, std::time::Instant)>>,
}

/// What a consumer's handle reports about it ([`ConsumerHandle::health`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConsumerHealth {
    /// Running; nothing it depends on is failing.
    Running,
    /// Running, but stuck retrying: the database (or the broker) is
    /// unavailable, or refuses a write it cannot skip, such as a dead
    /// letter. Nothing after the message in question is acknowledged
    /// meanwhile. `error` names each component and its last error.
    Degraded {
        /// What fails, component by component (`database: …`).
        error: String,
    },
    /// Running, but the database refuses one of the consumer's own
    /// statements in a way retrying cannot cure — a missing privilege (see
    /// the guide's "Roles and privileges"), a missing table or column:
    /// logged once at error level, retried every outage back-off cap until
    /// fixed. Nothing is applied twice or dead-lettered for it, and nothing
    /// after the message in question is acknowledged meanwhile.
    Refused {
        /// What is refused, component by component, naming each statement
        /// and what it needs.
        error: String,
    },
    /// Stopped after a shutdown.
    Stopped,
    /// Stopped on an error (what [`ConsumerHandle::join`] returns).
    Failed {
        /// The error.
        error: String,
    },
}

/// A snapshot of [`ConsumerStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerCounts {
    /// Messages received from Kafka.
    pub received: u64,
    /// Events whose handlers ran and committed.
    pub processed: u64,
    /// Events stored in `inbox_event`: every event in inbox mode; in dedup
    /// mode, the events set aside behind a failing event of their key (the
    /// failing one included), which the inbox processor then applies.
    pub stored: u64,
    /// Events skipped because already applied (or already stored).
    pub duplicates: u64,
    /// Messages of an ignored event type.
    pub ignored: u64,
    /// Messages and events written to the dead-letter table.
    pub dead_lettered: u64,
    /// Failed handler attempts.
    pub handler_failures: u64,
    /// Batches received from Kafka and committed.
    pub batches: u64,
    /// Dead letters re-driven successfully.
    pub redriven: u64,
    /// Times it rejoined its group after owning no partition while the
    /// group had messages to read (see [`ConsumerConfig::stall_timeout`]).
    pub rejoins: u64,
    /// Times a message arrived past its partition's expected offset and
    /// the partition was read again from there (see
    /// [`ConsumerConfig::recheck_offset_gaps`]).
    pub gaps_rechecked: u64,
}

impl ConsumerStats {
    /// Whether the consumer's role may take back the dedup rows of events it
    /// did not apply after all (`DELETE ON processed_event`), which skipping
    /// a handler's clean failure in place needs (see `apply::Failure`):
    /// asked in `conn`'s transaction at most every ten minutes. Without the
    /// grant (a role set up before it was needed), failures take their
    /// segment back, as they did; a warning says so once per answer.
    pub(crate) async fn may_undo_dedup(
        &self,
        conn: &mut sqlx::PgConnection,
    ) -> std::result::Result<bool, sqlx::Error> {
        const ASK_EVERY: std::time::Duration = std::time::Duration::from_secs(600);
        let known = *self.undo_dedup.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((may, at)) = known
            && at.elapsed() < ASK_EVERY
        {
            return Ok(may);
        }
        let may: bool =
            sqlx::query_scalar("SELECT has_table_privilege('processed_event', 'DELETE')")
                .fetch_one(conn)
                .await?;
        if !may && known.is_none_or(|(before, _)| before) {
            tracing::warn!(
                "the consumer's role may not delete from processed_event: a handler that fails \
                 without touching the transaction takes its batch's segment back (the events \
                 before it run again); grant `DELETE ON processed_event` (the guide's \
                 \"Roles and privileges\") to skip it in place"
            );
        }
        *self.undo_dedup.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((may, std::time::Instant::now()));
        Ok(may)
    }

    /// How the consumer is doing.
    pub fn health(&self) -> ConsumerHealth {
        let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(ended) = ended {
            return match ended {
                None => ConsumerHealth::Stopped,
                Some(error) => ConsumerHealth::Failed { error },
            };
        }
        match crate::backoff::summary(&self.problems) {
            None => ConsumerHealth::Running,
            Some((true, error)) => ConsumerHealth::Refused { error },
            Some((false, error)) => ConsumerHealth::Degraded { error },
        }
    }

    /// Where its tasks report what they are stuck on.
    pub(crate) fn problems(&self) -> crate::backoff::Problems {
        self.problems.clone()
    }

    /// The current counts.
    pub fn snapshot(&self) -> ConsumerCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerCounts {
            received: l(&self.received),
            processed: l(&self.processed),
            stored: l(&self.stored),
            duplicates: l(&self.duplicates),
            ignored: l(&self.ignored),
            dead_lettered: l(&self.dead_lettered),
            handler_failures: l(&self.handler_failures),
            batches: l(&self.batches),
            redriven: l(&self.redriven),
            rejoins: l(&self.rejoins),
            gaps_rechecked: l(&self.gaps_rechecked),
        }
    }
}

type Stats = ConsumerStats;

/// A consumer group member that applies events with its handlers. See the
/// module docs. Handlers are usually written with `#[inbox_handler]` (see
/// the `outbox` crate); by hand, an [`InboxHandler`]:
///
/// ```no_run
/// use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
/// use outbox_runtime::{Consumer, Mode};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl DomainEvent for OrderPlaced {
/// #     const TOPIC: &'static str = "orders";
/// #     const AGGREGATE_TYPE: &'static str = "Order";
/// #     const EVENT_TYPES: &'static [&'static str] = &["OrderPlaced"];
/// #     fn event_type(&self) -> &'static str { "OrderPlaced" }
/// #     fn event_version(&self) -> u32 { 1 }
/// #     fn aggregate_id(&self) -> String { self.order_id.clone() }
/// # }
///
/// struct Charge;
///
/// impl InboxHandler for Charge {
///     type Event = OrderPlaced;
///     const NAME: &'static str = "billing.charge";
///
///     fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: OrderPlaced) -> HandlerFuture<'a>
///     where
///         'c: 'a,
///     {
///         Box::pin(async move {
///             sqlx::query("INSERT INTO charges (order_id) VALUES ($1)")
///                 .bind(&event.order_id)
///                 .execute(&mut **ctx) // the consumer's transaction
///                 .await?;
///             Ok(())
///         })
///     }
/// }
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let consumer = Consumer::builder(pool)
///     .group("billing")
///     .brokers("kafka:9092")
///     .mode(Mode::Dedup)
///     .handler(Charge)
///     .spawn()?;
/// println!("{:?}", consumer.counts());
/// consumer.shutdown().await?; // commits what it applied, leaves the group
/// # Ok(())
/// # }
/// ```
pub struct Consumer {
    pool: PgPool,
    config: Arc<ConsumerConfig>,
    registry: Arc<Registry>,
    stats: Arc<ConsumerStats>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("config", &self.config)
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

/// A consumer running in the background ([`Consumer::spawn`]).
#[derive(Debug)]
pub struct ConsumerHandle {
    token: CancellationToken,
    stats: Arc<ConsumerStats>,
    task: JoinHandle<Result<()>>,
}

impl ConsumerHandle {
    /// The consumer's counters.
    pub fn counts(&self) -> ConsumerCounts {
        self.stats.snapshot()
    }
    /// The consumer's counters, to read after [`shutdown`](Self::shutdown)
    /// too (the final counts: each batch's follow its commit).
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }
    /// A token that stops the consumer when cancelled.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.token.clone()
    }
    /// True once the consumer task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
    /// Running, degraded (stuck retrying, and on what), stopped, or failed
    /// (with the error). Also logged, and exported as the
    /// `outbox_consumer_up` gauge: an embedded consumer never stops silently.
    pub fn health(&self) -> ConsumerHealth {
        self.stats.health()
    }
    /// Stops the consumer gracefully: the batch in flight is applied and
    /// committed, its offsets committed, the group left. Returns the
    /// consumer's result.
    pub async fn shutdown(self) -> Result<()> {
        self.token.cancel();
        self.join().await
    }
    /// Waits for the consumer to end (after its token is cancelled or on error).
    pub async fn join(self) -> Result<()> {
        self.task.await.map_err(|e| Error::Task(e.to_string()))?
    }
}

impl Consumer {
    /// Starts building a consumer on `pool`, which needs at least 2
    /// connections (dedup mode), or `writers + processors + 1` (inbox mode).
    pub fn builder(pool: PgPool) -> ConsumerBuilder {
        ConsumerBuilder {
            pool,
            config: ConsumerConfig::new(),
            registry: Registry::default(),
            ignored: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    /// The consumer's counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// Runs the consumer on a tokio task until [`ConsumerHandle::shutdown`].
    pub fn spawn(self) -> ConsumerHandle {
        let token = CancellationToken::new();
        let stats = self.stats.clone();
        let task = tokio::spawn(self.run(token.clone()));
        ConsumerHandle { token, stats, task }
    }

    /// Records how the consumer ended: health, the `outbox_consumer_up`
    /// gauge, and an error log if it failed.
    fn ended(group: &str, stats: &ConsumerStats, result: &Result<()>) {
        let error = result.as_ref().err().map(ToString::to_string);
        if let Some(error) = &error {
            tracing::error!(group, %error, "consumer stopped on an error");
        }
        *stats.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        crate::metrics::consumer_up(group, false);
    }

    /// Runs the consumer until `shutdown` is cancelled, then finishes the
    /// batch in flight, commits its offsets and leaves the group. Returns an
    /// error only for problems a retry cannot fix (e.g. an invalid Kafka
    /// setting).
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let (group, stats) = (self.config.group.clone(), self.stats.clone());
        let result = self.run_inner(shutdown).await;
        Self::ended(&group, &stats, &result);
        result
    }

    async fn run_inner(self, shutdown: CancellationToken) -> Result<()> {
        let Consumer {
            pool,
            config,
            registry,
            stats,
        } = self;
        let shared = Arc::new(Shared::new(config.commit_offsets));
        let check = match config.mode {
            Mode::Dedup => Check::Decode,
            Mode::Inbox => Check::Json,
        };
        let topics = registry.topics();
        let poller = Poller::new(
            PollerSettings {
                client: config.client_config(),
                topics: topics.clone(),
                max_batch: config.batch_size,
                max_batch_bytes: config.max_batch_bytes,
                linger: config.batch_linger,
                max_bytes: config.max_payload_bytes,
                check,
                group: config.group.clone(),
                stall_timeout: config.stall_timeout,
                recheck_offset_gaps: config.recheck_offset_gaps,
            },
            shared.clone(),
        )?;
        tracing::info!(
            group = %config.group,
            mode = %config.mode,
            topics = ?topics,
            handlers = ?registry.names(),
            brokers = %config.brokers,
            settings = ?kafka::redacted(&config.kafka_settings),
            "consumer started"
        );

        let (tx, mut rx) = mpsc::channel(1);
        let poll_thread = {
            let (registry, stats) = (registry.clone(), stats.clone());
            tokio::task::spawn_blocking(move || poller.run(registry, tx, stats))
        };
        let background = CancellationToken::new();
        // The background tasks stop with this function, however it ends.
        let _stop_background = background.clone().drop_guard();
        let wake = Arc::new(Notify::new());
        // The background tasks, watched: one that ends before the consumer
        // (a panic) stops the consumer with its error.
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(crate::metrics::consumer_task(
            pool.clone(),
            crate::metrics::Sampled {
                group: config.group.clone(),
                sagas: registry.sagas().to_vec(),
                saga_stuck_after: config.saga_stuck_after,
            },
            stats.clone(),
            background.clone(),
        ));
        tasks.spawn(
            redrive::Redriver {
                pool: pool.clone(),
                config: config.clone(),
                registry: registry.clone(),
                stats: stats.clone(),
                wake: wake.clone(),
            }
            .run(background.clone()),
        );
        // Inbox mode: the processors apply what the consumer stores. Dedup
        // mode: they apply the events set aside behind a failing event of
        // their key, and give their connection back when there is none.
        let processors = match config.mode {
            Mode::Inbox => config.processors,
            Mode::Dedup => config.processors.max(1),
        };
        for worker in 0..processors {
            tasks.spawn(
                processor::Processor::new(
                    pool.clone(),
                    config.clone(),
                    registry.clone(),
                    stats.clone(),
                    wake.clone(),
                    worker,
                )
                .run(background.clone()),
            );
        }

        let health = || {
            backoff::Health::new("database", config.outage_backoff, config.outage_backoff_max)
                .reporting(stats.problems.clone())
        };
        crate::metrics::consumer_up(&config.group, true);
        crate::metrics::consumer_stalled(&config.group, false);
        let mut failed = None;
        let mut sink = match config.mode {
            Mode::Dedup => Sink::Dedup(dedup::Applier {
                pool: &pool,
                config: &config,
                registry: &registry,
                stats: &stats,
                shared: &shared,
                db: health(),
                latency: crate::metrics::ConsumerLatency::new(&config.group),
                conn: txn::GuardedConn::new(pool.clone(), config.handler_timeout),
                wake: Some(&wake),
                held: Box::default(),
            }),
            Mode::Inbox => Sink::Store(store::Store {
                pool: &pool,
                config: &config,
                stats: &stats,
                shared: &shared,
                wake: &wake,
                db: health(),
                progress: progress_mode(&pool, &config.group).await,
            }),
        };
        loop {
            shared.set_idle(true);
            // The first retry from memory due (dedup mode): the loop wakes
            // for it when no batch comes.
            let due = match &sink {
                Sink::Dedup(applier) => applier.held.next_due(),
                Sink::Store(_) => None,
            };
            let batch = tokio::select! {
                biased;
                _ = shutdown.cancelled() => None,
                Some(ended) = tasks.join_next() => {
                    let error = match ended {
                        Err(e) if e.is_panic() => format!("a consumer task panicked: {e}"),
                        Err(e) => format!("a consumer task failed: {e}"),
                        Ok(()) => "a consumer task ended early".to_owned(),
                    };
                    failed = Some(Error::Task(error));
                    None
                }
                batch = rx.recv() => batch,
                _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)),
                    if due.is_some() => Some(Vec::new()),
            };
            shared.set_idle(false);
            let Some(mut batch) = batch else { break };
            // The retries from memory now due go first, in the same
            // transaction as the batch (their keys' later events in it
            // follow them).
            if let Sink::Dedup(applier) = &mut sink {
                let mut retries = applier.due();
                if !retries.is_empty() {
                    retries.append(&mut batch);
                    batch = retries;
                }
            }
            let (batch, dropped) = shared.begin_batch(batch);
            // Retries from memory of a partition revoked since they were
            // taken out are forgotten (its next owner reads them again).
            if let Sink::Dedup(applier) = &mut sink {
                applier.held.dropped(&dropped);
            }
            if !batch.is_empty() {
                match &mut sink {
                    Sink::Dedup(applier) => applier.process(batch, &shutdown).await,
                    Sink::Store(store) => store.process(batch, &shutdown).await,
                }
            }
            shared.end_batch();
        }
        if let Sink::Dedup(applier) = &mut sink {
            applier.conn.release().await;
        }
        shared.stop();
        drop(rx);
        let polled = poll_thread
            .await
            .map_err(|e| Error::Task(e.to_string()))
            .and_then(|r| r);
        background.cancel();
        while let Some(ended) = tasks.join_next().await {
            if let Err(error) = ended {
                tracing::error!(%error, "consumer background task failed");
                failed.get_or_insert(Error::Task(error.to_string()));
            }
        }
        tracing::info!(group = %config.group, counts = ?stats.snapshot(), "consumer stopped");
        match failed {
            Some(error) => Err(error),
            None => polled,
        }
    }
}

enum Sink<'a> {
    Dedup(dedup::Applier<'a>),
    Store(store::Store<'a>),
}
