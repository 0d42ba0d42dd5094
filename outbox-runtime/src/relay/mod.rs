//! The relay: publishes `outbox_event` rows to Kafka, at least once, in id
//! order per partition key, and marks them published. Several relays may run
//! at once: each owns a share of the lanes (see [`lanes`](self::lanes)), so a
//! key's events are published by one relay at a time, in order. It never
//! deletes rows.
//!
//! One loop per relay overlaps the database and the broker: while batch *n*
//! is being delivered, batch *n+1* is claimed; while batch *n+1* is being
//! delivered, batch *n* is marked published and committed. A batch is
//! bounded by rows and by bytes; after one cut at its byte budget, the next
//! claim waits until it has committed (`Loop::cut`). Batch *n+1* is
//! handed to the producer only after every delivery of batch *n* is known, so
//! a key that failed in batch *n* sends nothing of batch *n+1*; a key with a
//! row left unpublished in a batch stays out of claims and sends until that
//! batch's transaction ends (see `Loop::held`). Batch *n* is
//! marked as soon as its deliveries are known, even while the claim of *n+1*
//! still waits for a pool connection: the loop never waits for a connection
//! while holding one that a finished batch would free.
//!
//! Submodules: [`claim`](self::claim) (the SQL), [`held`](self::held)
//! (rows held back out of the claim's index), [`lanes`](self::lanes)
//! (lane ownership across relays), [`publish`](self::publish) (the producer),
//! [`topics`](self::topics) (topics missing on the broker),
//! [`wake`](self::wake) (LISTEN/NOTIFY and polling), `trace_links` (with
//! the `otel` feature: the links of each batch's `outbox.relay.batch` span
//! to its events' traces).

pub(crate) mod claim;
pub(crate) mod held;
pub(crate) mod lanes;
pub(crate) mod publish;
pub(crate) mod topics;
#[cfg(feature = "otel")]
mod trace_links;
mod wake;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::claim::{Batch, Failure, Row};
use self::publish::{FailureKind, Outcome, Publisher};
use self::topics::Topics;
use self::wake::Waker;
use crate::backoff::{self, Health};
use crate::cloudevents::{CloudEvents, CloudEventsMode};
use crate::error::{Error, Result};
use crate::kafka;
use crate::scope::OutboxScope;

/// The default byte budget of a relay's batch (16 MiB).
pub const DEFAULT_MAX_BATCH_BYTES: usize = 16 << 20;

/// The largest byte budget of a batch (1 GiB).
const MAX_BATCH_BYTES_LIMIT: usize = 1 << 30;

/// Relay settings. Build with [`Relay::builder`]. `Debug` redacts secret
/// Kafka settings.
#[derive(Clone)]
pub struct RelayConfig {
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// Extra librdkafka settings (TLS, SASL, tuning). `enable.idempotence`
    /// and `acks=all` are always enforced.
    pub kafka_settings: Vec<(String, String)>,
    /// Rows claimed per batch.
    pub batch_size: usize,
    /// Bytes claimed per batch (payloads, headers and keys), about: a claim
    /// stops after the row that reaches it, and a single row larger than it
    /// is claimed alone. Bounds what a relay holds: this batch, the one in
    /// flight and the one being marked.
    pub max_batch_bytes: usize,
    /// Fallback poll interval when no NOTIFY arrives.
    pub poll_interval: Duration,
    /// LISTEN for the commit-time NOTIFY of new rows.
    pub listen: bool,
    /// Message-level failures after which a row is parked (at least 2: a
    /// row is parked only on a failure it met sent alone, after its first).
    pub max_attempts: u32,
    /// First retry delay of a failed key or topic; doubles up to `retry_backoff_max`.
    pub retry_backoff: Duration,
    /// Cap of the per-key and per-topic retry delay.
    pub retry_backoff_max: Duration,
    /// First hold of a topic missing on the broker (default 5 s): its rows
    /// are held without being sent, and the broker is asked again after
    /// it (see [`topics`](self::topics)). Each hold is stretched by a
    /// random share of itself (up to twice as long).
    pub missing_topic_hold: Duration,
    /// Cap of that hold, which doubles while the topic stays missing
    /// (default 30 s): a topic created meanwhile is published within about
    /// twice this.
    pub missing_topic_hold_max: Duration,
    /// First back-off when the broker or the database is unavailable.
    pub outage_backoff: Duration,
    /// Cap of the outage back-off.
    pub outage_backoff_max: Duration,
    /// How long librdkafka keeps trying one message (`message.timeout.ms`).
    pub delivery_timeout: Duration,
    /// Number of lanes the partition keys are spread over (default 16); the
    /// relays of one database share them out. Every relay of a database must
    /// use the same count. `0` turns lanes off: relays then only skip each
    /// other's rows, and per-key order holds only with a single relay; a
    /// relay without lanes and relays with lanes refuse to run side by side.
    /// A lane is a fixed set of the 64 slots rows are stored in (see
    /// [`lanes`](self::lanes)): the count must divide 64 (1, 2, 4, 8, 16, 32
    /// or 64).
    pub lanes: u16,
    /// `statement_timeout` of the relay's SQL (claims, marks, lane and
    /// metrics queries); zero: none. A statement that runs longer fails and
    /// is retried after the outage back-off.
    pub statement_timeout: Duration,
    /// Most events per second this relay claims (default: no limit). The
    /// relay's work shares the database (and, on a small host, the CPU)
    /// with the application: a limit leaves the application's writers
    /// more of it while a large backlog drains (measured: see
    /// BENCHMARKS.md). Batches stay whole: a claim of *n* rows waits until
    /// *n* / rate seconds after the previous claim (bursts of at most a
    /// second's worth after an idle spell).
    pub max_events_per_second: Option<u32>,
    /// How long a relay that stops answering (host frozen, connection
    /// half-open) keeps its lanes (default 10 s): its lane session's
    /// `idle_session_timeout`, TCP keepalives and `tcp_user_timeout` on the
    /// server side, and the longest the relay waits for an answer there.
    /// Rows it had claimed come free after [`RelayConfig::claim_idle_timeout`].
    pub lane_timeout: Duration,
    /// CloudEvents headers (default off): see [`crate::cloudevents`].
    pub cloud_events: CloudEvents,
    /// Prepended to every event's topic (default empty): an event of topic
    /// `orders` goes to `{topic_prefix}orders`. Tests use it to run on
    /// topics of their own (`testing::TestTopics`); consumers take the same
    /// prefix ([`ConsumerConfig::topic_prefix`](crate::ConsumerConfig::topic_prefix)).
    pub topic_prefix: String,
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured without `..`: a new field must be added here.
        let Self {
            brokers,
            kafka_settings,
            batch_size,
            max_batch_bytes,
            poll_interval,
            listen,
            max_attempts,
            retry_backoff,
            retry_backoff_max,
            missing_topic_hold,
            missing_topic_hold_max,
            outage_backoff,
            outage_backoff_max,
            delivery_timeout,
            lanes,
            statement_timeout,
            max_events_per_second,
            lane_timeout,
            cloud_events,
            topic_prefix,
        } = self;
        f.debug_struct("RelayConfig")
            .field("brokers", brokers)
            .field("kafka_settings", &kafka::Redacted(kafka_settings))
            .field("batch_size", batch_size)
            .field("max_batch_bytes", max_batch_bytes)
            .field("poll_interval", poll_interval)
            .field("listen", listen)
            .field("max_attempts", max_attempts)
            .field("retry_backoff", retry_backoff)
            .field("retry_backoff_max", retry_backoff_max)
            .field("missing_topic_hold", missing_topic_hold)
            .field("missing_topic_hold_max", missing_topic_hold_max)
            .field("outage_backoff", outage_backoff)
            .field("outage_backoff_max", outage_backoff_max)
            .field("delivery_timeout", delivery_timeout)
            .field("lanes", lanes)
            .field("statement_timeout", statement_timeout)
            .field("max_events_per_second", max_events_per_second)
            .field("lane_timeout", lane_timeout)
            .field("cloud_events", cloud_events)
            .field("topic_prefix", topic_prefix)
            .finish()
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            brokers: kafka::DEFAULT_BROKERS.to_owned(),
            kafka_settings: Vec::new(),
            batch_size: 2000,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
            poll_interval: Duration::from_millis(500),
            listen: true,
            max_attempts: 5,
            retry_backoff: Duration::from_millis(250),
            retry_backoff_max: Duration::from_secs(30),
            missing_topic_hold: Duration::from_secs(5),
            missing_topic_hold_max: Duration::from_secs(30),
            outage_backoff: Duration::from_millis(100),
            outage_backoff_max: Duration::from_secs(5),
            delivery_timeout: Duration::from_secs(30),
            lanes: 16,
            statement_timeout: Duration::from_secs(30),
            max_events_per_second: None,
            lane_timeout: Duration::from_secs(10),
            cloud_events: CloudEvents::default(),
            topic_prefix: String::new(),
        }
    }
}

