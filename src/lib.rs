//! Domain events with the transactional outbox and inbox patterns.
//!
//! PostgreSQL is the source of truth and Kafka the transport: events are
//! written to the `outbox_event` table in the same transaction as the domain
//! change ([`UnitOfWork`]), and a relay publishes them afterwards. Consumers
//! apply each event's effect once (deduplicated by event id).
//!
//! ```ignore
//! use outbox::prelude::*;
//!
//! #[derive(Serialize, Deserialize, DomainEvent)]
//! #[event(topic = "orders", aggregate_type = "Order")]
//! struct OrderPlaced {
//!     #[event(aggregate_id)]
//!     order_id: Uuid,
//!     amount_cents: i64,
//! }
//!
//! let mut uow = UnitOfWork::begin(&pool).await?;
//! sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2)")
//!     .bind(id).bind(amount).execute(&mut *uow).await?;
//! uow.record(OrderPlaced { order_id: id, amount_cents: amount });
//! uow.commit().await?; // the order row and the outbox row, atomically
//! ```
//!
//! # Handlers never touch the producer
//!
//! Write-side code is a [`command_handler`], run by [`execute`] in a Unit of
//! Work of its own (committed on `Ok`, rolled back on `Err`); consumer-side
//! code is an [`inbox_handler`], run by the consumer inside its transaction.
//! Both get the transaction and an event recorder, nothing else:
//!
//! ```no_run
//! use outbox::prelude::*;
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Serialize, Deserialize, DomainEvent)]
//! # #[event(topic = "orders")]
//! # struct OrderPlaced { #[event(aggregate_id)] order_id: Uuid }
//! # #[derive(Serialize, Deserialize, DomainEvent)]
//! # #[event(topic = "invoices")]
//! # struct InvoiceRequested { #[event(aggregate_id)] order_id: Uuid }
//! struct PlaceOrder {
//!     order_id: Uuid,
//! }
//!
//! #[command_handler]
//! async fn place_order(uow: &mut UnitOfWork, cmd: PlaceOrder) -> Result<Uuid, outbox::Error> {
//!     sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!         .bind(cmd.order_id)
//!         .execute(&mut **uow)
//!         .await?;
//!     uow.record(OrderPlaced { order_id: cmd.order_id });
//!     Ok(cmd.order_id)
//! }
//!
//! #[inbox_handler]
//! async fn request_invoice(
//!     ctx: &mut HandlerContext<'_>,
//!     event: OrderPlaced,
//! ) -> Result<(), outbox::BoxError> {
//!     ctx.record(InvoiceRequested { order_id: event.order_id });
//!     Ok(())
//! }
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), outbox::Error> {
//! let order_id = outbox::execute(&pool, place_order, PlaceOrder { order_id: Uuid::now_v7() }).await?;
//! # Ok(()) }
//! ```
//!
//! Reaching Kafka from a handler does not compile. The relay's producer is
//! private to it, the handlers' first argument is a sealed trait
//! ([`HandlerArg`]), and the macros reject producers, the relay and
//! `ClientConfig` among the parameters, and producer types, client creation
//! and producer sends in the body, with a message saying what to do instead:
//!
//! ```compile_fail
//! use outbox::prelude::*;
//! use rdkafka::producer::FutureProducer;
//! # struct PlaceOrder;
//!
//! #[command_handler]
//! async fn place_order(
//!     uow: &mut UnitOfWork,
//!     cmd: PlaceOrder,
//!     producer: &FutureProducer, // error: a `#[command_handler]` cannot take a Kafka producer
//! ) -> Result<(), outbox::Error> {
//!     Ok(())
//! }
//! ```

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub use outbox_core::{
    Aggregate, AggregateRoot, BoxError, CommandFuture, CommandHandler, CommandOutput, Committed,
    DomainEvent, Error, EventVersion, HandlerArg, HandlerContext, HandlerFuture, Headers,
    InboxHandler, InboxOutput, IncomingEvent, LockPolicy, MIGRATOR, OutboxMessage, PendingEvents,
    Result, TraceParent, cancel_scheduled, migrate, migrate_with, trace,
};

/// A domain change and its events, committed as one transaction: the
/// application's rows and the `outbox_event` rows, or neither.
///
/// ```
/// use outbox::prelude::*;
/// # use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, DomainEvent)]
/// #[event(topic = "orders")]
/// struct OrderPlaced {
///     #[event(aggregate_id)]
///     order_id: Uuid,
///     amount_cents: i64,
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let db = outbox::testing::TestDb::builder()
/// #     .sql("CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL)")
/// #     .create()
/// #     .await?;
/// # let pool = db.pool().clone();
/// let id = Uuid::now_v7();
/// let mut uow = UnitOfWork::begin(&pool).await?;
/// sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, 500)")
///     .bind(id)
///     .execute(&mut *uow) // the transaction, the usual sqlx way
///     .await?;
/// uow.record(OrderPlaced { order_id: id, amount_cents: 500 });
/// uow.commit().await?; // the order row and the outbox row, atomically
///
/// let waiting: i64 =
///     sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE aggregate_id = $1")
///         .bind(id.to_string())
///         .fetch_one(&pool)
///         .await?;
/// assert_eq!(waiting, 1); // the relay publishes it
/// # Ok(())
/// # }
/// ```
pub use outbox_core::UnitOfWork;

/// Runs a [`command_handler`] in a Unit of Work of its own: committed on
/// `Ok`, rolled back on `Err`, events included.
///
/// ```
/// use outbox::prelude::*;
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize, DomainEvent)]
/// # #[event(topic = "orders")]
/// # struct OrderPlaced { #[event(aggregate_id)] order_id: Uuid }
///
/// struct PlaceOrder {
///     amount_cents: i64,
/// }
///
/// #[command_handler]
/// async fn place_order(uow: &mut UnitOfWork, cmd: PlaceOrder) -> Result<Uuid, outbox::Error> {
///     let order_id = Uuid::now_v7();
///     sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2)")
///         .bind(order_id)
///         .bind(cmd.amount_cents)
///         .execute(&mut **uow)
///         .await?;
///     uow.record(OrderPlaced { order_id });
///     Ok(order_id)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let db = outbox::testing::TestDb::builder()
/// #     .sql("CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL)")
/// #     .create()
/// #     .await?;
/// # let pool = db.pool().clone();
/// let order_id = outbox::execute(&pool, place_order, PlaceOrder { amount_cents: 500 }).await?;
/// # let _ = order_id;
/// # Ok(())
/// # }
/// ```
pub use outbox_core::execute;

