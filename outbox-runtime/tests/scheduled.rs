//! Scheduled messages (`UnitOfWork::record_at`, `record_after`,
//! `cancel_scheduled`) against a real PostgreSQL and broker: a scheduled
//! event is published once its time has come and not before, even by a
//! relay whose poll interval is longer than the wait; it does not hold back
//! the later events of its key; a cancelled one is never published.
//!
//! The tests that call `relay_mode` run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command): "published" is
//! then "passed by its slot's position" (see `common::unpublished`); a
//! scheduled row waits on the held rows' path until due and is marked
//! published there, in either mode; a missing topic is held as a row of
//! `outbox_held_topic` instead of on its events' rows.

mod common;

use std::time::{Duration, SystemTime};

use common::*;
use outbox_core::{DomainEvent, UnitOfWork};
use outbox_runtime::{Relay, ops};
use sqlx::PgPool;
use uuid::Uuid;

fn relay(pool: &PgPool) -> outbox_runtime::RelayBuilder {
    Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
}

/// Whether the row is published: marked, or passed by its slot's position
/// (the progress mode).
async fn published(pool: &PgPool, event_id: Uuid) -> bool {
    let published = outbox_runtime::relay::progress::Published::of(pool)
        .await
        .unwrap();
    sqlx::query_scalar(&format!(
        "{}SELECT {} FROM outbox_event WHERE event_id = $1",
        published.with, published.condition
    ))
    .bind(event_id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Whether the database's clock has passed the row's `due_at`, and whether
/// the row is published (in either relay mode).
async fn due_and_published(pool: &PgPool, event_id: Uuid) -> (bool, bool) {
    let due: bool = sqlx::query_scalar(
        "SELECT due_at <= clock_timestamp() FROM outbox_event WHERE event_id = $1",
    )
    .bind(event_id)
    .fetch_one(pool)
    .await
    .unwrap();
    (due, published(pool, event_id).await)
}

/// Whether a topic missing on the broker is held: on its rows (the
/// default mode), or as a row of `outbox_held_topic` (the progress mode).
async fn topic_held(pool: &PgPool, topic: &str) -> bool {
    let held = if progress_mode() {
        "SELECT EXISTS (SELECT 1 FROM outbox_held_topic WHERE topic = $1)"
    } else {
        "SELECT EXISTS (SELECT 1 FROM outbox_event
                        WHERE topic = $1 AND held_until IS NOT NULL AND due_at IS NULL
                          AND published_at IS NULL)"
    };
    sqlx::query_scalar(held)
        .bind(topic)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether `event_id` was marked published at or after its `due_at` (a
/// scheduled row goes out on the held rows' path, which marks it, in
/// either relay mode).
async fn published_when_due(pool: &PgPool, event_id: Uuid) -> bool {
    sqlx::query_scalar("SELECT published_at >= due_at FROM outbox_event WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn ids(received: &[Received]) -> Vec<Uuid> {
    received.iter().map(Received::event_id).collect()
}

/// An event scheduled two seconds ahead is not on the topic before its
/// time (an event committed with it is, at once), and is once its time has
/// come, published at or after `due_at`: by a relay whose poll interval (a
/// minute) is far longer, since an idle relay wakes when the next hold ends.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_scheduled_event_goes_out_at_its_time_and_not_before(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("scheduled-due");
    create_topic(&brokers(), &topic).await;
    let handle = relay(&pool)
        .poll_interval(Duration::from_secs(60))
        .spawn()
        .unwrap();

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let now = uow.record_message(message(&topic, "a", 0));
    let due = SystemTime::now() + Duration::from_secs(2);
    let later = uow.record_message_at(due, message(&topic, "b", 1));
    uow.commit().await.unwrap();

    let first = read_topic(&brokers(), &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(ids(&first), [now]);
    // Until its time, the consumer of the topic never sees it (a read
    // counts if the time had not come when it ended).
    loop {
        let seen = read_all(&brokers(), &topic, Duration::from_secs(10)).await;
        let (due, published) = due_and_published(&pool, later).await;
        if due {
            break;
        }
        assert!(!published, "published before its time");
        assert!(!ids(&seen).contains(&later), "on the topic before its time");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let all = read_topic(&brokers(), &topic, 2, Duration::from_secs(30)).await;
    assert!(ids(&all).contains(&later), "published once due");
    assert!(
        eventually(Duration::from_secs(10), || async {
            due_and_published(&pool, later).await.1
        })
        .await
    );
    assert!(published_when_due(&pool, later).await);
    handle.shutdown().await.unwrap();
}

/// Key K: a scheduled event S (due in three seconds), then E1 and E2 of
/// the same key recorded after it: E1 and E2 go out without waiting for
/// S, S after its time; on K's partition, E1, E2, S.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_scheduled_event_does_not_hold_back_its_keys_later_events(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("scheduled-order");
    create_topic(&brokers(), &topic).await;
    let handle = relay(&pool).spawn().unwrap();

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let due = SystemTime::now() + Duration::from_secs(3);
    let s = uow.record_message_at(due, message(&topic, "K", 0));
    uow.commit().await.unwrap();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let e1 = uow.record_message(message(&topic, "K", 1));
    uow.commit().await.unwrap();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let e2 = uow.record_message(message(&topic, "K", 2));
    uow.commit().await.unwrap();

    let first = read_topic(&brokers(), &topic, 2, Duration::from_secs(30)).await;
    assert_eq!(ids(&first), [e1, e2]);
    let (due_yet, published) = due_and_published(&pool, s).await;
    assert!(
        !due_yet && !published,
        "E1 and E2 went out without waiting for S"
    );

    let all = read_topic(&brokers(), &topic, 3, Duration::from_secs(30)).await;
    assert_eq!(ids(&all), [e1, e2, s], "one key, one partition: E1, E2, S");
    assert!(
        eventually(Duration::from_secs(10), || async {
            due_and_published(&pool, s).await.1
        })
        .await
    );
    assert!(published_when_due(&pool, s).await);
    handle.shutdown().await.unwrap();
}

/// Key K: E committed, then S scheduled a second ahead, both waiting (no
/// relay runs) until S is due: the relay sends E, then S. Once due, a
/// scheduled event is claimed in id order like any row: it goes after the
/// rows of its key committed before it (a backlog's included), in either
/// relay mode.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_due_scheduled_event_goes_after_its_keys_earlier_events(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("scheduled-backlog");
    create_topic(&brokers(), &topic).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let e = uow.record_message(message(&topic, "K", 0));
    uow.commit().await.unwrap();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let due = SystemTime::now() + Duration::from_secs(1);
    let s = uow.record_message_at(due, message(&topic, "K", 1));
    uow.commit().await.unwrap();
    while !due_and_published(&pool, s).await.0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let handle = relay(&pool).spawn().unwrap();
    let received = read_topic(&brokers(), &topic, 2, Duration::from_secs(30)).await;
    assert_eq!(ids(&received), [e, s], "one key, one partition: E, then S");
    assert!(wait_until_topic_published(&pool, &topic, Duration::from_secs(10)).await);
    handle.shutdown().await.unwrap();
}

/// Due scheduled events among a backlog of their keys, relayed through a
/// producer queue too small for a batch (rows withheld, lanes read again):
/// every event once, the events of a key not scheduled in commit order, and
/// a due event after every earlier event of its key (a later one may go
/// before it: it would have, had the relay kept up), in either mode. A
/// guard of the progress mode's claim of due rows, which waits for the
/// committed positions: it took them once by the windows' positions in
/// memory, which count rows of batches still open that a rewind reads
/// again (seen under load in `roles`' relay test).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn due_scheduled_events_keep_their_keys_order_when_rows_are_withheld(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("scheduled-withheld");
    create_topic(&brokers(), &topic).await;
    let due = SystemTime::now() + Duration::from_secs(1);
    let (mut committed, mut scheduled) = (Vec::new(), Vec::new());
    for round in 0..40 {
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        for seq in 0..48 {
            let key = format!("k{}", seq % 4);
            committed.push(uow.record_message(message(&topic, &key, round * 50 + seq)));
        }
        for k in 0..2 {
            let event = message(&topic, &format!("k{k}"), round * 50 + 48 + k);
            let id = uow.record_message_at(due, event);
            committed.push(id);
            scheduled.push(id);
        }
        uow.commit().await.unwrap();
    }
    while SystemTime::now() < due + Duration::from_millis(200) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let handle = relay(&pool)
        .kafka_setting("queue.buffering.max.messages", "40")
        .batch_size(200)
        .spawn()
        .unwrap();
    let published = wait_until_topic_published(&pool, &topic, Duration::from_secs(60)).await;
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert!(published, "the relay drained the outbox: {counts:?}");
    assert!(counts.withheld > 0, "rows were withheld: {counts:?}");
    assert_eq!(counts.order_violations, 0, "{counts:?}");
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    let plain: Vec<Uuid> = committed
        .iter()
        .filter(|id| !scheduled.contains(id))
        .copied()
        .collect();
    let plain_received: Vec<Received> = received
        .iter()
        .filter(|r| !scheduled.contains(&r.event_id()))
        .cloned()
        .collect();
    assert_eq!(verify(&plain, &plain_received), 0, "every event once");
    let at: std::collections::HashMap<Uuid, usize> = received
        .iter()
        .enumerate()
        .map(|(i, r)| (r.event_id(), i))
        .collect();
    assert_eq!(at.len(), committed.len(), "every event once: {counts:?}");
    let key_of: std::collections::HashMap<Uuid, &str> = received
        .iter()
        .map(|r| (r.event_id(), r.key.as_str()))
        .collect();
    for (p, s) in committed.iter().enumerate() {
        if !scheduled.contains(s) {
            continue;
        }
        for earlier in committed[..p].iter().filter(|e| key_of[*e] == key_of[s]) {
            assert!(
                at[earlier] < at[s],
                "scheduled {s} (key {}) went before its key's earlier {earlier}",
                key_of[s]
            );
        }
    }
    assert_eq!(
        counts.published,
        committed.len() as u64,
        "nothing sent twice: {counts:?}"
    );
}

keyed_event!(
    /// The events of the cancel test (a topic of its own, shared by runs:
    /// the test reads only its event ids).
    Reminder, "scheduled-cancel"
);

fn reminder(key: &str, seq: u64) -> Reminder {
    Reminder {
        key: key.into(),
        seq,
    }
}

/// `cancel_scheduled`: before its time, `true`, and the event is never
/// published (an event recorded and cancelled in one Unit of Work is not
/// even written); a cancel rolled back cancels nothing; once the event is
/// published, or for an event that was not scheduled, or cancelled
/// already, `false`.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn cancelled_scheduled_events_are_never_published(pool: PgPool) {
    relay_mode(&pool).await;
    create_topic(&brokers(), <Reminder as DomainEvent>::TOPIC).await;
    let key = Uuid::now_v7().to_string();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let cancelled = uow.record_after(Duration::from_secs(1), reminder(&key, 0));
    let kept = uow.record_after(Duration::from_secs(1), reminder(&key, 1));
    let rolled_back = uow.record_after(Duration::from_secs(2), reminder(&key, 2));
    let plain = uow.record(reminder(&key, 3));
    let never_written = uow.record_after(Duration::from_secs(1), reminder(&key, 4));
    assert!(uow.cancel_scheduled(never_written).await.unwrap());
    let committed = uow.commit().await.unwrap();
    assert_eq!(committed.event_ids.len(), 4);
    assert!(!committed.event_ids.contains(&never_written));

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(uow.cancel_scheduled(cancelled).await.unwrap());
    assert!(
        !uow.cancel_scheduled(plain).await.unwrap(),
        "not a scheduled event"
    );
    uow.commit().await.unwrap();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(uow.cancel_scheduled(rolled_back).await.unwrap());
    uow.rollback().await.unwrap();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(
        !uow.cancel_scheduled(cancelled).await.unwrap(),
        "cancelled already"
    );
    uow.commit().await.unwrap();

    let handle = relay(&pool).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            due_and_published(&pool, kept).await.1 && due_and_published(&pool, rolled_back).await.1
        })
        .await,
        "the events not cancelled are published"
    );
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(
        !uow.cancel_scheduled(kept).await.unwrap(),
        "published already"
    );
    uow.commit().await.unwrap();
    // A few more release rounds: the cancelled one stays where it is.
    tokio::time::sleep(Duration::from_secs(2)).await;
    handle.shutdown().await.unwrap();

    let received = read_all(
        &brokers(),
        <Reminder as DomainEvent>::TOPIC,
        Duration::from_secs(30),
    )
    .await;
    let mine: Vec<Uuid> = ids(&received)
        .into_iter()
        .filter(|id| [cancelled, kept, rolled_back, plain, never_written].contains(id))
        .collect();
    assert_eq!(mine.len(), 3, "{mine:?}");
    assert!(!mine.contains(&cancelled) && !mine.contains(&never_written));
    let reason: Option<String> =
        sqlx::query_scalar("SELECT discard_reason FROM outbox_event WHERE event_id = $1")
            .bind(cancelled)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(reason.as_deref(), Some("cancelled"));
    assert!(!published(&pool, cancelled).await);
    let status = ops::status(&pool).await.unwrap();
    assert_eq!(status.scheduled.total, 0);

    // Past the retention window, the cleanup deletes a cancelled event as
    // it deletes a published one; a row an operator dropped stays.
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let dropped = uow.record(reminder(&key, 5));
    uow.commit().await.unwrap();
    sqlx::query(
        "UPDATE outbox_event SET parked_at = now(), discarded_at = now(),
                                 discard_reason = 'no longer needed'
         WHERE event_id = $1",
    )
    .bind(dropped)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE outbox_event SET created_at = created_at - interval '40 days',
                                 published_at = published_at - interval '40 days',
                                 discarded_at = discarded_at - interval '40 days'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let retention = outbox_runtime::cleanup::Retention::new(Duration::from_secs(30 * 86_400));
    let report = outbox_runtime::cleanup::cleanup(&pool, &retention)
        .await
        .unwrap();
    assert_eq!(report.outbox_events, 4, "{report:?}");
    let left: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM outbox_event")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, [dropped]);
}

