//! The relay in the progress mode (`relay::progress`): positions per batch
//! instead of a mark per row. Real PostgreSQL, real broker. Each test
//! enables the mode on its fresh database, runs relays, and checks what a
//! consumer of the topic reads (every committed event, first deliveries of
//! a key in commit order) and what the relays wrote.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::relay::progress;
use outbox_runtime::{Relay, ops};
use sqlx::PgPool;
use sqlx::types::chrono;

fn relay(pool: &PgPool) -> outbox_runtime::RelayBuilder {
    Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
}

/// Waits until the progress mode has nothing left to publish.
async fn wait_until_done(pool: &PgPool, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if progress::pending(pool).await.unwrap() == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Rows of the outbox written or locked since they were inserted (a row
/// version's `xmax` is set by an update, a delete or a row lock).
async fn touched(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE xmax::text <> '0'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// If events are missing, says where the topic's offsets have holes (a
/// record the broker acknowledged and does not return) before the check
/// fails: the test broker's defect, not a lost event, if the holes account
/// for them.
fn report_holes(committed: &[uuid::Uuid], received: &[Received]) {
    let seen: std::collections::HashSet<uuid::Uuid> =
        received.iter().map(Received::event_id).collect();
    let missing = committed.iter().filter(|id| !seen.contains(id)).count();
    if missing == 0 {
        return;
    }
    let mut by_partition: std::collections::BTreeMap<i32, Vec<i64>> = Default::default();
    for r in received {
        by_partition.entry(r.partition).or_default().push(r.offset);
    }
    for (partition, offsets) in by_partition {
        let (first, last) = (offsets[0], offsets[offsets.len() - 1]);
        let holes = (last - first + 1) as usize - offsets.len();
        eprintln!(
            "partition {partition}: offsets {first}..={last}, {} records, {holes} holes",
            offsets.len()
        );
    }
    eprintln!("{missing} events missing");
}

/// One relay, writers committing while it runs: every event arrives once,
/// each key in commit order, and no outbox row was written or locked to
/// publish it — the positions are the only writes.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_publishes_every_event_once_in_key_order_without_writing_a_row(pool: PgPool) {
    let topic = unique_topic("progress-basic");
    create_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
    let mut committed = commit_messages(&pool, &topic, 2_000, 50, 100).await;
    let handle = relay(&pool).batch_size(300).spawn().unwrap();
    // More while it runs, some in transactions that overlap.
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (pool, topic) = (pool.clone(), topic.clone());
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for round in 0..20 {
                    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
                    for i in 0..25 {
                        let seq = 10_000 + w * 1_000 + round * 25 + i;
                        ids.push(uow.record_message(message(
                            &topic,
                            &format!("w{w}-{}", i % 5),
                            seq,
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    uow.commit().await.unwrap();
                }
                ids
            })
        })
        .collect();
    for w in writers {
        committed.extend(w.await.unwrap());
    }
    assert!(
        wait_until_done(&pool, Duration::from_secs(60)).await,
        "relay drained the outbox"
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.published as usize, committed.len());

    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    let duplicates = verify(&committed, &received);
    assert_eq!(duplicates, 0, "one relay, no failure: no duplicates");
    assert_eq!(touched(&pool).await, 0, "no outbox row written or locked");
    let marked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(marked, 0);
    let positions: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_progress")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        positions > 1 && (positions as usize) < committed.len(),
        "positions per batch and lane, not per event: {positions}"
    );
}

/// A relay on a task of its own, aborted to crash it.
fn crashable(pool: &PgPool) -> tokio::task::JoinHandle<()> {
    let relay = relay(pool).batch_size(200).build().unwrap();
    tokio::spawn(async move {
        let _ = relay.run(tokio_util::sync::CancellationToken::new()).await;
    })
}

/// Three relays share the lanes while writers commit; relays are aborted
/// (a crash: the batch in flight is neither finished nor flushed) and
/// started again, four times. Nothing is lost, every key's first
/// deliveries follow commit order; duplicates come only from batches the
/// crashed relays had not recorded.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relays_that_crash_and_restart_lose_nothing_and_keep_key_order(pool: PgPool) {
    let topic = unique_topic("progress-crash");
    // Several relays write it at once: see `create_warm_topic`.
    create_warm_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let (pool, topic, stop) = (pool.clone(), topic.clone(), stop.clone());
            tokio::spawn(async move {
                let mut ids = Vec::new();
                let mut seq = 0;
                while !stop.load(Ordering::Relaxed) {
                    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
                    for i in 0..20 {
                        ids.push(uow.record_message(message(
                            &topic,
                            &format!("w{w}-{}", i % 7),
                            seq,
                        )));
                        seq += 1;
                    }
                    uow.commit().await.unwrap();
                }
                ids
            })
        })
        .collect();
    let mut relays: Vec<_> = (0..3).map(|_| crashable(&pool)).collect();
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let victim = relays.remove(round % relays.len());
        victim.abort();
        let _ = victim.await;
        relays.push(crashable(&pool));
    }
    stop.store(true, Ordering::Relaxed);
    let mut committed = Vec::new();
    for w in writers {
        committed.extend(w.await.unwrap());
    }
    assert!(
        wait_until_done(&pool, Duration::from_secs(90)).await,
        "relays drained the outbox"
    );
    for r in relays {
        r.abort();
    }
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    report_holes(&committed, &received);
    let duplicates = verify(&committed, &received);
    eprintln!(
        "{} events, {duplicates} duplicates after 4 crashes",
        committed.len()
    );
    assert_eq!(touched(&pool).await, 0, "no outbox row written or locked");
}

