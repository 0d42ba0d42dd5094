//! Applying settings to the relay and consumer builders and to replay
//! options: only what is set changes.

use std::time::Duration;

use super::{ConsumerSettings, KafkaSettings, RelaySettings};
use crate::error::{Error, Result};
use crate::inbox::{ConsumerBuilder, Mode};
use crate::relay::RelayBuilder;
use crate::replay::ReplayOptions;

pub(super) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

impl RelayBuilder {
    /// Applies Kafka settings: the brokers (if set) and every property.
    pub fn kafka(mut self, kafka: &KafkaSettings) -> Self {
        if let Some(brokers) = &kafka.brokers {
            self = self.brokers(brokers.clone());
        }
        for (key, value) in &kafka.properties {
            self = self.kafka_setting(key.clone(), value.clone());
        }
        self
    }

    /// Applies every relay setting that is set; the others keep their
    /// current values.
    pub fn settings(mut self, s: &RelaySettings) -> Self {
        if let Some(n) = s.batch_size {
            self = self.batch_size(n);
        }
        if let Some(n) = s.max_batch_bytes {
            self = self.max_batch_bytes(n);
        }
        if let Some(n) = s.poll_interval_ms {
            self = self.poll_interval(ms(n));
        }
        if let Some(on) = s.listen {
            self = self.listen(on);
        }
        if let Some(n) = s.max_attempts {
            self = self.max_attempts(n);
        }
        if let Some(n) = s.delivery_timeout_ms {
            self = self.delivery_timeout(ms(n));
        }
        if let Some(n) = s.lanes {
            self = self.lanes(n);
        }
        if s.retry_backoff_ms.is_some() || s.retry_backoff_max_ms.is_some() {
            let (first, max) = (
                self.current().retry_backoff,
                self.current().retry_backoff_max,
            );
            self = self.retry_backoff(
                s.retry_backoff_ms.map_or(first, ms),
                s.retry_backoff_max_ms.map_or(max, ms),
            );
        }
        if s.outage_backoff_ms.is_some() || s.outage_backoff_max_ms.is_some() {
            let (first, max) = (
                self.current().outage_backoff,
                self.current().outage_backoff_max,
            );
            self = self.outage_backoff(
                s.outage_backoff_ms.map_or(first, ms),
                s.outage_backoff_max_ms.map_or(max, ms),
            );
        }
        if s.missing_topic_hold_ms.is_some() || s.missing_topic_hold_max_ms.is_some() {
            let (first, max) = (
                self.current().missing_topic_hold,
                self.current().missing_topic_hold_max,
            );
            self = self.missing_topic_hold(
                s.missing_topic_hold_ms.map_or(first, ms),
                s.missing_topic_hold_max_ms.map_or(max, ms),
            );
        }
        if let Some(n) = s.statement_timeout_ms {
            self = self.statement_timeout(ms(n));
        }
        if let Some(n) = s.lane_timeout_ms {
            self = self.lane_timeout(ms(n));
        }
        if let Some(n) = s.max_events_per_second {
            self = self.max_events_per_second(Some(n));
        }
        if s.cloud_events.is_some() || s.cloud_events_source.is_some() {
            let current = &self.current().cloud_events;
            let mode = s.cloud_events.unwrap_or(current.mode);
            let source = s
                .cloud_events_source
                .clone()
                .unwrap_or_else(|| current.source.clone());
            self = self.cloud_events(mode, source);
        }
        self
    }
}

impl ConsumerBuilder {
    /// Applies Kafka settings: the brokers (if set) and every property.
    pub fn kafka(mut self, kafka: &KafkaSettings) -> Self {
        if let Some(brokers) = &kafka.brokers {
            self = self.brokers(brokers.clone());
        }
        for (key, value) in &kafka.properties {
            self = self.kafka_setting(key.clone(), value.clone());
        }
        self
    }

