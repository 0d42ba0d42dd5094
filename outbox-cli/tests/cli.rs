//! The `outbox` command against a real PostgreSQL and the broker: every
//! subcommand, exit codes for bad configuration, and no secrets in logs.
//! The tests of an outbox run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command; the mode is the
//! database's, enabled before any command runs): "published" is then
//! "passed by its slot's position", and the tests that publish rows by hand
//! record such a position instead of marking them, the rows' creation
//! standing for their publication time.

#[path = "../../outbox-runtime/tests/common/mod.rs"]
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

/// Publishes the rows `condition` selects as a relay would: marks them
/// (`published_at = published`, the default mode), or, in the progress mode,
/// records a position of every lane slot that passes every row committed so
/// far (`condition` and `published` ignored: a row has no time of its own
/// there, its creation stands for it).
async fn publish_by_hand(pool: &PgPool, condition: &str, published: &str) {
    if progress_mode() {
        record_position(pool).await;
    } else {
        sqlx::query(&format!(
            "UPDATE outbox_event SET published_at = {published} WHERE {condition}"
        ))
        .execute(pool)
        .await
        .unwrap();
    }
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
    relay_mode(&pool).await;
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
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("TOPIC") && lines[0].contains("UNPUBLISHED"),
        "{out}"
    );
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(row[..2], [topic.as_str(), "7"], "{out}");
    assert!(lines[2].starts_with("TOTAL"), "{out}");
    // Columns are aligned: every row as wide as the header's columns.
    assert_eq!(lines[0].find("PUBLISHED").map(|_| ()), Some(()));
    assert!(lines[1].len() <= lines[0].len().max(lines[1].len()));

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
    let o = outbox(Some(&url), &["status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON status");
    assert_eq!(
        (status["unpublished"].as_i64(), status["parked"].as_i64()),
        (Some(7), Some(0))
    );

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
    relay_mode(&pool).await;
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
    // Running (it logged its settings at start): it holds its lanes.
    assert!(
        eventually(Duration::from_secs(30), || async {
            outbox_runtime::ops::relays(&pool)
                .await
                .is_ok_and(|r| r.iter().any(|r| !r.lanes.is_empty()))
        })
        .await,
        "the relay started"
    );
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

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn replay_cleanup_and_parked_drop(pool: PgPool) {
    relay_mode(&pool).await;
    let url = url_of(&pool);
    let topic = unique_topic("cli-ops");
    create_topic(&brokers(), &topic).await;
    let ids = commit_messages(&pool, &topic, 12, 3, 12).await;
    // Ten published (two of them long ago), two parked.
    sqlx::query(
        "UPDATE outbox_event SET created_at = now() - interval '1 hour'
         WHERE id IN (SELECT id FROM outbox_event ORDER BY id LIMIT 10)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE outbox_event SET created_at = now() - interval '40 days'
         WHERE id IN (SELECT id FROM outbox_event ORDER BY id LIMIT 2)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE outbox_event SET parked_at = now(), attempts = 5
         WHERE id IN (SELECT id FROM outbox_event ORDER BY id OFFSET 10)",
    )
    .execute(&pool)
    .await
    .unwrap();
    publish_by_hand(&pool, "parked_at IS NULL", "created_at").await;
    assert_eq!(unpublished(&pool).await, 2, "ten published, two parked");
    let first: i64 = sqlx::query_scalar("SELECT min(id) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();

    // Replay: a dry run counts, a filtered run sends.
    let o = outbox(
        Some(&url),
        &["replay", "--dry-run", "--topic", &topic, "--json"],
    )
    .await;
    assert!(o.status.success(), "{:?}", text(&o));
    let dry: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(dry["matched"], 10, "published rows only");
    let o = outbox(Some(&url), &["replay", "--dry-run", "--since", "2h"]).await;
    assert!(
        text(&o).0.contains("dry run: 8 published events match"),
        "{:?}",
        text(&o)
    );
    let o = outbox(Some(&url), &["replay", "--since", "yesterday-ish"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("invalid time"), "{:?}", text(&o));
    let to = format!("{}", first + 4);
    // Two of them were published 40 days ago, beyond the dedup window:
    // refused without --force, nothing sent.
    let o = outbox(Some(&url), &["replay", "--topic", &topic, "--to-id", &to]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(
        text(&o).1.contains("2 of the 5 events") && text(&o).1.contains("--force"),
        "{:?}",
        text(&o)
    );
    let o = outbox(
        Some(&url),
        &[
            "replay", "--topic", &topic, "--to-id", &to, "--force", "--json",
        ],
    )
    .await;
    assert!(o.status.success(), "{:?}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["replayed"], 5);
    let received = read_topic(&brokers(), &topic, 5, Duration::from_secs(30)).await;
    assert_eq!(received.len(), 5);
    assert!(
        received
            .iter()
            .all(|m| m.headers["replay_id"] == report["replay_id"].as_str().unwrap())
    );
    let got: std::collections::HashSet<uuid::Uuid> =
        received.iter().map(Received::event_id).collect();
    assert_eq!(got, ids[..5].iter().copied().collect());

    // Cleanup: a window shorter than the dedup window is refused.
    let o = outbox(Some(&url), &["cleanup", "--older-than", "1d"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(
        text(&o).1.contains("shorter than the dedup window 7d"),
        "{:?}",
        text(&o)
    );
    let o = outbox(Some(&url), &["cleanup", "--older-than", "30x"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    let o = outbox(Some(&url), &["cleanup", "--older-than", "30d", "--json"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    let done: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(done["outbox_events"], 2);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 10);
    assert_eq!(done["dead_letters"], 0);

    // Dead letters: only when asked, each kind by its own age.
    sqlx::query(
        "INSERT INTO dead_letter (consumer, topic, \"partition\", \"offset\", reason, error, status,
                                  last_failed_at, resolved_at)
         VALUES ('g', 't', 0, 1, 'not_json', 'resolved long ago', 'resolved',
                 now() - interval '60 days', now() - interval '30 days'),
                ('g', 't', 0, 2, 'not_json', 'failed long ago', 'dead', now() - interval '60 days', NULL),
                ('g', 't', 0, 3, 'not_json', 'marked for retry', 'retry', now() - interval '60 days', NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let o = outbox(
        Some(&url),
        &[
            "cleanup",
            "--older-than",
            "30d",
            "--resolved-dead-letters-older-than",
            "7d",
        ],
    )
    .await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).0.contains(", 1 dead letters"), "{:?}", text(&o));
    let o = outbox(
        Some(&url),
        &[
            "cleanup",
            "--older-than",
            "30d",
            "--dead-letters-older-than",
            "45d",
            "--json",
        ],
    )
    .await;
    assert!(o.status.success(), "{:?}", text(&o));
    let done: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(done["dead_letters"], 1);
    let kept: Vec<String> = sqlx::query_scalar("SELECT error FROM dead_letter")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(kept, ["marked for retry"]);
    let o = outbox(
        Some(&url),
        &[
            "cleanup",
            "--older-than",
            "30d",
            "--dead-letters-older-than",
            "soon",
        ],
    )
    .await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));

    // Parked rows: drop needs a reason and a selection; dropped rows stay.
    let o = outbox(Some(&url), &["parked", "drop", "--all"]).await;
    assert_eq!(
        o.status.code(),
        Some(2),
        "--reason is required: {:?}",
        text(&o)
    );
    let o = outbox(Some(&url), &["parked", "drop", "--reason", "obsolete"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    let o = outbox(
        Some(&url),
        &["parked", "drop", "--all", "--reason", "obsolete"],
    )
    .await;
    assert!(
        text(&o).0.contains("dropped 2 parked rows"),
        "{:?}",
        text(&o)
    );
    let o = outbox(Some(&url), &["status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (status["parked"].as_i64(), status["discarded"].as_i64()),
        (Some(0), Some(2))
    );
    let o = outbox(Some(&url), &["parked", "list", "--json"]).await;
    let parked: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(parked.as_array().map(Vec::len), Some(0));

    // dead-letters retry/drop share their selection flags.
    let o = outbox(Some(&url), &["dead-letters", "drop"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    let o = outbox(
        Some(&url),
        &["dead-letters", "retry", "--all", "--consumer", "billing"],
    )
    .await;
    assert!(
        text(&o).0.contains("marked 0 dead letters"),
        "{:?}",
        text(&o)
    );
}

/// `--schema` (or `OUTBOX_SCHEMA`) chooses the outbox when services share a
/// database: `migrate` creates the schema and its tables, the other
/// commands work on that schema's outbox only; a name that is not a plain
/// identifier is refused.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_schema_flag_chooses_the_outbox(pool: PgPool) {
    relay_mode(&pool).await;
    let url = url_of(&pool);
    let o = outbox(Some(&url), &["--schema", "billing", "migrate"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).0.contains("schema billing"), "{:?}", text(&o));
    commit_messages(&pool, &unique_topic("cli-public"), 3, 1, 3).await;

    let status = |args: &'static [&'static str]| {
        let url = url.clone();
        async move {
            let o = outbox(Some(&url), args).await;
            assert!(o.status.success(), "{:?}", text(&o));
            serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("JSON status")
        }
    };
    let public = status(&["status", "--json"]).await;
    let billing = status(&["--schema", "billing", "status", "--json"]).await;
    assert_eq!(public["schema"], "public");
    assert_eq!(public["unpublished"], 3);
    assert_eq!(billing["schema"], "billing");
    assert_eq!(billing["unpublished"], 0);
    assert_ne!(public["channel"], billing["channel"]);

    let o = outbox(Some(&url), &["--schema", "Billing-1", "status"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("invalid schema"), "{:?}", text(&o));
}

/// `outbox relay --lanes 0` beside a relay with lanes is refused with exit
/// code 2 and a message naming both (the library's refusal is tested in the
/// runtime's `lanes` tests). In the progress mode a relay without lanes is
/// refused whatever runs beside it, the message naming the mode.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_without_lanes_is_refused_beside_relays_with_lanes(pool: PgPool) {
    relay_mode(&pool).await;
    let with_lanes = outbox_runtime::Relay::builder(pool.clone())
        .brokers(brokers())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            with_lanes.lanes().len() == 16
        })
        .await
    );
    let o = outbox(Some(&url_of(&pool)), &["relay", "--lanes", "0"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    let why = if progress_mode() {
        "the progress mode, which needs lanes"
    } else {
        "without lanes"
    };
    assert!(text(&o).1.contains(why), "{:?}", text(&o));
    assert_eq!(
        with_lanes.lanes().len(),
        16,
        "the running relay keeps its lanes"
    );
    with_lanes.shutdown().await.unwrap();
}

/// `outbox replay` of events published before the dedup window: refused
/// with exit code 2 and a hint at `--force`, nothing sent; `--dry-run`
/// counts them; `--force` sends them.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_replay_beyond_the_dedup_window_is_refused_by_the_command(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("cli-replay-window");
    create_topic(&brokers(), &topic).await;
    commit_messages(&pool, &topic, 4, 2, 4).await;
    sqlx::query("UPDATE outbox_event SET created_at = now() - interval '8 days'")
        .execute(&pool)
        .await
        .unwrap();
    publish_by_hand(&pool, "true", "created_at").await;
    assert_eq!(unpublished(&pool).await, 0);
    let url = url_of(&pool);
    let o = outbox(Some(&url), &["replay", "--topic", &topic]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("--force"), "{:?}", text(&o));
    let o = outbox(Some(&url), &["replay", "--topic", &topic, "--dry-run"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).0.contains("4 of them"), "{:?}", text(&o));
    assert!(
        read_all(&brokers(), &topic, Duration::from_secs(5))
            .await
            .is_empty(),
        "a refused replay sends nothing"
    );
    let o = outbox(Some(&url), &["replay", "--topic", &topic, "--force"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).0.contains("replayed 4 events"), "{:?}", text(&o));
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn partitions_enable_list_maintain_and_cleanup(pool: PgPool) {
    relay_mode(&pool).await;
    let url = url_of(&pool);
    let topic = unique_topic("cli-part");
    commit_messages(&pool, &topic, 5, 1, 5).await;
    let o = outbox(Some(&url), &["partitions", "list"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        text(&o).0.contains("no partitioned table"),
        "{:?}",
        text(&o)
    );

    // A bad period is refused, nothing converted.
    let o = outbox(Some(&url), &["partitions", "enable", "--period", "1500ms"]).await;
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("whole seconds"), "{:?}", text(&o));

    let o = outbox(
        Some(&url),
        &["partitions", "enable", "--period", "6h", "--ahead", "2"],
    )
    .await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        text(&o)
            .0
            .contains("partitioned: outbox_event, processed_event, inbox_event"),
        "{:?}",
        text(&o)
    );
    let o = outbox(Some(&url), &["partitions", "list", "--json"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    let parts: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON list");
    let outbox_parts: Vec<&serde_json::Value> = parts
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["table"] == "outbox_event")
        .collect();
    // legacy, two periods of 6 hours, default
    assert_eq!(outbox_parts.len(), 4, "{parts:#}");
    assert_eq!(outbox_parts[0]["kind"], "legacy");
    assert_eq!(outbox_parts[3]["kind"], "default");

    let o = outbox(Some(&url), &["partitions", "maintain", "--ahead", "4"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        text(&o).0.starts_with("6 partitions created ahead"),
        "{:?}",
        text(&o)
    );

    // Cleanup runs on the partitioned layout (nothing old yet).
    let o = outbox(Some(&url), &["cleanup", "--older-than", "30d", "--json"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON report");
    assert_eq!(report["partitions_dropped"], 0);
    assert_eq!(report["outbox_events"], 0);
}

/// `outbox sagas`: the summary per type and stage (stuck ones counted),
/// lists by state, stage and idleness, one instance with its pending
/// timeout's due time (read from the timeout's outbox row), and a clear
/// error for an instance that does not exist.
#[sqlx::test(migrations = false)]
async fn sagas_summary_list_and_show(pool: PgPool) {
    let url = url_of(&pool);
    let o = outbox(Some(&url), &["migrate"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    relay_mode(&pool).await;
    // A timeout of o-1, due in an hour, as a saga step schedules it.
    let due = sqlx::types::chrono::Utc::now() + Duration::from_secs(3600);
    let mut uow = outbox_core::UnitOfWork::begin(&pool).await.unwrap();
    let timeout = uow.record_message_at(due, message("order-timeouts", "o-1", 0));
    uow.commit().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_saga (saga_type, saga_id, state, stage, version, timeouts, updated_at,
                                  completed_at)
         VALUES ('order', 'o-1', '{\"order_id\":\"o-1\"}', 'AwaitingPayment', 1,
                 jsonb_build_object('payment', $1::text), now() - interval '3 hours', NULL),
                ('order', 'o-2', '{}', 'AwaitingPayment', 2, '{}', now(), NULL),
                ('order', 'o-3', '{}', 'Shipped', 3, '{}', now(), now()),
                ('refund', 'r-1', '{}', 'Asked', 1, '{}', now() - interval '2 days', NULL)",
    )
    .bind(timeout.to_string())
    .execute(&pool)
    .await
    .unwrap();

    let o = outbox(Some(&url), &["sagas", "summary", "--json"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let of = |t: &str, s: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["saga_type"] == t && r["stage"] == s)
            .cloned()
            .unwrap_or_else(|| panic!("{t}/{s} in {rows}"))
    };
    // o-1 has taken no step for 3 hours but waits for its timeout, due in
    // an hour: not stuck (see the end for the same once it is overdue).
    let awaiting = of("order", "AwaitingPayment");
    assert_eq!(
        (awaiting["running"].as_i64(), awaiting["stuck"].as_i64()),
        (Some(2), Some(0))
    );
    assert!(awaiting["oldest_step_secs"].as_f64().unwrap() >= 3.0 * 3600.0 - 60.0);
    let shipped = of("order", "Shipped");
    assert_eq!(
        (shipped["running"].as_i64(), shipped["completed"].as_i64()),
        (Some(0), Some(1))
    );
    assert_eq!(of("refund", "Asked")["stuck"], 1);
    let o = outbox(Some(&url), &["sagas", "summary", "--stuck-after", "3d"]).await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.starts_with("saga type"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("order") && l.contains("AwaitingPayment")),
        "{out}"
    );

    // Stuck ones: running, no step for over an hour, the least recent first.
    let ids = |o: &Output| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON list");
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["saga_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let o = outbox(Some(&url), &["sagas", "list", "--idle", "1h", "--json"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(ids(&o), ["r-1", "o-1"]);
    let o = outbox(
        Some(&url),
        &["sagas", "list", "--state", "completed", "--json"],
    )
    .await;
    assert_eq!(ids(&o), ["o-3"]);
    let o = outbox(
        Some(&url),
        &[
            "sagas",
            "list",
            "--type",
            "order",
            "--stage",
            "AwaitingPayment",
            "--json",
        ],
    )
    .await;
    assert_eq!(ids(&o), ["o-1", "o-2"]);
    let o = outbox(Some(&url), &["sagas", "list", "--state", "all"]).await;
    let (out, _) = text(&o);
    assert_eq!(out.lines().count(), 5, "a header and four instances: {out}");

    let o = outbox(Some(&url), &["sagas", "show", "order", "o-1", "--json"]).await;
    assert!(o.status.success(), "{:?}", text(&o));
    let one: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(one["stage"], "AwaitingPayment");
    assert_eq!(one["state"]["order_id"], "o-1");
    assert_eq!(one["timeouts"], 1);
    let pending = &one["pending_timeouts"][0];
    assert_eq!(pending["name"], "payment");
    assert_eq!(pending["timeout_id"], timeout.to_string());
    let at = sqlx::types::chrono::DateTime::parse_from_rfc3339(
        pending["due_at"].as_str().expect("a due time"),
    )
    .unwrap();
    assert!(
        (at.to_utc() - due).num_milliseconds().abs() < 1000,
        "{at} vs {due}"
    );
    let o = outbox(Some(&url), &["sagas", "show", "order", "o-1"]).await;
    let (out, _) = text(&o);
    assert!(out.contains("timeout   payment"), "{out}");

    let o = outbox(Some(&url), &["sagas", "show", "order", "nope"]).await;
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("no saga instance order/nope"), "{err}");

    // Its timeout's time past (no relay published it): o-1 waits for
    // nothing still to come, and is stuck.
    sqlx::query("UPDATE outbox_event SET due_at = now() - interval '1 minute' WHERE event_id = $1")
        .bind(timeout)
        .execute(&pool)
        .await
        .unwrap();
    let o = outbox(Some(&url), &["sagas", "summary", "--json"]).await;
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let stuck = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["saga_type"] == "order" && r["stage"] == "AwaitingPayment")
        .map(|r| r["stuck"].clone());
    assert_eq!(stuck, Some(serde_json::json!(1)), "{rows}");
}

/// In the progress mode, `outbox status` (text and JSON) and `outbox
/// progress status` show each lane's lag and the transaction holding the
/// lanes' windows back, with its pid and age. The position is recorded as
/// a relay records one, while a transaction that wrote an event is open;
/// three events commit after it.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn status_shows_the_lanes_lag_and_the_transaction_holding_them(pool: PgPool) {
    let url = url_of(&pool);
    outbox_runtime::relay::progress::enable(&pool)
        .await
        .unwrap();
    let topic = unique_topic("cli-lag");
    commit_messages(&pool, &topic, 12, 3, 4).await;
    let mut holder = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let held = [message(&topic, "held", 0)];
    outbox_core::insert_messages(&mut holder, &held, &outbox_core::Headers::default())
        .await
        .unwrap();
    commit_messages(&pool, &topic, 5, 1, 5).await;
    sqlx::query(
        "INSERT INTO outbox_progress (slots, done)
         SELECT ARRAY(SELECT generate_series(0, 63))::int2[], pg_current_snapshot()",
    )
    .execute(&pool)
    .await
    .unwrap();
    commit_messages(&pool, &topic, 3, 3, 3).await;

    let json = |o: &Output| -> serde_json::Value {
        assert!(o.status.success(), "{:?}", text(o));
        serde_json::from_slice(&o.stdout).expect("JSON status")
    };
    let lag = |status: &serde_json::Value| -> i64 {
        let lanes = status["progress"]["lanes"].as_array().expect("lanes");
        lanes.iter().map(|l| l["events"].as_i64().unwrap()).sum()
    };
    let status = json(&outbox(Some(&url), &["status", "--json"]).await);
    assert_eq!(lag(&status), 3, "{status}");
    let holding = &status["progress"]["holding"];
    assert_eq!(holding["pid"], pid, "{status}");
    assert!(holding["age_secs"].as_f64().unwrap() > 0.0, "{status}");
    assert_eq!(holding["state"], "idle in transaction", "{status}");

    for args in [&["status"][..], &["progress", "status"]] {
        let o = outbox(Some(&url), args).await;
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}{err}");
        assert!(out.contains("LAG (EVENTS)"), "{args:?}: {out}");
        assert!(
            out.contains("all slots"),
            "the position `enable` recorded: {out}"
        );
        assert!(
            out.contains("held back by: transaction ")
                && out.contains(&format!("pid {pid}, open for ")),
            "{args:?}: {out}"
        );
    }

    // Committed, its event is lag too, and nothing holds the lanes back.
    holder.commit().await.unwrap();
    let status = json(&outbox(Some(&url), &["status", "--json"]).await);
    assert_eq!(lag(&status), 4, "{status}");
    assert!(status["progress"]["holding"].is_null(), "{status}");
    let (out, _) = text(&outbox(Some(&url), &["progress", "status"]).await);
    assert!(out.contains("held back by: no transaction"), "{out}");
}
