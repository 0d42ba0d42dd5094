//! The billing handler against a real PostgreSQL (a fresh database per test,
//! the service's migrations applied), run in a transaction the way the
//! consumer runs it: the charge and the `PaymentCaptured` outbox row commit
//! together, or neither exists.

use billing_service::charge_order;
use demo_events::{OrderCreated, PaymentCaptured};
use outbox::prelude::*;
use outbox::{DomainEvent, IncomingEvent};
use sqlx::PgPool;

fn incoming(event: &OrderCreated) -> IncomingEvent {
    IncomingEvent::new(
        Uuid::now_v7(),
        event.event_type(),
        event.event_version(),
        OrderCreated::TOPIC,
        event.partition_key(),
        Headers::default(),
    )
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn order() -> OrderCreated {
    OrderCreated {
        order_id: Uuid::now_v7(),
        customer: "ann".into(),
        amount_cents: 4_200,
    }
}

#[sqlx::test(migrations = false)]
async fn an_order_is_charged_and_its_payment_recorded_in_the_same_transaction(pool: PgPool) {
    billing_service::migrate(&pool).await.unwrap();
    let event = order();
    let incoming = incoming(&event);
    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    charge_order::call(&mut ctx, event.clone()).await.unwrap();
    let ids = ctx.flush().await.unwrap();
    drop(ctx);
    assert_eq!(ids.len(), 1);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM charges").await,
        0,
        "not visible before commit"
    );
    tx.commit().await.unwrap();

    let (payment_id, order_id, amount): (Uuid, Uuid, i64) =
        sqlx::query_as("SELECT id, order_id, amount_cents FROM charges")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((order_id, amount), (event.order_id, 4_200));
    let (event_id, topic, key, payload, causation): (Uuid, String, String, sqlx::types::Json<PaymentCaptured>, Option<String>) =
        sqlx::query_as(
            "SELECT event_id, topic, partition_key, payload, headers->>'causation_id' FROM outbox_event",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(event_id, ids[0]);
    assert_eq!(topic, PaymentCaptured::TOPIC);
    assert_eq!(key, event.order_id.to_string(), "keyed by the order");
    assert_eq!(
        payload.0,
        PaymentCaptured {
            payment_id,
            order_id: event.order_id,
            amount_cents: 4_200
        }
    );
    assert_eq!(causation, Some(incoming.event_id.to_string()));
}

#[sqlx::test(migrations = false)]
async fn a_rolled_back_charge_leaves_no_payment_event(pool: PgPool) {
    billing_service::migrate(&pool).await.unwrap();
    let event = order();
    let incoming = incoming(&event);
    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    charge_order::call(&mut ctx, event).await.unwrap();
    ctx.flush().await.unwrap();
    drop(ctx);
    tx.rollback().await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}
