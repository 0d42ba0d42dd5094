//! The relay's and a consumer's settings, each optional.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::cloudevents::CloudEventsMode;

/// Relay settings, each optional (unset: the builder's default). Section
/// `[relay]`; environment `OUTBOX_RELAY_<FIELD>`; flags of `outbox relay`
/// with the same names (`--batch-size`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RelaySettings {
    /// Rows per batch (default 2000).
    pub batch_size: Option<usize>,
    /// Bytes per batch: payloads, headers and keys (default 16 MiB).
    pub max_batch_bytes: Option<usize>,
    /// Poll interval when no NOTIFY arrives (default 500 ms).
    pub poll_interval_ms: Option<u64>,
    /// LISTEN for the commit-time NOTIFY (default true).
    pub listen: Option<bool>,
    /// Message-level failures before a row is parked (default 5).
    pub max_attempts: Option<u32>,
    /// librdkafka `message.timeout.ms` (default 30000).
    pub delivery_timeout_ms: Option<u64>,
    /// Lanes (default 16; 0: off).
    pub lanes: Option<u16>,
    /// First retry delay of a failing key or topic (default 250 ms).
    pub retry_backoff_ms: Option<u64>,
    /// Cap of that delay (default 30 s).
    pub retry_backoff_max_ms: Option<u64>,
    /// First hold of a topic missing on the broker (default 5 s).
    pub missing_topic_hold_ms: Option<u64>,
    /// Cap of that hold (default 30 s).
    pub missing_topic_hold_max_ms: Option<u64>,
    /// First back-off in a broker or database outage (default 100 ms).
    pub outage_backoff_ms: Option<u64>,
    /// Cap of that back-off (default 5 s).
    pub outage_backoff_max_ms: Option<u64>,
    /// `statement_timeout` of the relay's SQL (default 30 s).
    pub statement_timeout_ms: Option<u64>,
    /// How long a relay that stops answering keeps its lanes (default 10 s).
    pub lane_timeout_ms: Option<u64>,
    /// Most events per second the relay claims (default: no limit).
    pub max_events_per_second: Option<u32>,
    /// Where `outbox relay` serves Prometheus metrics (the builder does not
    /// use it: call [`crate::metrics::serve`]).
    pub metrics_addr: Option<SocketAddr>,
    /// CloudEvents headers: `off` (default), `both` (beside the framework's
    /// own) or `only` (instead of them). See [`crate::cloudevents`].
    pub cloud_events: Option<CloudEventsMode>,
    /// The `ce_source` of the events (default `/outbox`).
    pub cloud_events_source: Option<String>,
}

impl RelaySettings {
    /// These settings with `higher`'s on top.
    pub fn overlay(self, higher: RelaySettings) -> RelaySettings {
        RelaySettings {
            batch_size: higher.batch_size.or(self.batch_size),
            max_batch_bytes: higher.max_batch_bytes.or(self.max_batch_bytes),
            poll_interval_ms: higher.poll_interval_ms.or(self.poll_interval_ms),
            listen: higher.listen.or(self.listen),
            max_attempts: higher.max_attempts.or(self.max_attempts),
            delivery_timeout_ms: higher.delivery_timeout_ms.or(self.delivery_timeout_ms),
            lanes: higher.lanes.or(self.lanes),
            retry_backoff_ms: higher.retry_backoff_ms.or(self.retry_backoff_ms),
            retry_backoff_max_ms: higher.retry_backoff_max_ms.or(self.retry_backoff_max_ms),
            missing_topic_hold_ms: higher.missing_topic_hold_ms.or(self.missing_topic_hold_ms),
            missing_topic_hold_max_ms: higher
                .missing_topic_hold_max_ms
                .or(self.missing_topic_hold_max_ms),
            outage_backoff_ms: higher.outage_backoff_ms.or(self.outage_backoff_ms),
            outage_backoff_max_ms: higher.outage_backoff_max_ms.or(self.outage_backoff_max_ms),
            statement_timeout_ms: higher.statement_timeout_ms.or(self.statement_timeout_ms),
            lane_timeout_ms: higher.lane_timeout_ms.or(self.lane_timeout_ms),
            max_events_per_second: higher.max_events_per_second.or(self.max_events_per_second),
            metrics_addr: higher.metrics_addr.or(self.metrics_addr),
            cloud_events: higher.cloud_events.or(self.cloud_events),
            cloud_events_source: higher.cloud_events_source.or(self.cloud_events_source),
        }
    }
}