impl RelayConfig {
    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.brokers.trim().is_empty() {
            return bad("brokers must not be empty".into());
        }
        if self.batch_size == 0 || self.batch_size > 100_000 {
            return bad(format!(
                "batch size must be 1..=100000, got {}",
                self.batch_size
            ));
        }
        if self.max_batch_bytes == 0 || self.max_batch_bytes > MAX_BATCH_BYTES_LIMIT {
            return bad(format!(
                "max batch bytes must be 1..=1 GiB, got {}",
                self.max_batch_bytes
            ));
        }
        if self.max_attempts == 0 {
            return bad("max attempts must be >= 1".into());
        }
        if self.poll_interval.is_zero() {
            return bad("poll interval must be > 0".into());
        }
        if self.missing_topic_hold < Duration::from_millis(100)
            || self.missing_topic_hold_max < self.missing_topic_hold
        {
            return bad(format!(
                "missing topic hold must be >= 100 ms and its cap at least as long, got {:?} and {:?}",
                self.missing_topic_hold, self.missing_topic_hold_max
            ));
        }
        if self.delivery_timeout < Duration::from_millis(100) {
            return bad("delivery timeout must be >= 100 ms".into());
        }
        if self.lanes != 0 && lanes::SLOTS % i32::from(self.lanes) != 0 {
            return bad(format!(
                "lanes must be 0 (none) or a divisor of {} (1, 2, 4, 8, 16, 32 or 64), got {}: \
                 a lane is a fixed set of the {} slots rows are stored in",
                lanes::SLOTS,
                self.lanes,
                lanes::SLOTS
            ));
        }
        if !self.statement_timeout.is_zero() && self.statement_timeout < Duration::from_millis(100)
        {
            return bad("statement timeout must be 0 (none) or >= 100 ms".into());
        }
        if self.max_events_per_second == Some(0) {
            return bad("max events per second must be >= 1 (unset: no limit)".into());
        }
        if self.lane_timeout < Duration::from_secs(1) {
            return bad("lane timeout must be >= 1 s".into());
        }
        self.cloud_events.validate()
    }

    /// How long a claim transaction may stay idle before the server ends
    /// it: longer than a working relay keeps a batch open between two
    /// statements (its deliveries, then an outage back-off and a broker
    /// probe), so that only a frozen relay hits it — delivery timeout +
    /// outage back-off cap + 5 s (40 s by default). Its claimed rows, and
    /// the handover of its lanes, wait at most that long.
    pub fn claim_idle_timeout(&self) -> Duration {
        self.delivery_timeout + self.outage_backoff_max + Duration::from_secs(5)
    }

    fn producer_config(&self) -> rdkafka::ClientConfig {
        let mut defaults: Vec<(String, String)> = vec![
            ("linger.ms".into(), "1".into()),
            ("queue.buffering.max.messages".into(), "1000000".into()),
            ("queue.buffering.max.kbytes".into(), "1048576".into()),
            ("batch.num.messages".into(), "10000".into()),
            // Reconnect within a second once the broker is back (the
            // librdkafka default waits up to 10 s).
            ("reconnect.backoff.max.ms".into(), "1000".into()),
            (
                "message.timeout.ms".into(),
                self.delivery_timeout.as_millis().to_string(),
            ),
        ];
        defaults.extend(self.kafka_settings.iter().cloned());
        kafka::client_config(&self.brokers, &defaults)
    }
}

