//! Event versions through the real broker, relay, replay and consumers:
//! a version-1 row, published long ago by the first release and lost by
//! Kafka since, is replayed and upcast to the current version by the
//! consumer; a version-3 event reaching a service still on version 2 is
//! dead-lettered as `unsupported_version`, and once a handler that reads
//! version 3 is deployed, retrying the dead letter applies it — nothing
//! lost.

use std::time::{Duration, Instant};

use outbox::prelude::*;
use outbox::runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox::runtime::replay::{self, ReplayFilter, ReplayOptions};
use outbox::runtime::{Consumer, DeadLetterReason, Relay};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

const TOPIC: &str = "evo-kafka-orders";

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(
    topic = "evo-kafka-orders",
    aggregate_type = "Order",
    event_type = "OrderPlaced",
    version = 1
)]
struct OrderPlacedV1 {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(
    topic = "evo-kafka-orders",
    aggregate_type = "Order",
    event_type = "OrderPlaced",
    version = 2,
    upcast_from(OrderPlacedV1)
)]
struct OrderPlacedV2 {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
}

impl From<OrderPlacedV1> for OrderPlacedV2 {
    fn from(v1: OrderPlacedV1) -> Self {
        Self {
            order_id: v1.order_id,
            amount_cents: v1.amount * 100,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(
    topic = "evo-kafka-orders",
    aggregate_type = "Order",
    version = 3,
    upcast_from(OrderPlacedV2)
)]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
    currency: String,
}

impl From<OrderPlacedV2> for OrderPlaced {
    fn from(v2: OrderPlacedV2) -> Self {
        Self {
            order_id: v2.order_id,
            amount_cents: v2.amount_cents,
            currency: "EUR".into(),
        }
    }
}

/// The current handler: records what it got, the version it came as and
/// whether it was a replay.
#[inbox_handler]
async fn book_order(ctx: &mut HandlerContext<'_>, event: OrderPlaced) -> Result<(), sqlx::Error> {
    let version = ctx.incoming().event_version as i32;
    let replay = ctx.incoming().headers.extra.get("replay_id").cloned();
    sqlx::query(
        "INSERT INTO booked (order_id, amount_cents, currency, version, replay_id) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(event.order_id)
    .bind(event.amount_cents)
    .bind(&event.currency)
    .bind(version)
    .bind(replay)
    .execute(&mut **ctx)
    .await?;
    Ok(())
}

/// The handler of a service still on version 2.
#[inbox_handler]
async fn book_order_v2(
    ctx: &mut HandlerContext<'_>,
    event: OrderPlacedV2,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO booked_v2 (order_id, amount_cents) VALUES ($1, $2)")
        .bind(event.order_id)
        .bind(event.amount_cents)
        .execute(&mut **ctx)
        .await?;
    Ok(())
}

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// Deletes the topic and creates it again, empty (the handlers are bound to
/// a fixed topic).
async fn reset_topic(brokers: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let _ = admin.delete_topics(&[TOPIC], &options).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match outbox::runtime::kafka::create_topics(brokers, &[], &[TOPIC.to_owned()], 1, 1).await {
            Ok(created) if created.iter().all(|(_, new)| *new) => break,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "could not recreate {TOPIC}: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check().await {
        assert!(Instant::now() < deadline, "not within 60 s: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn old_versions_are_upcast_after_replay_and_newer_ones_wait_in_dead_letters(pool: PgPool) {
    for sql in [
        "CREATE TABLE booked (order_id uuid PRIMARY KEY, amount_cents bigint NOT NULL, \
         currency text NOT NULL, version int NOT NULL, replay_id text)",
        "CREATE TABLE booked_v2 (order_id uuid PRIMARY KEY, amount_cents bigint NOT NULL)",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let brokers = brokers();
    reset_topic(&brokers).await;

    // 1. A version-1 event the first release recorded and its relay
    //    published; the topic has lost it since. A replay sends it again,
    //    and today's consumer upcasts it (v1 → v2 → v3).
    let old = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.record(OrderPlacedV1 {
        order_id: old,
        amount: 12,
    });
    uow.commit().await.unwrap();
    sqlx::query("UPDATE outbox_event SET published_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let filter = ReplayFilter {
        topic: Some(TOPIC.into()),
        ..ReplayFilter::default()
    };
    let report = replay::replay(&pool, &ReplayOptions::new(&brokers, filter))
        .await
        .unwrap();
    assert_eq!(report.replayed, 1);
    let current = Consumer::builder(pool.clone())
        .group("evo-current")
        .brokers(&brokers)
        .handler(book_order)
        .spawn()
        .unwrap();
    eventually("the replayed v1 event is handled", || async {
        count(&pool, "SELECT count(*) FROM booked").await == 1
    })
    .await;
    current.shutdown().await.unwrap();
    let row: (Uuid, i64, String, i32, Option<String>) =
        sqlx::query_as("SELECT order_id, amount_cents, currency, version, replay_id FROM booked")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        row,
        (
            old,
            1200,
            "EUR".into(),
            1,
            Some(report.replay_id.to_string())
        )
    );

    // 2. Version 3, published by a newer producer, reaches a service still
    //    on version 2: dead-lettered as unsupported, not a decoding accident.
    let new = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.record(OrderPlaced {
        order_id: new,
        amount_cents: 4200,
        currency: "CHF".into(),
    });
    uow.commit().await.unwrap();
    let relay = Relay::builder(pool.clone())
        .brokers(&brokers)
        .spawn()
        .unwrap();
    let lagging = Consumer::builder(pool.clone())
        .group("evo-lagging")
        .brokers(&brokers)
        .handler(book_order_v2)
        .redrive_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    let letters = || async {
        dead_letter::list(&pool, &DeadLetterFilter::new().consumer("evo-lagging"))
            .await
            .unwrap()
    };
    eventually("the v3 event is dead-lettered", || async {
        !letters().await.is_empty()
    })
    .await;
    // The replayed version 1 before it was upcast to version 2 and handled.
    eventually("the v1 event is handled by the v2 service", || async {
        count(
            &pool,
            "SELECT count(*) FROM booked_v2 WHERE amount_cents = 1200",
        )
        .await
            == 1
    })
    .await;
    lagging.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    let letter = &letters().await[0];
    assert_eq!(letter.reason, DeadLetterReason::UnsupportedVersion.as_str());
    assert!(
        letter.error.contains("version 3 is newer"),
        "{}",
        letter.error
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM booked_v2").await, 1);

    // 3. The service deploys a handler that reads version 3; the operator
    //    retries the dead letter; it is applied from the kept bytes.
    let upgraded = Consumer::builder(pool.clone())
        .group("evo-lagging")
        .brokers(&brokers)
        .handler(book_order)
        .redrive_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    assert_eq!(
        dead_letter::retry(&pool, Some("evo-lagging"), None)
            .await
            .unwrap(),
        1
    );
    eventually("the retried v3 event is handled", || async {
        count(
            &pool,
            "SELECT count(*) FROM dead_letter WHERE consumer = 'evo-lagging' AND status = 'resolved'",
        )
        .await
            == 1
    })
    .await;
    upgraded.shutdown().await.unwrap();
    let row: (i64, String, i32) =
        sqlx::query_as("SELECT amount_cents, currency, version FROM booked WHERE order_id = $1")
            .bind(new)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(row, (4200, "CHF".into(), 3));
}