/// A poison event (too large for the producer) is retried, then parked;
/// its key's later events wait behind it (held: the rare path writes those
/// rows) and follow in order once it is parked; other keys never wait.
/// Requeued, it is read again although its lane's position is past it.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_poison_event_is_parked_and_holds_back_only_its_key(pool: PgPool) {
    let topic = unique_topic("progress-poison");
    create_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
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
        let parked = ops::status(&pool).await.unwrap().parked;
        if parked == 1 && progress::pending(&pool).await.unwrap() == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "poison not parked / others not drained"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    assert_eq!(verify(&committed, &received), 0);
    assert!(received.iter().all(|r| r.event_id() != poison_id));
    let (attempts, parked): (i32, bool) = sqlx::query_as(
        "SELECT attempts, parked_at IS NOT NULL FROM outbox_event WHERE event_id = $1",
    )
    .bind(poison_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, parked), (3, true));
    // Only the poison and its key's later events were written (held, then
    // marked published by the rare path): no other key's row.
    let written: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT partition_key FROM outbox_event WHERE xmax::text <> '0'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(written, vec!["k0".to_owned()]);

    // Requeued with a size the producer takes: it goes out.
    sqlx::query("UPDATE outbox_event SET payload = '{\"seq\": 1}' WHERE event_id = $1")
        .bind(poison_id)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(ops::requeue_parked(&pool, None).await.unwrap(), 1);
    assert!(wait_until_done(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(
        &brokers(),
        &topic,
        committed.len() + 1,
        Duration::from_secs(30),
    )
    .await;
    assert!(received.iter().any(|r| r.event_id() == poison_id));
}

/// A producer queue too small for a batch withholds rows without a hold:
/// their lane's position stops before the first and the lane is read again
/// from there. Nothing is lost and each key stays in order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn rows_withheld_without_a_hold_are_read_again_in_order(pool: PgPool) {
    let topic = unique_topic("progress-withheld");
    create_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
    let committed = commit_messages(&pool, &topic, 3_000, 5, 100).await;
    let handle = relay(&pool)
        .kafka_setting("queue.buffering.max.messages", "40")
        .batch_size(200)
        .spawn()
        .unwrap();
    assert!(wait_until_done(&pool, Duration::from_secs(60)).await);
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert!(
        counts.withheld > 0,
        "the small queue held rows back: {counts:?}"
    );
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    report_holes(&committed, &received);
    let duplicates = verify(&committed, &received);
    eprintln!("{} events, {duplicates} duplicates", committed.len());
    assert_eq!(
        touched(&pool).await,
        0,
        "no row written: they were read again"
    );
}

/// The broker stops answering mid-drain (SIGSTOP): deliveries time out,
/// the lanes are read again from the first undelivered row, and once it
/// answers everything arrives, each key in order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_broker_that_stops_answering_costs_nothing(pool: PgPool) {
    let port = free_port();
    let broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = unique_topic("progress-outage");
    create_topic(&brokers, &topic).await;
    progress::enable(&pool).await.unwrap();
    let committed = commit_messages(&pool, &topic, 3_000, 20, 100).await;
    let handle = Relay::builder(pool.clone())
        .brokers(&brokers)
        .delivery_timeout(Duration::from_secs(2))
        .outage_backoff(Duration::from_millis(200), Duration::from_secs(1))
        .batch_size(100)
        .max_events_per_second(Some(2_000))
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    broker.pause();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let pending_in_outage = progress::pending(&pool).await.unwrap();
    broker.resume();
    assert!(wait_until_done(&pool, Duration::from_secs(60)).await);
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert!(pending_in_outage > 0, "the outage came mid-drain");
    assert!(
        counts.failed > 0,
        "deliveries failed in the outage: {counts:?}"
    );
    let received = read_topic(&brokers, &topic, committed.len(), Duration::from_secs(60)).await;
    report_holes(&committed, &received);
    let duplicates = verify(&committed, &received);
    eprintln!("{} events, {duplicates} duplicates", committed.len());
    assert_eq!(
        touched(&pool).await,
        0,
        "no row written: they were read again"
    );
}

/// A relay without lanes would read every lane's window beside the others:
/// in the progress mode it refuses to start, saying why.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_without_lanes_is_refused(pool: PgPool) {
    progress::enable(&pool).await.unwrap();
    let error = relay(&pool)
        .lanes(0)
        .spawn()
        .unwrap()
        .join()
        .await
        .unwrap_err();
    assert!(error.to_string().contains("progress mode"), "{error}");
}

/// The relay as its role: the guide's block lets it read the mode; in the
/// progress mode it also needs to insert positions. Without that grant its
/// first finish is refused, reported as such, and it stops publishing
/// (nothing more is claimed until the positions are recorded); given the
/// grant, it writes them and goes on: every event once, none twice.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_relay_role_records_positions_only_with_its_grant(pool: PgPool) {
    use common::roles::*;
    use outbox_runtime::RelayHealth;
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    // The mode's other grant: held topics.
    roles
        .sql("GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_held_topic TO outbox_relay")
        .await;
    progress::enable(&pool).await.unwrap();
    let topic = unique_topic("progress-roles");
    create_topic(&brokers(), &topic).await;
    let app = roles.pool("outbox_app", 1);
    let committed = commit_messages(&app, &topic, 200, 10, 20).await;
    let relay = Relay::builder(roles.pool("outbox_relay", 4))
        .brokers(brokers())
        .batch_size(50)
        .poll_interval(Duration::from_millis(100))
        .outage_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .spawn()
        .unwrap();
    let refused = eventually(Duration::from_secs(20), || async {
        matches!(relay.health(), RelayHealth::Refused { error }
            if error.contains("record progress") && error.contains("permission denied"))
    })
    .await;
    assert!(refused, "{:?}\n{}", relay.health(), logs.text());
    // The batches already open when the refusal came settle; then nothing.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let published = relay.counts().published;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        relay.counts().published,
        published,
        "nothing more is published while its positions are refused"
    );
    assert!(published < committed.len() as u64, "{published}");
    assert_eq!(logs.count("permission denied"), 1, "{}", logs.text());

    roles
        .sql("GRANT INSERT ON outbox_progress TO outbox_relay")
        .await;
    assert!(wait_until_done(&pool, Duration::from_secs(30)).await);
    assert!(
        eventually(Duration::from_secs(10), || async {
            relay.health() == RelayHealth::Running
        })
        .await,
        "{:?}",
        relay.health()
    );
    relay.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    assert_eq!(verify(&committed, &received), 0, "no event published twice");
    app.close().await;
    roles.drop_all().await;
}

