//! Kafka client configuration shared by the relay and the consumers: the
//! relay's producer settings, `-X key=value` passthrough, secret redaction for
//! logs, the message header names, and topic creation.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use crate::error::{Error, Result};

/// Default bootstrap servers when none are configured.
pub const DEFAULT_BROKERS: &str = "127.0.0.1:9092";

/// Kafka header names the relay writes and the consumers read.
pub mod header {
    /// The event's unique id (UUID).
    pub const EVENT_ID: &str = "event_id";
    /// The event type name.
    pub const EVENT_TYPE: &str = "event_type";
    /// The schema version of the event type.
    pub const EVENT_VERSION: &str = "event_version";
    /// The aggregate type.
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    /// The aggregate instance id.
    pub const AGGREGATE_ID: &str = "aggregate_id";
    /// The payload's media type (`application/json`).
    pub const CONTENT_TYPE: &str = "content-type";
    /// The media type of every payload the relay sends.
    pub const JSON: &str = "application/json";
}

/// Parses a `key=value` librdkafka setting (the CLI's `-X`).
pub fn parse_setting(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(Error::Config(format!(
            "librdkafka setting `{s}` is not of the form key=value"
        ))),
    }
}

/// True for settings whose values must never be logged.
pub fn is_secret(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "token",
        "key.pem",
        "certificate.pem",
        "jaas",
    ]
    .iter()
    .any(|s| key.contains(s))
}

/// `key=value` pairs for logging, secrets replaced by `***`.
pub fn redacted(settings: &[(String, String)]) -> Vec<String> {
    settings
        .iter()
        .map(|(k, v)| {
            if is_secret(k) {
                format!("{k}=***")
            } else {
                format!("{k}={v}")
            }
        })
        .collect()
}

/// A librdkafka configuration for `brokers` plus `overrides`.
pub(crate) fn client_config(brokers: &str, overrides: &[(String, String)]) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (key, value) in overrides {
        config.set(key, value);
    }
    config
}

/// Creates the topics that do not exist yet; existing ones are left alone.
pub async fn create_topics(
    brokers: &str,
    overrides: &[(String, String)],
    topics: &[String],
    partitions: i32,
    replication: i32,
) -> Result<Vec<(String, bool)>> {
    if partitions < 1 {
        return Err(Error::Config(format!(
            "partitions must be >= 1, got {partitions}"
        )));
    }
    if replication < 1 {
        return Err(Error::Config(format!(
            "replication must be >= 1, got {replication}"
        )));
    }
    let admin: AdminClient<DefaultClientContext> = client_config(brokers, overrides).create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin.create_topics(&new, &options).await?;
    let mut out = Vec::new();
    for result in results {
        match result {
            Ok(topic) => out.push((topic, true)),
            Err((topic, RDKafkaErrorCode::TopicAlreadyExists)) => out.push((topic, false)),
            Err((topic, code)) => {
                return Err(Error::TopicCreation {
                    topic,
                    reason: code.to_string(),
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_secrets_are_redacted() {
        assert_eq!(
            parse_setting("sasl.password=a=b").unwrap(),
            ("sasl.password".into(), "a=b".into())
        );
        assert!(parse_setting("novalue").is_err());
        assert!(parse_setting("=x").is_err());
        let shown = redacted(&[
            ("sasl.password".into(), "hunter2".into()),
            ("ssl.key.pem".into(), "-----BEGIN".into()),
            ("linger.ms".into(), "5".into()),
        ]);
        assert_eq!(
            shown,
            vec!["sasl.password=***", "ssl.key.pem=***", "linger.ms=5"]
        );
    }
}
