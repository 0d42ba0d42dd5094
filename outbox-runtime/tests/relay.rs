//! The relay against a real PostgreSQL (fresh database per test) and a real
//! Kafka-protocol broker. The tests that call `relay_mode` run in the
//! progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test
//! command): "published" is then "passed by its slot's position" (see
//! `common::unpublished`), and a missing topic is held as a row of
//! `outbox_held_topic` instead of on its events' rows.

mod common;

use std::time::{Duration, Instant};

use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::{Relay, ops};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

fn relay(pool: &PgPool) -> outbox_runtime::RelayBuilder {
    Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn committed_events_arrive_once_with_key_headers_payload_and_order(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-basic");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(&pool, &topic, 3_000, 50, 100).await;
    // One event with custom headers.
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let correlation = uuid::Uuid::now_v7();
    uow.set_correlation_id(correlation);
    uow.headers_mut()
        .extra
        .insert("tenant".into(), "acme".into());
    let mut m = message(&topic, "special", 9_999);
    m.event_version = 3;
    let special = uow.record_message(m);
    uow.commit().await.unwrap();
    let mut all = committed.clone();
    all.push(special);

    let handle = relay(&pool).batch_size(500).spawn().unwrap();
    assert!(
        wait_until_published(&pool, Duration::from_secs(60)).await,
        "relay drained the outbox"
    );
    handle.shutdown().await.unwrap();

    let received = read_topic(&brokers(), &topic, all.len(), Duration::from_secs(60)).await;
    let duplicates = verify(&all, &received);
    assert_eq!(duplicates, 0, "one relay, no failure: no duplicates");
    assert_eq!(received.len(), all.len());

    for r in &received {
        let seq = r.seq() as usize;
        if r.event_id() == special {
            assert_eq!(r.key, "special");
            assert_eq!(r.headers["event_version"], "3");
            assert_eq!(r.headers["correlation_id"], correlation.to_string());
            assert_eq!(r.headers["tenant"], "acme");
        } else {
            assert_eq!(r.key, format!("k{}", seq % 50), "key = partition key");
            assert_eq!(r.payload["key"], r.key.as_str());
            assert_eq!(r.headers["event_version"], "1");
            assert!(r.headers.contains_key("correlation_id"));
        }
        assert_eq!(r.headers["event_type"], "OrderPlaced");
        assert_eq!(r.headers["aggregate_type"], "Order");
        assert_eq!(r.headers["aggregate_id"], r.key);
        assert_eq!(r.headers["content-type"], "application/json");
    }
    // Same key → same partition.
    let mut partition_of = std::collections::HashMap::new();
    for r in &received {
        assert_eq!(
            *partition_of.entry(r.key.clone()).or_insert(r.partition),
            r.partition
        );
    }
    // Published rows stay in the table.
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept as usize, all.len());
    assert_eq!(unpublished(&pool).await, 0);
    // Marked one by one, or (the progress mode) none written.
    let marked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    let expected = if progress_mode() { 0 } else { all.len() };
    assert_eq!(marked as usize, expected);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn notify_wakes_an_idle_relay_in_milliseconds(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-notify");
    create_topic(&brokers(), &topic).await;
    // A poll interval far longer than the assertion: only NOTIFY can be fast.
    let handle = relay(&pool)
        .poll_interval(Duration::from_secs(30))
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut worst = Duration::ZERO;
    for i in 0..5 {
        let start = Instant::now();
        commit_messages(&pool, &topic, 1, 1, 1).await;
        assert!(wait_until_published(&pool, Duration::from_secs(10)).await);
        worst = worst.max(start.elapsed());
        assert_eq!(handle.counts().published, i + 1);
    }
    handle.shutdown().await.unwrap();
    assert!(
        worst < Duration::from_secs(5),
        "commit→published took {worst:?} with a 30 s poll interval"
    );
    eprintln!("worst commit→published with NOTIFY: {worst:?}");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn notify_can_be_switched_off_and_polling_still_delivers(pool: PgPool) {
    relay_mode(&pool).await;
    assert!(ops::notify_enabled(&pool).await.unwrap());
    ops::set_notify(&pool, false).await.unwrap();
    assert!(!ops::notify_enabled(&pool).await.unwrap());
    let topic = unique_topic("relay-poll");
    create_topic(&brokers(), &topic).await;
    let handle = relay(&pool)
        .poll_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    let committed = commit_messages(&pool, &topic, 10, 3, 5).await;
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    verify(&committed, &received);
    ops::set_notify(&pool, true).await.unwrap();
    assert!(ops::notify_enabled(&pool).await.unwrap());
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn three_relays_over_fifty_thousand_events_lose_nothing(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-three");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(&pool, &topic, 50_000, 1_000, 1_000).await;
    let handles: Vec<_> = (0..3)
        .map(|_| relay(&pool).batch_size(1000).spawn().unwrap())
        .collect();
    assert!(
        wait_until_published(&pool, Duration::from_secs(120)).await,
        "drained"
    );
    let mut published = 0;
    for h in handles {
        published += h.counts().published;
        h.shutdown().await.unwrap();
    }
    // No row is claimed by two relays at once.
    assert_eq!(published as usize, committed.len());
    let received = read_topic(
        &brokers(),
        &topic,
        committed.len(),
        Duration::from_secs(120),
    )
    .await;
    // Lanes: one relay per key, so per-key order holds across the three.
    let duplicates = verify(&committed, &received);
    eprintln!(
        "3 relays, {} events: {duplicates} duplicates",
        committed.len()
    );
    assert_eq!(duplicates, 0);
}

/// Relays embedded in an application share its pool, which may be small and
/// busy. A relay must never wait for a connection while holding the one that
/// would free another: here one relay gets a pool of 2, three relays share a
/// pool of 3, and each goes idle (LISTEN) before a backlog of many batches
/// arrives.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relays_on_a_small_shared_pool_never_starve_themselves(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-small-pool");
    create_topic(&brokers(), &topic).await;
    let small = |n| {
        PgPoolOptions::new()
            .max_connections(n)
            .acquire_timeout(Duration::from_secs(60))
            .connect_lazy_with((*pool.connect_options()).clone())
    };
    for (relays, connections) in [(1, 2), (3, 3)] {
        let shared = small(connections);
        let handles: Vec<_> = (0..relays)
            .map(|_| relay(&shared).batch_size(100).spawn().unwrap())
            .collect();
        // Idle first: each relay now listens.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let committed = commit_messages(&pool, &topic, 5_000, 100, 500).await;
        assert!(
            wait_until_published(&pool, Duration::from_secs(30)).await,
            "{relays} relay(s) on a pool of {connections} stalled"
        );
        for h in handles {
            h.shutdown().await.unwrap();
        }
        assert_eq!(committed.len(), 5_000);
        shared.close().await;
    }
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(all, 10_000);
}

/// What the `outbox_relay_consecutive_failures` gauge shows: the rounds of
/// a relay whose only event keeps failing count up; once that event is
/// parked and nothing is left to publish, the count is back to 0. (Both
/// modes: the backlog sample that ends the count reads the positions in
/// the progress mode.)
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn failed_rounds_in_a_row_are_counted_until_nothing_is_left_to_publish(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-failing");
    create_topic(&brokers(), &topic).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let mut poison = message(&topic, "k0", 0);
    poison.payload = serde_json::json!({ "blob": "x".repeat(300_000) }).to_string();
    uow.record_message(poison);
    uow.commit().await.unwrap();

    let relay = relay(&pool)
        .kafka_setting("message.max.bytes", "100000")
        .max_attempts(3)
        .retry_backoff(Duration::from_millis(100), Duration::from_millis(200))
        .build()
        .unwrap();
    let stats = relay.stats();
    let handle = relay.spawn();
    // Each attempt fails (too large for the producer) and delivers nothing:
    // 1, 2, 3 failed rounds, the third parks it.
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while handle.counts().parked == 0 {
        most = most.max(stats.consecutive_failures());
        assert!(
            Instant::now() < deadline,
            "not parked: {:?}",
            handle.counts()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    most = most.max(stats.consecutive_failures());
    assert!(most >= 2, "failed rounds seen: at most {most}");
    assert_eq!(handle.counts().published, 0);
    // The next backlog sample (every 5 s) finds nothing left to publish.
    let deadline = Instant::now() + Duration::from_secs(15);
    while stats.consecutive_failures() != 0 {
        assert!(
            Instant::now() < deadline,
            "still {} failed rounds with nothing to publish",
            stats.consecutive_failures()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.shutdown().await.unwrap();
}

/// A poison event is retried, then parked; its key's later events wait
/// behind it, other keys never do. Both modes: in the progress mode the
/// parked row and the held ones are written by the rare paths, the rest
/// passed by the positions; `status` counts both alike.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_poison_event_is_parked_and_holds_back_only_its_key(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-poison");
    create_topic(&brokers(), &topic).await;
    // k0: a normal event, then the poison (too large for the producer), then
    // two more; other keys in between.
    let mut committed = Vec::new();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    committed.push(uow.record_message(message(&topic, "k0", 0)));
    let mut poison = message(&topic, "k0", 1);
    poison.payload = serde_json::json!({ "seq": 1, "blob": "x".repeat(300_000) }).to_string();
    let poison_id = uow.record_message(poison);
    for seq in 2..40 {
        let key = if seq % 4 == 0 {
            "k0".to_owned()
        } else {
            format!("k{}", seq % 4)
        };
        committed.push(uow.record_message(message(&topic, &key, seq)));
    }
    uow.commit().await.unwrap();

    let handle = relay(&pool)
        .kafka_setting("message.max.bytes", "100000")
        .max_attempts(3)
        .retry_backoff(Duration::from_millis(100), Duration::from_millis(400))
        .batch_size(10)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = ops::status(&pool).await.unwrap();
        if status.unpublished == 0 && status.parked == 1 && unpublished(&pool).await == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "poison not parked / others not drained: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.parked, 1);
    assert!(
        counts.withheld > 0,
        "later k0 events were held back behind the poison"
    );

    let (attempts, last_error, parked): (i32, Option<String>, bool) = sqlx::query_as(
        "SELECT attempts, last_error, parked_at IS NOT NULL FROM outbox_event WHERE event_id = $1",
    )
    .bind(poison_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, 3);
    assert!(parked);
    assert!(
        last_error
            .unwrap_or_default()
            .to_lowercase()
            .contains("too large")
    );
    assert_eq!(ops::parked(&pool, 10).await.unwrap()[0].event_id, poison_id);

    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    verify(&committed, &received);
    assert!(received.iter().all(|r| r.event_id() != poison_id));

    // Requeue: it fails again (still too large) — but it is back in the queue.
    assert_eq!(ops::requeue_parked(&pool, None).await.unwrap(), 1);
    assert_eq!(ops::status(&pool).await.unwrap().parked, 0);
    assert_eq!(ops::status(&pool).await.unwrap().unpublished, 1);
    assert_eq!(unpublished(&pool).await, 1);
}

/// Rows held back in one batch (here: librdkafka's queue is full) stay
/// locked until that batch commits, while the next claim already runs: it
/// must not send later rows of their keys in the meantime.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn rows_held_back_keep_their_keys_in_order(pool: PgPool) {
    let (committed, received, counts) = through_a_small_queue(&pool, 3_000, 5, 40, 200).await;
    let duplicates = verify(&committed, &received);
    assert_eq!(duplicates, 0, "nothing failed: no duplicates: {counts:?}");
}

/// Commits `n` events over `keys` keys and relays them with librdkafka's
/// queue limited to `queue` messages, `batch` rows a claim: asserts the
/// outbox drained and rows were withheld; returns the events committed,
/// those read back and the relay's counts.
async fn through_a_small_queue(
    pool: &PgPool,
    n: usize,
    keys: usize,
    queue: usize,
    batch: usize,
) -> (Vec<uuid::Uuid>, Vec<Received>, outbox_runtime::RelayCounts) {
    relay_mode(pool).await;
    let topic = unique_topic("relay-held");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(pool, &topic, n, keys, 100).await;

    let handle = relay(pool)
        .kafka_setting("queue.buffering.max.messages", queue.to_string())
        .batch_size(batch)
        .spawn()
        .unwrap();
    let drained = wait_until_published(pool, Duration::from_secs(60)).await;
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert!(drained, "relay drained the outbox: {counts:?}");
    assert!(
        counts.withheld > 0,
        "the small producer queue held rows back: {counts:?}"
    );
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    (committed, received, counts)
}

/// One key's backlog (one lane) through a producer queue a fraction of a
/// batch: each batch sends a few rows and withholds the rest, and the relay
/// goes on from there until everything is out, once and in order. A guard:
/// in the progress mode, withheld window rows once held their key, so that
/// a lane read again while the batch before was still open could be
/// withheld batch after batch and never move again (shown under load by
/// `roles`' relay test; this test passed on that code on an idle machine).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn one_keys_rows_withheld_batch_after_batch_still_drain(pool: PgPool) {
    let (committed, received, counts) = through_a_small_queue(&pool, 600, 1, 5, 50).await;
    assert_eq!(verify(&committed, &received), 0, "{counts:?}");
    assert_eq!(counts.published, 600, "nothing sent twice: {counts:?}");
}

/// A topic missing on the broker does not hold the others up, says why
/// (on its rows in the default mode; on its row of `outbox_held_topic` in
/// the progress mode, which writes none of its events), never parks, and
/// its events follow once it exists, without a restart.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_missing_topic_is_reported_on_its_rows_and_does_not_stall_others(pool: PgPool) {
    init_tracing();
    relay_mode(&pool).await;
    let good = unique_topic("relay-good");
    let missing = unique_topic("relay-missing");
    create_topic(&brokers(), &good).await;
    let mut committed_missing = commit_messages(&pool, &missing, 5, 2, 5).await;
    let committed_good = commit_messages(&pool, &good, 200, 10, 50).await;

    let handle = relay(&pool)
        .kafka_setting("topic.metadata.propagation.max.ms", "1000")
        .retry_backoff(Duration::from_millis(200), Duration::from_millis(500))
        .spawn()
        .unwrap();
    // The good topic drains although the missing topic's rows come first.
    let received = read_topic(
        &brokers(),
        &good,
        committed_good.len(),
        Duration::from_secs(60),
    )
    .await;
    verify(&committed_good, &received);
    // The missing topic's rows carry a clear error.
    let deadline = Instant::now() + Duration::from_secs(30);
    let error = loop {
        let reported = if progress_mode() {
            "SELECT reason FROM outbox_held_topic WHERE topic = $1"
        } else {
            "SELECT last_error FROM outbox_event WHERE topic = $1 AND last_error IS NOT NULL LIMIT 1"
        };
        let e: Option<String> = sqlx::query_scalar(reported)
            .bind(&missing)
            .fetch_optional(&pool)
            .await
            .unwrap()
            .flatten();
        if let Some(e) = e {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "no error recorded for the missing topic"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        error.contains(&missing) && error.contains("outbox topics create"),
        "{error}"
    );
    assert_eq!(
        ops::status(&pool).await.unwrap().parked,
        0,
        "a missing topic never parks rows"
    );
    assert_eq!(unpublished_of(&pool, &missing).await, 5, "its rows wait");

    // Create the topic: the held-back rows follow, without a restart.
    create_topic(&brokers(), &missing).await;
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(
        &brokers(),
        &missing,
        committed_missing.len(),
        Duration::from_secs(30),
    )
    .await;
    verify(&committed_missing, &received);
    committed_missing.clear();
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_relay_survives_a_database_outage(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-dbdown");
    create_topic(&brokers(), &topic).await;
    let options = pool.connect_options().as_ref().clone();
    let upstream = format!("127.0.0.1:{}", options.get_port()).parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let relay_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options.port(proxy.addr.port()))
        .await
        .unwrap();
    let relay = relay(&relay_pool)
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let stats = relay.stats();
    let handle = relay.spawn();
    let mut committed = commit_messages(&pool, &topic, 100, 5, 10).await;
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);

    proxy.cut();
    // Writers use their own connections: commits keep succeeding.
    committed.extend(commit_messages(&pool, &topic, 100, 5, 10).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        unpublished(&pool).await > 0,
        "nothing can be marked while the relay's database is cut"
    );
    // Claims refused (no connection) are failed rounds in a row
    // (`outbox_relay_consecutive_failures`).
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats.consecutive_failures() < 2 {
        assert!(Instant::now() < deadline, "no failed rounds counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.restore();
    assert!(
        wait_until_published(&pool, Duration::from_secs(60)).await,
        "backlog published after the outage"
    );
    // A delivered batch ends them.
    let deadline = Instant::now() + Duration::from_secs(15);
    while stats.consecutive_failures() != 0 {
        assert!(
            Instant::now() < deadline,
            "still {} failed rounds after the outage",
            stats.consecutive_failures()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!handle.is_finished(), "the relay kept running");
    handle.shutdown().await.unwrap();

    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    let duplicates = verify(&committed, &received);
    eprintln!("database outage: {duplicates} duplicates");
}

/// The same errors in both modes (the progress mode changes none of them).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn invalid_configuration_is_a_clear_error(pool: PgPool) {
    relay_mode(&pool).await;
    let err = Relay::builder(pool.clone())
        .batch_size(0)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("batch size"), "{err}");
    let err = Relay::builder(pool.clone())
        .brokers(" ")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("brokers"), "{err}");
    let err = Relay::builder(pool.clone())
        .max_events_per_second(Some(0))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("max events per second"), "{err}");
    let err = Relay::builder(pool.clone())
        .missing_topic_hold(Duration::from_secs(10), Duration::from_secs(1))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("missing topic hold"), "{err}");
    let relay = Relay::builder(pool)
        .kafka_setting("no.such.setting", "1")
        .build()
        .unwrap();
    let err = relay
        .run(outbox_runtime::CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no.such.setting"), "{err}");
}

/// Writers are the same in both modes: they notify only while a relay
/// waits.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn writers_notify_only_while_a_relay_waits(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-wake");
    let scope = outbox_runtime::OutboxScope::of(&pool).await.unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen(&scope.channel()).await.unwrap();
    // No relay waits: committing sends no NOTIFY (no commit-time lock).
    let quiet = commit_messages(&pool, &topic, 3, 1, 3).await;

    // A waiting relay holds the wake lock: writers notify.
    let mut waiting = pool.acquire().await.unwrap();
    let armed: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(scope.wake_lock())
        .fetch_one(&mut *waiting)
        .await
        .unwrap();
    assert!(armed);
    let loud = commit_messages(&pool, &topic, 3, 1, 3).await;

    // Notifications arrive in commit order: a marker sent after both commits
    // comes after whatever they sent.
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(scope.channel())
        .execute(&pool)
        .await
        .unwrap();
    let mut before_marker = 0;
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("the marker arrives")
            .unwrap();
        if n.payload() == "marker" {
            break;
        }
        before_marker += 1;
    }
    assert_eq!(
        before_marker, 1,
        "one NOTIFY, for {loud:?} (a relay waited), none for {quiet:?} (none waited)"
    );
}

