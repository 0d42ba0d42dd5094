//! Sagas under the testing kit against a real PostgreSQL (a `TestDb` per
//! test), no broker: an order saga declared with `#[outbox::saga]` runs on
//! the `TestBus`; its payment timeout waits for the test clock; the tests
//! read the instance back (`TestBus::saga`) and what each delivery did to
//! it (`Delivery::saga_history`), also under redelivery, and check that
//! the assertions fail with the instance or its history in their message.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use outbox::BoxError;
use outbox::prelude::*;
use outbox::runtime::{Consumer, DeadLetterReason, Mode};
use outbox::testing::{Faults, SagaInstance, SagaOutcome, TestBus, TestDb};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "saga-kit-orders", aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "saga-kit-payments", aggregate_type = "Order")]
struct PaymentTaken {
    #[event(aggregate_id)]
    order_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "saga-kit-orders", aggregate_type = "Order")]
struct OrderHeld {
    #[event(aggregate_id)]
    order_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "saga-kit-orders", aggregate_type = "Order")]
struct NoteAdded {
    #[event(aggregate_id)]
    order_id: String,
    text: String,
}

/// Handled by a step that always fails: dead-lettered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "saga-kit-orders", aggregate_type = "Order")]
struct OrderReleased {
    #[event(aggregate_id)]
    order_id: String,
}

/// A command to the warehouse, sent by the saga.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "saga-kit-warehouse", aggregate_type = "Order")]
struct ShipOrder {
    #[event(aggregate_id)]
    order_id: String,
}

/// The compensation of a reservation: sent when the payment is late.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "saga-kit-warehouse", aggregate_type = "Order")]
struct ReleaseStock {
    #[event(aggregate_id)]
    order_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Stage {
    AwaitingPayment,
    OnHold,
    Shipped,
    Cancelled,
}

#[derive(Debug, Serialize, Deserialize)]
struct Order {
    order_id: String,
    notes: Vec<String>,
    stage: Stage,
}

const PAYMENT_WINDOW: Duration = Duration::from_secs(15 * 60);

#[outbox::saga(name = "kit-order", timeouts = "saga-kit-timeouts", stage = Stage, correlate = order_id)]
impl Order {
    #[init]
    fn begin(e: &OrderPlaced) -> Self {
        Order {
            order_id: e.order_id.clone(),
            notes: Vec::new(),
            stage: Stage::AwaitingPayment,
        }
    }

    #[step(start)]
    async fn placed(ctx: &mut SagaContext<Self>, _e: OrderPlaced) -> Result<Stage, BoxError> {
        ctx.schedule_timeout("payment", PAYMENT_WINDOW);
        Ok(Stage::AwaitingPayment)
    }

    #[step(from = AwaitingPayment)]
    async fn paid(ctx: &mut SagaContext<Self>, e: PaymentTaken) -> Result<Stage, BoxError> {
        ctx.cancel_timeout("payment");
        ctx.send(ShipOrder {
            order_id: e.order_id,
        });
        ctx.complete();
        Ok(Stage::Shipped)
    }

    #[step(from = AwaitingPayment)]
    async fn held(_ctx: &mut SagaContext<Self>, _e: OrderHeld) -> Result<Stage, BoxError> {
        Ok(Stage::OnHold)
    }

    #[step(from = OnHold)]
    async fn released(_ctx: &mut SagaContext<Self>, _e: OrderReleased) -> Result<Stage, BoxError> {
        Err("the warehouse is closed".into())
    }

    /// In any stage.
    #[step]
    async fn noted(ctx: &mut SagaContext<Self>, e: NoteAdded) -> Result<Stage, BoxError> {
        ctx.notes.push(e.text);
        Ok(ctx.stage.clone())
    }

