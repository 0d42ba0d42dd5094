//! The payments consumer, and the whole flow orders → billing → orders,
//! against a real PostgreSQL (`TestDb`s), driven by the
//! testing kit without a broker. Orders and billing each have their own
//! database and outbox (a `TestDb` each);
//! the bus carries events between them as the broker would. Both consumers
//! are configured as their services run them.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use demo_events::{OrderCreated, PaymentCaptured};
use orders_service::api::{Limits, OrderView, router};
use outbox::prelude::*;
use outbox::runtime::DeadLetterReason;
use outbox::testing::{Faults, Outcome, TestBus, TestDb};
use sqlx::PgPool;
use tower::ServiceExt;

/// The billing service's database: a database of its own, as in
/// production.
async fn billing_database() -> TestDb {
    TestDb::builder()
        .migrator(&billing_service::MIGRATOR)
        .create()
        .await
        .unwrap()
}

/// `POST /orders` through the orders service's router; returns the id.
async fn place_order(pool: &PgPool, amount_cents: i64) -> Uuid {
    place_order_for(pool, "ann", amount_cents).await
}

/// [`place_order`] for `customer`.
async fn place_order_for(pool: &PgPool, customer: &str, amount_cents: i64) -> Uuid {
    let request = Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(format!(
            r#"{{"customer": "{customer}", "amount_cents": {amount_cents}}}"#
        )))
        .unwrap();
    let response = router(pool.clone(), Limits::default())
        .oneshot(request)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let created: serde_json::Value = serde_json::from_slice(&body).unwrap();
    created["id"].as_str().unwrap().parse().unwrap()
}