/// Builder of a [`Relay`].
#[derive(Debug, Clone)]
pub struct RelayBuilder {
    pool: PgPool,
    config: RelayConfig,
}

impl RelayBuilder {
    /// Kafka bootstrap servers (default `127.0.0.1:9092`).
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.config.brokers = brokers.into();
        self
    }
    /// One librdkafka setting (`key`, `value`), e.g. SASL or TLS options.
    pub fn kafka_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.kafka_settings.push((key.into(), value.into()));
        self
    }
    /// Rows per batch (default 2000).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.config.batch_size = n;
        self
    }
    /// Bytes per batch (default 16 MiB): payloads, headers and keys. A
    /// claim stops after the row that reaches it; a row larger than it is
    /// claimed alone. See [`RelayConfig::max_batch_bytes`].
    pub fn max_batch_bytes(mut self, n: usize) -> Self {
        self.config.max_batch_bytes = n;
        self
    }
    /// Poll interval when idle (default 500 ms).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.config.poll_interval = d;
        self
    }
    /// LISTEN for NOTIFY wake-ups (default on).
    pub fn listen(mut self, on: bool) -> Self {
        self.config.listen = on;
        self
    }
    /// Message-level failures before a row is parked (default 5). A row
    /// that failed is retried alone in its record batch (a broker refuses a
    /// whole batch for one bad record), and only such a failure parks it:
    /// a row is never parked on its first failure.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.config.max_attempts = n;
        self
    }
    /// First and maximum retry delay of a failing key or topic.
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config.retry_backoff = first;
        self.config.retry_backoff_max = max;
        self
    }
    /// First and maximum hold of a topic missing on the broker (default
    /// 5 s and 30 s). See [`RelayConfig::missing_topic_hold`].
    pub fn missing_topic_hold(mut self, first: Duration, max: Duration) -> Self {
        self.config.missing_topic_hold = first;
        self.config.missing_topic_hold_max = max;
        self
    }
    /// First and maximum back-off during a broker or database outage.
    pub fn outage_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config.outage_backoff = first;
        self.config.outage_backoff_max = max;
        self
    }
    /// librdkafka's `message.timeout.ms` (default 30 s).
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.config.delivery_timeout = d;
        self
    }
    /// Number of lanes (default 16; `0`: no lanes). See [`RelayConfig::lanes`].
    pub fn lanes(mut self, n: u16) -> Self {
        self.config.lanes = n;
        self
    }
    /// `statement_timeout` of the relay's SQL (default 30 s; zero: none).
    pub fn statement_timeout(mut self, d: Duration) -> Self {
        self.config.statement_timeout = d;
        self
    }
    /// Most events per second the relay claims (`None`, the default: no
    /// limit). See [`RelayConfig::max_events_per_second`].
    pub fn max_events_per_second(mut self, rate: Option<u32>) -> Self {
        self.config.max_events_per_second = rate;
        self
    }
    /// Writes CloudEvents binary-mode headers (`ce_id`, `ce_type`,
    /// `ce_source`, ...) beside the framework's own ([`CloudEventsMode::Both`])
    /// or instead of them ([`CloudEventsMode::Only`]), with `source` as
    /// `ce_source`. Default: off. See [`crate::cloudevents`].
    pub fn cloud_events(mut self, mode: CloudEventsMode, source: impl Into<String>) -> Self {
        self.config.cloud_events = CloudEvents {
            mode,
            source: source.into(),
        };
        self
    }
    /// The configuration so far.
    pub(crate) fn current(&self) -> &RelayConfig {
        &self.config
    }
    /// How long a relay that stops answering keeps its lanes (default 10 s).
    /// See [`RelayConfig::lane_timeout`].
    pub fn lane_timeout(mut self, d: Duration) -> Self {
        self.config.lane_timeout = d;
        self
    }
    /// Prepended to every event's topic (default none). See
    /// [`RelayConfig::topic_prefix`].
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.topic_prefix = prefix.into();
        self
    }
    /// Replaces the whole configuration.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }
    /// Validates the configuration and runs the relay on a tokio task.
    pub fn spawn(self) -> Result<RelayHandle> {
        Ok(self.build()?.spawn())
    }

    /// Validates the configuration.
    pub fn build(self) -> Result<Relay> {
        self.config.validate()?;
        Ok(Relay {
            pool: self.pool,
            config: self.config,
            stats: Arc::default(),
        })
    }
}

/// Counters of one relay, readable while it runs.
#[derive(Debug, Default)]
pub struct RelayStats {
    published: AtomicU64,
    failed: AtomicU64,
    parked: AtomicU64,
    withheld: AtomicU64,
    batches: AtomicU64,
    order_violations: AtomicU64,
    /// Failed rounds in a row (see [`RelayStats::consecutive_failures`]).
    failing: AtomicU64,
    lanes: std::sync::Mutex<Vec<i32>>,
}

/// A snapshot of [`RelayStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayCounts {
    /// Rows delivered and marked published.
    pub published: u64,
    /// Delivery failures (each attempt).
    pub failed: u64,
    /// Rows parked after too many failures.
    pub parked: u64,
    /// Rows claimed but held back behind a failed event of the same key.
    pub withheld: u64,
    /// Non-empty batches processed.
    pub batches: u64,
    /// Events delivered although an earlier event of their key in the same
    /// batch failed asynchronously (see the ordering notes in the README).
    pub order_violations: u64,
}

