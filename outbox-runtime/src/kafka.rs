//! Kafka client configuration shared by the relay, the consumers, replay
//! and topic creation: `key=value` passthrough of librdkafka settings, which
//! settings are secret, their redaction in logs and `Debug`, creating
//! clients without echoing secrets in errors, the message header names, and
//! topic creation.

use std::fmt;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::FromClientConfigAndContext;
use rdkafka::error::KafkaError;
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

/// True for settings whose values must never be logged or printed: every
/// property librdkafka itself marks sensitive (`sasl.username`,
/// `sasl.password`, `sasl.oauthbearer.config`,
/// `sasl.oauthbearer.client.secret`, `ssl.key.password`, `ssl.key.pem`,
/// `ssl.keystore.password`, the OIDC assertion's private key and
/// passphrase, ...), and any other whose name says password, secret, token,
/// passphrase, private key, PEM or JAAS.
pub fn is_secret(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    const EXACT: &[&str] = &["sasl.username", "sasl.oauthbearer.config", "ssl_key"];
    const PARTS: &[&str] = &[
        "password",
        "secret",
        "token",
        "passphrase",
        "private",
        ".pem",
        "jaas",
        "credential",
    ];
    EXACT.contains(&key.as_str()) || PARTS.iter().any(|s| key.contains(s))
}

/// The text shown instead of a secret value.
pub const REDACTED: &str = "***";

/// `key=value` pairs for logging, secrets replaced by `***`.
pub fn redacted(settings: &[(String, String)]) -> Vec<String> {
    settings
        .iter()
        .map(|(k, v)| {
            if is_secret(k) {
                format!("{k}={REDACTED}")
            } else {
                format!("{k}={v}")
            }
        })
        .collect()
}

/// Formats librdkafka settings for `Debug` with secret values redacted:
/// `{"linger.ms": "5", "sasl.password": "***"}`.
pub struct Redacted<'a>(pub &'a [(String, String)]);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| {
                let shown = if is_secret(k) { REDACTED } else { v.as_str() };
                (k, shown)
            }))
            .finish()
    }
}

/// Replaces every secret value of `config` found in `text` by `***`.
pub(crate) fn scrub(text: &str, config: &ClientConfig) -> String {
    let mut secrets: Vec<&str> = config
        .config_map()
        .into_iter()
        .filter(|(k, v)| is_secret(k) && !v.is_empty())
        .map(|(_, v)| v)
        .collect();
    // Longest first, so that a secret containing another is replaced whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_owned();
    for secret in secrets {
        out = out.replace(secret, REDACTED);
    }
    out
}

/// The same error with the rejected value of a secret setting redacted
/// (librdkafka's configuration errors echo the value they reject, in the
/// value and in the description).
pub(crate) fn scrub_error(error: KafkaError) -> KafkaError {
    match error {
        KafkaError::ClientConfig(code, description, key, value) if is_secret(&key) => {
            let description = if value.is_empty() {
                description
            } else {
                description.replace(&value, REDACTED)
            };
            KafkaError::ClientConfig(code, description, key, REDACTED.into())
        }
        other => other,
    }
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

/// Creates a Kafka client from `config`. A failure is a configuration
/// error whose text never contains a secret value of `config`.
pub(crate) fn create<T>(config: &ClientConfig) -> Result<T>
where
    T: rdkafka::config::FromClientConfig,
{
    config
        .create()
        .map_err(|error| creation_error(&scrub_error(error), config))
}

/// Like [`create`], with a client context.
pub(crate) fn create_with_context<C, T>(config: &ClientConfig, context: C) -> Result<T>
where
    C: ClientContext,
    T: FromClientConfigAndContext<C>,
{
    config
        .create_with_context(context)
        .map_err(|error| creation_error(&scrub_error(error), config))
}

fn creation_error(error: &KafkaError, config: &ClientConfig) -> Error {
    Error::Config(format!(
        "cannot create the Kafka client: {}",
        scrub(&error.to_string(), config)
    ))
}

/// A client context that keeps the client's first distinct errors (and
/// logs as the default context does).
#[derive(Default)]
struct LastError(std::sync::Mutex<Vec<String>>);

impl LastError {
    /// The errors reported, the first ones first.
    fn last(&self) -> Option<String> {
        let errors = self.0.lock().ok()?;
        (!errors.is_empty()).then(|| errors.join("; "))
    }

    fn keep(&self, reason: &str) {
        if let Ok(mut errors) = self.0.lock()
            && errors.len() < 3
            && !errors.iter().any(|e| e == reason)
        {
            errors.push(reason.to_owned());
        }
    }
}

impl rdkafka::producer::ProducerContext for LastError {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

impl ClientContext for LastError {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        match level {
            L::Emerg | L::Alert | L::Critical | L::Error => {
                tracing::error!(target: "librdkafka", "{fac} {message}");
                self.keep(message);
            }
            L::Warning => tracing::warn!(target: "librdkafka", "{fac} {message}"),
            L::Notice | L::Info => tracing::info!(target: "librdkafka", "{fac} {message}"),
            L::Debug => tracing::debug!(target: "librdkafka", "{fac} {message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", %error, reason, "Kafka client error");
        self.keep(reason);
    }
}

/// What goes wrong when a client with `config` asks the brokers for
/// metadata: librdkafka's last error, if it reports one within a few
/// seconds. (An admin client never hands its log and error events over.)
fn last_client_error(config: &ClientConfig) -> Option<String> {
    use rdkafka::producer::{BaseProducer, Producer};
    let producer: BaseProducer<LastError> =
        create_with_context(config, LastError::default()).ok()?;
    let _ = producer
        .client()
        .fetch_metadata(None, Duration::from_secs(3));
    // Hands the queued log and error events to the context.
    producer.poll(Duration::from_millis(100));
    producer.context().last()
}

/// Creates the topics that do not exist yet; existing ones are left alone.
/// When no broker answers in time (the admin request's timeout is
/// librdkafka's `socket.timeout.ms`), the error carries the client's last
/// error, e.g. a refused certificate.
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
    let mut config = client_config(brokers, overrides);
    // Errors reach the context even when nothing has set up `log` logging
    // (rdkafka derives librdkafka's log level from it).
    if (config.log_level as i32) < (rdkafka::config::RDKafkaLogLevel::Error as i32) {
        config.set_log_level(rdkafka::config::RDKafkaLogLevel::Error);
    }
    let admin: AdminClient<DefaultClientContext> = create(&config)?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = match admin.create_topics(&new, &options).await {
        Ok(results) => results,
        Err(KafkaError::AdminOp(RDKafkaErrorCode::OperationTimedOut)) => {
            // No broker answered: say why, as librdkafka tells it (a
            // refused TLS certificate, a failed login, ...).
            let probe = config.clone();
            let last = tokio::task::spawn_blocking(move || last_client_error(&probe))
                .await
                .ok()
                .flatten()
                .unwrap_or_else(|| "none reported".into());
            return Err(Error::TopicCreation {
                topic: topics.join(", "),
                reason: format!(
                    "no answer from the brokers ({brokers}) in time; what the client reported: {}",
                    scrub(&last, &config)
                ),
            });
        }
        Err(error) => return Err(error.into()),
    };
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