/// What operators read and run in the progress mode: `status` and the
/// backlog gauges count the rows the positions have not passed (all of
/// them before the relay, none after, although no row is marked); the
/// cleanup deletes the old rows the positions passed and never one they
/// have not, and prunes the positions no lane stands at.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn status_gauges_and_cleanup_follow_the_positions(pool: PgPool) {
    use outbox_runtime::cleanup::{self, Retention};
    let topic = unique_topic("progress-ops");
    create_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
    let committed = commit_messages(&pool, &topic, 500, 20, 50).await;
    let gauges = |pool: PgPool| async move {
        let (backlog, _, parked, held): (i64, Option<f64>, i64, i64) =
            sqlx::query_as(ops::progress_gauges_sql())
                .fetch_one(&pool)
                .await
                .unwrap();
        (backlog, parked, held)
    };
    let status = ops::status(&pool).await.unwrap();
    assert_eq!(status.unpublished, 500, "{status:?}");
    assert_eq!(gauges(pool.clone()).await, (500, 0, 0));

    let handle = relay(&pool).batch_size(100).spawn().unwrap();
    assert!(wait_until_done(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    assert_eq!(verify(&committed, &received), 0);
    let status = ops::status(&pool).await.unwrap();
    assert_eq!(status.unpublished, 0, "{status:?}");
    let published: i64 = status.topics.iter().map(|t| t.published).sum();
    assert_eq!(published, 500, "{status:?}");
    assert_eq!(gauges(pool.clone()).await, (0, 0, 0));

    // Ten more, not published (no relay); then everything is made old.
    let later = commit_messages(&pool, &topic, 10, 5, 10).await;
    assert_eq!(ops::status(&pool).await.unwrap().unpublished, 10);
    assert_eq!(gauges(pool.clone()).await, (10, 0, 0));
    sqlx::query("UPDATE outbox_event SET created_at = created_at - interval '40 days'")
        .execute(&pool)
        .await
        .unwrap();
    // The positions too: the cleanup keeps one a minute of those recorded
    // within the retention window, so that positions recorded across a
    // minute's turn would all be kept.
    sqlx::query("UPDATE outbox_progress SET recorded_at = recorded_at - interval '40 days'")
        .execute(&pool)
        .await
        .unwrap();
    let positions = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_progress")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = positions().await;
    let report = cleanup::cleanup(&pool, &Retention::new(Duration::from_secs(30 * 86_400)))
        .await
        .unwrap();
    assert_eq!(report.outbox_events, 500, "{report:?}");
    assert!(
        report.positions > 0 && positions().await < before,
        "{report:?}"
    );
    let left: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT event_id FROM outbox_event ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, later, "the rows the positions have not passed stay");
    // The positions kept still say where each lane stands: the ten go out.
    let handle = relay(&pool).spawn().unwrap();
    assert!(wait_until_done(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(
        &brokers(),
        &topic,
        committed.len() + later.len(),
        Duration::from_secs(30),
    )
    .await;
    let all: Vec<uuid::Uuid> = committed.iter().chain(&later).copied().collect();
    assert_eq!(verify(&all, &received), 0);
}

/// When was this event published? In the progress mode no time is
/// written per event: an event's page answers with the time of the first
/// position recorded past it. The cleanup thins the positions of the
/// retention window to one a minute per set of slots (the time then at most
/// a minute late) and deletes older ones, never the newest of a set.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn an_event_published_without_a_mark_is_dated_by_its_position_to_the_minute(pool: PgPool) {
    let topic = unique_topic("progress-dated");
    create_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
    let first = commit_messages(&pool, &topic, 300, 10, 30).await;
    let handle = relay(&pool).batch_size(20).spawn().unwrap();
    assert!(wait_until_done(&pool, Duration::from_secs(30)).await);
    // A second batch of events, published later than the first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let between: String = sqlx::query_scalar(
        r#"SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')"#,
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let second = commit_messages(&pool, &topic, 300, 10, 30).await;
    assert!(wait_until_done(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let unpublished = commit_messages(&pool, &topic, 5, 5, 5).await;

    // (id, created, published by) of each event, as its page says.
    let dated = |events: Vec<uuid::Uuid>| {
        let pool = pool.clone();
        async move {
            let mut rows = Vec::new();
            for event_id in events {
                let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event WHERE event_id = $1")
                    .bind(event_id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                let row = ops::outbox_row(&pool, id).await.unwrap().unwrap();
                rows.push((row.state(), row.passed, row.created_at, row.published_by));
            }
            rows
        }
    };
    let time = |t: &str| chrono::DateTime::parse_from_rfc3339(t).unwrap();
    let before = dated(first.clone()).await;
    for (state, passed, created, by) in &before {
        assert_eq!((*state, *passed), (ops::RowState::Published, true));
        let by = by.as_deref().expect("a published event has a time");
        assert!(
            time(by) >= time(created),
            "published by {by}, created {created}"
        );
    }
    let later = dated(second.clone()).await;
    let latest_first = before.iter().map(|r| time(r.3.as_ref().unwrap())).max();
    let earliest_second = later.iter().map(|r| time(r.3.as_ref().unwrap())).min();
    assert!(
        latest_first < Some(time(&between)) && earliest_second > Some(time(&between)),
        "the first batch dated before the second was written, the second after: \
         {latest_first:?} {between} {earliest_second:?}"
    );
    for (state, passed, _, by) in dated(unpublished.clone()).await {
        assert_eq!(
            (state, passed, by),
            (ops::RowState::Unpublished, false, None)
        );
    }

    // Move the positions back in time, in id order: the first half spread
    // over 50 to 40 minutes ago, the second over the last 3 minutes; the
    // events made older than all of them.
    sqlx::query(
        "UPDATE outbox_progress p
         SET recorded_at = now() - CASE WHEN r.n * 2 <= r.total
             THEN make_interval(secs => 3000 - 600.0 * r.n * 2 / r.total)
             ELSE make_interval(secs => 180.0 * (1 - (r.n * 2 - r.total)::float8 / r.total)) END
         FROM (SELECT id, row_number() OVER (ORDER BY id) AS n, count(*) OVER () AS total
               FROM outbox_progress) r
         WHERE p.id = r.id",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox_event SET created_at = now() - interval '2 hours'")
        .execute(&pool)
        .await
        .unwrap();
    let spread = dated(first.iter().chain(&second).copied().collect()).await;
    let positions_before: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_progress")
        .fetch_one(&pool)
        .await
        .unwrap();
    let newest_before: Vec<String> = progress::positions(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| format!("{} {} {:?} {:?}", p.slots, p.done, p.upto, p.after_id))
        .collect();
    let crowded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM outbox_progress
         GROUP BY slots, date_trunc('minute', recorded_at) HAVING count(*) > 1) m",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        crowded > 0,
        "some lane recorded several positions in a minute"
    );
    // Keep what was recorded within the last 30 minutes, one a minute.
    let cutoff: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now() - interval '30 minutes'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let pruned = progress::prune(&pool, cutoff).await.unwrap();
    assert!(pruned > 0);
    let (old, per_minute): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_progress p WHERE recorded_at < $1
                 AND EXISTS (SELECT 1 FROM outbox_progress n WHERE n.slots = p.slots
                             AND n.id > p.id)),
                (SELECT coalesce(max(c), 0) FROM (
                    SELECT count(*) AS c FROM outbox_progress
                    WHERE recorded_at >= $1
                    GROUP BY slots, date_trunc('minute', recorded_at)) m)",
    )
    .bind(cutoff)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        old, 0,
        "positions before the window go, but each set's newest"
    );
    assert_eq!(
        per_minute, 1,
        "one a minute per set of slots within the window"
    );
    let newest_after: Vec<String> = progress::positions(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| format!("{} {} {:?} {:?}", p.slots, p.done, p.upto, p.after_id))
        .collect();
    assert_eq!(newest_after, newest_before, "where each set stands is kept");
    let positions_after: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_progress")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(positions_before - positions_after, pruned as i64);

    // Every event's time after the thinning is never earlier than before;
    // published within the window, at most a minute later. (An event
    // published before the window would have been deleted by the same
    // cleanup pass, created before it: here it keeps a later bound, or
    // none.)
    let thinned = dated(first.iter().chain(&second).copied().collect()).await;
    let mut within = 0;
    for (was, now) in spread.iter().zip(&thinned) {
        assert_eq!((now.0, now.1), (ops::RowState::Published, true));
        let was = time(was.3.as_ref().unwrap());
        if was < cutoff {
            assert!(now.3.as_ref().is_none_or(|by| time(by) >= was));
            continue;
        }
        let by = time(now.3.as_ref().expect("published within the window: dated"));
        assert!(by >= was, "thinning never dates an event earlier");
        assert!(
            (by - was).num_seconds() < 60,
            "at most a minute later: {was} -> {by}"
        );
        within += 1;
    }
    assert!(within > 0, "some events were published within the window");
}