    /// The compensation: the stock reserved for the order is released.
    #[timeout(name = "payment", from = AwaitingPayment)]
    async fn payment_late(
        ctx: &mut SagaContext<Self>,
        _t: SagaTimeout<Self>,
    ) -> Result<Stage, BoxError> {
        let order_id = ctx.order_id.clone();
        ctx.send(ReleaseStock { order_id });
        ctx.complete();
        Ok(Stage::Cancelled)
    }
}

/// The service's consumer, as `main` would spawn it.
fn orders_process(pool: PgPool) -> outbox::runtime::ConsumerBuilder {
    Consumer::builder(pool)
        .group("orders-process")
        .saga::<Order>()
}

/// Records `event` in its own transaction, as a command would.
async fn record<E: DomainEvent>(pool: &PgPool, event: E) {
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    uow.record(event);
    uow.commit().await.unwrap();
}

async fn placed(pool: &PgPool, order_id: &str) {
    let order_id = order_id.to_owned();
    record(pool, OrderPlaced { order_id }).await;
}

async fn instance(bus: &TestBus, order_id: &str) -> SagaInstance<Order> {
    bus.saga::<Order>(order_id)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("no instance {order_id}"))
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p.downcast_ref::<&str>().unwrap_or(&"?").to_string(),
    }
}

#[tokio::test]
async fn an_unpaid_order_is_cancelled_when_its_payment_timeout_comes() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(orders_process(pool.clone()));
    placed(&pool, "o-1").await;

    // Before its time the timeout is not delivered: the order waits.
    let before = bus.deliver_due().await.unwrap();
    let history = before.saga_history::<Order>("o-1");
    history.assert_steps(&["OrderPlaced"]);
    assert_eq!(history.entries[0].outcome, SagaOutcome::Started);
    before.assert_not_published::<ReleaseStock>();
    instance(&bus, "o-1")
        .await
        .assert_stage(Stage::AwaitingPayment)
        .assert_running()
        .assert_pending_timeout("payment")
        .assert_version(1);

    // A minute short of the window: still nothing.
    bus.clock()
        .advance(PAYMENT_WINDOW - Duration::from_secs(60));
    let early = bus.deliver_due().await.unwrap();
    assert!(
        early.saga_history::<Order>("o-1").entries.is_empty(),
        "{early}"
    );
    instance(&bus, "o-1")
        .await
        .assert_stage(Stage::AwaitingPayment);

    // Past it: the timeout fires and the compensation runs.
    bus.clock().advance(Duration::from_secs(61));
    let after = bus.deliver_due().await.unwrap();
    let history = after.saga_history::<Order>("o-1");
    history.assert_timeout_fired("payment");
    history.assert_steps(&["timeout:payment"]);
    after.assert_published::<ReleaseStock>(|c| c.order_id == "o-1");
    after.assert_not_published::<ShipOrder>();
    let order = instance(&bus, "o-1").await;
    order
        .assert_stage(Stage::Cancelled)
        .assert_completed()
        .assert_no_pending_timeouts()
        .assert_version(2);
    assert_eq!(order.state.order_id, "o-1");

    // A payment arriving after the cancellation changes nothing.
    record(
        &pool,
        PaymentTaken {
            order_id: "o-1".into(),
        },
    )
    .await;
    let late = bus.deliver().await.unwrap();
    let history = late.saga_history::<Order>("o-1");
    assert_eq!(history.entries.len(), 1, "{history}");
    assert_eq!(history.entries[0].outcome, SagaOutcome::AfterCompletion);
    late.assert_not_published::<ShipOrder>();
    instance(&bus, "o-1")
        .await
        .assert_stage(Stage::Cancelled)
        .assert_version(2);
}