/// Wake locks are per database: a relay waiting on another database's outbox
/// must not make this relay believe writers here will notify it. The writer
/// holds the wake lock shared (mid-transaction) when the relay tries to arm;
/// once it commits, the relay must find its row at once, not after its poll
/// interval. (In the progress mode, enabled before the writer begins: its
/// transaction is in flight when the relay's first window is taken.)
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_waiting_on_another_database_does_not_delay_this_one(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-wake-other-db");
    create_topic(&brokers(), &topic).await;
    let other_db = format!("outbox_wake_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(&format!("CREATE DATABASE {other_db}"))
        .execute(&pool)
        .await
        .unwrap();
    let other = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone().database(&other_db))
        .await
        .unwrap();
    // "A relay waits on the other database": it holds that database's wake
    // lock, with the key of this database's (its outbox table could have the
    // same oid).
    let scope = outbox_runtime::OutboxScope::of(&pool).await.unwrap();
    let mut waiting = other.acquire().await.unwrap();
    let armed: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(scope.wake_lock())
        .fetch_one(&mut *waiting)
        .await
        .unwrap();
    assert!(armed);

    // A writer mid-transaction here: its insert took the wake lock shared.
    let mut tx = pool.begin().await.unwrap();
    outbox_core::insert_messages(&mut tx, &[message(&topic, "k", 1)], &Default::default())
        .await
        .unwrap();
    let handle = relay(&pool)
        .poll_interval(Duration::from_secs(10))
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let committed = Instant::now();
    tx.commit().await.unwrap();
    assert!(
        wait_until_published(&pool, Duration::from_secs(3)).await,
        "published right after the commit, not after the 10 s poll"
    );
    eprintln!("published {:?} after the commit", committed.elapsed());
    handle.shutdown().await.unwrap();
    drop(waiting);
    other.close().await;
    sqlx::query(&format!("DROP DATABASE {other_db} WITH (FORCE)"))
        .execute(&pool)
        .await
        .unwrap();
}

/// A relay with a rate limit publishes everything, in order, never ahead
/// of its budget: at any moment at most one batch plus the rate times the
/// time since it started (a bound that only a relay ignoring its limit can
/// break, however slow the machine). Both modes: the limit is the relay's
/// loop's, whatever it reads from.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_rate_limited_relay_keeps_to_its_rate_and_publishes_everything(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-rate");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(&pool, &topic, 1_500, 20, 500).await;
    let (rate, batch) = (500.0, 100_u64);
    let started = Instant::now();
    let handle = relay(&pool)
        .batch_size(batch as usize)
        .max_events_per_second(Some(rate as u32))
        .spawn()
        .unwrap();
    let mut samples = 0;
    while handle.counts().published < committed.len() as u64 {
        let published = handle.counts().published;
        let budget = batch + (rate * started.elapsed().as_secs_f64()) as u64;
        assert!(
            published <= budget,
            "{published} published after {:?}: over the budget {budget}",
            started.elapsed()
        );
        samples += 1;
        assert!(started.elapsed() < Duration::from_secs(60), "drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(samples > 10, "observed while draining");
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    verify(&committed, &received);
}