/// `outbox status` counts scheduled rows apart from held ones, with the
/// next due time.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn status_shows_scheduled_rows_apart_from_held_ones(pool: PgPool) {
    let topic = unique_topic("scheduled-status");
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let soon = SystemTime::now() + Duration::from_secs(600);
    uow.record_message_at(soon, message(&topic, "a", 0));
    uow.record_message_at(
        soon + Duration::from_secs(7 * 86_400),
        message(&topic, "b", 1),
    );
    uow.record_message(message(&topic, "c", 2));
    uow.commit().await.unwrap();
    // A row held after a failure.
    sqlx::query(
        "UPDATE outbox_event SET held_until = now() + interval '1 minute'
         WHERE topic = $1 AND due_at IS NULL",
    )
    .bind(&topic)
    .execute(&pool)
    .await
    .unwrap();

    let status = ops::status(&pool).await.unwrap();
    assert_eq!(status.scheduled.total, 2);
    assert_eq!(status.held, 1);
    let next = status.scheduled.next_due_secs.expect("next due");
    assert!((next - 600.0).abs() < 5.0, "{next}");
    assert_eq!(
        status.unpublished, 1,
        "the held row: scheduled ones are apart"
    );
    let topic_status = status
        .topics
        .iter()
        .find(|t| t.topic == topic)
        .expect("topic");
    assert_eq!(topic_status.scheduled, 2);
    assert_eq!(topic_status.held, 1);
}

