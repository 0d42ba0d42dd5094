//! Where the command's settings come from: flags, then the environment,
//! then the configuration file (`--config outbox.toml` or `OUTBOX_CONFIG`),
//! then the defaults, setting by setting (a librdkafka property given with
//! `-X` replaces the same property from the environment or the file; the
//! others stay). The file uses the sections of
//! [`outbox_runtime::settings::Settings`]; errors about it never quote its
//! text (it may hold secrets).

use std::path::{Path, PathBuf};

use outbox_runtime::settings::Settings;
use outbox_runtime::{Error, RelayConfig};
use serde::Serialize;

/// The settings of each source.
pub(crate) struct Layers {
    /// The configuration file, if any.
    pub path: Option<PathBuf>,
    pub file: Settings,
    pub env: Settings,
    pub flags: Settings,
}

/// One setting in effect and its source.
#[derive(Debug, Serialize)]
pub(crate) struct Entry {
    pub setting: String,
    pub value: String,
    pub source: &'static str,
}

impl Layers {
    /// Reads the file at `path` (if any) and the process environment.
    pub fn load(path: Option<&Path>, flags: Settings) -> Result<Self, Error> {
        let file = match path {
            Some(path) => read_file(path)?,
            None => Settings::default(),
        };
        Ok(Self {
            path: path.map(Path::to_path_buf),
            file,
            env: Settings::from_env()?,
            flags,
        })
    }

    /// The settings in effect (unset ones: the library's defaults).
    pub fn merged(&self) -> Settings {
        self.file
            .clone()
            .overlay(self.env.clone())
            .overlay(self.flags.clone())
    }

    /// Every setting in effect, defaults included, with its source; secrets
    /// as `***`.
    pub fn entries(&self) -> Vec<Entry> {
        let set = |s: &Settings| s.entries();
        let (flags, env, file) = (set(&self.flags), set(&self.env), set(&self.file));
        let has = |entries: &[(String, String)], key: &str| entries.iter().any(|(k, _)| k == key);
        let merged = defaults().overlay(self.merged());
        merged
            .entries()
            .into_iter()
            .map(|(setting, value)| {
                let source = if has(&flags, &setting) {
                    "flag"
                } else if has(&env, &setting) {
                    "environment"
                } else if has(&file, &setting) {
                    "file"
                } else {
                    "default"
                };
                Entry {
                    setting,
                    value,
                    source,
                }
            })
            .collect()
    }
}

/// The defaults of the settings the command uses, for `outbox config`.
fn defaults() -> Settings {
    let relay = RelayConfig::default();
    let lock = outbox_core::LockPolicy::default();
    let ms = |d: std::time::Duration| Some(d.as_millis() as u64);
    let mut s = Settings::default();
    s.database.connect_timeout_ms = ms(outbox_runtime::settings::DEFAULT_CONNECT_TIMEOUT);
    s.database.lock_timeout_ms = ms(lock.lock_timeout);
    s.database.lock_max_wait_ms = ms(lock.max_wait);
    s.kafka.brokers = Some(outbox_runtime::kafka::DEFAULT_BROKERS.into());
    s.relay.batch_size = Some(relay.batch_size);
    s.relay.max_batch_bytes = Some(relay.max_batch_bytes);
    s.relay.poll_interval_ms = ms(relay.poll_interval);
    s.relay.listen = Some(relay.listen);
    s.relay.max_attempts = Some(relay.max_attempts);
    s.relay.delivery_timeout_ms = ms(relay.delivery_timeout);
    s.relay.lanes = Some(relay.lanes);
    s.relay.retry_backoff_ms = ms(relay.retry_backoff);
    s.relay.retry_backoff_max_ms = ms(relay.retry_backoff_max);
    s.relay.missing_topic_hold_ms = ms(relay.missing_topic_hold);
    s.relay.missing_topic_hold_max_ms = ms(relay.missing_topic_hold_max);
    s.relay.outage_backoff_ms = ms(relay.outage_backoff);
    s.relay.outage_backoff_max_ms = ms(relay.outage_backoff_max);
    s.relay.statement_timeout_ms = ms(relay.statement_timeout);
    s.relay.lane_timeout_ms = ms(relay.lane_timeout);
    s.relay.cloud_events = Some(relay.cloud_events.mode);
    s.relay.cloud_events_source = Some(relay.cloud_events.source.clone());
    s
}

