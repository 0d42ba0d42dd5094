//! Settings from the environment and from configuration files, so that
//! secrets stay off command lines: the database URL, the Kafka client
//! (bootstrap servers and any librdkafka property), the relay and the
//! consumer. Every type here deserializes with serde (TOML, JSON, ...) and
//! reads the environment; [`Settings::overlay`] layers one source over
//! another (the `outbox` command: flags over environment over file over
//! defaults). `Debug` never shows a secret.
//!
//! The environment:
//!
//! | variable | setting |
//! |---|---|
//! | `DATABASE_URL` | [`DatabaseSettings::url`] |
//! | `OUTBOX_DATABASE_<SETTING>` | [`DatabaseSettings`] field (`OUTBOX_DATABASE_CONNECT_TIMEOUT_MS`) |
//! | `KAFKA_BROKERS` | [`KafkaSettings::brokers`] |
//! | `OUTBOX_KAFKA_<PROPERTY>` | librdkafka property `<property>`: lower case, `_` → `.`, `__` → `_` (`OUTBOX_KAFKA_SASL_PASSWORD` → `sasl.password`) |
//! | `OUTBOX_RELAY_<SETTING>` | [`RelaySettings`] field (`OUTBOX_RELAY_BATCH_SIZE`); `OUTBOX_LANES` = `OUTBOX_RELAY_LANES` |
//! | `OUTBOX_CONSUMER_<SETTING>` | [`ConsumerSettings`] field (`OUTBOX_CONSUMER_GROUP`) |
//!
//! The database password can also come from `PGPASSWORD` or a `.pgpass`
//! file (sqlx reads both when the URL has none), TLS files from
//! `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_runtime::settings::Settings;
//! // e.g. from outbox.toml: [kafka] "security.protocol" = "SASL_SSL" ...
//! let file: Settings = serde_json::from_str(r#"{ "kafka": { "security.protocol": "SSL" } }"#)?;
//! let settings = file.overlay(Settings::from_env()?);   // the environment wins
//! assert_eq!(settings.kafka.get("security.protocol"), Some("SSL"));
//! # Ok(()) }
//! ```
//!
//! Files: `database.rs` ([`DatabaseSettings`], TLS modes, URL redaction),
//! `kafka.rs` ([`KafkaSettings`]), `sections.rs` ([`RelaySettings`],
//! [`ConsumerSettings`]), `apply.rs` (the builders' `kafka` and `settings`).

mod apply;
mod database;
mod kafka;
mod sections;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use self::database::{DEFAULT_CONNECT_TIMEOUT, DatabaseSettings, redact_url};
pub use self::kafka::KafkaSettings;
pub use self::sections::{ConsumerSettings, RelaySettings};
use crate::error::{Error, Result};

/// The prefix of librdkafka properties in the environment.
pub const KAFKA_ENV_PREFIX: &str = "OUTBOX_KAFKA_";
/// The prefix of relay settings in the environment.
pub const RELAY_ENV_PREFIX: &str = "OUTBOX_RELAY_";
/// The prefix of consumer settings in the environment.
pub const CONSUMER_ENV_PREFIX: &str = "OUTBOX_CONSUMER_";
/// The prefix of database settings in the environment (besides
/// `DATABASE_URL`).
pub const DATABASE_ENV_PREFIX: &str = "OUTBOX_DATABASE_";

/// Everything the outbox's processes are configured with. Sections of a
/// configuration file: `[database]`, `[kafka]`, `[relay]`, `[consumer]`.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Settings {
    /// The database.
    pub database: DatabaseSettings,
    /// The Kafka clients (relay, consumers, replay, topic creation).
    pub kafka: KafkaSettings,
    /// The relay.
    pub relay: RelaySettings,
    /// A consumer.
    pub consumer: ConsumerSettings,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("database", &self.database)
            .field("kafka", &self.kafka)
            .field("relay", &self.relay)
            .field("consumer", &self.consumer)
            .finish()
    }
}