/// The embedded migrations up to and including `version`.
fn migrations_up_to(version: i64) -> sqlx::migrate::Migrator {
    sqlx::migrate::Migrator {
        migrations: std::borrow::Cow::Owned(
            outbox_core::MIGRATOR
                .iter()
                .filter(|m| m.version <= version)
                .cloned()
                .collect(),
        ),
        ignore_missing: true,
        locking: true,
        no_tx: false,
    }
}

/// Held rows per key, by the indexes' definitions (every partition's too).
async fn held_key_indexes(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT pg_get_indexdef(indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE pg_get_indexdef(indexrelid) LIKE '%(topic, partition_key, id)%held_until IS NOT NULL%'
         ORDER BY c.relname",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// An installation partitioned before this version: the migration adds
/// the column and rebuilds the index of held rows per key without the
/// scheduled ones on the partitioned table (every partition included);
/// then scheduled events are written, cancelled and published there.
#[sqlx::test(migrations = false)]
async fn the_migration_and_scheduled_events_work_on_the_partitioned_layout(pool: PgPool) {
    use outbox_runtime::partition::{self, PartitionPlan};
    migrations_up_to(20261204000040).run(&pool).await.unwrap();
    let topic = unique_topic("scheduled-partitioned");
    create_topic(&brokers(), &topic).await;
    let before = commit_messages(&pool, &topic, 10, 2, 5).await;
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let old = held_key_indexes(&pool).await;
    assert!(old.len() > 1, "the parent's and its partitions': {old:?}");
    assert!(old.iter().all(|d| !d.contains("due_at")), "{old:?}");

    outbox_core::migrate(&pool).await.unwrap();
    relay_mode(&pool).await;
    let new = held_key_indexes(&pool).await;
    assert_eq!(new.len(), old.len(), "{new:?}");
    assert!(new.iter().all(|d| d.contains("due_at IS NULL")), "{new:?}");
    assert!(
        partition::is_partitioned(&pool, "outbox_event")
            .await
            .unwrap()
    );

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let due = SystemTime::now() + Duration::from_secs(1);
    let sent = uow.record_message_at(due, message(&topic, "k0", 10));
    let cancelled = uow.record_message_at(due, message(&topic, "k1", 11));
    uow.commit().await.unwrap();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(uow.cancel_scheduled(cancelled).await.unwrap());
    uow.commit().await.unwrap();

    let handle = relay(&pool).spawn().unwrap();
    let received = read_topic(&brokers(), &topic, 11, Duration::from_secs(30)).await;
    assert_eq!(verify(&[before, vec![sent]].concat(), &received), 0);
    assert!(
        eventually(Duration::from_secs(10), || async {
            due_and_published(&pool, sent).await.1
        })
        .await
    );
    assert!(published_when_due(&pool, sent).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    handle.shutdown().await.unwrap();
    assert!(
        !ids(&read_all(&brokers(), &topic, Duration::from_secs(10)).await).contains(&cancelled)
    );
}

/// Rows of a topic missing on the broker are held, their holds extended,
/// then ended at once when the topic appears: a scheduled row of that
/// topic keeps waiting for its own time through all of it.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_missing_topics_release_leaves_scheduled_rows_waiting(pool: PgPool) {
    relay_mode(&pool).await;
    let missing = unique_topic("scheduled-missing");
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let plain = uow.record_message(message(&missing, "a", 0));
    let due = SystemTime::now() + Duration::from_secs(300);
    let scheduled = uow.record_message_at(due, message(&missing, "b", 1));
    uow.commit().await.unwrap();

    let handle = relay(&pool)
        .kafka_setting("topic.metadata.propagation.max.ms", "1000")
        .missing_topic_hold(Duration::from_millis(300), Duration::from_secs(1))
        .spawn()
        .unwrap();
    assert!(eventually(Duration::from_secs(30), || topic_held(&pool, &missing)).await);
    // A few rounds of holds extended.
    tokio::time::sleep(Duration::from_secs(2)).await;
    create_topic(&brokers(), &missing).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            published(&pool, plain).await
        })
        .await
    );
    assert!(!topic_held(&pool, &missing).await, "the topic's hold ended");
    tokio::time::sleep(Duration::from_secs(2)).await;
    handle.shutdown().await.unwrap();
    let waiting: bool =
        sqlx::query_scalar("SELECT held_until = due_at FROM outbox_event WHERE event_id = $1")
            .bind(scheduled)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        waiting && !published(&pool, scheduled).await,
        "the scheduled row still waits for its time"
    );
}