/// Reads and parses a TOML configuration file.
fn read_file(path: &Path) -> Result<Settings, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::Config(format!(
            "cannot read the configuration file {}: {e}",
            path.display()
        ))
    })?;
    let settings = parse(&text)
        .map_err(|why| Error::Config(format!("configuration file {}: {why}", path.display())))?;
    warn_if_readable_by_others(path, &settings);
    Ok(settings)
}

/// Parses a configuration file's text. The error says where and what, but
/// never quotes the text.
pub(crate) fn parse(text: &str) -> Result<Settings, String> {
    toml::from_str(text).map_err(|error| {
        let at = error.span().map(|span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: ")
        });
        format!(
            "{}{}",
            at.unwrap_or_default(),
            without_quoted_values(error.message())
        )
    })
}

/// `invalid type: string "hunter2", expected usize` → `invalid type:
/// string "…", expected usize`: serde quotes rejected values in double
/// quotes (names in backticks, which stay).
fn without_quoted_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut quoted = false;
    for c in message.trim().chars() {
        if c == '"' {
            if quoted {
                out.push('…');
            }
            out.push('"');
            quoted = !quoted;
        } else if !quoted {
            out.push(c);
        }
    }
    out
}

/// A file that holds secrets should be readable by its owner only.
fn warn_if_readable_by_others(path: &Path, settings: &Settings) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let secrets = settings
            .kafka
            .properties
            .keys()
            .any(|k| outbox_runtime::kafka::is_secret(k))
            || settings
                .database
                .url
                .as_deref()
                .is_some_and(|u| outbox_runtime::settings::redact_url(u) != u);
        let mode = std::fs::metadata(path).map(|m| m.permissions().mode());
        if let Ok(mode) = mode
            && secrets
            && mode & 0o077 != 0
        {
            tracing::warn!(
                file = %path.display(),
                mode = format!("{:o}", mode & 0o777),
                "the configuration file holds secrets and other users can read it (chmod 600)"
            );
        }
    }
    #[cfg(not(unix))]
    let _ = (path, settings);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_parse_into_every_section() {
        let s = parse(
            r#"
            [database]
            url = "postgres://relay@db/orders?sslmode=verify-full&sslrootcert=/etc/ca.pem"
            connect_timeout_ms = 5000

            [kafka]
            brokers = "k1:9093,k2:9093"
            "security.protocol" = "SASL_SSL"
            sasl.mechanism = "SCRAM-SHA-512"
            "linger.ms" = 5

            [relay]
            batch_size = 500
            lanes = 8
            metrics_addr = "127.0.0.1:9464"

            [consumer]
            group = "billing"
            "#,
        )
        .unwrap();
        assert_eq!(s.database.connect_timeout_ms, Some(5000));
        assert_eq!(s.kafka.brokers(), "k1:9093,k2:9093");
        assert_eq!(s.kafka.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(s.kafka.get("linger.ms"), Some("5"));
        assert_eq!(s.relay.lanes, Some(8));
        assert_eq!(
            s.relay.metrics_addr,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert_eq!(s.consumer.group.as_deref(), Some("billing"));
    }

    #[test]
    fn file_errors_say_where_and_never_quote_values() {
        let e = parse("[relay]\nbatch_size = \"hunter2\"\n").unwrap_err();
        assert!(e.starts_with("line 2, column"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let e = parse("[kafka]\n\"sasl.password\" = hunter2\n").unwrap_err();
        assert!(e.starts_with("line 2"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let e = parse("[relay]\nbatchsize = 1\n").unwrap_err();
        assert!(e.contains("unknown field `batchsize`"), "{e}");
        let e = parse("[kafak]\n").unwrap_err();
        assert!(e.contains("kafak"), "{e}");
    }

    #[test]
    fn relay_flags_become_relay_settings() {
        use clap::Parser;
        let cli = crate::args::Cli::try_parse_from([
            "outbox",
            "relay",
            "--max-batch-bytes",
            "65536",
            "--batch-size",
            "10",
        ])
        .unwrap();
        let flags = cli.flag_settings().unwrap();
        assert_eq!(flags.relay.max_batch_bytes, Some(65536));
        assert_eq!(flags.relay.batch_size, Some(10));
        let layers = Layers {
            path: None,
            file: Settings::default(),
            env: Settings::from_vars([("OUTBOX_RELAY_MAX_BATCH_BYTES", "1024")]).unwrap(),
            flags,
        };
        assert_eq!(layers.merged().relay.max_batch_bytes, Some(65536));
        let defaults = Layers {
            path: None,
            file: Settings::default(),
            env: Settings::default(),
            flags: Settings::default(),
        };
        let entry = defaults
            .entries()
            .into_iter()
            .find(|e| e.setting == "relay.max_batch_bytes")
            .unwrap();
        assert_eq!(
            (entry.value.as_str(), entry.source),
            ("16777216", "default")
        );
    }

    #[test]
    fn cloud_events_flags_become_relay_settings() {
        use clap::Parser;
        use outbox_runtime::cloudevents::CloudEventsMode;
        let cli = crate::args::Cli::try_parse_from([
            "outbox",
            "relay",
            "--cloud-events",
            "only",
            "--cloud-events-source",
            "/orders",
        ])
        .unwrap();
        let flags = cli.flag_settings().unwrap();
        assert_eq!(flags.relay.cloud_events, Some(CloudEventsMode::Only));
        assert_eq!(flags.relay.cloud_events_source.as_deref(), Some("/orders"));
        let error = crate::args::Cli::try_parse_from(["outbox", "relay", "--cloud-events", "x"])
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("off (default), both"), "{error}");
    }

    #[test]
    fn flags_beat_environment_beat_file_beat_defaults() {
        let file = parse(
            "[kafka]\nbrokers = \"file:1\"\n\"sasl.username\" = \"file\"\n\"client.id\" = \"file\"\n\
             [relay]\nbatch_size = 1\nlanes = 2\nmax_attempts = 3\n",
        )
        .unwrap();
        let env = Settings::from_vars([
            ("KAFKA_BROKERS", "env:1"),
            ("OUTBOX_KAFKA_CLIENT_ID", "env"),
            ("OUTBOX_RELAY_LANES", "20"),
            ("OUTBOX_RELAY_MAX_ATTEMPTS", "30"),
        ])
        .unwrap();
        let mut flags = Settings::default();
        flags.relay.max_attempts = Some(300);
        let layers = Layers {
            path: None,
            file,
            env,
            flags,
        };
        let merged = layers.merged();
        assert_eq!(merged.kafka.brokers(), "env:1");
        assert_eq!(merged.kafka.get("sasl.username"), Some("file"));
        assert_eq!(merged.kafka.get("client.id"), Some("env"));
        assert_eq!(merged.relay.batch_size, Some(1));
        assert_eq!(merged.relay.lanes, Some(20));
        assert_eq!(merged.relay.max_attempts, Some(300));
        let entries = layers.entries();
        let source = |k: &str| {
            entries
                .iter()
                .find(|e| e.setting == k)
                .map(|e| (e.value.as_str(), e.source))
        };
        assert_eq!(source("relay.max_attempts"), Some(("300", "flag")));
        assert_eq!(source("relay.lanes"), Some(("20", "environment")));
        assert_eq!(source("relay.batch_size"), Some(("1", "file")));
        assert_eq!(source("relay.poll_interval_ms"), Some(("500", "default")));
        assert_eq!(source("kafka.sasl.username"), Some(("***", "file")));
    }
}