/// `#[derive(DomainEvent)]`: see [`DomainEvent`] for the `#[event(...)]` attributes.
#[cfg(feature = "derive")]
pub use outbox_derive::DomainEvent;

/// `#[aggregate]`: generates the root type that records an aggregate's events.
#[cfg(feature = "derive")]
pub use outbox_derive::aggregate;

/// `#[inbox_handler]`: turns an `async fn(&mut HandlerContext<'_>, Event)`
/// into an [`InboxHandler`], run by the consumer in its transaction: the
/// handler's writes, the events it records and the event's dedup row commit
/// together.
///
/// ```
/// use outbox::prelude::*;
/// use outbox::testing::{TestBus, TestDb};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Debug, Serialize, Deserialize, DomainEvent)]
/// # #[event(topic = "orders")]
/// # struct OrderPlaced { #[event(aggregate_id)] order_id: Uuid, amount_cents: i64 }
/// # #[derive(Debug, Serialize, Deserialize, DomainEvent)]
/// # #[event(topic = "payments")]
/// # struct PaymentCaptured { #[event(aggregate_id)] order_id: Uuid }
///
/// #[inbox_handler]
/// async fn charge(ctx: &mut HandlerContext<'_>, event: OrderPlaced) -> Result<(), outbox::BoxError> {
///     sqlx::query("INSERT INTO charges (order_id, amount_cents) VALUES ($1, $2)")
///         .bind(event.order_id)
///         .bind(event.amount_cents)
///         .execute(&mut **ctx)
///         .await?;
///     ctx.record(PaymentCaptured { order_id: event.order_id });
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let db = TestDb::builder()
///     .sql("CREATE TABLE charges (order_id uuid PRIMARY KEY, amount_cents bigint NOT NULL)")
///     .create()
///     .await?;
/// let pool = db.pool().clone();
/// // The consumer's real path, without a broker.
/// let consumer = outbox::runtime::Consumer::builder(pool.clone()).group("billing").handler(charge);
/// let mut bus = TestBus::new().service(consumer);
///
/// let order_id = Uuid::now_v7();
/// let mut uow = UnitOfWork::begin(&pool).await?;
/// uow.record(OrderPlaced { order_id, amount_cents: 500 });
/// uow.commit().await?;
///
/// let delivery = bus.deliver().await?;
/// delivery.assert_published::<PaymentCaptured>(|e| e.order_id == order_id);
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "derive")]
pub use outbox_derive::inbox_handler;

