//! The testing kit (`outbox::testing`, feature `testing`) against a real
//! PostgreSQL (a `TestDb` per test), no broker: commands record
//! events, the `TestBus` delivers them through the consumer's real path,
//! the tests check what the database and the bus's report say — also under
//! the fault modes, with retries on the test clock, across two outboxes,
//! and with assertions that fail.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use outbox::prelude::*;
use outbox::runtime::cloudevents;
use outbox::runtime::{Consumer, DeadLetterReason, Mode};
use outbox::testing::{Error as BusError, FailTimes, Faults, Outcome, RawMessage, TestBus, TestDb};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "kit-orders", aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "kit-payments", aggregate_type = "Payment")]
struct PaymentCaptured {
    #[event(aggregate_id)]
    payment_id: Uuid,
    #[event(partition_key)]
    order_id: Uuid,
    amount_cents: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "kit-steps", aggregate_type = "Job")]
struct StepDone {
    #[event(aggregate_id)]
    job: String,
    step: i32,
}

/// A reminder scheduled by [`place_order_with_reminder`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "kit-reminders", aggregate_type = "Order")]
struct PaymentReminder {
    #[event(aggregate_id)]
    order_id: Uuid,
}

struct PlaceOrder {
    amount_cents: i64,
}

/// Places an order with a payment reminder in 15 minutes (nothing
/// charges it here); returns the order id and the reminder's event id.
async fn place_order_with_reminder(pool: &PgPool) -> (Uuid, Uuid) {
    let order_id = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id, amount_cents, status) VALUES ($1, 100, 'pending')")
        .bind(order_id)
        .execute(&mut *uow)
        .await
        .unwrap();
    let reminder = uow.record_after(Duration::from_secs(15 * 60), PaymentReminder { order_id });
    uow.commit().await.unwrap();
    (order_id, reminder)
}

#[inbox_handler]
async fn remind(ctx: &mut HandlerContext<'_>, event: PaymentReminder) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET status = 'reminded' WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut **ctx)
        .await?;
    Ok(())
}

#[command_handler]
async fn place_order(uow: &mut UnitOfWork, cmd: PlaceOrder) -> Result<Uuid, outbox::Error> {
    let order_id = Uuid::now_v7();
    sqlx::query("INSERT INTO orders (id, amount_cents, status) VALUES ($1, $2, 'pending')")
        .bind(order_id)
        .bind(cmd.amount_cents)
        .execute(&mut **uow)
        .await?;
    uow.record(OrderPlaced {
        order_id,
        amount_cents: cmd.amount_cents,
    });
    Ok(order_id)
}

#[inbox_handler]
async fn charge_order(ctx: &mut HandlerContext<'_>, event: OrderPlaced) -> Result<(), sqlx::Error> {
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
        amount_cents: event.amount_cents,
    });
    Ok(())
}

#[inbox_handler]
async fn mark_paid(
    ctx: &mut HandlerContext<'_>,
    event: PaymentCaptured,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET status = 'paid', paid_times = paid_times + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut **ctx)
        .await?;
    Ok(())
}

#[inbox_handler]
async fn log_step(ctx: &mut HandlerContext<'_>, event: StepDone) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO steps (job, step) VALUES ($1, $2)")
        .bind(&event.job)
        .bind(event.step)
        .execute(&mut **ctx)
        .await?;
    Ok(())
}

/// Records the next step forever: an endless cascade.
#[inbox_handler]
async fn next_step(ctx: &mut HandlerContext<'_>, event: StepDone) -> Result<(), sqlx::Error> {
    ctx.record(StepDone {
        job: event.job,
        step: event.step + 1,
    });
    Ok(())
}

/// The tables of the tests' services, in the template of their databases.
const TABLES: &str = "
    CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL, status text NOT NULL, paid_times int NOT NULL DEFAULT 0);
    CREATE TABLE charges (id uuid PRIMARY KEY, order_id uuid NOT NULL, amount_cents bigint NOT NULL);
    CREATE TABLE steps (seq bigserial PRIMARY KEY, job text NOT NULL, step int NOT NULL);";