/// Once released, a scheduled event whose delivery fails is handled like
/// any event: retried, then parked; the events of its key recorded after
/// it still go out.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_scheduled_event_that_fails_once_due_is_retried_then_parked(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("scheduled-fails");
    create_topic(&brokers(), &topic).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let mut poison = message(&topic, "K", 0);
    poison.payload = serde_json::json!({ "blob": "x".repeat(300_000) }).to_string();
    let due = SystemTime::now() + Duration::from_secs(1);
    let scheduled = uow.record_message_at(due, poison);
    uow.commit().await.unwrap();
    let handle = relay(&pool)
        .kafka_setting("message.max.bytes", "100000")
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(100), Duration::from_millis(200))
        .spawn()
        .unwrap();
    let parked = || async {
        let (parked, attempts) = sqlx::query_as::<_, (bool, i32)>(
            "SELECT parked_at IS NOT NULL, attempts FROM outbox_event WHERE event_id = $1",
        )
        .bind(scheduled)
        .fetch_one(&pool)
        .await
        .unwrap();
        (parked, attempts, published(&pool, scheduled).await)
    };
    assert!(
        eventually(Duration::from_secs(30), || async { parked().await.0 }).await,
        "{:?}",
        parked().await
    );
    assert_eq!(parked().await, (true, 2, false));
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let later = uow.record_message(message(&topic, "K", 1));
    uow.commit().await.unwrap();
    let received = read_topic(&brokers(), &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(ids(&received), [later]);
    handle.shutdown().await.unwrap();
}