/// Turning the mode on releases the rows held back after failures (the
/// windows read them in id order with the rest), never a scheduled event
/// still waiting for its time: recorded before `enable`, it goes out after
/// its time, not at the relay's start.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_scheduled_event_keeps_its_time_across_enable(pool: PgPool) {
    use sqlx::types::chrono;
    let topic = unique_topic("progress-scheduled");
    create_topic(&brokers(), &topic).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let due = chrono::Utc::now() + Duration::from_secs(3);
    let scheduled = uow.record_message_at(due, message(&topic, "k", 0));
    let now = uow.record_message(message(&topic, "k", 1));
    uow.commit().await.unwrap();
    progress::enable(&pool).await.unwrap();
    let handle = relay(&pool).spawn().unwrap();
    let first = read_topic(&brokers(), &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(
        first.iter().map(Received::event_id).collect::<Vec<_>>(),
        vec![now]
    );
    assert!(chrono::Utc::now() < due, "the test outran its margin");
    let both = read_topic(&brokers(), &topic, 2, Duration::from_secs(30)).await;
    assert!(chrono::Utc::now() >= due);
    assert!(both.iter().any(|r| r.event_id() == scheduled));
    // Its mark commits after the delivery the topic shows.
    let published_at = || async {
        sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
            "SELECT published_at FROM outbox_event WHERE event_id = $1",
        )
        .bind(scheduled)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    eventually(Duration::from_secs(10), || async {
        published_at().await.is_some()
    })
    .await;
    let published_at = published_at().await;
    handle.shutdown().await.unwrap();
    assert!(published_at.is_some_and(|at| at >= due), "{published_at:?}");
}

