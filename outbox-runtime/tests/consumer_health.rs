//! What an application sees of its embedded consumer, against a real
//! PostgreSQL and the real broker: `health()` says running, degraded (stuck
//! retrying, and on what) or failed (with the error); a dead letter the
//! database refuses holds the consumer at that message — its offset is
//! never committed past it — until the database takes it.

mod common;

use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, InboxHandler};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox_runtime::{Consumer, ConsumerHealth, Mode};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::PgPool;
use uuid::Uuid;

keyed_event!(RefusedDedup, "consumer-health-refused-dedup");
keyed_event!(RefusedInbox, "consumer-health-refused-inbox");
keyed_event!(BadSetting, "consumer-health-bad-setting");

/// The group's committed offset of each partition (-1: none).
async fn committed(group: &str, topic: &str) -> Vec<i64> {
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", &group)
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition(&topic, p);
        }
        let offsets = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap();
        (0..PARTITIONS)
            .map(
                |p| match offsets.find_partition(&topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => -1,
                },
            )
            .collect()
    })
    .await
    .unwrap()
}

async fn effects(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effect")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// One key (one partition): 20 good events, a malformed one, 20 more.
/// While the database refuses dead letters, the consumer reports itself
/// degraded, applies nothing from the malformed message on, and commits no
/// offset past it; once the database takes the letter, everything goes on.
async fn refused_dead_letter_holds_the_offset(
    pool: &PgPool,
    topic: &str,
    mode: Mode,
    handler: impl InboxHandler,
) {
    sqlx::query("CREATE TABLE effect (event_id uuid NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN RAISE EXCEPTION 'dead letters are refused by policy'; END $$",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER refuse BEFORE INSERT ON dead_letter FOR EACH ROW EXECUTE FUNCTION refuse()",
    )
    .execute(pool)
    .await
    .unwrap();
    reset_topic(&brokers(), topic).await;
    let event = |seq: usize| {
        TestMessage::event(
            Uuid::now_v7(),
            "OrderPlaced",
            "k",
            serde_json::json!({ "key": "k", "seq": seq }),
        )
    };
    let mut messages: Vec<TestMessage> = (0..20).map(event).collect();
    messages.push(event(20).payload(b"not json at all".to_vec()));
    messages.extend((21..41).map(event));
    // One record batch per message, so that the consumer can start at any
    // committed offset (see `produce_unbatched`).
    produce_unbatched(&brokers(), topic, &messages).await;

    let group = unique_topic("refused");
    let handle = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(brokers())
        .mode(mode)
        .batch_size(5)
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(200))
        .processor_poll_interval(Duration::from_millis(50))
        .handler(handler)
        .spawn()
        .unwrap();
    let degraded = eventually(Duration::from_secs(30), || async {
        matches!(handle.health(), ConsumerHealth::Degraded { .. })
    })
    .await;
    assert!(degraded, "{:?}", handle.health());
    let ConsumerHealth::Degraded { error } = handle.health() else {
        unreachable!()
    };
    assert!(error.contains("refused by policy"), "{error}");
    // Held there for a while: nothing past the malformed message applied or
    // acknowledged.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(matches!(handle.health(), ConsumerHealth::Degraded { .. }));
    assert!(effects(pool).await <= 20);
    let partition_of_k: Vec<i64> = committed(&group, topic).await;
    assert!(
        partition_of_k.iter().all(|o| *o <= 20),
        "an offset moved past the refused dead letter: {partition_of_k:?}"
    );

    sqlx::query("DROP TRIGGER refuse ON dead_letter")
        .execute(pool)
        .await
        .unwrap();
    let done = eventually(Duration::from_secs(30), || async {
        effects(pool).await == 40 && handle.health() == ConsumerHealth::Running
    })
    .await;
    assert!(
        done,
        "{} applied; {:?}",
        effects(pool).await,
        handle.health()
    );
    let letters = dead_letter::list(pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].offset, 20);
    handle.shutdown().await.unwrap();
    assert!(committed(&group, topic).await.contains(&41));
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_refused_dead_letter_holds_the_consumer_at_its_message(pool: PgPool) {
    init_tracing();
    refused_dead_letter_holds_the_offset(
        &pool,
        RefusedDedup::TOPIC,
        Mode::Dedup,
        RecordEffect::<RefusedDedup>::new(),
    )
    .await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_refused_dead_letter_holds_the_consumer_at_its_message(pool: PgPool) {
    init_tracing();
    refused_dead_letter_holds_the_offset(
        &pool,
        RefusedInbox::TOPIC,
        Mode::Inbox,
        RecordEffect::<RefusedInbox>::new(),
    )
    .await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_consumer_that_cannot_run_reports_failed_with_its_error(pool: PgPool) {
    init_tracing();
    let handle = Consumer::builder(pool.clone())
        .group(unique_topic("bad-setting"))
        .brokers(brokers())
        .kafka_setting("no.such.setting", "1")
        .handler(RecordEffect::<BadSetting>::new())
        .spawn()
        .unwrap();
    let failed = eventually(Duration::from_secs(10), || async {
        matches!(handle.health(), ConsumerHealth::Failed { .. })
    })
    .await;
    assert!(failed, "{:?}", handle.health());
    let ConsumerHealth::Failed { error } = handle.health() else {
        unreachable!()
    };
    assert!(error.contains("no.such.setting"), "{error}");
    let joined = handle.join().await.unwrap_err();
    assert_eq!(joined.to_string(), error);
}