async fn tables(pool: &PgPool) {
    sqlx::raw_sql(TABLES).execute(pool).await.unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn billing(pool: &PgPool) -> outbox::runtime::ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group("billing")
        .handler(charge_order)
}

fn orders(pool: &PgPool) -> outbox::runtime::ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group("orders")
        .handler(mark_paid)
}

/// The services' consumers, as the README's example has them.
mod billing {
    pub fn consumer(pool: sqlx::PgPool) -> outbox::runtime::ConsumerBuilder {
        super::billing(&pool)
    }
}

mod orders {
    pub fn consumer(pool: sqlx::PgPool) -> outbox::runtime::ConsumerBuilder {
        super::orders(&pool)
    }
}

// README: Testing your handlers (begin)
#[tokio::test]
async fn placing_an_order_charges_it_and_marks_it_paid() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap(); // in ms
    let pool = db.pool().clone();
    // The services' own consumers: no broker, no relay.
    let mut bus = TestBus::new()
        .service(billing::consumer(pool.clone()))
        .service(orders::consumer(pool.clone()));
    let cmd = PlaceOrder { amount_cents: 500 };
    let order_id = outbox::execute(&pool, place_order, cmd).await.unwrap();

    // Delivers, and delivers what the handlers record, until nothing is new.
    let delivery = bus.deliver().await.unwrap();
    delivery.assert_published::<PaymentCaptured>(|e| e.order_id == order_id);
    delivery.assert_sequence(order_id, &["OrderPlaced", "PaymentCaptured"]);
    delivery.assert_no_dead_letters();
}
// README: Testing your handlers (end)

// README: Messages of other producers (begin)
#[tokio::test]
async fn an_order_placed_by_the_legacy_shop_is_charged_once() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let mut bus = TestBus::new().service(billing::consumer(db.pool().clone()));
    // A CloudEvent of a system that does not use this framework.
    let order_id = Uuid::now_v7();
    let placed = RawMessage::cloud_event(OrderPlaced::TOPIC, "OrderPlaced", "inv-42")
        .header("ce_source", "/legacy-shop")
        .key(order_id.to_string())
        .json(&serde_json::json!({ "order_id": order_id, "amount_cents": 500 }));
    bus.send(placed.clone()).send(placed.clone()); // twice: charged once
    bus.send(placed.without_header("ce_source")); // no source: no identity

    let delivery = bus.deliver().await.unwrap();
    let id = cloudevents::event_id("/legacy-shop", "inv-42"); // from source and id
    let handled: Vec<_> = delivery.handled().map(|d| d.event_id).collect();
    assert_eq!(handled, [Some(id)]);
    assert_eq!(delivery.duplicates(), 1);
    let dead = delivery.assert_dead_lettered::<OrderPlaced>(|e| e.order_id == order_id);
    assert!(matches!(&dead.outcome, Outcome::DeadLettered { reason, .. }
        if *reason == DeadLetterReason::NoEventId));
}
// README: Messages of other producers (end)

/// The testing chapter's examples (docs/src/testing.md) are the tests above,
/// verbatim: they run here (the chapter marks them `ignore` for the doc
/// tests, which would only compile them).
#[test]
fn the_guide_examples_are_this_files_tests() {
    let this = include_str!("testing_kit.rs");
    let chapter = include_str!("../docs/src/testing.md");
    let blocks: Vec<&str> = chapter
        .split("```rust,ignore\n")
        .skip(1)
        .map(|b| &b[..b.find("```").expect("the block's end")])
        .collect();
    for (name, lines) in [
        ("Testing your handlers", 20),
        ("Messages of other producers", 25),
    ] {
        let begin = format!("// README: {name} (begin)\n");
        let end = format!("// README: {name} (end)\n");
        let start = this.find(&begin).expect("the begin marker") + begin.len();
        let example = &this[start..this.find(&end).expect("the end marker")];
        let Some(block) = blocks.iter().find(|b| b.ends_with(example)) else {
            panic!("no README example is the test `{name}`:\n{example}\nREADME:\n{blocks:#?}");
        };
        assert!(block.lines().count() <= lines, "{block}");
    }
}