#[tokio::test]
async fn deliver_jumps_the_clock_to_the_payment_timeout() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(orders_process(pool.clone()));
    placed(&pool, "o-2").await;

    // One `deliver`: the start, then the clock jumps to the timeout.
    let delivery = bus.deliver().await.unwrap();
    // (The timeout was due 15 minutes after its step ran: a few
    // milliseconds before this clock started.)
    let elapsed = bus.clock().elapsed();
    assert!(
        elapsed > PAYMENT_WINDOW - Duration::from_secs(10),
        "{elapsed:?}"
    );
    let history = delivery.saga_history::<Order>("o-2");
    history.assert_steps(&["OrderPlaced", "timeout:payment"]);
    delivery.assert_saga_step::<Order, OrderPlaced>("o-2");
    delivery.assert_published::<ReleaseStock>(|c| c.order_id == "o-2");
    instance(&bus, "o-2")
        .await
        .assert_stage(Stage::Cancelled)
        .assert_completed();
}

#[tokio::test]
async fn a_paid_order_ships_and_its_cancelled_timeout_never_comes() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(orders_process(pool.clone()));
    placed(&pool, "o-3").await;
    bus.deliver_due().await.unwrap();
    record(
        &pool,
        PaymentTaken {
            order_id: "o-3".into(),
        },
    )
    .await;

    let delivery = bus.deliver().await.unwrap();
    let history = delivery.saga_history::<Order>("o-3");
    history.assert_steps(&["PaymentTaken"]);
    // Its timeout's row was cancelled: no jump, no timeout delivered.
    assert_eq!(history.entries.len(), 1, "{history}");
    assert_eq!(bus.clock().elapsed(), Duration::ZERO);
    let paid = delivery.assert_saga_step::<Order, PaymentTaken>("o-3");
    assert_eq!(paid.order_id, "o-3");
    delivery.assert_published::<ShipOrder>(|c| c.order_id == "o-3");
    delivery.assert_not_published::<ReleaseStock>();
    instance(&bus, "o-3")
        .await
        .assert_stage(Stage::Shipped)
        .assert_completed()
        .assert_no_pending_timeouts()
        .assert_version(2);
}

#[tokio::test]
async fn redelivered_saga_messages_change_nothing() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new()
        .service(orders_process(pool.clone()))
        .faults(Faults::new().deliver_twice().redeliver_batches());
    placed(&pool, "o-4").await;
    let note = NoteAdded {
        order_id: "o-4".into(),
        text: "gift wrap".into(),
    };
    record(&pool, note).await;

    let delivery = bus.deliver_due().await.unwrap();
    let history = delivery.saga_history::<Order>("o-4");
    // Two messages, each sent twice, each batch delivered twice.
    assert_eq!(history.entries.len(), 8, "{history}");
    history.assert_steps(&["OrderPlaced", "NoteAdded"]);
    history.assert_each_applied_once();
    let duplicates = history
        .entries
        .iter()
        .filter(|e| e.outcome == SagaOutcome::Duplicate)
        .count();
    assert_eq!(duplicates, 6, "{history}");
    let order = instance(&bus, "o-4").await;
    order.assert_stage(Stage::AwaitingPayment).assert_version(2);
    assert_eq!(order.state.notes, ["gift wrap"]);
}

#[tokio::test]
async fn a_message_in_another_stage_is_ignored() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(orders_process(pool.clone()));
    placed(&pool, "o-5").await;
    record(
        &pool,
        OrderHeld {
            order_id: "o-5".into(),
        },
    )
    .await;
    bus.deliver_due().await.unwrap();
    record(
        &pool,
        PaymentTaken {
            order_id: "o-5".into(),
        },
    )
    .await;

    let delivery = bus.deliver_due().await.unwrap();
    let history = delivery.saga_history::<Order>("o-5");
    assert_eq!(history.entries.len(), 1, "{history}");
    assert_eq!(history.entries[0].outcome, SagaOutcome::OtherStage);
    assert_eq!(history.steps(), Vec::<String>::new());
    // Handled by the consumer (its dedup row written), but no step ran.
    delivery.assert_handled::<PaymentTaken>(|p| p.order_id == "o-5");
    delivery.assert_not_published::<ShipOrder>();
    instance(&bus, "o-5")
        .await
        .assert_stage(Stage::OnHold)
        .assert_running()
        .assert_version(2);
    // Another instance's history is its own; an unknown one has none.
    assert!(delivery.saga_history::<Order>("o-1").entries.is_empty());
    assert!(bus.saga::<Order>("o-404").await.unwrap().is_none());
}