/// In the progress mode (positions instead of marks; a due held row is
/// claimed as it is, without a release): a scheduled event goes out once
/// due, not before, and is marked published; cancelling it then answers
/// `false`; a cancelled one never goes out.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn scheduled_events_in_the_progress_mode(pool: PgPool) {
    use outbox_runtime::relay::progress;
    let topic = unique_topic("scheduled-progress");
    create_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
    let handle = relay(&pool).lanes(4).spawn().unwrap();

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let now = uow.record_message(message(&topic, "K", 0));
    let due = SystemTime::now() + Duration::from_secs(2);
    let sent = uow.record_message_at(due, message(&topic, "K", 1));
    let cancelled = uow.record_message_at(due, message(&topic, "L", 2));
    uow.commit().await.unwrap();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(uow.cancel_scheduled(cancelled).await.unwrap());
    uow.commit().await.unwrap();

    let first = read_topic(&brokers(), &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(ids(&first), [now]);
    let all = read_topic(&brokers(), &topic, 2, Duration::from_secs(30)).await;
    assert_eq!(ids(&all), [now, sent]);
    assert!(
        eventually(Duration::from_secs(10), || async {
            due_and_published(&pool, sent).await.1
        })
        .await
    );
    assert!(published_when_due(&pool, sent).await);
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(!uow.cancel_scheduled(sent).await.unwrap(), "published");
    uow.commit().await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    handle.shutdown().await.unwrap();
    let seen = ids(&read_all(&brokers(), &topic, Duration::from_secs(10)).await);
    assert!(!seen.contains(&cancelled));
}