#[tokio::test]
async fn an_order_is_charged_and_marked_paid_without_a_broker() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let started = Instant::now();
    let mut bus = TestBus::new()
        .service(billing(&pool))
        .service(orders(&pool));
    let order_id = outbox::execute(&pool, place_order, PlaceOrder { amount_cents: 500 })
        .await
        .unwrap();
    let delivery = bus.deliver().await.unwrap();
    delivery
        .assert_published::<PaymentCaptured>(|e| e.order_id == order_id && e.amount_cents == 500);
    delivery.assert_handled::<OrderPlaced>(|e| e.order_id == order_id);
    delivery.assert_sequence(order_id, &["OrderPlaced", "PaymentCaptured"]);
    delivery.assert_no_dead_letters();
    delivery.assert_each_handled_once();
    eprintln!(
        "kit: the test's command, delivery and assertions took {:?}",
        started.elapsed()
    );

    assert_eq!(delivery.rounds, 2, "{delivery}");
    let counts = delivery.counts();
    assert_eq!(counts["OrderPlaced"].handled, 1);
    assert_eq!(counts["PaymentCaptured"].handled, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders WHERE status = 'paid' AND paid_times = 1"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL"
        )
        .await,
        0,
        "the bus marks what it delivered published"
    );
    // The follow-up event carries the handled event's correlation and
    // causation, as the consumer writes them.
    let placed = &delivery.published[0];
    let captured = &delivery.published[1];
    assert_eq!(
        captured.header("causation_id"),
        Some(placed.event_id.to_string())
    );
    assert_eq!(
        captured.header("correlation_id"),
        placed.header("correlation_id")
    );
    // Nothing left: a second delivery does nothing.
    let again = bus.deliver().await.unwrap();
    assert!(
        again.published.is_empty() && again.delivered.is_empty(),
        "{again}"
    );
}

#[tokio::test]
async fn every_event_delivered_twice_is_applied_once() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    for mode in [Mode::Dedup, Mode::Inbox] {
        let mut bus = TestBus::new()
            .service(billing(&pool).mode(mode))
            .service(orders(&pool).mode(mode))
            .faults(Faults::new().deliver_twice());
        for amount in [100, 200, 300] {
            outbox::execute(
                &pool,
                place_order,
                PlaceOrder {
                    amount_cents: amount,
                },
            )
            .await
            .unwrap();
        }
        let delivery = bus.deliver().await.unwrap();
        delivery.assert_each_handled_once();
        delivery.assert_no_dead_letters();
        assert_eq!(delivery.delivered.len(), 12, "{delivery}");
        assert_eq!(delivery.duplicates(), 6, "{mode}: {delivery}");
        sqlx::query("TRUNCATE orders, charges")
            .execute(&pool)
            .await
            .unwrap();
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
}