#[tokio::test]
async fn saga_assertions_fail_with_the_instance_or_its_history() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(orders_process(pool.clone()));
    placed(&pool, "o-6").await;
    let delivery = bus.deliver_due().await.unwrap();
    let order = instance(&bus, "o-6").await;

    let fails = |f: &dyn Fn()| panic_message(catch_unwind(AssertUnwindSafe(f)).unwrap_err());
    let message = fails(&|| {
        order.assert_stage(Stage::Shipped);
    });
    assert!(
        message.contains("expected stage Shipped, found AwaitingPayment")
            && message.contains("instance `o-6`")
            && message.contains("\"order_id\":\"o-6\""),
        "{message}"
    );
    let message = fails(&|| {
        order.assert_completed();
    });
    assert!(message.contains("it is running"), "{message}");
    let message = fails(&|| {
        order.assert_pending_timeout("shipping");
    });
    assert!(
        message.contains("expected timeout `shipping` pending")
            && message.contains("pending timeouts [\"payment\"]"),
        "{message}"
    );
    let message = fails(&|| {
        order.assert_version(5);
    });
    assert!(message.contains("expected version 5"), "{message}");

    let history = delivery.saga_history::<Order>("o-6");
    let message = fails(&|| history.assert_steps(&["OrderPlaced", "PaymentTaken"]));
    assert!(
        message.contains(r#"applied ["OrderPlaced"]"#) && message.contains("OrderPlaced: started"),
        "{message}"
    );
    let message = fails(&|| history.assert_timeout_fired("payment"));
    assert!(message.contains("timeout `payment`"), "{message}");
    let message = fails(&|| {
        delivery.assert_saga_step::<Order, PaymentTaken>("o-6");
    });
    assert!(
        message.contains("no `PaymentTaken` was applied to saga `kit-order` instance `o-6`"),
        "{message}"
    );
}

#[tokio::test]
async fn a_failing_step_is_dead_lettered_and_changes_nothing() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(orders_process(pool.clone()).max_attempts(2));
    placed(&pool, "o-7").await;
    record(
        &pool,
        OrderHeld {
            order_id: "o-7".into(),
        },
    )
    .await;
    record(
        &pool,
        OrderReleased {
            order_id: "o-7".into(),
        },
    )
    .await;

    let delivery = bus.deliver_due().await.unwrap();
    let history = delivery.saga_history::<Order>("o-7");
    history.assert_steps(&["OrderPlaced", "OrderHeld"]);
    let last = history.entries.last().unwrap();
    assert_eq!(last.label(), "OrderReleased");
    assert!(
        matches!(&last.outcome, SagaOutcome::DeadLettered { reason, error }
            if *reason == DeadLetterReason::HandlerFailed && error.contains("the warehouse is closed")),
        "{history}"
    );
    instance(&bus, "o-7")
        .await
        .assert_stage(Stage::OnHold)
        .assert_version(2);
}

#[tokio::test]
async fn a_saga_in_inbox_mode_has_the_same_history() {
    let db = TestDb::new().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(orders_process(pool.clone()).mode(Mode::Inbox));
    placed(&pool, "o-8").await;
    let note = NoteAdded {
        order_id: "o-8".into(),
        text: "fragile".into(),
    };
    record(&pool, note).await;

    let delivery = bus.deliver().await.unwrap();
    let history = delivery.saga_history::<Order>("o-8");
    history.assert_steps(&["OrderPlaced", "NoteAdded", "timeout:payment"]);
    let order = instance(&bus, "o-8").await;
    order.assert_stage(Stage::Cancelled).assert_version(3);
    assert_eq!(order.state.notes, ["fragile"]);
}
