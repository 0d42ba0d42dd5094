//! `#[inbox_handler]` and `#[command_handler]` at run time, against a real
//! PostgreSQL (a fresh database per test).
//!
//! Inbox handlers are driven the way the consumer drives them: a transaction,
//! a `HandlerContext` over it, `InboxHandler::handle`, then `flush` and
//! commit (or rollback). Command handlers run through `outbox::execute` and
//! through `call` / `handle` on a Unit of Work the test manages.

use std::collections::HashMap;
use std::fmt;

use outbox::prelude::*;
use outbox::{BoxError, DomainEvent, Error, IncomingEvent};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", aggregate_type = "Order")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "invoices", aggregate_type = "Invoice")]
struct InvoiceRequested {
    #[event(aggregate_id)]
    invoice_id: Uuid,
    order_id: Uuid,
}

/// An event whose payload cannot be serialized (JSON map keys must be strings).
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(topic = "broken")]
struct Unserializable {
    #[event(aggregate_id)]
    id: u64,
    map: HashMap<(u8, u8), u8>,
}

async fn create_tables(pool: &PgPool) {
    for sql in [
        "CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL CHECK (amount_cents > 0))",
        "CREATE TABLE invoices (id uuid PRIMARY KEY, order_id uuid NOT NULL UNIQUE)",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn incoming_for(event: &OrderCreated, correlation_id: Option<Uuid>) -> IncomingEvent {
    IncomingEvent::new(
        Uuid::now_v7(),
        event.event_type(),
        event.event_version(),
        OrderCreated::TOPIC,
        event.partition_key(),
        Headers {
            correlation_id,
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            ..Headers::default()
        },
    )
}

fn order(amount_cents: i64) -> OrderCreated {
    OrderCreated {
        order_id: Uuid::now_v7(),
        amount_cents,
    }
}

// ---------------------------------------------------------------- inbox side

/// Writes an invoice row and records a follow-up event.
#[inbox_handler]
async fn request_invoice(
    ctx: &mut HandlerContext<'_>,
    event: OrderCreated,
) -> Result<(), BoxError> {
    let invoice_id = Uuid::now_v7();
    sqlx::query("INSERT INTO invoices (id, order_id) VALUES ($1, $2)")
        .bind(invoice_id)
        .bind(event.order_id)
        .execute(&mut **ctx)
        .await?;
    ctx.record(InvoiceRequested {
        invoice_id,
        order_id: event.order_id,
    });
    Ok(())
}

#[derive(Debug, PartialEq)]
struct Refused(i64);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "refused an order of {} cents", self.0)
    }
}

impl std::error::Error for Refused {}

/// Fails with an error of its own type, after doing some work.
#[inbox_handler(name = "invoices.refuse")]
async fn refuse(ctx: &mut HandlerContext<'_>, event: OrderCreated) -> Result<(), Refused> {
    ctx.record(InvoiceRequested {
        invoice_id: Uuid::now_v7(),
        order_id: event.order_id,
    });
    Err(Refused(event.amount_cents))
}

