//! Where the `outbox` command's settings come from, run as a process:
//! flags over the environment over the configuration file over defaults,
//! shown by `outbox config` and obeyed by the subcommands; configuration
//! mistakes exit with code 2 and a message that names the culprit.

#[path = "../../outbox-runtime/tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use common::*;
use sqlx::PgPool;

/// A file of the test's own, removed on drop.
pub struct TempFile(pub PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("outbox-{}-{name}", uuid::Uuid::new_v4().simple()));
        std::fs::write(&path, text).expect("write temp file");
        Self(path)
    }
    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 path")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs `outbox` with exactly `env` (plus PATH), nothing inherited.
async fn outbox(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(outbox_bin());
    cmd.args(args).env_clear().env("RUST_LOG", "warn");
    if let Ok(path) = std::env::var("PATH") {
        cmd.env("PATH", path);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("outbox finished in time")
        .expect("run outbox")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn setting<'a>(config: &'a serde_json::Value, name: &str) -> (&'a str, &'a str) {
    let entry = config["settings"]
        .as_array()
        .expect("settings")
        .iter()
        .find(|e| e["setting"] == name)
        .unwrap_or_else(|| panic!("no {name} in {config}"));
    (
        entry["value"].as_str().unwrap(),
        entry["source"].as_str().unwrap(),
    )
}

#[tokio::test]
async fn outbox_config_shows_each_setting_from_its_highest_source() {
    let file = TempFile::new(
        "outbox.toml",
        r#"
        [database]
        url = "postgres://relay:file-secret@db.example/orders?sslmode=verify-full"
        lock_timeout_ms = 1500

        [kafka]
        brokers = "file:9093"
        "security.protocol" = "SASL_SSL"
        sasl.mechanism = "SCRAM-SHA-512"
        "sasl.username" = "relay"
        "sasl.password" = "file-password"
        "client.id" = "from-file"

        [relay]
        batch_size = 100
        max_batch_bytes = 1048576
        lanes = 4
        max_attempts = 7
        "#,
    );
    let o = outbox(
        &[
            ("OUTBOX_CONFIG", file.path()),
            ("KAFKA_BROKERS", "env:9093"),
            ("OUTBOX_KAFKA_SASL_PASSWORD", "env-password"),
            ("OUTBOX_RELAY_LANES", "8"),
            ("OUTBOX_RELAY_MAX_ATTEMPTS", "9"),
        ],
        &["--connect-timeout-ms", "2500", "config", "--json"],
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
    let all = text(&o);
    for secret in ["file-secret", "file-password", "env-password"] {
        assert!(!all.contains(secret), "{secret} shown: {all}");
    }
    let config: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(config["file"], file.path());
    assert_eq!(
        setting(&config, "database.url"),
        (
            "postgres://relay:***@db.example/orders?sslmode=verify-full",
            "file"
        )
    );
    assert_eq!(
        setting(&config, "database.connect_timeout_ms"),
        ("2500", "flag")
    );
    assert_eq!(
        setting(&config, "database.lock_timeout_ms"),
        ("1500", "file")
    );
    assert_eq!(
        setting(&config, "database.lock_max_wait_ms"),
        ("300000", "default")
    );
    assert_eq!(
        setting(&config, "kafka.brokers"),
        ("env:9093", "environment")
    );
    assert_eq!(
        setting(&config, "kafka.sasl.password"),
        ("***", "environment")
    );
    assert_eq!(
        setting(&config, "kafka.sasl.mechanism"),
        ("SCRAM-SHA-512", "file")
    );
    assert_eq!(setting(&config, "kafka.client.id"), ("from-file", "file"));
    assert_eq!(setting(&config, "relay.batch_size"), ("100", "file"));
    assert_eq!(
        setting(&config, "relay.max_batch_bytes"),
        ("1048576", "file")
    );
    assert_eq!(setting(&config, "relay.lanes"), ("8", "environment"));
    assert_eq!(setting(&config, "relay.max_attempts"), ("9", "environment"));
    assert_eq!(
        setting(&config, "relay.poll_interval_ms"),
        ("500", "default")
    );
    assert_eq!(
        setting(&config, "relay.statement_timeout_ms"),
        ("30000", "default")
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn subcommands_obey_flags_over_environment_over_file(pool: PgPool) {
    let good = database_url(&pool);
    let topic = unique_topic("cfg");
    // The file names a database and a broker that do not exist, and a
    // librdkafka setting the broker cannot speak.
    let file = TempFile::new(
        "outbox.toml",
        "[database]\nurl = \"postgres://nobody@127.0.0.1:1/none\"\nconnect_timeout_ms = 2000\n\
         [kafka]\nbrokers = \"127.0.0.1:1\"\n\"security.protocol\" = \"SSL\"\n",
    );
    let cfg = file.path();

    // File only: it is read (and fails on its unreachable database).
    let o = outbox(&[], &["--config", cfg, "status"]).await;
    assert!(!o.status.success(), "{}", text(&o));
    // The environment beats the file: the test database.
    let o = outbox(
        &[("DATABASE_URL", &good)],
        &["--config", cfg, "status", "--json"],
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
    // A flag beats the environment.
    let o = outbox(
        &[("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")],
        &["--config", cfg, "--database-url", &good, "status", "--json"],
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));

    // Kafka: the environment's brokers beat the file's; a -X flag beats the
    // file's security.protocol, an environment variable beats it too.
    let brokers = brokers();
    let o = outbox(
        &[("KAFKA_BROKERS", &brokers)],
        &[
            "--config",
            cfg,
            "topics",
            "create",
            &topic,
            "-X",
            "security.protocol=PLAINTEXT",
        ],
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("{topic}: created")),
        "{}",
        text(&o)
    );
    let o = outbox(
        &[
            ("KAFKA_BROKERS", &brokers),
            ("OUTBOX_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT"),
        ],
        &["--config", cfg, "topics", "create", &topic],
    )
    .await;
    assert!(
        text(&o).contains(&format!("{topic}: exists")),
        "{}",
        text(&o)
    );
    // And a flag beats the environment's brokers.
    let o = outbox(
        &[("KAFKA_BROKERS", "127.0.0.1:1")],
        &["topics", "create", &topic, "--brokers", &brokers],
    )
    .await;
    assert!(
        text(&o).contains(&format!("{topic}: exists")),
        "{}",
        text(&o)
    );
}

#[tokio::test]
async fn configuration_mistakes_exit_2_naming_the_culprit() {
    let url = (
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let o = outbox(&[url], &["--config", "/nonexistent/outbox.toml", "status"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("cannot read the configuration file /nonexistent/outbox.toml"),
        "{}",
        text(&o)
    );

    let file = TempFile::new("bad.toml", "[kafka]\n\"sasl.password\" = hunter2-in-file\n");
    let o = outbox(&[url], &["--config", file.path(), "status"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("line 2"), "{}", text(&o));
    assert!(!text(&o).contains("hunter2"), "{}", text(&o));

    let file = TempFile::new("typo.toml", "[relay]\nbatchsize = 5\n");
    let o = outbox(&[url], &["--config", file.path(), "status"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("unknown field `batchsize`"),
        "{}",
        text(&o)
    );

    let o = outbox(&[url, ("OUTBOX_RELAY_BATCH_SIZE", "lots")], &["status"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("OUTBOX_RELAY_BATCH_SIZE"), "{}", text(&o));

    let o = outbox(&[url, ("OUTBOX_RELAY_BATCHSIZE", "5")], &["status"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("OUTBOX_RELAY_BATCHSIZE"), "{}", text(&o));
}

#[tokio::test]
async fn cloud_events_settings_come_from_the_file_and_the_environment() {
    let file = TempFile::new(
        "outbox.toml",
        "[relay]\ncloud_events = \"both\"\ncloud_events_source = \"/from-file\"\n",
    );
    let config = |env: Vec<(&'static str, String)>| {
        let file = file.path().to_owned();
        async move {
            let mut env: Vec<(&str, String)> = env;
            env.push(("OUTBOX_CONFIG", file));
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            outbox(&env, &["config", "--json"]).await
        }
    };
    let o = config(vec![]).await;
    assert!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(setting(&json, "relay.cloud_events"), ("both", "file"));
    assert_eq!(
        setting(&json, "relay.cloud_events_source"),
        ("/from-file", "file")
    );

    let o = config(vec![("OUTBOX_RELAY_CLOUD_EVENTS", "only".into())]).await;
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(
        setting(&json, "relay.cloud_events"),
        ("only", "environment")
    );

    // A mode that does not exist names the variable and the modes.
    let o = config(vec![("OUTBOX_RELAY_CLOUD_EVENTS", "binary".into())]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let all = text(&o);
    assert!(
        all.contains("OUTBOX_RELAY_CLOUD_EVENTS") && all.contains("binary"),
        "{all}"
    );
}