/// A replay and an event's page tell what the positions passed as
/// published: the rows the relay published without writing them, and
/// those the rare path marked; never the parked one. The dedup window's
/// check counts a passed row by its creation time (the mode keeps no
/// publication time per row): more refused, never fewer.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn replay_and_the_event_page_see_what_the_positions_passed(pool: PgPool) {
    use outbox_runtime::replay::{self, ReplayFilter, ReplayOptions};

    let topic = unique_topic("progress-replay");
    let again = unique_topic("progress-replayed");
    create_topic(&brokers(), &topic).await;
    create_topic(&brokers(), &again).await;
    progress::enable(&pool).await.unwrap();
    let mut committed = Vec::new();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let mut poison = message(&topic, "k0", 0);
    poison.payload = serde_json::json!({ "seq": 0, "blob": "x".repeat(300_000) }).to_string();
    let poison_id = uow.record_message(poison);
    for seq in 1..30 {
        committed.push(uow.record_message(message(&topic, &format!("k{}", seq % 3), seq)));
    }
    uow.commit().await.unwrap();
    let handle = relay(&pool)
        .kafka_setting("message.max.bytes", "100000")
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(100), Duration::from_millis(200))
        .batch_size(10)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(ops::status(&pool).await.unwrap().parked == 1
        && progress::pending(&pool).await.unwrap() == 0)
    {
        assert!(Instant::now() < deadline, "poison parked, the rest drained");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    handle.shutdown().await.unwrap();
    let (by_position, marked): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL),
                count(*) FILTER (WHERE published_at IS NOT NULL)
         FROM outbox_event",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(by_position > 0, "some rows published without a write");
    assert!(marked > 0, "the poison's key: published by the rare path");

    // The event page.
    let id_of = |event_id: uuid::Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT id FROM outbox_event WHERE event_id = $1")
                .bind(event_id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let poison_row = ops::outbox_row(&pool, id_of(poison_id).await)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(poison_row.state(), ops::RowState::Parked);
    assert!(!poison_row.passed);
    let mut states = std::collections::HashMap::new();
    for &event_id in &committed {
        let row = ops::outbox_row(&pool, id_of(event_id).await)
            .await
            .unwrap()
            .unwrap();
        *states
            .entry((row.state().as_str(), row.passed, row.published_at.is_some()))
            .or_insert(0) += 1;
    }
    assert_eq!(
        states
            .get(&("published", true, false))
            .copied()
            .unwrap_or(0),
        by_position
    );
    assert_eq!(
        states
            .get(&("published", false, true))
            .copied()
            .unwrap_or(0),
        marked
    );

    // The selection: every published row, the parked one left out.
    let all = ReplayFilter::default();
    assert_eq!(
        replay::count(&pool, &all).await.unwrap(),
        committed.len() as u64
    );
    let window = Duration::from_secs(24 * 3600);
    let selected = replay::selection(&pool, &all, window).await.unwrap();
    assert_eq!(
        (selected.matched, selected.beyond_window),
        (committed.len() as u64, 0)
    );
    // Rows created two days ago: a passed row counts as published then.
    let aged: i64 = sqlx::query_scalar(
        "WITH a AS (UPDATE outbox_event SET created_at = created_at - interval '2 days'
                    WHERE published_at IS NULL AND parked_at IS NULL RETURNING 1)
         SELECT count(*) FROM a",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(aged, by_position);
    let selected = replay::selection(&pool, &all, window).await.unwrap();
    assert_eq!(selected.beyond_window, by_position as u64);
    let mut options = ReplayOptions::new(brokers(), all);
    options.to_topic = Some(again.clone());
    options.batch_size = 7;
    options.dedup_window = window;
    let refused = replay::replay(&pool, &options).await.unwrap_err();
    assert!(
        refused.to_string().contains("refusing to replay"),
        "{refused}"
    );
    options.force = true;
    let report = replay::replay(&pool, &options).await.unwrap();
    assert_eq!(report.replayed, committed.len() as u64);
    let received = read_topic(&brokers(), &again, committed.len(), Duration::from_secs(30)).await;
    assert_eq!(verify(&committed, &received), 0);
    assert!(received.iter().all(|r| r.event_id() != poison_id));
}

/// Events of `topic` the windows passed over while it is held as missing.
async fn passed_over(pool: &PgPool, topic: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(rows), 0)::int8 FROM outbox_held_topic WHERE topic = $1",
    )
    .bind(topic)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Enables the progress mode, commits 1,000 events of `topic` (missing on
/// the broker) over keys k0–k19, and starts a relay with batches of
/// `batch_size` that holds the topic (rechecked within 2 s); returns once
/// every event is passed over, with the events and the relay.
async fn pass_over_missing_topic(
    pool: &PgPool,
    topic: &str,
    batch_size: usize,
) -> (Vec<uuid::Uuid>, outbox_runtime::RelayHandle) {
    progress::enable(pool).await.unwrap();
    let committed = commit_messages(pool, topic, 1_000, 20, 100).await;
    let handle = relay(pool)
        .missing_topic_hold(Duration::from_secs(1), Duration::from_secs(2))
        .batch_size(batch_size)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            passed_over(pool, topic).await >= 1_000
        })
        .await,
        "every event passed over: {}",
        passed_over(pool, topic).await
    );
    (committed, handle)
}