/// Consumer settings, each optional (unset: the builder's default). Section
/// `[consumer]`; environment `OUTBOX_CONSUMER_<FIELD>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ConsumerSettings {
    /// The consumer group.
    pub group: Option<String>,
    /// `dedup` (default) or `inbox`.
    pub mode: Option<String>,
    /// Most messages per batch (default 1000).
    pub batch_size: Option<usize>,
    /// Most bytes per batch: keys, headers and payloads (default 16 MiB).
    pub max_batch_bytes: Option<usize>,
    /// How long a batch may wait to fill (default 5 ms).
    pub batch_linger_ms: Option<u64>,
    /// Handler attempts before a dead letter (default 5).
    pub max_attempts: Option<u32>,
    /// First retry delay of a failing handler (default 100 ms).
    pub retry_backoff_ms: Option<u64>,
    /// Cap of that delay (default 10 s).
    pub retry_backoff_max_ms: Option<u64>,
    /// First back-off in a database outage (default 100 ms).
    pub outage_backoff_ms: Option<u64>,
    /// Cap of that back-off (default 5 s).
    pub outage_backoff_max_ms: Option<u64>,
    /// A handler call taking longer fails its event; also the handlers'
    /// `statement_timeout` (default 30 s).
    pub handler_timeout_ms: Option<u64>,
    /// Larger messages (key, headers and payload) are dead-lettered
    /// (default 1 MiB).
    pub max_payload_bytes: Option<usize>,
    /// How often dead letters marked for retry are picked up (default 5 s).
    pub redrive_interval_ms: Option<u64>,
    /// Inbox mode: storing connections (default 2).
    pub writers: Option<usize>,
    /// Inbox mode: processor tasks (default 1).
    pub processors: Option<usize>,
    /// Inbox mode: rows per processor transaction (default 500).
    pub processor_batch_size: Option<usize>,
    /// Inbox mode: idle processor poll interval (default 500 ms).
    pub processor_poll_interval_ms: Option<u64>,
    /// Receiving nothing this long with messages to read: stalled (default
    /// 60 s).
    pub stall_timeout_ms: Option<u64>,
    /// A running saga instance without a step for this long, and no
    /// timeout still to come, is stuck (default 1 h).
    pub saga_stuck_after_ms: Option<u64>,
    /// Dedup mode: retry a failing event from memory while its next
    /// attempt is due within this many ms (default: off).
    pub memory_retries_ms: Option<u64>,
    /// With `memory_retries_ms`: most events waiting in memory at once
    /// (default 10,000).
    pub memory_retries_max_events: Option<usize>,
    /// Read a partition again from the expected offset when a message
    /// arrives past it, once per gap (default true).
    pub recheck_offset_gaps: Option<bool>,
}

impl ConsumerSettings {
    /// These settings with `higher`'s on top.
    pub fn overlay(self, higher: ConsumerSettings) -> ConsumerSettings {
        ConsumerSettings {
            group: higher.group.or(self.group),
            mode: higher.mode.or(self.mode),
            batch_size: higher.batch_size.or(self.batch_size),
            max_batch_bytes: higher.max_batch_bytes.or(self.max_batch_bytes),
            batch_linger_ms: higher.batch_linger_ms.or(self.batch_linger_ms),
            max_attempts: higher.max_attempts.or(self.max_attempts),
            retry_backoff_ms: higher.retry_backoff_ms.or(self.retry_backoff_ms),
            retry_backoff_max_ms: higher.retry_backoff_max_ms.or(self.retry_backoff_max_ms),
            outage_backoff_ms: higher.outage_backoff_ms.or(self.outage_backoff_ms),
            outage_backoff_max_ms: higher.outage_backoff_max_ms.or(self.outage_backoff_max_ms),
            handler_timeout_ms: higher.handler_timeout_ms.or(self.handler_timeout_ms),
            max_payload_bytes: higher.max_payload_bytes.or(self.max_payload_bytes),
            redrive_interval_ms: higher.redrive_interval_ms.or(self.redrive_interval_ms),
            writers: higher.writers.or(self.writers),
            processors: higher.processors.or(self.processors),
            processor_batch_size: higher.processor_batch_size.or(self.processor_batch_size),
            processor_poll_interval_ms: higher
                .processor_poll_interval_ms
                .or(self.processor_poll_interval_ms),
            stall_timeout_ms: higher.stall_timeout_ms.or(self.stall_timeout_ms),
            saga_stuck_after_ms: higher.saga_stuck_after_ms.or(self.saga_stuck_after_ms),
            memory_retries_ms: higher.memory_retries_ms.or(self.memory_retries_ms),
            memory_retries_max_events: higher
                .memory_retries_max_events
                .or(self.memory_retries_max_events),
            recheck_offset_gaps: higher.recheck_offset_gaps.or(self.recheck_offset_gaps),
        }
    }
}