async fn order(pool: &PgPool, id: Uuid) -> OrderView {
    let response = router(pool.clone(), Limits::default())
        .oneshot(
            Request::get(format!("/orders/{id}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test]
async fn a_placed_order_is_charged_by_billing_and_marked_paid() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let billing_db = billing_database().await;
    let billing = billing_db.pool().clone();
    // Every event twice, every batch again after its commit: each order is
    // still charged once and paid once.
    let mut bus = TestBus::new()
        .service(orders_service::payments::consumer(pool.clone(), "orders"))
        .service(billing_service::consumer(billing.clone(), "billing"))
        .faults(Faults::new().deliver_twice().redeliver_batches());
    let first = place_order(&pool, 1_250).await;
    let second = place_order(&pool, 990).await;

    let delivery = bus.deliver().await.unwrap();
    delivery.assert_each_handled_once();
    delivery.assert_no_dead_letters();
    for (id, amount) in [(first, 1_250), (second, 990)] {
        delivery.assert_sequence(id, &["OrderCreated", "StockReserved", "PaymentCaptured"]);
        delivery.assert_handled::<OrderCreated>(|o| o.order_id == id);
        let payment = delivery.assert_published::<PaymentCaptured>(|p| p.order_id == id);
        assert_eq!(payment.amount_cents, amount);
        let view = order(&pool, id).await;
        assert_eq!(view.status, "paid");
        assert_eq!(view.payment_id, Some(payment.payment_id));
    }
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&billing)
        .await
        .unwrap();
    assert_eq!(charges, 2);
    let applied: Vec<i32> = sqlx::query_scalar("SELECT payments_applied FROM public.orders")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(applied, [1, 1]);
}

/// Records a payment as billing would, in an outbox the bus reads.
async fn payment(pool: &PgPool, order_id: Uuid, amount_cents: i64) -> PaymentCaptured {
    let payment = PaymentCaptured {
        payment_id: Uuid::now_v7(),
        order_id,
        amount_cents,
    };
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    uow.record(payment.clone());
    uow.commit().await.unwrap();
    payment
}

#[tokio::test]
async fn a_payment_for_no_order_or_of_another_amount_is_dead_lettered() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(
        orders_service::payments::consumer(pool.clone(), "orders")
            .max_attempts(2)
            .retry_backoff(Duration::from_secs(5), Duration::from_secs(5)),
    );
    let order_id = place_order(&pool, 700).await;
    let stray = payment(&pool, Uuid::now_v7(), 700).await;
    let wrong = payment(&pool, order_id, 699).await;

    // What is due only: the order's payment timeout (30 s) stays ahead.
    let delivery = bus.deliver_due().await.unwrap();
    for (event, expected) in [
        (&stray, format!("no order {}", stray.order_id)),
        (
            &wrong,
            format!("order {order_id} costs 700 cents, the payment is of 699 cents"),
        ),
    ] {
        let dead = delivery.assert_dead_lettered::<PaymentCaptured>(|p| p == event);
        let Outcome::DeadLettered { reason, error, .. } = &dead.outcome else {
            unreachable!("a dead letter")
        };
        assert_eq!(*reason, DeadLetterReason::HandlerFailed);
        assert!(error.contains(&expected), "{error}");
    }
    assert_eq!(order(&pool, order_id).await.status, "pending");

    // The right payment marks it paid; a second, distinct one is counted
    // (a double charge shows), and the first stays the order's.
    let right = payment(&pool, order_id, 700).await;
    let again = payment(&pool, order_id, 700).await;
    let delivery = bus.deliver_due().await.unwrap();
    delivery.assert_no_dead_letters();
    assert_eq!(delivery.handled().count(), 2, "{delivery}");
    let view = order(&pool, order_id).await;
    assert_eq!(view.status, "paid");
    assert_eq!(view.payment_id, Some(right.payment_id));
    assert_ne!(view.payment_id, Some(again.payment_id));
    let applied: i32 = sqlx::query_scalar("SELECT payments_applied FROM orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(applied, 2);
}

/// The order-payment saga: billing declines the card and never answers, so
/// the bus jumps its clock to the payment timeout, which cancels the order
/// and releases its stock; the paid order beside it ends paid, its timeout
/// cancelled, its stock kept. Everything delivered twice changes nothing.
#[tokio::test]
async fn an_order_not_paid_in_time_is_cancelled_and_its_stock_released() {
    use demo_events::{OrderCancelled, StockReleased, StockReserved};
    use orders_service::order_saga::{OrderPayment, Stage};

    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let billing_db = billing_database().await;
    let billing = billing_db.pool().clone();
    let mut bus = TestBus::new()
        .service(orders_service::payments::consumer(pool.clone(), "orders"))
        .service(billing_service::consumer(billing.clone(), "billing"))
        .faults(Faults::new().deliver_twice());
    let declined = place_order_for(&pool, demo_events::DECLINED_CUSTOMER, 4_200).await;
    let paid = place_order(&pool, 990).await;

    // Nothing due yet: the declined order waits for its payment.
    let before = bus.deliver_due().await.unwrap();
    before.assert_no_dead_letters();
    assert_eq!(order(&pool, declined).await.status, "pending");
    let saga = bus.saga::<OrderPayment>(declined).await.unwrap().unwrap();
    assert_eq!(saga.stage, Stage::AwaitingPayment);
    assert!(saga.timeouts.contains_key("payment"), "{saga:?}");
    assert!(saga.state.stock_reserved);

    // The clock jumps to the timeout.
    let after = bus.deliver().await.unwrap();
    after.assert_no_dead_letters();
    let cancelled = after.assert_published::<OrderCancelled>(|c| c.order_id == declined);
    assert!(
        cancelled.reason.contains("no payment within"),
        "{cancelled:?}"
    );
    after.assert_handled::<OrderCancelled>(|c| c.order_id == declined);
    after.assert_published::<StockReleased>(|s| s.order_id == declined);
    assert_eq!(after.published::<StockReleased>().len(), 1, "{after}");
    assert_eq!(after.published::<OrderCancelled>().len(), 1, "{after}");
    let view = order(&pool, declined).await;
    assert_eq!((view.status.as_str(), view.paid_at), ("cancelled", None));
    let saga = bus.saga::<OrderPayment>(declined).await.unwrap().unwrap();
    assert_eq!((&saga.stage, saga.completed), (&Stage::Cancelled, true));
    assert!(!saga.state.stock_reserved);
    assert!(saga.timeouts.is_empty(), "{saga:?}");

    let saga = bus.saga::<OrderPayment>(paid).await.unwrap().unwrap();
    assert_eq!((&saga.stage, saga.completed), (&Stage::Paid, true));
    assert!(saga.timeouts.is_empty(), "{saga:?}");
    assert_eq!(order(&pool, paid).await.status, "paid");
    before.assert_published::<StockReserved>(|s| s.order_id == paid);
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&billing)
        .await
        .unwrap();
    assert_eq!(charges, 1, "only the paid order is charged");
}