impl RelayStats {
    /// The lanes this relay claims from right now (empty without lanes).
    pub fn lanes(&self) -> Vec<i32> {
        self.lanes.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Failed rounds in a row: batches of which no event was delivered
    /// while some delivery failed, and claims or marks the database
    /// refused. Back to 0 once a batch delivers an event, or when the
    /// outbox has nothing left to publish (the failing rows were parked).
    /// Exported as the `outbox_relay_consecutive_failures` gauge.
    pub fn consecutive_failures(&self) -> u64 {
        self.failing.load(Ordering::Relaxed)
    }

    /// Counts a failed round.
    fn failed_round(&self) {
        self.failing.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends a run of failed rounds: events were delivered, or nothing is
    /// left to deliver.
    pub(crate) fn failing_over(&self) {
        self.failing.store(0, Ordering::Relaxed);
    }

    /// The current counts.
    pub fn snapshot(&self) -> RelayCounts {
        RelayCounts {
            published: self.published.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            parked: self.parked.load(Ordering::Relaxed),
            withheld: self.withheld.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            order_violations: self.order_violations.load(Ordering::Relaxed),
        }
    }
}

/// Publishes the outbox to Kafka. See the module docs.
#[derive(Debug)]
pub struct Relay {
    pool: PgPool,
    config: RelayConfig,
    stats: Arc<RelayStats>,
}

/// A relay running in the background ([`Relay::spawn`]).
#[derive(Debug)]
pub struct RelayHandle {
    token: CancellationToken,
    stats: Arc<RelayStats>,
    task: JoinHandle<Result<()>>,
}

impl RelayHandle {
    /// The relay's counters.
    pub fn counts(&self) -> RelayCounts {
        self.stats.snapshot()
    }
    /// The lanes the relay claims from right now (empty without lanes).
    pub fn lanes(&self) -> Vec<i32> {
        self.stats.lanes()
    }
    /// A token that stops the relay when cancelled.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.token.clone()
    }
    /// True once the relay task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
    /// Stops the relay gracefully: the batch in flight is delivered and
    /// marked, the producer flushed. Returns the relay's result.
    pub async fn shutdown(self) -> Result<()> {
        self.token.cancel();
        self.join().await
    }
    /// Waits for the relay to end (after its token is cancelled or on error).
    pub async fn join(self) -> Result<()> {
        self.task.await.map_err(|e| Error::Task(e.to_string()))?
    }
}

impl Relay {
    /// Starts building a relay on `pool`. The relay works with any pool size;
    /// it takes up to 3 connections at once (a claim, the batch in flight,
    /// the batch being marked) and is fastest when the pool has them. LISTEN
    /// and, with lanes, the lane locks use connections of their own.
    pub fn builder(pool: PgPool) -> RelayBuilder {
        RelayBuilder {
            pool,
            config: RelayConfig::default(),
        }
    }

    /// The relay's counters.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Runs the relay on a tokio task until [`RelayHandle::shutdown`].
    pub fn spawn(self) -> RelayHandle {
        let token = CancellationToken::new();
        let stats = self.stats.clone();
        let task = tokio::spawn(self.run(token.clone()));
        RelayHandle { token, stats, task }
    }

    /// Runs the relay until `shutdown` is cancelled. Returns an error only for
    /// problems a retry cannot fix (e.g. an invalid producer configuration).
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let mut publisher = Publisher::new(self.config.producer_config())?
            .with_cloud_events(self.config.cloud_events.clone())
            .topic_prefix(&self.config.topic_prefix);
        let Some(scope) = self.outbox(&shutdown).await else {
            return Ok(());
        };
        let shared = Arc::new(lanes::Shared::new(scope, self.config.lanes));
        let manager = lanes::LaneManager::start(
            &self.pool,
            scope,
            self.config.lanes,
            self.config.lane_timeout,
            shared.clone(),
        )
        .await?;
        // The lanes go with this future: a relay task that panics or is
        // dropped (aborted, its runtime shut down) stops its lane manager,
        // which releases them, instead of leaving it holding lanes nobody
        // publishes.
        let stop = CancellationToken::new();
        let _release_lanes = stop.clone().drop_guard();
        let manager = manager.spawn(stop.clone());
        tracing::info!(
            brokers = %self.config.brokers,
            settings = ?kafka::redacted(&self.config.kafka_settings),
            batch_size = self.config.batch_size,
            lanes = self.config.lanes,
            outbox = scope.oid(),
            "relay started"
        );
        let mut waker = Waker::new(
            &self.pool,
            scope,
            self.config.listen,
            self.config.poll_interval,
        );
        waker.also_wake_on(shared.clone());
        let begin = claim::begin(
            self.config.claim_idle_timeout(),
            self.config.statement_timeout,
        );
        let mut relay = Loop {
            pool: &self.pool,
            config: &self.config,
            stats: &self.stats,
            latency: crate::metrics::relay_batch_latency(),
            blocked: Blocked::default(),
            topics: Topics::new(
                self.config.missing_topic_hold,
                self.config.missing_topic_hold_max,
            ),
            waker,
            lanes: shared,
            manager: &manager,
            begin: &begin,
            broker: Health::new(
                "broker",
                self.config.outage_backoff,
                self.config.outage_backoff_max,
            ),
            database: Health::new(
                "database",
                self.config.outage_backoff,
                self.config.outage_backoff_max,
            ),
            in_flight: None,
            marking: None,
            held: HashMap::new(),
            released: None,
            cut: None,
            paced: None,
            batches: 0,
            producer_unusable: false,
            answered_yet_failing: 0,
            probe_answered: false,
        };
        let metrics_stop = CancellationToken::new();
        let _stop_metrics = metrics_stop.clone().drop_guard();
        let metrics = tokio::spawn(crate::metrics::relay_task(
            self.pool.clone(),
            self.stats.clone(),
            metrics_stop.clone(),
        ));
        let result = relay.run(&mut publisher, &shutdown).await;
        relay.waker.close().await;
        publisher.flush(Duration::from_secs(10));
        // Every claim transaction has ended: the lanes can go.
        stop.cancel();
        let _ = manager.await;
        metrics_stop.cancel();
        let _ = metrics.await;
        tracing::info!(counts = ?self.stats.snapshot(), "relay stopped");
        result
    }