/// Creates `topic` on the broker while a writer keeps committing events to
/// it, 10 a transaction over keys k0–k19 (k0 and k1 with `two_keys`),
/// `pause` between transactions:
/// the topic is created `before` after the writer starts, and the writer
/// stops `after` later. Returns the writer's events, in commit order.
async fn write_while_created(
    pool: &PgPool,
    topic: &str,
    two_keys: bool,
    pause: Duration,
    before: Duration,
    after: Duration,
) -> Vec<uuid::Uuid> {
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (pool, topic, writing) = (pool.clone(), topic.to_owned(), writing.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut seq = 10_000;
            while writing.load(Ordering::Relaxed) {
                let mut uow = UnitOfWork::begin(&pool).await.unwrap();
                for _ in 0..10 {
                    let key = format!("k{}", seq % if two_keys { 2 } else { 20 });
                    ids.push(uow.record_message(message(&topic, &key, seq)));
                    seq += 1;
                }
                uow.commit().await.unwrap();
                tokio::time::sleep(pause).await;
            }
            ids
        })
    };
    tokio::time::sleep(before).await;
    create_topic(&brokers(), topic).await;
    tokio::time::sleep(after).await;
    writing.store(false, Ordering::Relaxed);
    writer.await.unwrap()
}

/// A topic missing on the broker is held as one row, not row by row: its
/// events are passed over by the windows without being written, the other
/// topic drains, `status`, the gauges and the cleanup still count them as
/// waiting. Once the topic exists (created while a writer keeps committing
/// events to it), every event goes out, each key in commit order, and the
/// hold is gone.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_missing_topic_is_held_as_one_row_and_its_events_follow_once_it_exists(pool: PgPool) {
    common::init_tracing();
    use outbox_runtime::cleanup::{self, Retention};
    let good = unique_topic("progress-good");
    let missing = unique_topic("progress-missing");
    create_topic(&brokers(), &good).await;
    progress::enable(&pool).await.unwrap();
    let mut committed_missing = commit_messages(&pool, &missing, 2_000, 20, 100).await;
    let committed_good = commit_messages(&pool, &good, 500, 10, 100).await;

    let handle = relay(&pool)
        .missing_topic_hold(Duration::from_secs(1), Duration::from_secs(2))
        .batch_size(200)
        .spawn()
        .unwrap();
    let received = read_topic(
        &brokers(),
        &good,
        committed_good.len(),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(verify(&committed_good, &received), 0);
    assert!(
        eventually(Duration::from_secs(30), || async {
            passed_over(&pool, &missing).await >= 2_000
        })
        .await,
        "every event of the missing topic passed over: {}",
        passed_over(&pool, &missing).await
    );
    let holds: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_held_topic")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(holds, 1, "one row for the topic");
    let written: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_event WHERE topic = $1
         AND (held_until IS NOT NULL OR last_error IS NOT NULL OR xmax::text <> '0')",
    )
    .bind(&missing)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        written, 0,
        "no event of the missing topic written or locked"
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            progress::pending(&pool).await.unwrap() == 2_000
        })
        .await,
        "only the missing topic's events wait: {}",
        progress::pending(&pool).await.unwrap()
    );
    let status = ops::status(&pool).await.unwrap();
    assert!(status.unpublished >= 2_000, "{status:?}");
    let (backlog, _, _, held): (i64, Option<f64>, i64, i64) =
        sqlx::query_as(ops::progress_gauges_sql())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(backlog >= 2_000 && held >= 2_000, "{backlog} {held}");
    // Made old, the waiting events are not deleted.
    sqlx::query("UPDATE outbox_event SET created_at = created_at - interval '40 days'")
        .execute(&pool)
        .await
        .unwrap();
    let report = cleanup::cleanup(&pool, &Retention::new(Duration::from_secs(30 * 86_400)))
        .await
        .unwrap();
    assert_eq!(
        report.outbox_events, 500,
        "only the good topic's: {report:?}"
    );
    assert_eq!(progress::pending(&pool).await.unwrap(), 2_000);

    // A writer keeps committing events of the missing topic (the same
    // keys, one transaction after another) while it is created.
    committed_missing.extend(
        write_while_created(
            &pool,
            &missing,
            false,
            Duration::from_millis(20),
            Duration::from_millis(500),
            Duration::from_secs(3),
        )
        .await,
    );
    assert!(
        wait_until_done(&pool, Duration::from_secs(60)).await,
        "pending: {}",
        progress::pending(&pool).await.unwrap()
    );
    handle.shutdown().await.unwrap();
    assert_eq!(
        passed_over(&pool, &missing).await,
        0,
        "the hold is gone once the topic exists"
    );
    let received = read_topic(
        &brokers(),
        &missing,
        committed_missing.len(),
        Duration::from_secs(60),
    )
    .await;
    report_holes(&committed_missing, &received);
    verify(&committed_missing, &received);
}

/// A key's events behind its held rows keep commit order while batches
/// overlap. A missing topic's 1,000 events over 20 keys are passed over,
/// then released as held rows once the topic exists, while a writer keeps
/// committing events of the same keys. With batches of 10, the last held
/// rows go out in one batch, the next holds the window's rows behind them
/// (its hold written when it ends), and the one after is claimed while
/// that hold is not committed but the held rows' marks are: it sees no
/// held row before the keys' later rows, and must not send them ahead of
/// the rows the batch before it holds. (The race is not forced: before the
/// relay made such rows wait, 3 runs of this test in 21 sent a key's later
/// rows first.)
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn rows_behind_held_rows_keep_their_keys_order_while_batches_overlap(pool: PgPool) {
    common::init_tracing();
    let topic = unique_topic("progress-behind-held");
    let (mut committed, handle) = pass_over_missing_topic(&pool, &topic, 10).await;
    committed.extend(
        write_while_created(
            &pool,
            &topic,
            false,
            Duration::from_millis(5),
            Duration::from_millis(300),
            Duration::from_secs(4),
        )
        .await,
    );
    assert!(
        wait_until_done(&pool, Duration::from_secs(60)).await,
        "pending: {}",
        progress::pending(&pool).await.unwrap()
    );
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    report_holes(&committed, &received);
    verify(&committed, &received);
}

