//! A relay's settings ([`RelayConfig`]), their checks, and its builder.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::lanes;
use super::{Relay, RelayHandle};
use crate::cloudevents::{CloudEvents, CloudEventsMode};
use crate::error::{Error, Result};
use crate::kafka;

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
    /// it (see `topics`). Each hold is stretched by a
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
    /// `lanes`): the count must divide 64 (1, 2, 4, 8, 16, 32
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
    pub(super) fn validate(&self) -> Result<()> {
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

    pub(super) fn producer_config(&self) -> rdkafka::ClientConfig {
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
    pub(super) pool: PgPool,
    pub(super) config: RelayConfig,
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