    /// The outbox this relay publishes: the `outbox_event` table its pool's
    /// `search_path` finds. Waits (backing off) while the database is down
    /// or the table missing; `None` if shut down meanwhile.
    async fn outbox(&self, shutdown: &CancellationToken) -> Option<OutboxScope> {
        let mut health = Health::new(
            "database",
            self.config.outage_backoff,
            self.config.outage_backoff_max,
        );
        loop {
            match OutboxScope::of(&self.pool).await {
                Ok(scope) => {
                    health.up();
                    return Some(scope);
                }
                Err(error) => {
                    let wait = health.down(&error);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.cancelled() => return None,
                    }
                }
            }
        }
    }
}

/// A batch handed to the producer, awaiting its deliveries.
struct InFlight {
    /// The batch's number in this relay (see [`Loop::held`]).
    seq: u64,
    batch: Batch,
    sent_at: Instant,
    outcomes: Vec<Option<Outcome>>,
    pending: Vec<(usize, rdkafka::producer::DeliveryFuture)>,
    /// The batch's `outbox.relay.batch` span, from the hand-over to the
    /// producer until the deliveries are evaluated.
    span: tracing::Span,
}

impl InFlight {
    /// Awaits the deliveries; rows never handed over count as withheld.
    async fn deliveries(mut self) -> (Batch, Vec<Outcome>) {
        let pending = std::mem::take(&mut self.pending);
        publish::settle(pending, &self.batch.rows, &mut self.outcomes).await;
        let outcomes = self
            .outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::Withheld))
            .collect();
        (self.batch, outcomes)
    }
}

/// Keys and topics held back after failures, until a deadline.
#[derive(Default)]
struct Blocked {
    keys: HashMap<String, Instant>,
    topics: HashMap<String, (Instant, u32)>,
}

impl Blocked {
    /// Forgets blocks that have ended.
    fn expire(&mut self) {
        let now = Instant::now();
        self.keys.retain(|_, until| *until > now);
        self.topics.retain(|_, (until, _)| *until > now);
    }

    /// Until when `row` is blocked (by its key or its topic), if it is.
    fn deadline(&self, row: &Row) -> Option<Instant> {
        let now = Instant::now();
        let key = self.keys.get(&row.partition_key).copied();
        let topic = self.topics.get(&row.topic).map(|(u, _)| *u);
        key.into_iter().chain(topic).filter(|u| *u > now).max()
    }
}

struct Loop<'a> {
    pool: &'a PgPool,
    config: &'a RelayConfig,
    stats: &'a RelayStats,
    latency: metrics::Histogram,
    blocked: Blocked,
    /// Topics missing on the broker (see [`topics`]).
    topics: Topics,
    waker: Waker,
    lanes: Arc<lanes::Shared>,
    /// The lane manager's task: the relay stops if it ends by itself.
    manager: &'a JoinHandle<()>,
    /// The claim transactions' `BEGIN` (see [`claim::begin`]).
    begin: &'a str,
    broker: Health,
    database: Health,
    in_flight: Option<InFlight>,
    /// The last batch's mark-and-commit, and that batch's number.
    marking: Option<(u64, JoinHandle<Result<()>>)>,
    /// Keys with a row left unpublished (held back or failed) in a batch
    /// whose transaction has not ended, mapped to the last such batch's
    /// number. That row stays locked until the batch ends, so a claim skips
    /// it and could take later rows of its key: until then these keys are
    /// left out of claims and held back in sends.
    held: HashMap<String, u64>,
    /// When held rows were last released, and whether that release was
    /// cut at its limit (see [`held::release`]).
    released: Option<(Instant, bool)>,
    /// The number of a batch cut at the byte budget whose transaction has
    /// not ended (see [`Batch::cut`]): no claim runs until it ends.
    cut: Option<u64>,
    /// With a rate limit: the earliest the next claim may run.
    paced: Option<Instant>,
    /// Batches handed to the producer so far.
    batches: u64,
    producer_unusable: bool,
    /// Rounds in a row whose deliveries failed although the broker had
    /// just answered a probe.
    answered_yet_failing: u32,
    /// Whether the last broker probe was answered.
    probe_answered: bool,
}

/// Rounds of failed deliveries to a broker that answers probes after which
/// the producer is replaced. A broker that lost its state (restarted with
/// empty storage, or a cluster rebuilt) answers metadata requests but never
/// acknowledges the old producer's messages: its idempotence state (producer
/// id, epoch, sequence numbers) is unknown there, and librdkafka keeps
/// retrying it without reporting a fatal error.
const STUCK_ROUNDS: u32 = 2;