/// How the consumer runs a handler: decode by event type, handle, flush.
async fn dispatch<H: InboxHandler>(
    handler: &H,
    ctx: &mut HandlerContext<'_>,
    payload: &[u8],
) -> Result<Vec<Uuid>, BoxError> {
    let event = H::Event::from_payload(&ctx.incoming().event_type.clone(), payload)?;
    handler.handle(ctx, event).await?;
    Ok(ctx.flush().await?)
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn inbox_handler_work_and_follow_ups_commit_with_the_transaction(pool: PgPool) {
    create_tables(&pool).await;
    let event = order(500);
    let correlation = Uuid::now_v7();
    let incoming = incoming_for(&event, Some(correlation));
    let payload = event.to_payload().unwrap();

    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    let ids = dispatch(&request_invoice, &mut ctx, payload.as_bytes())
        .await
        .unwrap();
    assert_eq!(ids.len(), 1);
    assert_eq!(ctx.recorded_events(), 0, "flushed");
    drop(ctx);

    // Nothing is visible outside the transaction yet.
    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
    tx.commit().await.unwrap();

    let (order_id,): (Uuid,) = sqlx::query_as("SELECT order_id FROM invoices")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(order_id, event.order_id);
    let (event_id, topic, event_type, headers): (Uuid, String, String, sqlx::types::Json<Headers>) =
        sqlx::query_as("SELECT event_id, topic, event_type, headers FROM outbox_event")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(event_id, ids[0]);
    assert_eq!(
        (topic.as_str(), event_type.as_str()),
        ("invoices", "InvoiceRequested")
    );
    assert_eq!(headers.causation_id, Some(incoming.event_id));
    assert_eq!(headers.correlation_id, Some(correlation));
    // The same trace, continued by the handling: same trace id, new span.
    let sent: outbox::TraceParent = incoming
        .headers
        .traceparent
        .as_deref()
        .unwrap()
        .parse()
        .unwrap();
    let follow: outbox::TraceParent = headers.traceparent.as_deref().unwrap().parse().unwrap();
    assert_eq!(follow.trace_id(), sent.trace_id());
    assert_ne!(follow.parent_id(), sent.parent_id());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn follow_ups_of_an_uncorrelated_event_are_correlated_by_it(pool: PgPool) {
    create_tables(&pool).await;
    let event = order(500);
    let incoming = incoming_for(&event, None);

    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    request_invoice.handle(&mut ctx, event).await.unwrap();
    ctx.flush().await.unwrap();
    drop(ctx);
    tx.commit().await.unwrap();

    let headers: sqlx::types::Json<Headers> =
        sqlx::query_scalar("SELECT headers FROM outbox_event")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(headers.correlation_id, Some(incoming.event_id));
    assert_eq!(headers.causation_id, Some(incoming.event_id));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn rollback_drops_the_handlers_work_and_its_follow_ups(pool: PgPool) {
    create_tables(&pool).await;
    let event = order(500);
    let incoming = incoming_for(&event, None);

    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    request_invoice.handle(&mut ctx, event).await.unwrap();
    assert_eq!(ctx.flush().await.unwrap().len(), 1);
    drop(ctx);
    let inside: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(inside, 1, "written inside the transaction");
    tx.rollback().await.unwrap();

    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn handler_errors_are_boxed_with_their_type(pool: PgPool) {
    create_tables(&pool).await;
    assert_eq!(<refuse as InboxHandler>::NAME, "invoices.refuse");
    assert_eq!(<request_invoice as InboxHandler>::NAME, "request_invoice");

    let event = order(7);
    let incoming = incoming_for(&event, None);
    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    let error = refuse.handle(&mut ctx, event).await.unwrap_err();
    assert_eq!(error.downcast_ref::<Refused>(), Some(&Refused(7)));
    assert_eq!(error.to_string(), "refused an order of 7 cents");
    // The consumer does not flush after an error: the recorded event is
    // dropped with the transaction.
    assert_eq!(ctx.recorded_events(), 1);
    drop(ctx);
    drop(tx);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);

    // A failing query surfaces as the handler's error (here a duplicate
    // invoice for the same order).
    let event = order(500);
    let incoming = incoming_for(&event, None);
    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    request_invoice
        .handle(&mut ctx, event.clone())
        .await
        .unwrap();
    let error = request_invoice.handle(&mut ctx, event).await.unwrap_err();
    let database = error.downcast_ref::<sqlx::Error>().unwrap();
    assert!(
        database
            .as_database_error()
            .is_some_and(|e| e.is_unique_violation()),
        "{database}"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn call_runs_the_function_itself(pool: PgPool) {
    create_tables(&pool).await;
    let event = order(500);
    let incoming = incoming_for(&event, None);
    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    request_invoice::call(&mut ctx, event).await.unwrap();
    assert_eq!(ctx.recorded_events(), 1);
    ctx.flush().await.unwrap();
    drop(ctx);
    tx.commit().await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 1);
}

// -------------------------------------------------------------- command side

struct PlaceOrder {
    amount_cents: i64,
}

/// The application's error: a rejection, or the outbox's (and sqlx's)
/// errors, which `outbox::execute` needs to return.
#[derive(Debug)]
enum PlaceOrderError {
    Rejected(&'static str),
    Outbox(Error),
}

impl fmt::Display for PlaceOrderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlaceOrderError::Rejected(why) => write!(f, "rejected: {why}"),
            PlaceOrderError::Outbox(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for PlaceOrderError {}

impl From<Error> for PlaceOrderError {
    fn from(error: Error) -> Self {
        PlaceOrderError::Outbox(error)
    }
}

impl From<sqlx::Error> for PlaceOrderError {
    fn from(error: sqlx::Error) -> Self {
        PlaceOrderError::Outbox(error.into())
    }
}

/// Inserts the order, records `OrderCreated`; rejects after both when the
/// amount is over a limit, so that a rollback has something to undo.
#[command_handler]
async fn place_order(uow: &mut UnitOfWork, cmd: PlaceOrder) -> Result<Uuid, PlaceOrderError> {
    let order_id = Uuid::now_v7();
    sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2)")
        .bind(order_id)
        .bind(cmd.amount_cents)
        .execute(&mut **uow)
        .await?;
    uow.record(OrderCreated {
        order_id,
        amount_cents: cmd.amount_cents,
    });
    if cmd.amount_cents > 1_000_000 {
        return Err(PlaceOrderError::Rejected("over the limit"));
    }
    Ok(order_id)
}

/// Records an event that cannot be serialized: the commit fails.
#[command_handler]
async fn place_broken(uow: &mut UnitOfWork, cmd: PlaceOrder) -> Result<(), BoxError> {
    sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2)")
        .bind(Uuid::now_v7())
        .bind(cmd.amount_cents)
        .execute(&mut **uow)
        .await?;
    uow.record(Unserializable {
        id: 1,
        map: HashMap::from([((1, 2), 3)]),
    });
    Ok(())
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn execute_commits_on_ok(pool: PgPool) {
    create_tables(&pool).await;
    let order_id = outbox::execute(&pool, place_order, PlaceOrder { amount_cents: 500 })
        .await
        .unwrap();

    let stored: Uuid = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, order_id);
    let aggregate_id: String = sqlx::query_scalar("SELECT aggregate_id FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(aggregate_id, order_id.to_string());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn execute_rolls_back_on_err(pool: PgPool) {
    create_tables(&pool).await;
    let error = outbox::execute(
        &pool,
        place_order,
        PlaceOrder {
            amount_cents: 2_000_000,
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, PlaceOrderError::Rejected("over the limit")),
        "{error}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);

    // A query that fails inside the handler rolls back the same way.
    let error = outbox::execute(&pool, place_order, PlaceOrder { amount_cents: -1 })
        .await
        .unwrap_err();
    assert!(
        matches!(error, PlaceOrderError::Outbox(Error::Database(_))),
        "{error}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);

    // The pool is left healthy.
    outbox::execute(&pool, place_order, PlaceOrder { amount_cents: 1 })
        .await
        .unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn execute_returns_a_failed_commit_as_the_handlers_error(pool: PgPool) {
    create_tables(&pool).await;
    let error = outbox::execute(&pool, place_broken, PlaceOrder { amount_cents: 5 })
        .await
        .unwrap_err();
    let outbox_error = error.downcast_ref::<Error>().unwrap();
    assert!(
        matches!(outbox_error, Error::Serialize { .. }),
        "{outbox_error}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn several_commands_share_a_unit_of_work_the_caller_commits(pool: PgPool) {
    create_tables(&pool).await;
    assert_eq!(<place_order as CommandHandler>::NAME, "place_order");

    // Dropped: both commands vanish.
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    place_order::call(&mut uow, PlaceOrder { amount_cents: 1 })
        .await
        .unwrap();
    place_order
        .handle(&mut uow, PlaceOrder { amount_cents: 2 })
        .await
        .unwrap();
    assert_eq!(uow.pending_events(), 2);
    drop(uow);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);

    // Committed: both, with one correlation id.
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    place_order::call(&mut uow, PlaceOrder { amount_cents: 1 })
        .await
        .unwrap();
    place_order
        .handle(&mut uow, PlaceOrder { amount_cents: 2 })
        .await
        .unwrap();
    uow.commit().await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 2);
    assert_eq!(
        count(
            &pool,
            "SELECT count(DISTINCT headers->>'correlation_id') FROM outbox_event"
        )
        .await,
        1
    );
}

// ------------------------------------------------ aggregates in a handler

/// An invoice aggregate, created by an inbox handler.
#[aggregate]
#[derive(Debug, Clone)]
struct Invoice {
    id: Uuid,
    order_id: Uuid,
}

/// Records the follow-up on an aggregate root and collects it into the
/// handler context, as a command handler does with its Unit of Work.
#[inbox_handler]
async fn invoice_through_an_aggregate(
    ctx: &mut HandlerContext<'_>,
    event: OrderCreated,
) -> Result<(), BoxError> {
    let mut invoice = InvoiceRoot::new(Invoice {
        id: Uuid::now_v7(),
        order_id: event.order_id,
    });
    let (invoice_id, order_id) = (invoice.id, invoice.order_id);
    invoice.record(InvoiceRequested {
        invoice_id,
        order_id,
    });
    ctx.collect(&mut invoice);
    assert_eq!(invoice.discard_events(), 0, "collected, none left");
    Ok(())
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_handler_collects_an_aggregates_events_as_follow_ups(pool: PgPool) {
    create_tables(&pool).await;
    let event = order(700);
    let incoming = incoming_for(&event, None);
    let payload = event.to_payload().unwrap();
    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    let ids = dispatch(&invoice_through_an_aggregate, &mut ctx, payload.as_bytes())
        .await
        .unwrap();
    drop(ctx);
    tx.commit().await.unwrap();
    assert_eq!(ids.len(), 1);
    let (event_id, event_type, headers): (Uuid, String, sqlx::types::Json<Headers>) =
        sqlx::query_as("SELECT event_id, event_type, headers FROM outbox_event")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (event_id, event_type.as_str()),
        (ids[0], "InvoiceRequested")
    );
    assert_eq!(headers.causation_id, Some(incoming.event_id));
}