#[tokio::test]
async fn a_batch_redelivered_after_the_commit_is_applied_once() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    for mode in [Mode::Dedup, Mode::Inbox] {
        let mut bus = TestBus::new()
            .service(billing(&pool).mode(mode))
            .service(orders(&pool).mode(mode))
            .faults(Faults::new().redeliver_batches());
        for amount in [100, 200] {
            outbox::execute(
                &pool,
                place_order,
                PlaceOrder {
                    amount_cents: amount,
                },
            )
            .await
            .unwrap();
        }
        let delivery = bus.deliver().await.unwrap();
        delivery.assert_each_handled_once();
        assert_eq!(delivery.duplicates(), 4, "{mode}: {delivery}");
        assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 2);
        assert_eq!(
            count(&pool, "SELECT count(*) FROM orders WHERE paid_times = 1").await,
            2
        );
        sqlx::query("TRUNCATE orders, charges")
            .execute(&pool)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_handler_failing_twice_is_retried_on_the_test_clock() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    for mode in [Mode::Dedup, Mode::Inbox] {
        let started = Instant::now();
        let mut bus = TestBus::new().service(
            Consumer::builder(pool.clone())
                .group(format!("billing-{mode}"))
                .handler(FailTimes::new(charge_order, 2))
                .mode(mode)
                .retry_backoff(Duration::from_secs(1), Duration::from_secs(60)),
        );
        let order_id = outbox::execute(&pool, place_order, PlaceOrder { amount_cents: 700 })
            .await
            .unwrap();
        let delivery = bus.deliver().await.unwrap();
        delivery.assert_handled::<OrderPlaced>(|e| e.order_id == order_id);
        delivery.assert_no_dead_letters();
        assert_eq!(delivery.handler_failures, 2, "{delivery}");
        // The back-off doubles: 1 s, then 2 s — waited on the test clock.
        assert_eq!(
            delivery.retry_waits,
            [Duration::from_secs(1), Duration::from_secs(2)],
            "{mode}: {delivery}"
        );
        eprintln!(
            "kit: {mode}: two retries (3 s of back-off) took {:?}",
            started.elapsed()
        );
        delivery.assert_published::<PaymentCaptured>(|e| e.order_id == order_id);
    }
}

#[tokio::test]
async fn a_handler_that_keeps_failing_is_dead_lettered_and_its_follow_ups_are_not_written() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    for mode in [Mode::Dedup, Mode::Inbox] {
        let group = format!("billing-{mode}");
        let mut bus = TestBus::new().service(
            Consumer::builder(pool.clone())
                .group(&group)
                .handler(FailTimes::new(charge_order, u32::MAX))
                .mode(mode)
                .max_attempts(3)
                .retry_backoff(Duration::from_secs(10), Duration::from_secs(15)),
        );
        let order_id = outbox::execute(&pool, place_order, PlaceOrder { amount_cents: 900 })
            .await
            .unwrap();
        let delivery = bus.deliver().await.unwrap();
        let dead = delivery.assert_dead_lettered::<OrderPlaced>(|e| e.order_id == order_id);
        match &dead.outcome {
            Outcome::DeadLettered {
                reason,
                error,
                attempts,
            } => {
                assert_eq!(*reason, DeadLetterReason::HandlerFailed);
                assert!(error.contains("injected failure"), "{error}");
                assert_eq!(*attempts, 3);
            }
            other => panic!("{other}"),
        }
        delivery.assert_not_published::<PaymentCaptured>();
        assert_eq!(delivery.handler_failures, 3);
        assert_eq!(delivery.retry_waits.len(), 2, "{mode}: {delivery}");
        assert_eq!(
            count(
                &pool,
                &format!("SELECT count(*) FROM dead_letter WHERE consumer = '{group}'")
            )
            .await,
            1
        );
        let failed = catch_unwind(AssertUnwindSafe(|| delivery.assert_no_dead_letters()));
        let message = panic_message(failed.unwrap_err());
        assert!(
            message.contains("1 written") && message.contains("handler_failed"),
            "{message}"
        );
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 0);
}

