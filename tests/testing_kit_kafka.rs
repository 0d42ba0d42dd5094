//! The testing kit against the real broker: `TestTopics` creates unique
//! topics and deletes them, and the message the `TestBus` delivers for an
//! outbox row is the one the relay sends to Kafka for it — same key, same
//! headers in the same order, same payload. Typed handlers run end to end
//! (relay → broker → consumers) on a test's own topics, beside another test
//! doing the same with the same event types.

use std::time::{Duration, Instant};

use outbox::prelude::*;
use outbox::runtime::{Consumer, Relay};
use outbox::testing::{TestBus, TestDb, TestTopics};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Headers as _, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
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
    // After the warm-up record.
    tpl.add_partition_offset(topic, 0, Offset::Offset(outbox::testing::FIRST_OFFSET))
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
    assert!(topic.starts_with("test-") && topic.ends_with(".kit-fidelity"));
    assert_eq!(topic, format!("{}kit-fidelity", topics.prefix()));

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

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(topic = "kit-e2e-orders", aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(topic = "kit-e2e-payments", aggregate_type = "Payment")]
struct PaymentCaptured {
    #[event(aggregate_id)]
    payment_id: Uuid,
    #[event(partition_key)]
    order_id: Uuid,
}

#[inbox_handler]
async fn charge(ctx: &mut HandlerContext<'_>, event: OrderPlaced) -> Result<(), sqlx::Error> {
    let payment_id = Uuid::now_v7();
    sqlx::query("INSERT INTO charges (id, order_id, amount_cents) VALUES ($1, $2, $3)")
        .bind(payment_id)
        .bind(event.order_id)
        .bind(event.amount_cents)
        .execute(&mut **ctx)
        .await?;
    ctx.record(PaymentCaptured {
        payment_id,
        order_id: event.order_id,
    });
    Ok(())
}

#[inbox_handler]
async fn mark_paid(
    ctx: &mut HandlerContext<'_>,
    event: PaymentCaptured,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut **ctx)
        .await?;
    Ok(())
}

const TABLES: &str = "
    CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL, status text NOT NULL);
    CREATE TABLE charges (id uuid PRIMARY KEY, order_id uuid NOT NULL, amount_cents bigint NOT NULL);";

/// Places `orders` orders and runs the services' typed handlers end to end
/// through the broker on topics of this test's own: every order is charged
/// once and marked paid, and no event of another test arrives.
async fn orders_are_charged_end_to_end_on_the_tests_own_topics(orders: usize) {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let topics = TestTopics::create(
        &TestTopics::brokers(),
        &[OrderPlaced::TOPIC, PaymentCaptured::TOPIC],
    )
    .await
    .unwrap();
    let relay = topics.relay(Relay::builder(pool.clone())).spawn().unwrap();
    let billing = topics
        .consumer(
            Consumer::builder(pool.clone())
                .group("billing")
                .handler(charge),
        )
        .await
        .unwrap()
        .spawn()
        .unwrap();
    let shipping = topics
        .consumer(
            Consumer::builder(pool.clone())
                .group("orders")
                .handler(mark_paid),
        )
        .await
        .unwrap()
        .spawn()
        .unwrap();

    let mut placed = Vec::new();
    for i in 0..orders {
        let order_id = Uuid::now_v7();
        let amount_cents = 100 + i as i64;
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        sqlx::query("INSERT INTO orders (id, amount_cents, status) VALUES ($1, $2, 'pending')")
            .bind(order_id)
            .bind(amount_cents)
            .execute(&mut *uow)
            .await
            .unwrap();
        uow.record(OrderPlaced {
            order_id,
            amount_cents,
        });
        uow.commit().await.unwrap();
        placed.push(order_id);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let paid: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE status = 'paid'")
            .fetch_one(&pool)
            .await
            .unwrap();
        if paid == orders as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{paid} of {orders} orders paid after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let anything stray arrive before looking.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut charged: Vec<Uuid> = sqlx::query_scalar("SELECT order_id FROM charges")
        .fetch_all(&pool)
        .await
        .unwrap();
    charged.sort();
    placed.sort();
    assert_eq!(
        charged, placed,
        "each of this test's orders charged once, no other"
    );
    let (received, dead): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM processed_event), (SELECT count(*) FROM dead_letter)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((received, dead), (2 * orders as i64, 0));
    // The events went through the test's topics, not the event types' own.
    let published: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT topic FROM outbox_event ORDER BY topic")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(published, [OrderPlaced::TOPIC, PaymentCaptured::TOPIC]);
    assert_eq!(
        topics.name(OrderPlaced::TOPIC),
        format!("{}{}", topics.prefix(), OrderPlaced::TOPIC)
    );
    assert_eq!(relay.counts().published, 2 * orders as u64);
    relay.shutdown().await.unwrap();
    billing.shutdown().await.unwrap();
    shipping.shutdown().await.unwrap();
    topics.cleanup().await.unwrap();
}

// Two tests of the same event types at once (the harness runs them in
// parallel): neither sees the other's events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_handlers_run_end_to_end_on_a_tests_own_topics() {
    orders_are_charged_end_to_end_on_the_tests_own_topics(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_test_of_the_same_event_types_runs_beside_it() {
    orders_are_charged_end_to_end_on_the_tests_own_topics(5).await;
}