/// Once a released topic's held rows are out, its keys leave the held
/// rows' path, even keys with rows in every batch. A missing topic's 1,000
/// events over 20 keys are passed over, then released as held rows once
/// the topic exists, while a writer keeps committing events of two of
/// those keys, both in every transaction, so in every batch (batches of up
/// to 1,000: a claim has room for the window's rows beside the held ones).
/// The window's rows behind the held ones are held too (written twice: a
/// hold, then a mark); once the released rows are out, the keys' later
/// rows go out through the windows, written by no one: none of the
/// writer's last third is marked. Each half of the relay's way out is
/// needed: with a batch that holds such rows claimed after (not while) it
/// ends, but the window rows' probe counting the held rows claimed with
/// them, or the other way round, every one of the writer's events was
/// marked (each batch held the keys' rows behind the holds of the one
/// before). Every event arrives, each key in order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn keys_with_rows_in_every_batch_leave_the_held_rows_path_once_it_is_empty(pool: PgPool) {
    common::init_tracing();
    let topic = unique_topic("progress-leave-held");
    let (mut committed, handle) = pass_over_missing_topic(&pool, &topic, 1_000).await;
    let written = write_while_created(
        &pool,
        &topic,
        true,
        Duration::from_millis(2),
        Duration::from_millis(300),
        Duration::from_secs(9),
    )
    .await;
    assert!(
        wait_until_done(&pool, Duration::from_secs(60)).await,
        "pending: {}",
        progress::pending(&pool).await.unwrap()
    );
    handle.shutdown().await.unwrap();
    let last_third = written[written.len() * 2 / 3..].to_vec();
    let marked = |ids: Vec<uuid::Uuid>| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outbox_event
                 WHERE event_id = ANY($1) AND published_at IS NOT NULL",
            )
            .bind(ids)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (all_marked, late_marked) = (
        marked(written.clone()).await,
        marked(last_third.clone()).await,
    );
    eprintln!(
        "the writer's {} events: {all_marked} marked; its last {}: {late_marked} marked",
        written.len(),
        last_third.len()
    );
    assert_eq!(
        late_marked, 0,
        "the keys' later rows go out through the windows, not the held rows' path"
    );
    committed.extend(written);
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    report_holes(&committed, &received);
    verify(&committed, &received);
}