#[tokio::test]
async fn interleaved_keys_keep_each_keys_order() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new()
        .service(
            Consumer::builder(pool.clone())
                .group("steps")
                .handler(log_step),
        )
        .faults(Faults::new().interleave_keys(42));
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    for step in 1..=4 {
        for job in ["a", "b", "c"] {
            uow.record(StepDone {
                job: job.into(),
                step,
            });
        }
    }
    uow.commit().await.unwrap();
    let delivery = bus.deliver().await.unwrap();
    delivery.assert_each_handled_once();
    let applied: Vec<(String, i32)> = sqlx::query_as("SELECT job, step FROM steps ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    let recorded: Vec<(String, i32)> = delivery
        .published::<StepDone>()
        .into_iter()
        .map(|e| (e.job, e.step))
        .collect();
    assert_ne!(applied, recorded, "the keys were interleaved");
    for job in ["a", "b", "c"] {
        let steps: Vec<i32> = applied
            .iter()
            .filter(|(j, _)| j == job)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(steps, [1, 2, 3, 4], "job {job}: {applied:?}");
        delivery.assert_sequence(job, &["StepDone"; 4]);
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn two_services_with_their_own_outboxes_talk_through_the_bus(pool: PgPool) {
    // orders in the test's database, billing in a schema of its own: two
    // outboxes, as two services' databases.
    tables(&pool).await;
    sqlx::query("CREATE SCHEMA billing")
        .execute(&pool)
        .await
        .unwrap();
    let options = (*pool.connect_options())
        .clone()
        .options([("search_path", "billing")]);
    let billing_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    outbox::migrate(&billing_pool).await.unwrap();
    sqlx::query("CREATE TABLE billing.charges (id uuid PRIMARY KEY, order_id uuid NOT NULL, amount_cents bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();

    let mut bus = TestBus::new()
        .service(orders(&pool))
        .service(billing(&billing_pool));
    let order_id = outbox::execute(
        &pool,
        place_order,
        PlaceOrder {
            amount_cents: 1_200,
        },
    )
    .await
    .unwrap();
    let delivery = bus.deliver().await.unwrap();
    delivery.assert_sequence(order_id, &["OrderPlaced", "PaymentCaptured"]);
    delivery.assert_each_handled_once();
    assert_ne!(delivery.published[0].outbox, delivery.published[1].outbox);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM billing.charges").await,
        1
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM public.charges").await, 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE status = 'paid'").await,
        1
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM billing.processed_event WHERE consumer = 'billing'"
        )
        .await,
        1
    );
    billing_pool.close().await;
}

#[tokio::test]
async fn an_endless_cascade_stops_with_a_clear_error() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new()
        .service(
            Consumer::builder(pool.clone())
                .group("loop")
                .handler(next_step),
        )
        .max_rounds(5);
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.record(StepDone {
        job: "j".into(),
        step: 0,
    });
    uow.commit().await.unwrap();
    let error = bus.deliver().await.unwrap_err();
    match &error {
        BusError::Endless { rounds, delivery } => {
            assert_eq!(*rounds, 5);
            assert_eq!(delivery.published.len(), 6, "{delivery}");
        }
        other => panic!("{other}"),
    }
    assert!(error.to_string().contains("after 5 rounds"), "{error}");
}

#[tokio::test]
async fn failed_assertions_show_what_was_there_instead() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(billing(&pool));
    let order_id = outbox::execute(&pool, place_order, PlaceOrder { amount_cents: 500 })
        .await
        .unwrap();
    let delivery = bus.deliver().await.unwrap();

    let message = panic_message(
        catch_unwind(AssertUnwindSafe(|| {
            delivery.assert_published::<OrderPlaced>(|e| e.amount_cents == 501);
        }))
        .unwrap_err(),
    );
    assert!(
        message.contains("no published `OrderPlaced` matches"),
        "{message}"
    );
    assert!(message.contains("amount_cents: 500"), "{message}");

    let message = panic_message(
        catch_unwind(AssertUnwindSafe(|| {
            delivery.assert_sequence(order_id, &["OrderPlaced"]);
        }))
        .unwrap_err(),
    );
    assert!(
        message
            .contains(r#"expected ["OrderPlaced"], published ["OrderPlaced", "PaymentCaptured"]"#),
        "{message}"
    );

    let message = panic_message(
        catch_unwind(AssertUnwindSafe(|| {
            delivery.assert_handled::<PaymentCaptured>(|_| true);
        }))
        .unwrap_err(),
    );
    // Nobody subscribes to payments on this bus.
    assert!(message.contains("none delivered"), "{message}");
}

