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

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use outbox_core::LockPolicy;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

use crate::error::{Error, Result};
use crate::inbox::{ConsumerBuilder, Mode};
use crate::kafka;
use crate::relay::RelayBuilder;
use crate::replay::ReplayOptions;

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
        settings.relay = from_fields(relay, &["metrics_addr"])?;
        settings.consumer = from_fields(consumer, &["group", "mode"])?;
        let url = settings.database.url.take();
        settings.database = from_fields(database, &[])?;
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
            let shown = if kafka::is_secret(key) {
                kafka::REDACTED
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

/// The database: its URL (with `sslmode`, `sslrootcert`, `sslcert`,
/// `sslkey` for TLS) and the connect timeout. `Debug` hides the URL's
/// password.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct DatabaseSettings {
    /// `postgres://user[:password]@host[:port]/database[?sslmode=verify-full&sslrootcert=ca.pem]`.
    pub url: Option<String>,
    /// How long to wait for a connection (TCP, TLS and authentication);
    /// default 10 s.
    pub connect_timeout_ms: Option<u64>,
    /// Schema changes (migrations, `outbox notify on|off`): how long one
    /// attempt waits for a table lock (default 2 s; see [`LockPolicy`]).
    pub lock_timeout_ms: Option<u64>,
    /// Schema changes: how long to keep trying (default 5 min).
    pub lock_max_wait_ms: Option<u64>,
}

impl fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("lock_timeout_ms", &self.lock_timeout_ms)
            .field("lock_max_wait_ms", &self.lock_max_wait_ms)
            .finish()
    }
}

/// The default database connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl DatabaseSettings {
    /// The connect timeout (default 10 s).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout_ms
            .map_or(DEFAULT_CONNECT_TIMEOUT, Duration::from_millis)
    }

    /// The connection options the URL describes. Errors never repeat the
    /// URL (it may hold a password). `sslmode=allow` is resolved as libpq
    /// does only by [`DatabaseSettings::pool`]; here it stays as sqlx reads
    /// it (no TLS).
    pub fn connect_options(&self) -> Result<PgConnectOptions> {
        let url = self.url.as_deref().ok_or_else(|| {
            Error::Config(
                "no database: set DATABASE_URL (or [database] url in the configuration file)"
                    .into(),
            )
        })?;
        let invalid = |why: &str| {
            Error::Config(format!(
                "DATABASE_URL is not a valid PostgreSQL URL ({why}); expected postgres://user@host:5432/database"
            ))
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(invalid("it must start with postgres:// or postgresql://"));
        }
        url.parse::<PgConnectOptions>().map_err(|error| {
            // sqlx's message names the bad part (an sslmode, a port), never
            // the password; the URL itself is not repeated.
            let text = error.to_string();
            let text = self
                .password()
                .map_or(text.clone(), |p| text.replace(&p, kafka::REDACTED));
            invalid(&text)
        })
    }

    /// The URL's password, if it has one.
    fn password(&self) -> Option<String> {
        let url = self.url.as_deref()?;
        let rest = url.split_once("://")?.1;
        let authority = rest.split(['/', '?']).next()?;
        let userinfo = authority.rsplit_once('@')?.0;
        let password = userinfo.split_once(':')?.1;
        (!password.is_empty()).then(|| password.to_owned())
    }

    /// A pool of at most `max_connections` on this database, connecting
    /// lazily, with the connect timeout as its acquire timeout.
    /// `sslmode=allow` behaves as libpq's: plain text, unless the server
    /// insists on TLS (sqlx alone never tries TLS with `allow`); this asks
    /// the server once, here.
    pub async fn pool(&self, max_connections: u32) -> Result<sqlx::PgPool> {
        let mut options = self.connect_options()?;
        if matches!(options.get_ssl_mode(), PgSslMode::Allow) {
            options = resolve_allow(options, self.connect_timeout()).await;
        }
        Ok(PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(self.connect_timeout())
            .connect_lazy_with(options))
    }

    /// How schema changes wait for table locks.
    pub fn lock_policy(&self) -> LockPolicy {
        let default = LockPolicy::default();
        LockPolicy::new(
            self.lock_timeout_ms.map_or(default.lock_timeout, ms),
            self.lock_max_wait_ms.map_or(default.max_wait, ms),
        )
    }

    /// These settings with `higher`'s on top.
    pub fn overlay(self, higher: DatabaseSettings) -> DatabaseSettings {
        DatabaseSettings {
            url: higher.url.or(self.url),
            connect_timeout_ms: higher.connect_timeout_ms.or(self.connect_timeout_ms),
            lock_timeout_ms: higher.lock_timeout_ms.or(self.lock_timeout_ms),
            lock_max_wait_ms: higher.lock_max_wait_ms.or(self.lock_max_wait_ms),
        }
    }
}

/// libpq's `sslmode=allow`: try without TLS; if the server refuses a
/// connection without encryption, use TLS (without verifying the
/// certificate, as `allow` does not).
async fn resolve_allow(options: PgConnectOptions, timeout: Duration) -> PgConnectOptions {
    use sqlx::{ConnectOptions, Connection};
    let plain = options.clone().ssl_mode(PgSslMode::Disable);
    match tokio::time::timeout(timeout, plain.connect()).await {
        Ok(Err(sqlx::Error::Database(error)))
            if error.code().as_deref() == Some("28000")
                && error.message().contains("no encryption") =>
        {
            tracing::debug!("sslmode=allow: the server requires TLS; using it");
            options.ssl_mode(PgSslMode::Require)
        }
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            options.ssl_mode(PgSslMode::Disable)
        }
        // Unreachable or another refusal: the pool reports it when used.
        _ => options.ssl_mode(PgSslMode::Disable),
    }
}

