//! The Kafka client settings: bootstrap servers and librdkafka properties,
//! from a file (quoted or dotted keys) or the environment.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use super::Settings;
use crate::error::Result;
use crate::kafka;

/// Kafka client settings: the bootstrap servers and librdkafka properties
/// (TLS, SASL, tuning), shared by the relay, the consumers, replay and topic
/// creation. In a file, `[kafka]` takes `brokers` and properties by name,
/// quoted or as dotted keys: `"sasl.password" = "…"` or `sasl.password =
/// "…"`; numbers and booleans are passed as text. `bootstrap.servers` is
/// the same as `brokers`. `Debug` redacts secret values
/// ([`kafka::is_secret`]).
#[derive(Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaSettings {
    /// Bootstrap servers (default `127.0.0.1:9092`).
    pub brokers: Option<String>,
    /// librdkafka properties by name.
    pub properties: BTreeMap<String, String>,
}

impl fmt::Debug for KafkaSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties: Vec<(String, String)> = self
            .properties
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        f.debug_struct("KafkaSettings")
            .field("brokers", &self.brokers)
            .field("properties", &kafka::Redacted(&properties))
            .finish()
    }
}

impl KafkaSettings {
    /// Reads `KAFKA_BROKERS` and `OUTBOX_KAFKA_*` from the environment.
    pub fn from_env() -> Result<Self> {
        Ok(Settings::from_env()?.kafka)
    }

    /// Sets a librdkafka property (`bootstrap.servers` sets the brokers).
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        let key = key.into().trim().to_owned();
        if key == "bootstrap.servers" {
            self.brokers = Some(value.into());
        } else {
            self.properties.insert(key, value.into());
        }
        self
    }

    /// A property's value.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.properties.get(key).map(String::as_str)
    }

    /// The bootstrap servers, or the default `127.0.0.1:9092`.
    pub fn brokers(&self) -> &str {
        self.brokers.as_deref().unwrap_or(kafka::DEFAULT_BROKERS)
    }

    /// The properties as `(key, value)` pairs, for
    /// [`kafka::create_topics`] and [`ReplayOptions::kafka_settings`](crate::replay::ReplayOptions::kafka_settings).
    pub fn pairs(&self) -> Vec<(String, String)> {
        self.properties
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// These settings with `higher`'s on top, property by property.
    pub fn overlay(mut self, higher: KafkaSettings) -> KafkaSettings {
        if higher.brokers.is_some() {
            self.brokers = higher.brokers;
        }
        self.properties.extend(higher.properties);
        self
    }
}

impl<'de> Deserialize<'de> for KafkaSettings {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let table = BTreeMap::<String, serde_json::Value>::deserialize(deserializer)?;
        let mut settings = KafkaSettings::default();
        let mut flat = Vec::new();
        for (key, value) in table {
            flatten(key, value, &mut flat).map_err(D::Error::custom)?;
        }
        for (key, value) in flat {
            if key == "brokers" {
                settings.brokers = Some(value);
            } else {
                settings.set(key, value);
            }
        }
        Ok(settings)
    }
}

/// `{sasl: {password: "x"}}` (TOML's dotted keys) → `sasl.password = "x"`.
fn flatten(
    key: String,
    value: serde_json::Value,
    out: &mut Vec<(String, String)>,
) -> std::result::Result<(), String> {
    use serde_json::Value;
    match value {
        Value::String(s) => out.push((key, s)),
        Value::Number(n) => out.push((key, n.to_string())),
        Value::Bool(b) => out.push((key, b.to_string())),
        Value::Object(table) => {
            for (k, v) in table {
                flatten(format!("{key}.{k}"), v, out)?;
            }
        }
        Value::Null | Value::Array(_) => {
            return Err(format!(
                "kafka setting `{key}`: expected a string, number or boolean"
            ));
        }
    }
    Ok(())
}
