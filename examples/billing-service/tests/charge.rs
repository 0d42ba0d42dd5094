//! The billing service's consumer against a real PostgreSQL (a `TestDb`
//! per test: a clone of a template with the service's migrations), driven by the
//! testing kit: `OrderCreated` events recorded in the outbox are delivered
//! to the service's consumer — configured as the service runs it — through
//! the consumer's real path, without a broker.

use std::time::Duration;

use billing_service::consumer;
use demo_events::{OrderCreated, PaymentCaptured};
use outbox::prelude::*;
use outbox::runtime::DeadLetterReason;
use outbox::testing::{Faults, Outcome, TestBus, TestDb};
use sqlx::PgPool;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Records `OrderCreated` as the orders service does, in an outbox the bus
/// reads (here billing's own database).
async fn order_created(pool: &PgPool, amount_cents: i64) -> OrderCreated {
    let event = OrderCreated {
        order_id: Uuid::now_v7(),
        customer: "ann".into(),
        amount_cents,
    };
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    uow.record(event.clone());
    uow.commit().await.unwrap();
    event
}

#[tokio::test]
async fn an_order_is_charged_once_and_its_payment_recorded_with_the_charge() {
    let db = TestDb::builder()
        .migrator(&billing_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    // The orders service's relay may publish an event twice, and billing
    // may die between its commit and its offset commit.
    let mut bus = TestBus::new()
        .service(consumer(pool.clone(), "billing"))
        .faults(Faults::new().deliver_twice().redeliver_batches());
    let order = order_created(&pool, 4_200).await;

    let delivery = bus.deliver().await.unwrap();
    delivery.assert_each_handled_once();
    delivery.assert_no_dead_letters();
    let payment = delivery.assert_published::<PaymentCaptured>(|p| p.order_id == order.order_id);
    assert_eq!(payment.amount_cents, 4_200);
    delivery.assert_sequence(order.order_id, &["OrderCreated", "PaymentCaptured"]);
    let (created, captured) = (&delivery.published[0], &delivery.published[1]);
    assert_eq!(captured.topic, PaymentCaptured::TOPIC);
    assert_eq!(
        captured.key,
        order.order_id.to_string(),
        "keyed by the order"
    );
    assert_eq!(
        captured.header("causation_id"),
        Some(created.event_id.to_string())
    );

    let charges: Vec<(Uuid, Uuid, i64)> =
        sqlx::query_as("SELECT id, order_id, amount_cents FROM charges")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        charges,
        [(payment.payment_id, order.order_id, 4_200)],
        "one charge, the payment's"
    );
}

#[tokio::test]
async fn a_charge_the_database_refuses_is_retried_then_dead_lettered_without_a_payment() {
    let db = TestDb::builder()
        .migrator(&billing_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(
        consumer(pool.clone(), "billing")
            .max_attempts(3)
            .retry_backoff(Duration::from_secs(1), Duration::from_secs(30)),
    );
    // `charges.amount_cents` must be > 0.
    let bad = order_created(&pool, 0).await;
    let good = order_created(&pool, 100).await;

    let delivery = bus.deliver().await.unwrap();
    let dead = delivery.assert_dead_lettered::<OrderCreated>(|o| o.order_id == bad.order_id);
    let Outcome::DeadLettered {
        reason,
        error,
        attempts,
    } = &dead.outcome
    else {
        unreachable!("assert_dead_lettered returns a dead letter")
    };
    assert_eq!(*reason, DeadLetterReason::HandlerFailed);
    assert!(error.contains("check constraint"), "{error}");
    assert_eq!(*attempts, 3);
    // Two retries, 1 s then 2 s, on the test clock.
    assert_eq!(delivery.retry_waits.len(), 2, "{delivery}");
    assert_eq!(bus.clock().elapsed(), Duration::from_secs(3), "{delivery}");

    // The failed order left no charge and no payment; the next one was
    // charged.
    delivery.assert_published::<PaymentCaptured>(|p| p.order_id == good.order_id);
    assert_eq!(delivery.published::<PaymentCaptured>().len(), 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM dead_letter WHERE consumer = 'billing'"
        )
        .await,
        1
    );
}