#[tokio::test]
async fn an_ignored_event_type_is_reported_as_ignored() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let mut bus =
        TestBus::new().service(billing(&pool).ignore_event_type("kit-orders", "OrderCancelled"));
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.record_message(outbox::OutboxMessage {
        event_id: Uuid::now_v7(),
        aggregate_type: "Order".into(),
        aggregate_id: "o1".into(),
        event_type: "OrderCancelled".into(),
        event_version: 1,
        topic: "kit-orders".into(),
        partition_key: "o1".into(),
        payload: "{}".into(),
        headers: Headers::default(),
    });
    uow.commit().await.unwrap();
    let delivery = bus.deliver().await.unwrap();
    assert_eq!(delivery.counts()["OrderCancelled"].ignored, 1, "{delivery}");
    delivery.assert_no_dead_letters();
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

/// A consumer configured with a topic prefix (as `TestTopics` wires it)
/// gets its events on the bus too, on the prefixed topic.
#[tokio::test]
async fn a_consumer_with_a_topic_prefix_gets_its_events_on_the_bus() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let mut bus = TestBus::new().service(billing(&pool).topic_prefix("test-x."));
    let cmd = PlaceOrder { amount_cents: 700 };
    let order_id = outbox::execute(&pool, place_order, cmd).await.unwrap();
    let delivery = bus.deliver().await.unwrap();
    delivery.assert_handled::<OrderPlaced>(|e| e.order_id == order_id);
    // Reported under the event's own topic.
    assert_eq!(delivery.delivered[0].topic, "kit-orders");
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 1);
}

/// Scheduled events wait for the bus's clock: `deliver_due` leaves a
/// reminder due in 15 minutes until the clock has moved past it;
/// `deliver` jumps the clock to it; a cancelled one is never delivered.
#[tokio::test]
async fn scheduled_events_are_delivered_when_the_test_clock_reaches_them() {
    let db = TestDb::builder().sql(TABLES).create().await.unwrap();
    let pool = db.pool().clone();
    let status = async |order_id: Uuid| -> String {
        sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
            .bind(order_id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let mut bus = TestBus::new().service(
        Consumer::builder(pool.clone())
            .group("reminders")
            .handler(remind),
    );

    let (order, _) = place_order_with_reminder(&pool).await;
    let before = bus.deliver_due().await.unwrap();
    assert!(before.published.is_empty(), "{before}");
    assert_eq!(status(order).await, "pending");
    bus.clock().advance(Duration::from_secs(14 * 60));
    assert!(bus.deliver_due().await.unwrap().published.is_empty());
    bus.clock().advance(Duration::from_secs(2 * 60));
    let after = bus.deliver_due().await.unwrap();
    after.assert_handled::<PaymentReminder>(|e| e.order_id == order);
    assert_eq!(status(order).await, "reminded");

    // `deliver` jumps to the next one; a cancelled one never comes. (A
    // new bus: its clock's time is the database's again.)
    let mut bus = TestBus::new().service(
        Consumer::builder(pool.clone())
            .group("reminders")
            .handler(remind),
    );
    let started = Instant::now();
    let (later, _) = place_order_with_reminder(&pool).await;
    let (cancelled, reminder) = place_order_with_reminder(&pool).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(uow.cancel_scheduled(reminder).await.unwrap());
    uow.commit().await.unwrap();
    let elapsed = bus.clock().elapsed();
    let delivery = bus.deliver().await.unwrap();
    delivery.assert_handled::<PaymentReminder>(|e| e.order_id == later);
    assert_eq!(delivery.published.len(), 1, "{delivery}");
    assert!(bus.clock().elapsed() >= elapsed + Duration::from_secs(14 * 60));
    assert!(delivery.retry_waits.is_empty(), "a jump is no retry");
    assert_eq!(status(later).await, "reminded");
    assert_eq!(status(cancelled).await, "pending");
    assert!(started.elapsed() < Duration::from_secs(60));
}
