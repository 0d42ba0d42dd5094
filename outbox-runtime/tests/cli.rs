//! The `outbox` command against a real PostgreSQL and the broker: every
//! subcommand, exit codes for bad configuration, and no secrets in logs.

mod common;

use std::process::Output;
use std::time::Duration;

use common::*;
use sqlx::PgPool;

fn url_of(pool: &PgPool) -> String {
    let o = pool.connect_options();
    format!(
        "postgres://{}@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().expect("database")
    )
}

async fn outbox(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env("KAFKA_BROKERS", brokers());
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("outbox finished in time")
        .expect("run outbox")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[sqlx::test(migrations = false)]
async fn migrate_status_topics_parked_and_notify(pool: PgPool) {
    let url = url_of(&pool);
    for _ in 0..2 {
        let o = outbox(Some(&url), &["migrate"]).await;
        assert!(o.status.success(), "{:?}", text(&o));
        assert!(text(&o).0.contains("migrations applied"));
    }
    let topic = unique_topic("cli");
    commit_messages(&pool, &topic, 7, 2, 7).await;

    let o = outbox(Some(&url), &["status", "--json"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON status");
    assert_eq!(status["unpublished"], 7);
    assert_eq!(status["parked"], 0);
    assert_eq!(status["notify_enabled"], true);
    assert_eq!(status["topics"][0]["topic"], topic.as_str());
    assert!(status["oldest_unpublished_secs"].as_f64().is_some());

    let o = outbox(Some(&url), &["status"]).await;
    let (out, _) = text(&o);
    assert!(
        out.contains("unpublished: 7") && out.contains(&topic),
        "{out}"
    );

    // Topics named by the outbox's rows, created once, then left alone.
    let o = outbox(
        Some(&url),
        &["topics", "create", "--from-outbox", "--partitions", "2"],
    )
    .await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        text(&o).0.contains(&format!("{topic}: created")),
        "{:?}",
        text(&o)
    );
    let o = outbox(Some(&url), &["topics", "create", &topic]).await;
    assert!(
        text(&o).0.contains(&format!("{topic}: exists")),
        "{:?}",
        text(&o)
    );

    // Parked rows: park one by hand, list it, requeue it.
    sqlx::query("UPDATE outbox_event SET parked_at = now(), attempts = 5, last_error = 'boom' WHERE id = (SELECT min(id) FROM outbox_event)")
        .execute(&pool)
        .await
        .unwrap();
    let o = outbox(Some(&url), &["parked", "list", "--json"]).await;
    let parked: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON list");
    assert_eq!(parked.as_array().map(Vec::len), Some(1));
    assert_eq!(parked[0]["last_error"], "boom");
    let o = outbox(Some(&url), &["parked", "requeue"]).await;
    assert_eq!(o.status.code(), Some(2), "requeue needs --all or --id");
    let o = outbox(Some(&url), &["parked", "requeue", "--all"]).await;
    assert!(text(&o).0.contains("requeued 1"), "{:?}", text(&o));

    let o = outbox(Some(&url), &["notify", "off"]).await;
    assert!(text(&o).0.contains("notify: off"));
    let o = outbox(Some(&url), &["notify", "on"]).await;
    assert!(text(&o).0.contains("notify: on"));
}

#[tokio::test]
async fn bad_configuration_is_a_clear_error_not_a_panic() {
    let o = outbox(None, &["status"]).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("DATABASE_URL"), "{:?}", text(&o));

    let o = outbox(Some("mysql://nope"), &["status"]).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).1.contains("not a valid PostgreSQL URL"),
        "{:?}",
        text(&o)
    );

    let o = outbox(
        Some("postgres://postgres@127.0.0.1/postgres"),
        &["relay", "-X", "novalue"],
    )
    .await;
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("key=value"), "{:?}", text(&o));

    let o = outbox(
        Some("postgres://postgres@127.0.0.1/postgres"),
        &["relay", "--batch-size", "0"],
    )
    .await;
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("batch size"), "{:?}", text(&o));

    let o = outbox(
        Some("postgres://postgres@127.0.0.1/postgres"),
        &["relay", "-X", "no.such.setting=1"],
    )
    .await;
    assert!(!o.status.success());
    let (_, err) = text(&o);
    assert!(
        err.contains("no.such.setting") && !err.contains("panicked"),
        "{err}"
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn credentials_never_appear_in_logs(pool: PgPool) {
    let o = pool.connect_options();
    // A password in the URL (trust auth ignores it) and a secret -X setting.
    let url = format!(
        "postgres://{}:s3cr3t-db@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().unwrap()
    );
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args([
            "relay",
            "-X",
            "sasl.password=hunter2-kafka",
            "-X",
            "sasl.username=svc",
        ])
        .env("DATABASE_URL", &url)
        .env("KAFKA_BROKERS", brokers())
        .env("RUST_LOG", "debug")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all.contains("relay started"), "{all}");
    assert!(all.contains("sasl.password=***"), "{all}");
    assert!(!all.contains("hunter2-kafka"), "{all}");
    assert!(!all.contains("s3cr3t-db"), "{all}");
    assert!(out.status.success(), "SIGTERM → exit 0: {:?}", out.status);
}