impl Settings {
    /// Reads the process environment (see the module docs). Unknown
    /// `OUTBOX_RELAY_*`, `OUTBOX_CONSUMER_*` and `OUTBOX_DATABASE_*`
    /// variables and unreadable values are errors that name the variable.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars_os().filter_map(|(k, v)| {
            // Variables that are not Unicode cannot be ours.
            Some((k.into_string().ok()?, v.into_string().ok()?))
        }))
    }

    /// Like [`Settings::from_env`], from the given variables.
    pub fn from_vars<I, K, V>(vars: I) -> Result<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut settings = Settings::default();
        let mut relay = BTreeMap::new();
        let mut consumer = BTreeMap::new();
        let mut database = BTreeMap::new();
        for (key, value) in vars {
            let (key, value) = (key.as_ref().to_owned(), value.as_ref().to_owned());
            if key == "DATABASE_URL" {
                settings.database.url = Some(value);
            } else if key == "KAFKA_BROKERS" {
                settings.kafka.brokers = Some(value);
            } else if key == "OUTBOX_LANES" {
                relay.entry("lanes".to_owned()).or_insert((key, value));
            } else if key == "OUTBOX_SCHEMA" {
                database.entry("schema".to_owned()).or_insert((key, value));
            } else if let Some(name) = key.strip_prefix(KAFKA_ENV_PREFIX) {
                settings.kafka.set(env_property(&key, name)?, value);
            } else if let Some(name) = key.strip_prefix(RELAY_ENV_PREFIX) {
                relay.insert(name.to_ascii_lowercase(), (key, value));
            } else if let Some(name) = key.strip_prefix(CONSUMER_ENV_PREFIX) {
                consumer.insert(name.to_ascii_lowercase(), (key, value));
            } else if let Some(name) = key.strip_prefix(DATABASE_ENV_PREFIX) {
                database.insert(name.to_ascii_lowercase(), (key, value));
            }
        }
        settings.relay = from_fields(
            relay,
            &["metrics_addr", "cloud_events", "cloud_events_source"],
        )?;
        settings.consumer = from_fields(consumer, &["group", "mode"])?;
        let url = settings.database.url.take();
        settings.database = from_fields(database, &["schema"])?;
        settings.database.url = url;
        Ok(settings)
    }

    /// Every setting that is set, as `section.name` and a value to show:
    /// secret Kafka values and the database URL's password as `***`.
    pub fn entries(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let d = &self.database;
        let database = [
            ("url", d.url.as_deref().map(redact_url)),
            (
                "connect_timeout_ms",
                d.connect_timeout_ms.map(|n| n.to_string()),
            ),
            ("lock_timeout_ms", d.lock_timeout_ms.map(|n| n.to_string())),
            (
                "lock_max_wait_ms",
                d.lock_max_wait_ms.map(|n| n.to_string()),
            ),
            ("schema", d.schema.clone()),
        ];
        for (name, value) in database {
            if let Some(value) = value {
                out.push((format!("database.{name}"), value));
            }
        }
        if let Some(brokers) = &self.kafka.brokers {
            out.push(("kafka.brokers".into(), brokers.clone()));
        }
        for (key, value) in &self.kafka.properties {
            let shown = if crate::kafka::is_secret(key) {
                crate::kafka::REDACTED
            } else {
                value
            };
            out.push((format!("kafka.{key}"), shown.to_owned()));
        }
        push_section(&mut out, "relay", &self.relay);
        push_section(&mut out, "consumer", &self.consumer);
        out
    }

    /// These settings with `higher`'s on top: every setting `higher` has
    /// replaces this one's; librdkafka properties are replaced one by one.
    pub fn overlay(self, higher: Settings) -> Settings {
        Settings {
            database: self.database.overlay(higher.database),
            kafka: self.kafka.overlay(higher.kafka),
            relay: self.relay.overlay(higher.relay),
            consumer: self.consumer.overlay(higher.consumer),
        }
    }
}

