//! The testing kit against the real broker: `TestTopics` creates unique
//! topics and deletes them, and the message the `TestBus` delivers for an
//! outbox row is the one the relay sends to Kafka for it — same key, same
//! headers in the same order, same payload.

use std::time::{Duration, Instant};

use outbox::prelude::*;
use outbox::runtime::Relay;
use outbox::testing::{TestBus, TestTopics};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers as _, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::PgPool;

/// Key, headers and payload of the first message of `topic`.
type Received = (Vec<u8>, Vec<(String, String)>, Vec<u8>);

fn read_first(brokers: &str, topic: &str) -> Received {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("kit-{}", Uuid::now_v7().simple()))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .expect("partition");
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            let v = h.value.unwrap_or_default();
                            (h.key.to_owned(), String::from_utf8_lossy(v).into_owned())
                        })
                        .collect()
                })
                .unwrap_or_default();
            return (
                m.key().unwrap_or_default().to_vec(),
                headers,
                m.payload().unwrap_or_default().to_vec(),
            );
        }
    }
    panic!("nothing on {topic} within 30 s");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_bus_delivers_what_the_relay_sends(pool: PgPool) {
    let brokers = TestTopics::brokers();
    let topics = TestTopics::create(&brokers, &["kit-fidelity"])
        .await
        .unwrap();
    let topic = topics.name("kit-fidelity").to_owned();
    assert!(topic.starts_with("kit-fidelity-") && topic.len() > "kit-fidelity-".len());

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.headers_mut()
        .extra
        .insert("tenant".into(), "acme".into());
    uow.record_message(outbox::OutboxMessage {
        event_id: Uuid::now_v7(),
        aggregate_type: "Order".into(),
        aggregate_id: "o-1".into(),
        event_type: "OrderPlaced".into(),
        event_version: 2,
        topic: topic.clone(),
        partition_key: "k-1".into(),
        payload: r#"{"amount_cents": 500}"#.into(),
        headers: Headers::default(),
    });
    uow.commit().await.unwrap();

    // The relay sends it …
    let relay = Relay::builder(pool.clone())
        .brokers(&brokers)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let published: bool =
            sqlx::query_scalar("SELECT bool_and(published_at IS NOT NULL) FROM outbox_event")
                .fetch_one(&pool)
                .await
                .unwrap();
        if published {
            break;
        }
        assert!(Instant::now() < deadline, "the relay did not publish");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.shutdown().await.unwrap();
    let (key, headers, payload) = {
        let (brokers, topic) = (brokers.clone(), topic.clone());
        tokio::task::spawn_blocking(move || read_first(&brokers, &topic))
            .await
            .unwrap()
    };

    // … and the bus, given the same row again, delivers the same message.
    sqlx::query("UPDATE outbox_event SET published_at = NULL")
        .execute(&pool)
        .await
        .unwrap();
    let delivery = TestBus::new().outbox(pool.clone()).deliver().await.unwrap();
    let bus = &delivery.published[0];
    assert_eq!(bus.key.as_bytes(), key);
    assert_eq!(bus.payload.as_bytes(), payload);
    assert_eq!(bus.message_headers, headers);
    assert!(
        headers.iter().any(|(k, v)| k == "tenant" && v == "acme"),
        "{headers:?}"
    );
    topics.cleanup().await.unwrap();
}