/// `#[command_handler]`: turns an `async fn(&mut UnitOfWork, Command)` into a
/// [`CommandHandler`], run with [`execute`].
#[cfg(feature = "derive")]
pub use outbox_derive::command_handler;

/// Sagas: long-running processes whose state lives in `outbox_saga`, moved
/// by messages in the consumer's transaction (see the guide's "Sagas").
pub use outbox_core::saga;
pub use outbox_core::{MessageSteps, OtherStage, Saga, SagaContext, SagaRegistrar, SagaTimeout};

/// `#[saga]`: implements [`Saga`] for a saga's state from an `impl` block
/// whose functions are its steps. See the guide's "Sagas".
#[cfg(feature = "derive")]
pub use outbox_derive::saga;

/// The relay and consumer runtime.
#[cfg(feature = "runtime")]
pub use outbox_runtime as runtime;

/// Event contracts: the catalogue of event types with their JSON Schemas, the
/// AsyncAPI document and the compatibility check (feature `schemas`).
#[cfg(feature = "schemas")]
pub use outbox_core::contracts;

/// The testing kit (feature `testing`): a [`TestBus`](testing::TestBus)
/// delivers what the outbox holds to your inbox handlers through the
/// consumer's real path, without a broker; see [`outbox_runtime::testing`].
#[cfg(feature = "testing")]
pub use outbox_runtime::testing;

/// OpenTelemetry export (`otel` feature): the OTLP layer configured by the
/// `OTEL_*` environment variables and its flushing guard. See the guide's
/// "Tracing with OpenTelemetry".
#[cfg(all(feature = "otel", feature = "runtime"))]
pub use outbox_runtime::telemetry;

/// The names most applications need: `use outbox::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Aggregate, AggregateRoot, CommandHandler, DomainEvent, HandlerContext, Headers,
        InboxHandler, Saga, SagaContext, SagaTimeout, UnitOfWork,
    };
    #[cfg(feature = "derive")]
    pub use crate::{aggregate, command_handler, inbox_handler, saga};
    pub use uuid::Uuid;
}

/// The guide's chapters (`docs/src`): `cargo test --doc` compiles every
/// Rust snippet in them.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../docs/src/consuming.md")]
    mod consuming {}
    #[doc = include_str!("../docs/src/contracts.md")]
    mod contracts {}
    #[doc = include_str!("../docs/src/events.md")]
    mod events {}
    #[doc = include_str!("../docs/src/migrations.md")]
    mod migrations {}
    #[doc = include_str!("../docs/src/operating.md")]
    mod operating {}
    #[doc = include_str!("../docs/src/production.md")]
    mod production {}
    #[doc = include_str!("../docs/src/sagas.md")]
    mod sagas {}
    #[doc = include_str!("../docs/src/testing.md")]
    mod testing {}
    #[doc = include_str!("../docs/src/unit-of-work.md")]
    mod unit_of_work {}
    #[doc = include_str!("../docs/src/relay.md")]
    mod relay {}
    #[doc = include_str!("../docs/src/guarantees.md")]
    mod guarantees {}
}

/// Support items for code generated by the `outbox` macros. Not public API.
#[doc(hidden)]
pub mod __private {
    pub use outbox_core::__private::*;
}