/// `postgres://user:***@host/db`: the URL with its password hidden.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return kafka::REDACTED.into();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:{}@{host}", kafka::REDACTED),
            None => format!("{userinfo}@{host}"),
        },
        None => authority.to_owned(),
    };
    // A password can also be a query parameter.
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => {
                        format!("{k}={}", kafka::REDACTED)
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

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
    /// [`kafka::create_topics`] and [`ReplayOptions::kafka_settings`].
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

/// Relay settings, each optional (unset: the builder's default). Section
/// `[relay]`; environment `OUTBOX_RELAY_<FIELD>`; flags of `outbox relay`
/// with the same names (`--batch-size`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RelaySettings {
    /// Rows per batch (default 2000).
    pub batch_size: Option<usize>,
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
    /// First back-off in a broker or database outage (default 100 ms).
    pub outage_backoff_ms: Option<u64>,
    /// Cap of that back-off (default 5 s).
    pub outage_backoff_max_ms: Option<u64>,
    /// `statement_timeout` of the relay's SQL (default 30 s).
    pub statement_timeout_ms: Option<u64>,
    /// Where `outbox relay` serves Prometheus metrics (the builder does not
    /// use it: call [`crate::metrics::serve`]).
    pub metrics_addr: Option<SocketAddr>,
}

impl RelaySettings {
    /// These settings with `higher`'s on top.
    pub fn overlay(self, higher: RelaySettings) -> RelaySettings {
        RelaySettings {
            batch_size: higher.batch_size.or(self.batch_size),
            poll_interval_ms: higher.poll_interval_ms.or(self.poll_interval_ms),
            listen: higher.listen.or(self.listen),
            max_attempts: higher.max_attempts.or(self.max_attempts),
            delivery_timeout_ms: higher.delivery_timeout_ms.or(self.delivery_timeout_ms),
            lanes: higher.lanes.or(self.lanes),
            retry_backoff_ms: higher.retry_backoff_ms.or(self.retry_backoff_ms),
            retry_backoff_max_ms: higher.retry_backoff_max_ms.or(self.retry_backoff_max_ms),
            outage_backoff_ms: higher.outage_backoff_ms.or(self.outage_backoff_ms),
            outage_backoff_max_ms: higher.outage_backoff_max_ms.or(self.outage_backoff_max_ms),
            statement_timeout_ms: higher.statement_timeout_ms.or(self.statement_timeout_ms),
            metrics_addr: higher.metrics_addr.or(self.metrics_addr),
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
    /// Larger payloads are dead-lettered (default 1 MiB).
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
}

impl ConsumerSettings {
    /// These settings with `higher`'s on top.
    pub fn overlay(self, higher: ConsumerSettings) -> ConsumerSettings {
        ConsumerSettings {
            group: higher.group.or(self.group),
            mode: higher.mode.or(self.mode),
            batch_size: higher.batch_size.or(self.batch_size),
            batch_linger_ms: higher.batch_linger_ms.or(self.batch_linger_ms),
            max_attempts: higher.max_attempts.or(self.max_attempts),
            retry_backoff_ms: higher.retry_backoff_ms.or(self.retry_backoff_ms),
            retry_backoff_max_ms: higher.retry_backoff_max_ms.or(self.retry_backoff_max_ms),
            outage_backoff_ms: higher.outage_backoff_ms.or(self.outage_backoff_ms),
            outage_backoff_max_ms: higher.outage_backoff_max_ms.or(self.outage_backoff_max_ms),
            max_payload_bytes: higher.max_payload_bytes.or(self.max_payload_bytes),
            redrive_interval_ms: higher.redrive_interval_ms.or(self.redrive_interval_ms),
            writers: higher.writers.or(self.writers),
            processors: higher.processors.or(self.processors),
            processor_batch_size: higher.processor_batch_size.or(self.processor_batch_size),
            processor_poll_interval_ms: higher
                .processor_poll_interval_ms
                .or(self.processor_poll_interval_ms),
        }
    }
}

fn ms(n: u64) -> Duration {
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
        if let Some(n) = s.statement_timeout_ms {
            self = self.statement_timeout(ms(n));
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
            ("OUTBOX_CONSUMER_GROUP", "g"),
            ("OUTBOX_CONSUMER_MODE", "inbox"),
            ("OUTBOX_CONSUMER_OUTAGE_BACKOFF_MS", "300"),
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
        assert_eq!(r.lanes, 16, "unset: the default");
        let consumer = crate::Consumer::builder(pool)
            .kafka(&s.kafka)
            .settings(&s.consumer)
            .unwrap();
        let c = consumer.current();
        assert_eq!((c.group.as_str(), c.mode), ("g", Mode::Inbox));
        assert_eq!(
            (c.outage_backoff, c.outage_backoff_max),
            (ms(300), Duration::from_secs(5))
        );
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

    #[test]
    fn urls_lose_their_passwords() {
        assert_eq!(
            redact_url("postgres://u:s3cret@h:5432/d?sslmode=require"),
            "postgres://u:***@h:5432/d?sslmode=require"
        );
        assert_eq!(redact_url("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(
            redact_url("postgres://h/d?user=u&password=s3cret"),
            "postgres://h/d?user=u&password=***"
        );
        assert_eq!(redact_url("garbage s3cret"), "***");
        let d = DatabaseSettings {
            url: Some("postgres://u:s3cret@h/d".into()),
            ..DatabaseSettings::default()
        };
        assert!(!format!("{d:?}").contains("s3cret"));
        assert_eq!(d.password().as_deref(), Some("s3cret"));
    }
}