/// The relay role with the progress mode's grant on the positions but only
/// `SELECT` on held topics (an upgrade that missed a line): a topic missing
/// on the broker cannot be recorded. The refusal is reported once, naming
/// the statement, and in the relay's health; the relay does not spin, and
/// the rest of the outbox is still published (the lane of the missing
/// topic's event stops just before it, the position never passes it).
/// Given the grant, the topic is held; created, its event goes out.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_refused_topic_hold_stops_only_its_lane_and_loses_nothing(pool: PgPool) {
    use common::roles::*;
    use outbox_runtime::RelayHealth;
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    roles
        .sql("GRANT INSERT ON outbox_progress TO outbox_relay")
        .await;
    roles
        .sql("GRANT SELECT ON outbox_held_topic TO outbox_relay")
        .await;
    progress::enable(&pool).await.unwrap();
    let good = unique_topic("progress-refused-good");
    let missing = unique_topic("progress-refused-missing");
    create_topic(&brokers(), &good).await;
    let app = roles.pool("outbox_app", 1);
    let mut committed = commit_messages(&app, &good, 200, 20, 50).await;
    let mut uow = UnitOfWork::begin(&app).await.unwrap();
    let lost = uow.record_message(message(&missing, "k0", 0));
    uow.commit().await.unwrap();
    // The good topic's events after it, of every key (k0's lane included).
    committed.extend(commit_messages(&app, &good, 200, 20, 50).await);
    let relay = Relay::builder(roles.pool("outbox_relay", 4))
        .brokers(brokers())
        .batch_size(100)
        .missing_topic_hold(Duration::from_secs(1), Duration::from_secs(2))
        .poll_interval(Duration::from_millis(100))
        .outage_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .spawn()
        .unwrap();
    let refused = eventually(Duration::from_secs(20), || async {
        matches!(relay.health(), RelayHealth::Refused { error }
            if error.contains("topic missing on the broker") && error.contains("permission denied"))
    })
    .await;
    assert!(refused, "{:?}\n{}", relay.health(), logs.text());
    // The other lanes' events are published meanwhile: at least every
    // event but those of the missing event's lane after it (those of its
    // batch delivered before the refusal are out too, marked, not sent
    // again).
    let expected: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_event e, outbox_event m
         WHERE m.event_id = $1 AND e.topic = $2
           AND (e.lane_slot % 16 <> m.lane_slot % 16 OR e.id < m.id)",
    )
    .bind(lost)
    .bind(&good)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(expected > 300 && expected < 400, "{expected}");
    let received = read_topic(
        &brokers(),
        &good,
        expected as usize,
        Duration::from_secs(30),
    )
    .await;
    assert!(received.len() as i64 >= expected, "{}", logs.text());
    let batches = relay.counts().batches;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let rounds = relay.counts().batches - batches;
    assert!(rounds <= 8, "{rounds} batches in 4 s while refused");
    assert!(matches!(relay.health(), RelayHealth::Refused { .. }));
    let reported = logs.refusals();
    assert_eq!(
        logs.count("permission denied"),
        reported.len(),
        "{}",
        logs.text()
    );
    // The missing event is never passed: its lane's position stops before it.
    let waiting: bool = sqlx::query_scalar(&format!(
        "{}SELECT NOT {} FROM outbox_event WHERE event_id = $1",
        progress::Published::in_mode(true).with,
        progress::Published::in_mode(true).condition
    ))
    .bind(lost)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        waiting,
        "the missing topic's event is not taken as published"
    );

    roles
        .sql("GRANT INSERT, UPDATE, DELETE ON outbox_held_topic TO outbox_relay")
        .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            progress::pending(&pool).await.unwrap() == 1 && relay.health() == RelayHealth::Running
        })
        .await,
        "{:?} pending {}\n{}",
        relay.health(),
        progress::pending(&pool).await.unwrap(),
        logs.text()
    );
    let held = progress::held_topics(&pool).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0].topic, missing);
    create_topic(&brokers(), &missing).await;
    assert!(wait_until_done(&pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();
    let received = read_all(&brokers(), &good, Duration::from_secs(30)).await;
    assert_eq!(verify(&committed, &received), 0, "no event published twice");
    let received = read_topic(&brokers(), &missing, 1, Duration::from_secs(30)).await;
    assert_eq!(verify(&[lost], &received), 0);
    app.close().await;
    roles.drop_all().await;
}

/// The indexes of `MARKS_INDEXES` still on the outbox, with their
/// partitions' indexes (on the partitioned layout).
async fn marks_indexes(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT i::regclass::text
         FROM unnest($1::text[]) AS n(name)
         CROSS JOIN LATERAL (SELECT to_regclass(n.name)::oid
                             UNION SELECT relid FROM pg_partition_tree(to_regclass(n.name))) t(i)
         WHERE i IS NOT NULL
         ORDER BY 1",
    )
    .bind(progress::MARKS_INDEXES.as_slice())
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The default mode's indexes of unpublished rows would hold every row in
/// the progress mode (no row is marked): enabling drops them, without
/// stopping the writers. An outbox enabled while they were kept (an
/// earlier version) gets them dropped by enabling again: the drop waits
/// for a transaction open on the table while writers commit, then ends.
/// The relay then publishes every event, each key in commit order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn enabling_drops_the_indexes_every_row_would_stay_in_while_writers_go_on(pool: PgPool) {
    let topic = unique_topic("progress-indexes");
    create_topic(&brokers(), &topic).await;
    assert_eq!(marks_indexes(&pool).await.len(), 2);
    let mut committed = commit_messages(&pool, &topic, 300, 10, 50).await;
    progress::enable(&pool).await.unwrap();
    assert!(marks_indexes(&pool).await.is_empty());

    // As an earlier version left them.
    sqlx::query(
        "CREATE INDEX ix_outbox_event_unpublished ON outbox_event (id)
         WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE INDEX ix_outbox_event_unpublished_slot ON outbox_event (lane_slot, id)
         WHERE coalesce(published_at, parked_at, held_until) IS NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
    // A transaction that has read the table (a report, a `pg_dump`).
    let mut open = pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM outbox_event")
        .execute(&mut *open)
        .await
        .unwrap();
    let again = tokio::spawn({
        let pool = pool.clone();
        async move { progress::enable(&pool).await }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !again.is_finished(),
        "the drop waits for the open transaction"
    );
    // Other writers are not held up meanwhile.
    let during = tokio::time::timeout(
        Duration::from_secs(5),
        commit_messages(&pool, &topic, 100, 10, 20),
    )
    .await
    .expect("writers commit while the drop waits");
    open.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), again)
        .await
        .expect("the drop ends once the transaction has")
        .unwrap()
        .unwrap();
    assert!(marks_indexes(&pool).await.is_empty());
    committed.extend(during);
    committed.extend(commit_messages(&pool, &topic, 100, 10, 20).await);

    let handle = relay(&pool).spawn().unwrap();
    assert!(
        wait_until_done(&pool, Duration::from_secs(60)).await,
        "relay drained the outbox"
    );
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    verify(&committed, &received);
}

/// On the partitioned layout the indexes are partitioned (a partitioned
/// index cannot be dropped concurrently): enabling drops them with their
/// partitions' indexes, waiting for the table's lock a short while at a
/// time, and the partitions created afterwards do not get them. The relay
/// publishes every event.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn on_the_partitioned_layout_enabling_drops_them_on_every_partition(pool: PgPool) {
    use outbox_runtime::partition::{self, PartitionPlan};
    let topic = unique_topic("progress-indexes-partitioned");
    create_topic(&brokers(), &topic).await;
    let plan = PartitionPlan {
        period: Duration::from_secs(60),
        ..PartitionPlan::default()
    };
    partition::enable(&pool, &plan).await.unwrap();
    let before = marks_indexes(&pool).await;
    assert!(
        before.len() > 2,
        "partitioned indexes with theirs on each partition: {before:?}"
    );
    let mut committed = commit_messages(&pool, &topic, 300, 10, 50).await;
    progress::enable(&pool).await.unwrap();
    assert!(marks_indexes(&pool).await.is_empty());
    // Partitions ahead, created after: none of them gets the indexes.
    let plan = PartitionPlan { ahead: 6, ..plan };
    partition::maintain(&pool, &plan).await.unwrap();
    assert!(marks_indexes(&pool).await.is_empty());
    let partitions_with_them: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_index i
         JOIN pg_inherits h ON h.inhrelid = i.indrelid
         WHERE h.inhparent = 'outbox_event'::regclass
           AND pg_get_expr(i.indpred, i.indrelid) LIKE '%published_at IS NULL%'
           AND pg_get_expr(i.indpred, i.indrelid) NOT LIKE '%IS NOT NULL%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(partitions_with_them, 0);

    committed.extend(commit_messages(&pool, &topic, 200, 10, 50).await);
    let handle = relay(&pool).spawn().unwrap();
    assert!(
        wait_until_done(&pool, Duration::from_secs(60)).await,
        "relay drained the outbox"
    );
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    verify(&committed, &received);
}