    /// Applies every consumer setting that is set; the others keep their
    /// current values. An unknown mode is an error.
    pub fn settings(mut self, s: &ConsumerSettings) -> Result<Self> {
        if let Some(group) = &s.group {
            self = self.group(group.clone());
        }
        if let Some(mode) = &s.mode {
            self = self.mode(match mode.as_str() {
                "dedup" => Mode::Dedup,
                "inbox" => Mode::Inbox,
                other => {
                    return Err(Error::Config(format!(
                        "consumer mode must be dedup or inbox, got `{other}`"
                    )));
                }
            });
        }
        if let Some(n) = s.batch_size {
            self = self.batch_size(n);
        }
        if let Some(n) = s.max_batch_bytes {
            self = self.max_batch_bytes(n);
        }
        if let Some(n) = s.batch_linger_ms {
            self = self.batch_linger(ms(n));
        }
        if let Some(n) = s.max_attempts {
            self = self.max_attempts(n);
        }
        if s.retry_backoff_ms.is_some() || s.retry_backoff_max_ms.is_some() {
            let (first, max) = (
                self.current().retry_backoff,
                self.current().retry_backoff_max,
            );
            self = self.retry_backoff(
                s.retry_backoff_ms.map_or(first, ms),
                s.retry_backoff_max_ms.map_or(max, ms),
            );
        }
        if s.outage_backoff_ms.is_some() || s.outage_backoff_max_ms.is_some() {
            let (first, max) = (
                self.current().outage_backoff,
                self.current().outage_backoff_max,
            );
            self = self.outage_backoff(
                s.outage_backoff_ms.map_or(first, ms),
                s.outage_backoff_max_ms.map_or(max, ms),
            );
        }
        if let Some(n) = s.handler_timeout_ms {
            self = self.handler_timeout(ms(n));
        }
        if let Some(n) = s.max_payload_bytes {
            self = self.max_payload_bytes(n);
        }
        if let Some(n) = s.redrive_interval_ms {
            self = self.redrive_interval(ms(n));
        }
        if let Some(n) = s.writers {
            self = self.writers(n);
        }
        if let Some(n) = s.processors {
            self = self.processors(n);
        }
        if let Some(n) = s.processor_batch_size {
            self = self.processor_batch_size(n);
        }
        if let Some(n) = s.processor_poll_interval_ms {
            self = self.processor_poll_interval(ms(n));
        }
        if let Some(n) = s.stall_timeout_ms {
            self = self.stall_timeout(ms(n));
        }
        if let Some(n) = s.saga_stuck_after_ms {
            self = self.saga_stuck_after(ms(n));
        }
        if let Some(n) = s.memory_retries_ms.filter(|n| *n > 0) {
            self = self.memory_retries(ms(n));
        }
        if let Some(n) = s.memory_retries_max_events {
            self = self.memory_retries_max_events(n);
        }
        if let Some(on) = s.recheck_offset_gaps {
            self = self.recheck_offset_gaps(on);
        }
        Ok(self)
    }
}

impl ReplayOptions {
    /// Applies Kafka settings: the brokers (if set) and every property.
    pub fn kafka(mut self, kafka: &KafkaSettings) -> Self {
        if let Some(brokers) = &kafka.brokers {
            self.brokers = brokers.clone();
        }
        self.kafka_settings.extend(kafka.pairs());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Settings;

    #[tokio::test]
    async fn builders_take_the_settings_that_are_set() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://u@127.0.0.1:1/d")
            .unwrap();
        let s = Settings::from_vars([
            ("KAFKA_BROKERS", "k:1"),
            ("OUTBOX_KAFKA_CLIENT_ID", "c"),
            ("OUTBOX_RELAY_BATCH_SIZE", "10"),
            ("OUTBOX_RELAY_RETRY_BACKOFF_MAX_MS", "7000"),
            ("OUTBOX_RELAY_STATEMENT_TIMEOUT_MS", "1500"),
            ("OUTBOX_RELAY_MAX_BATCH_BYTES", "65536"),
            ("OUTBOX_RELAY_MISSING_TOPIC_HOLD_MS", "2000"),
            ("OUTBOX_RELAY_MAX_EVENTS_PER_SECOND", "5000"),
            ("OUTBOX_CONSUMER_MAX_BATCH_BYTES", "4096"),
            ("OUTBOX_CONSUMER_GROUP", "g"),
            ("OUTBOX_CONSUMER_MODE", "inbox"),
            ("OUTBOX_CONSUMER_OUTAGE_BACKOFF_MS", "300"),
            ("OUTBOX_CONSUMER_MEMORY_RETRIES_MS", "800"),
            ("OUTBOX_CONSUMER_MEMORY_RETRIES_MAX_EVENTS", "50000"),
        ])
        .unwrap();
        let relay = crate::Relay::builder(pool.clone())
            .retry_backoff(ms(40), ms(50))
            .kafka(&s.kafka)
            .settings(&s.relay);
        let r = relay.current();
        assert_eq!((r.brokers.as_str(), r.batch_size), ("k:1", 10));
        assert_eq!(r.kafka_settings, vec![("client.id".into(), "c".into())]);
        // Only the maximum was set: the first delay stays as it was.
        assert_eq!((r.retry_backoff, r.retry_backoff_max), (ms(40), ms(7000)));
        assert_eq!(r.statement_timeout, ms(1500));
        assert_eq!(r.max_batch_bytes, 65536);
        assert_eq!(r.lanes, 16, "unset: the default");
        assert_eq!(
            (r.missing_topic_hold, r.missing_topic_hold_max),
            (ms(2000), Duration::from_secs(30))
        );
        assert_eq!(r.max_events_per_second, Some(5000));
        let consumer = crate::Consumer::builder(pool)
            .kafka(&s.kafka)
            .settings(&s.consumer)
            .unwrap();
        let c = consumer.current();
        assert_eq!((c.group.as_str(), c.mode), ("g", Mode::Inbox));
        assert_eq!(c.max_batch_bytes, 4096);
        assert_eq!(
            (c.outage_backoff, c.outage_backoff_max),
            (ms(300), Duration::from_secs(5))
        );
        assert_eq!(c.memory_retries, Some(ms(800)));
        assert_eq!(c.memory_retries_max_events, 50_000);
        let bad = ConsumerSettings {
            mode: Some("fast".into()),
            ..ConsumerSettings::default()
        };
        let error = crate::Consumer::builder(
            sqlx::postgres::PgPoolOptions::new()
                .connect_lazy("postgres://u@127.0.0.1:1/d")
                .unwrap(),
        )
        .settings(&bad)
        .unwrap_err();
        assert!(error.to_string().contains("dedup or inbox"), "{error}");
    }
}
