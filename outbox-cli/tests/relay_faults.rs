//! The relay under faults: SIGKILL of the relay process mid-batch, and a
//! broker that becomes unreachable and comes back (a proxy in front of a
//! private broker is cut, then restored). These run in the progress mode
//! too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command; the mode is
//! the database's, enabled before any relay starts): "published" is then
//! "passed by its slot's position" (see `common::unpublished`). The last
//! test is the progress mode's own, from the command line, in either.

#[path = "../../outbox-runtime/tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use outbox_runtime::Relay;
use sqlx::PgPool;

fn start_relay(pool: &PgPool) -> tokio::process::Child {
    relay_process(&database_url(pool), &brokers(), &["--batch-size", "500"])
}

fn kill(child: &tokio::process::Child, sig: &str) {
    signal(child.id().expect("running"), sig);
}

/// Rows published, in either mode (marked, or passed by the positions).
async fn published(pool: &PgPool) -> i64 {
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(pool)
        .await
        .unwrap();
    all - unpublished(pool).await
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relay_sigkilled_mid_batch_then_restarted_loses_nothing(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-kill");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(&pool, &topic, 30_000, 200, 1_000).await;

    let mut kills = 0;
    for _ in 0..3 {
        let mut relay = start_relay(&pool);
        // Let it publish part of the backlog, then kill it without warning.
        let before = published(&pool).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while published(&pool).await < before + 2_000 {
            assert!(Instant::now() < deadline, "relay made no progress");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if unpublished(&pool).await == 0 {
            break;
        }
        kill(&relay, "-KILL");
        relay.wait().await.unwrap();
        kills += 1;
    }
    assert!(kills > 0, "the relay was killed mid-backlog at least once");
    assert!(unpublished(&pool).await > 0 || kills > 0);

    // A fresh relay finishes the backlog; SIGTERM stops it cleanly (exit 0).
    let mut relay = start_relay(&pool);
    assert!(
        wait_until_published(&pool, Duration::from_secs(120)).await,
        "backlog drained after restart"
    );
    kill(&relay, "-TERM");
    let status = tokio::time::timeout(Duration::from_secs(30), relay.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "graceful shutdown exits 0, got {status}");

    let received = read_topic(
        &brokers(),
        &topic,
        committed.len(),
        Duration::from_secs(120),
    )
    .await;
    let duplicates = verify(&committed, &received);
    eprintln!(
        "relay SIGKILLed {kills} times over {} events: 0 lost, {duplicates} duplicates",
        committed.len()
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn broker_outage_commits_continue_and_the_backlog_follows(pool: PgPool) {
    relay_mode(&pool).await;
    init_tracing();
    // Clients reach the private broker only through the proxy, which the
    // broker advertises as its address.
    let (proxy_port, broker_port) = (free_port(), free_port());
    let proxy = Proxy::start_on(
        proxy_port,
        format!("127.0.0.1:{broker_port}").parse().unwrap(),
    )
    .await;
    let _broker = PrivateBroker::start(broker_port, proxy_port);
    let brokers = format!("127.0.0.1:{proxy_port}");
    let topic = unique_topic("relay-outage");
    create_topic(&brokers, &topic).await;

    let handle = Relay::builder(pool.clone())
        .brokers(brokers.clone())
        .delivery_timeout(Duration::from_secs(3))
        .outage_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .spawn()
        .unwrap();
    let mut committed = commit_messages(&pool, &topic, 200, 10, 20).await;
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);

    proxy.cut();
    let cut_at = Instant::now();
    // Writers never talk to the broker: commits keep succeeding.
    committed.extend(commit_messages(&pool, &topic, 500, 10, 20).await);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        unpublished(&pool).await > 0,
        "nothing can be published while the broker is unreachable"
    );
    assert!(
        !handle.is_finished(),
        "the relay keeps running through the outage"
    );
    committed.extend(commit_messages(&pool, &topic, 100, 10, 20).await);

    proxy.restore();
    let restored_at = Instant::now();
    assert!(
        wait_until_published(&pool, Duration::from_secs(90)).await,
        "backlog published after the outage"
    );
    let recovery = restored_at.elapsed();
    assert!(!handle.is_finished());
    let counts = handle.counts();
    handle.shutdown().await.unwrap();

    let received = read_topic(&brokers, &topic, committed.len(), Duration::from_secs(60)).await;
    let duplicates = verify(&committed, &received);
    eprintln!(
        "broker outage of {:?}: {} events, 0 lost, {duplicates} duplicates, recovered {recovery:?} after restore, counts {counts:?}",
        restored_at - cut_at,
        committed.len()
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_broker_restarted_without_its_state_gets_the_backlog(pool: PgPool) {
    relay_mode(&pool).await;
    init_tracing();
    // A broker with in-memory storage forgets everything when killed,
    // including the idempotent producer's id and sequence numbers.
    let port = free_port();
    let mut broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = unique_topic("relay-broker-restart");
    create_topic(&brokers, &topic).await;
    let handle = Relay::builder(pool.clone())
        .brokers(brokers.clone())
        .delivery_timeout(Duration::from_secs(2))
        .outage_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .retry_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .spawn()
        .unwrap();
    commit_messages(&pool, &topic, 200, 10, 20).await;
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);

    broker.kill();
    let after = commit_messages(&pool, &topic, 300, 10, 20).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _broker = PrivateBroker::start(port, port);
    create_topic(&brokers, &topic).await;
    let restarted = Instant::now();
    assert!(
        wait_until_published(&pool, Duration::from_secs(40)).await,
        "backlog published to the restarted broker: {:?}",
        handle.counts()
    );
    let recovery = restarted.elapsed();
    handle.shutdown().await.unwrap();
    // The restarted broker's log holds exactly what was committed while it
    // was down.
    let received = read_topic(&brokers, &topic, after.len(), Duration::from_secs(30)).await;
    let duplicates = verify(&after, &received);
    eprintln!(
        "broker restarted empty: backlog of 300 published {recovery:?} after the restart, {duplicates} duplicates"
    );
}

/// The progress mode from the command line: `outbox progress status` says
/// it is off, `enable` turns it on (twice: nothing more), `status` shows
/// where the slots stand; then relay processes are SIGKILLed mid-backlog
/// three times and a fresh one finishes it: nothing lost, each key in
/// order, no outbox row written.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_progress_mode_from_the_command_line_survives_sigkills(pool: PgPool) {
    use outbox_runtime::relay::progress;
    let url = database_url(&pool);
    let run = |args: &'static [&'static str]| {
        let url = url.clone();
        async move {
            let out = tokio::process::Command::new(outbox_bin())
                .args(args)
                .env("DATABASE_URL", &url)
                .output()
                .await
                .unwrap();
            assert!(out.status.success(), "{args:?}: {out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    assert!(run(&["progress", "status"]).await.contains("off"));
    let enabled = run(&["progress", "enable"]).await;
    assert!(enabled.contains("on"), "{enabled}");
    assert!(
        enabled.contains("indexes of unpublished rows: dropped"),
        "{enabled}"
    );
    assert!(run(&["progress", "enable"]).await.contains("on"));
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::text[]) n WHERE to_regclass(n) IS NOT NULL",
    )
    .bind(progress::MARKS_INDEXES.as_slice())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        left, 0,
        "the default mode's indexes of unpublished rows are dropped"
    );
    let status = run(&["progress", "status", "--json"]).await;
    let positions: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(positions.as_array().map(Vec::len), Some(1), "{status}");

    let topic = unique_topic("progress-kill");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(&pool, &topic, 30_000, 200, 1_000).await;
    let pending = || async { progress::pending(&pool).await.unwrap() };
    let mut kills = 0;
    for _ in 0..3 {
        let mut relay = start_relay(&pool);
        let before = pending().await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while pending().await > before - 2_000 {
            assert!(Instant::now() < deadline, "relay made no progress");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if pending().await == 0 {
            break;
        }
        kill(&relay, "-KILL");
        relay.wait().await.unwrap();
        kills += 1;
    }
    assert!(kills > 0, "the relay was killed mid-backlog at least once");
    let mut relay = start_relay(&pool);
    let deadline = Instant::now() + Duration::from_secs(120);
    while pending().await > 0 {
        assert!(Instant::now() < deadline, "backlog drained after restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kill(&relay, "-TERM");
    let status = tokio::time::timeout(Duration::from_secs(30), relay.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "graceful shutdown exits 0, got {status}");
    let received = read_topic(
        &brokers(),
        &topic,
        committed.len(),
        Duration::from_secs(120),
    )
    .await;
    let duplicates = verify(&committed, &received);
    eprintln!(
        "progress mode: relay SIGKILLed {kills} times over {} events: 0 lost, {duplicates} duplicates",
        committed.len()
    );
    let touched: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE xmax::text <> '0'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(touched, 0, "no outbox row written");
    // Lane 0 of the relay's 16 (slots {0,16,32,48}).
    let lanes = run(&["progress", "status"]).await;
    assert!(lanes.contains("0 of 16"), "{lanes}");
}