/// Appends the fields of a settings section that are set, as
/// `section.field` and their value as text.
fn push_section(out: &mut Vec<(String, String)>, name: &str, section: &impl Serialize) {
    if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(section) {
        for (field, value) in fields {
            let shown = match value {
                serde_json::Value::Null => continue,
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            out.push((format!("{name}.{field}"), shown));
        }
    }
}

/// `OUTBOX_KAFKA_SASL_PASSWORD` → `sasl.password`; `__` stands for `_`
/// (`OUTBOX_KAFKA_LOG__LEVEL` → `log_level`).
fn env_property(variable: &str, name: &str) -> Result<String> {
    if name.is_empty() || name.starts_with('_') && !name.starts_with("__") {
        return Err(Error::Config(format!(
            "{variable}: no librdkafka property named (use e.g. OUTBOX_KAFKA_SASL_PASSWORD for sasl.password)"
        )));
    }
    Ok(name
        .to_ascii_lowercase()
        .split("__")
        .map(|part| part.replace('_', "."))
        .collect::<Vec<_>>()
        .join("_"))
}

/// Deserializes a settings section from environment variables (field name
/// → (variable, value)); values are parsed by the field's type (`strings`:
/// the fields that take text as it is).
fn from_fields<T: serde::de::DeserializeOwned>(
    fields: BTreeMap<String, (String, String)>,
    strings: &[&str],
) -> Result<T> {
    let mut object = serde_json::Map::new();
    for (field, (_, value)) in &fields {
        let value = if strings.contains(&field.as_str()) {
            value.as_str().into()
        } else {
            env_value(value)
        };
        object.insert(field.clone(), value);
    }
    serde_json::from_value(serde_json::Value::Object(object)).map_err(|error| {
        // Name the variable, not the field: the message is for whoever set it.
        let text = error.to_string();
        let variable = fields
            .iter()
            .find(|(field, _)| text.contains(&format!("`{field}`")))
            .map(|(_, (variable, _))| variable.as_str());
        match variable {
            Some(variable) => Error::Config(format!("{variable}: {text}")),
            None => Error::Config(format!(
                "environment ({}): {text}",
                fields
                    .values()
                    .map(|(variable, _)| variable.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    })
}

/// An environment value as JSON: numbers and booleans as such, the rest as
/// a string (the field's type decides whether it fits).
fn env_value(value: &str) -> serde_json::Value {
    let trimmed = value.trim();
    if let Ok(n) = trimmed.parse::<u64>() {
        return n.into();
    }
    match trimmed {
        "true" => true.into(),
        "false" => false.into(),
        _ => value.into(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn environment_names_map_to_librdkafka_properties() {
        let s = Settings::from_vars([
            ("OUTBOX_KAFKA_SASL_PASSWORD", "p"),
            ("OUTBOX_KAFKA_SECURITY_PROTOCOL", "SASL_SSL"),
            ("OUTBOX_KAFKA_LOG__LEVEL", "7"),
            ("KAFKA_BROKERS", "k:9093"),
            ("OUTBOX_RELAY_BATCH_SIZE", "100"),
            ("OUTBOX_RELAY_LISTEN", "false"),
            ("OUTBOX_CONSUMER_GROUP", "1234"),
            ("OUTBOX_CONSUMER_MODE", "inbox"),
            ("DATABASE_URL", "postgres://u:pw@h/d"),
            ("OUTBOX_DATABASE_CONNECT_TIMEOUT_MS", "2500"),
            ("UNRELATED", "x"),
        ])
        .unwrap();
        assert_eq!(s.kafka.get("sasl.password"), Some("p"));
        assert_eq!(s.kafka.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(s.kafka.get("log_level"), Some("7"));
        assert_eq!(s.kafka.brokers(), "k:9093");
        assert_eq!(s.relay.batch_size, Some(100));
        assert_eq!(s.relay.listen, Some(false));
        assert_eq!(s.consumer.group.as_deref(), Some("1234"));
        assert_eq!(s.consumer.mode.as_deref(), Some("inbox"));
        assert_eq!(s.database.url.as_deref(), Some("postgres://u:pw@h/d"));
        assert_eq!(s.database.connect_timeout(), Duration::from_millis(2500));
    }

    #[test]
    fn bad_environment_values_name_the_variable() {
        let e = Settings::from_vars([("OUTBOX_RELAY_BATCH_SIZE", "lots")]).unwrap_err();
        assert!(e.to_string().contains("OUTBOX_RELAY_BATCH_SIZE"), "{e}");
        let e = Settings::from_vars([("OUTBOX_RELAY_BATCH_SIZ", "5")]).unwrap_err();
        assert!(e.to_string().contains("OUTBOX_RELAY_BATCH_SIZ"), "{e}");
        assert!(e.to_string().contains("unknown field"), "{e}");
        let e = Settings::from_vars([("OUTBOX_KAFKA_", "x")]).unwrap_err();
        assert!(e.to_string().contains("OUTBOX_KAFKA_"), "{e}");
        // OUTBOX_LANES is the relay's lanes; OUTBOX_RELAY_LANES wins.
        let s = Settings::from_vars([("OUTBOX_LANES", "4")]).unwrap();
        assert_eq!(s.relay.lanes, Some(4));
        let s = Settings::from_vars([("OUTBOX_RELAY_LANES", "8"), ("OUTBOX_LANES", "4")]).unwrap();
        assert_eq!(s.relay.lanes, Some(8));
    }

    #[test]
    fn files_take_quoted_and_dotted_kafka_keys_and_any_scalar() {
        let s: Settings = serde_json::from_value(serde_json::json!({
            "kafka": {
                "brokers": "a:1",
                "sasl.mechanism": "PLAIN",
                "sasl": { "password": "p" },
                "linger": { "ms": 5 },
                "enable.ssl.certificate.verification": true,
            },
            "relay": { "batch_size": 10 },
        }))
        .unwrap();
        assert_eq!(s.kafka.brokers(), "a:1");
        assert_eq!(s.kafka.get("sasl.password"), Some("p"));
        assert_eq!(s.kafka.get("linger.ms"), Some("5"));
        assert_eq!(
            s.kafka.get("enable.ssl.certificate.verification"),
            Some("true")
        );
        assert_eq!(s.relay.batch_size, Some(10));
        let bad =
            serde_json::from_value::<Settings>(serde_json::json!({"relay": {"batchsize": 1}}));
        assert!(bad.unwrap_err().to_string().contains("batchsize"));
        let bad = serde_json::from_value::<Settings>(serde_json::json!({"kafka": {"x": [1]}}));
        assert!(bad.unwrap_err().to_string().contains("`x`"));
    }

    #[test]
    fn overlay_prefers_the_higher_source_setting_by_setting() {
        let mut file = Settings::default();
        file.kafka.set("bootstrap.servers", "file:1");
        file.kafka.set("sasl.username", "file-user");
        file.kafka.set("sasl.password", "file-pw");
        file.relay.batch_size = Some(1);
        file.relay.lanes = Some(2);
        let mut env = Settings::default();
        env.kafka.set("sasl.password", "env-pw");
        env.relay.lanes = Some(3);
        let merged = file.overlay(env);
        assert_eq!(merged.kafka.brokers(), "file:1");
        assert_eq!(merged.kafka.get("sasl.username"), Some("file-user"));
        assert_eq!(merged.kafka.get("sasl.password"), Some("env-pw"));
        assert_eq!(
            (merged.relay.batch_size, merged.relay.lanes),
            (Some(1), Some(3))
        );
    }
}