impl Loop<'_> {
    /// Publishes until `shutdown`; fails if the lane manager ended by
    /// itself (it panicked), after settling the batch in flight.
    async fn run(&mut self, publisher: &mut Publisher, shutdown: &CancellationToken) -> Result<()> {
        let mut result = Ok(());
        loop {
            if result.is_ok() && self.manager.is_finished() {
                tracing::error!("the lane manager stopped: the relay stops");
                result = Err(Error::Task("the relay's lane manager stopped".into()));
            }
            let stopping = shutdown.is_cancelled() || result.is_err();
            if stopping && self.in_flight.is_none() {
                break;
            }
            if self
                .marking
                .as_ref()
                .is_some_and(|(_, task)| task.is_finished())
            {
                // Ended already: release its keys before the claim.
                self.finish_marking().await;
            }
            let mut claim_next = !stopping && !self.broker.is_down();
            if let Some(cut) = self.cut {
                // A batch cut at the byte budget may lock rows it did not
                // return: no claim until its transaction has ended.
                if self.in_flight.as_ref().is_some_and(|f| f.seq == cut) {
                    claim_next = false;
                } else {
                    self.finish_marking().await;
                }
            }
            let limit = self.config.batch_size as i64;
            if !stopping
                && self
                    .released
                    .is_none_or(|(at, full)| full || at.elapsed() >= held::RELEASE_INTERVAL)
            {
                // Rows whose hold has ended go back into the claim's index.
                let full =
                    match held::release(self.pool, limit, self.config.statement_timeout).await {
                        Ok(n) => n >= limit as u64,
                        Err(error) => {
                            tracing::debug!(%error, "releasing held rows failed");
                            false
                        }
                    };
                self.released = Some((Instant::now(), full));
            }
            self.blocked.expire();
            if !stopping {
                let due = self.topics.rechecks_due();
                self.look_up_topics(publisher, due).await;
            }
            let keys: Vec<String> = self.held.keys().cloned().collect();
            let max_bytes = i64::try_from(self.config.max_batch_bytes).unwrap_or(i64::MAX);
            let pool = self.pool.clone();
            let claimable = self.lanes.claimable();
            if let Ok(mut held) = self.stats.lanes.lock() {
                held.clone_from(&claimable.lanes);
            }
            let begin = self.begin.to_owned();
            // The next claim runs while the batch in flight is delivered. As
            // soon as its deliveries are known the batch is marked and
            // committed, even while the claim still waits for a connection:
            // the claim never holds up the transaction that would free one
            // (with a small pool, waiting for both would deadlock).
            //
            // It runs on a task of its own, so that it is never dropped half
            // way: a claim cut off inside its `BEGIN` round trip would give
            // its connection back to the pool inside the open transaction,
            // holding the lanes' "in use" locks (and, with the application's
            // pool, handing the transaction to the application). A claim
            // whose relay is gone finishes and drops its batch: rolled back.
            let step = Instant::now();
            let pace = self.paced.filter(|at| claim_next && *at > step);
            let stop = shutdown.clone();
            let claim = async move {
                if let Some(at) = pace {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = stop.cancelled() => return (None, Duration::ZERO),
                    }
                }
                let start = Instant::now();
                let claimed = if claim_next {
                    let task = tokio::spawn(async move {
                        claim::claim(&pool, &begin, limit, max_bytes, &keys, &claimable).await
                    });
                    Some(
                        task.await
                            .map_err(|e| Error::Task(e.to_string()))
                            .and_then(|r| r),
                    )
                } else {
                    None
                };
                (claimed, start.elapsed())
            };
            let mut claim = std::pin::pin!(claim);
            let mut claimed = None;
            let mut transient: Option<String> = None;
            let mut delivered_some = false;
            let mut delivery_time = Duration::ZERO;
            if let Some(in_flight) = self.in_flight.take() {
                let start = Instant::now();
                let sent_at = in_flight.sent_at;
                let in_flight_seq = in_flight.seq;
                let batch_span = in_flight.span.clone();
                let mut deliveries = std::pin::pin!(in_flight.deliveries());
                let (batch, outcomes) = tokio::select! {
                    delivered = &mut deliveries => delivered,
                    done = &mut claim => {
                        claimed = Some(done);
                        deliveries.await
                    }
                };
                self.latency.record(sent_at.elapsed());
                delivery_time = start.elapsed();
                let evaluated = self.evaluate(in_flight_seq, &batch, outcomes);
                batch_span.record("published", evaluated.published.len());
                drop(batch_span);
                delivered_some = !evaluated.published.is_empty();
                transient = evaluated.transient.clone();
                if claimed.is_none() {
                    let mut previous = std::pin::pin!(self.finish_marking());
                    tokio::select! {
                        _ = &mut previous => {}
                        done = &mut claim => {
                            claimed = Some(done);
                            previous.await;
                        }
                    }
                } else {
                    self.finish_marking().await;
                }
                self.marking = Some((in_flight_seq, tokio::spawn(batch.finish_owned(evaluated))));
            }
            let (claimed, claim_time) = match claimed {
                Some(done) => done,
                None => claim.await,
            };
            tracing::trace!(
                claimed = claimed
                    .as_ref()
                    .and_then(|c| c.as_ref().ok())
                    .map(|b| b.rows.len()),
                claim_ms = claim_time.as_secs_f64() * 1e3,
                delivery_ms = delivery_time.as_secs_f64() * 1e3,
                step_ms = step.elapsed().as_secs_f64() * 1e3,
                "relay step"
            );

            let mut idle = false;
            match claimed {
                Some(Ok(batch)) if batch.rows.is_empty() => idle = true,
                Some(Ok(batch)) => {
                    self.database.up();
                    self.pace(batch.rows.len());
                    self.waker.busy().await;
                    let due = self.topics.due(batch.rows.iter().map(|r| r.topic.as_str()));
                    self.look_up_topics(publisher, due).await;
                    self.in_flight = Some(self.send(publisher, batch));
                }
                Some(Err(error)) => {
                    self.stats.failed_round();
                    let wait = self.database.down(&error);
                    self.sleep(wait, shutdown).await;
                }
                None => {}
            }

            // Only a delivery proves the producer works: a round whose rows
            // were all held back proves nothing.
            if delivered_some {
                self.answered_yet_failing = 0;
            }
            if let Some(error) = transient {
                if self.probe_answered {
                    self.answered_yet_failing += 1;
                    if self.answered_yet_failing >= STUCK_ROUNDS {
                        self.answered_yet_failing = 0;
                        self.producer_unusable = true;
                        tracing::warn!(
                            rounds = STUCK_ROUNDS,
                            "the broker answers but deliveries keep failing"
                        );
                    }
                }
                if std::mem::take(&mut self.producer_unusable) {
                    self.finish_in_flight_before_recreate().await;
                    publisher.recreate(&error);
                } else {
                    publisher.recover_if_fatal();
                }
                self.wait_for_broker(publisher, &error, shutdown).await;
            } else if self.broker.is_down() && self.in_flight.is_none() {
                self.wait_for_broker(publisher, "", shutdown).await;
            }

            if idle && self.in_flight.is_none() && !shutdown.is_cancelled() {
                // Nothing to overlap the last batch's mark-and-commit with:
                // wait for it. If it releases held keys, their rows are
                // claimable now; otherwise wait for work.
                if !self.finish_marking().await {
                    tokio::select! {
                        _ = self.waker.wait(shutdown) => {}
                        _ = wait_finished(self.manager) => {}
                    }
                }
            }
        }
        self.finish_marking().await;
        result
    }

    /// With a rate limit: the next claim waits until `rows` / rate seconds
    /// after this one's turn (at most a second's worth of catching up).
    fn pace(&mut self, rows: usize) {
        let Some(rate) = self.config.max_events_per_second else {
            return;
        };
        let now = Instant::now();
        let turn = self
            .paced
            .filter(|at| *at + Duration::from_secs(1) > now)
            .unwrap_or(now);
        self.paced = Some(turn + Duration::from_secs_f64(rows as f64 / f64::from(rate)));
    }

    /// Asks the broker about topics (a batch's not known yet, or missing
    /// ones whose hold has ended: see [`topics`]); a topic found missing
    /// again has its held rows held longer, one found created has them
    /// released, in the background.
    async fn look_up_topics(&mut self, publisher: &mut Publisher, due: Vec<String>) {
        if due.is_empty() {
            return;
        }
        if self.topics.paused() {
            self.topics
                .unanswered(due, "an earlier lookup got no answer");
            return;
        }
        let due_again = due.clone();
        match publisher.lookup(due, topics::LOOKUP_TIMEOUT).await {
            Ok(answers) => {
                for action in self.topics.record(answers) {
                    let (pool, timeout) = (self.pool.clone(), self.config.statement_timeout);
                    tokio::spawn(async move {
                        if let Err(error) = held::topic_rows(&pool, &action, timeout).await {
                            tracing::debug!(%error, ?action, "updating a topic's held rows failed");
                        }
                    });
                }
            }
            Err(error) => self.topics.unanswered(due_again, &error),
        }
    }

    /// Hands a claimed batch to the producer, holding back rows of keys that
    /// are held (a row of theirs is still locked unpublished) or blocked,
    /// rows of blocked topics and of topics missing on the broker, rows behind a held row of their key (see
    /// [`held`]), and the later rows of these rows' keys in the batch.
    fn send(&mut self, publisher: &mut Publisher, batch: Batch) -> InFlight {
        self.batches += 1;
        let seq = self.batches;
        if batch.cut {
            self.cut = Some(seq);
        }
        let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(batch.rows.len());
        let mut go = Vec::with_capacity(batch.rows.len());
        // Topic and key of the rows withheld so far in this batch.
        let mut withheld: std::collections::HashSet<(&str, &str)> =
            std::collections::HashSet::new();
        for (i, row) in batch.rows.iter().enumerate() {
            let topic_key = (row.topic.as_str(), row.partition_key.as_str());
            if self.held.contains_key(&row.partition_key)
                || self.blocked.deadline(row).is_some()
                || self.topics.held(&row.topic).is_some()
                || row.behind_held_secs.is_some()
                || withheld.contains(&topic_key)
            {
                withheld.insert(topic_key);
                outcomes.push(Some(Outcome::Withheld));
            } else {
                outcomes.push(None);
                go.push(i);
            }
        }
        let span = tracing::info_span!(
            parent: None,
            "outbox.relay.batch",
            batch = seq,
            rows = batch.rows.len(),
            sent = go.len(),
            published = tracing::field::Empty,
            links = tracing::field::Empty,
            links_dropped = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        trace_links::link_events(&span, &batch.rows, &go);
        let pending = span.in_scope(|| publisher.send(&batch.rows, go, &mut outcomes));
        // Rows held back now (here, or by the producer: a full queue, an
        // earlier row of their key refused) keep their keys held.
        for (row, outcome) in batch.rows.iter().zip(&outcomes) {
            if outcome.is_some() {
                self.held.insert(row.partition_key.clone(), seq);
            }
        }
        InFlight {
            seq,
            batch,
            sent_at: Instant::now(),
            outcomes,
            pending,
            span,
        }
    }

    /// Turns the outcomes of a batch into the rows to mark, the failures
    /// to record and the withheld rows to hold (see [`held`]); updates
    /// blocked keys and topics and the counters.
    fn evaluate(&mut self, seq: u64, batch: &Batch, outcomes: Vec<Outcome>) -> Evaluated {
        let mut published = Vec::with_capacity(batch.rows.len());
        let mut failures = Vec::new();
        let mut failed_keys: Vec<String> = Vec::new();
        let mut transient = None;
        let (mut withheld, mut parked) = (0_u64, 0_u64);
        let now = Instant::now();
        let mut withheld_rows = Vec::new();
        // The row of each failure, in the order of `failures`.
        let mut failed_rows = Vec::new();
        let mut failed_deliveries = 0_u64;
        for (row, outcome) in batch.rows.iter().zip(outcomes) {
            let key_failed = failed_keys.contains(&row.partition_key);
            match outcome {
                Outcome::Delivered => {
                    if key_failed {
                        self.stats.order_violations.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            id = row.id,
                            key = %row.partition_key,
                            "event delivered after an earlier event of its key failed"
                        );
                    }
                    published.push(row.id);
                }
                Outcome::Withheld => {
                    withheld += 1;
                    withheld_rows.push(row);
                }
                Outcome::Failed(kind, error) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    failed_deliveries += 1;
                    if !key_failed {
                        failed_keys.push(row.partition_key.clone());
                        let held = self.held.entry(row.partition_key.clone()).or_insert(seq);
                        *held = (*held).max(seq);
                    }
                    match kind {
                        FailureKind::Transient => {
                            transient.get_or_insert(error);
                        }
                        FailureKind::Fatal => {
                            self.producer_unusable = true;
                            transient.get_or_insert(error);
                        }
                        FailureKind::Message => {
                            let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
                            // Only a failure of the row sent alone is surely
                            // its own (a broker refuses a whole batch for one
                            // bad record): a first failure never parks.
                            let park = attempts >= self.config.max_attempts && row.attempts > 0;
                            if park {
                                parked += 1;
                                tracing::error!(
                                    id = row.id, event_id = %row.event_id, attempts, error,
                                    "event parked after repeated failures (requeue with `outbox parked requeue`)"
                                );
                            } else {
                                let delay = backoff::delay(
                                    self.config.retry_backoff,
                                    self.config.retry_backoff_max,
                                    attempts,
                                );
                                self.blocked
                                    .keys
                                    .insert(row.partition_key.clone(), now + delay);
                            }
                            failures.push(Failure {
                                id: row.id,
                                error,
                                counted: true,
                                park,
                                hold: None,
                            });
                            failed_rows.push(row);
                        }
                        FailureKind::Topic => {
                            self.topics.forget(&row.topic);
                            let entry = self
                                .blocked
                                .topics
                                .entry(row.topic.clone())
                                .or_insert((now, 0));
                            if entry.0 <= now {
                                entry.1 += 1;
                                let delay = backoff::delay(
                                    self.config.retry_backoff,
                                    self.config.retry_backoff_max,
                                    entry.1,
                                );
                                entry.0 = now + delay;
                                tracing::error!(topic = %row.topic, error, "cannot publish to topic: holding its events back");
                            }
                            failures.push(Failure {
                                id: row.id,
                                error,
                                counted: true,
                                park: false,
                                hold: None,
                            });
                            failed_rows.push(row);
                        }
                    }
                }
            }
        }
        // Rows of blocked keys and topics, and rows behind a held row of
        // their key, are held until the block ends (rows withheld only
        // because an earlier batch of this relay is still open are not:
        // they are claimed again once it ends).
        let secs = |until: Instant| until.saturating_duration_since(now).as_secs_f64();
        for (failure, row) in failures.iter_mut().zip(failed_rows) {
            if !failure.park {
                failure.hold = self.blocked.deadline(row).map(secs);
            }
        }
        let mut holds = Vec::new();
        for row in withheld_rows {
            let blocked = self.blocked.deadline(row).map(secs);
            let behind = row.behind_held_secs.map(|s| s.max(0.0));
            let missing = self.topics.held(&row.topic);
            let missing_secs = missing.map(|(until, _)| secs(until));
            let Some(hold) = blocked
                .into_iter()
                .chain(behind)
                .chain(missing_secs)
                .reduce(f64::max)
            else {
                continue;
            };
            match missing {
                // The reason goes with the hold (not counted as an attempt).
                Some((_, reason)) => failures.push(Failure {
                    id: row.id,
                    error: reason.to_owned(),
                    counted: false,
                    park: false,
                    hold: Some(hold),
                }),
                None => holds.push((row.id, hold)),
            }
        }
        if transient.is_none() {
            self.broker.up();
        }
        if !published.is_empty() {
            self.stats.failing_over();
        } else if failed_deliveries > 0 {
            self.stats.failed_round();
        }
        self.stats
            .published
            .fetch_add(published.len() as u64, Ordering::Relaxed);
        self.stats.withheld.fetch_add(withheld, Ordering::Relaxed);
        self.stats.parked.fetch_add(parked, Ordering::Relaxed);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        Evaluated {
            published,
            failures,
            holds,
            transient,
        }
    }

    /// Before the producer is replaced, the batch sent through the old one is
    /// settled: its deliveries are awaited and recorded like any other.
    async fn finish_in_flight_before_recreate(&mut self) {
        if let Some(in_flight) = self.in_flight.take() {
            let seq = in_flight.seq;
            let (batch, outcomes) = in_flight.deliveries().await;
            let evaluated = self.evaluate(seq, &batch, outcomes);
            self.finish_marking().await;
            self.marking = Some((seq, tokio::spawn(batch.finish_owned(evaluated))));
        }
        self.producer_unusable = false;
    }

    /// Waits for the previous batch's mark-and-commit. Once its transaction
    /// has ended (committed or rolled back), its rows are unlocked: the keys
    /// it held are released.
    /// Returns whether it released any.
    async fn finish_marking(&mut self) -> bool {
        let mut released = false;
        if let Some((seq, task)) = self.marking.take() {
            let result = task
                .await
                .map_err(|e| Error::Task(e.to_string()))
                .and_then(|r| r);
            if self.cut.is_some_and(|cut| cut <= seq) {
                self.cut = None;
            }
            let before = self.held.len();
            self.held.retain(|_, last| *last > seq);
            released = self.held.len() < before;
            match result {
                Ok(()) => self.database.up(),
                Err(error) => {
                    // The batch's transaction rolled back: its rows stay
                    // unpublished and are sent again (at least once).
                    self.stats.failed_round();
                    self.database.down(&error);
                }
            }
        }
        released
    }

    /// Backs off until the broker answers again.
    async fn wait_for_broker(
        &mut self,
        publisher: &mut Publisher,
        error: &str,
        shutdown: &CancellationToken,
    ) {
        let wait = self.broker.down(&error);
        self.sleep(wait, shutdown).await;
        if shutdown.is_cancelled() {
            return;
        }
        publisher.recover_if_fatal();
        self.probe_answered = publisher.probe(Duration::from_secs(2)).await;
        if self.probe_answered {
            // Deliveries will tell whether it is really back.
            self.broker.up();
        }
    }

    async fn sleep(&self, d: Duration, shutdown: &CancellationToken) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}

/// Returns once `task` has ended (polling: the handle is borrowed).
async fn wait_finished(task: &JoinHandle<()>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a batch's deliveries came to (see [`Loop::evaluate`]).
struct Evaluated {
    published: Vec<i64>,
    failures: Vec<Failure>,
    /// Withheld rows to hold: id, seconds.
    holds: Vec<(i64, f64)>,
    /// The first transient failure.
    transient: Option<String>,
}

impl Batch {
    async fn finish_owned(self, e: Evaluated) -> Result<()> {
        self.finish(&e.published, &e.failures, &e.holds).await
    }
}
