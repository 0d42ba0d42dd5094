#![deny(warnings, missing_docs)]
//! `#[inbox_handler]` turns the function into a unit struct implementing
//! `InboxHandler`: any error that converts into `BoxError`, aliases of
//! `Result`, docs, visibility and other attributes are kept.

use std::fmt;

use outbox::prelude::*;
use outbox::{BoxError, IncomingEvent};
use serde::{Deserialize, Serialize};

/// An order was created.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
pub struct OrderCreated {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// An invoice was requested.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "invoices")]
pub struct InvoiceRequested {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// Records the invoice request, and writes to the database.
#[inbox_handler]
pub async fn on_order_created(
    ctx: &mut HandlerContext<'_>,
    event: OrderCreated,
) -> Result<(), BoxError> {
    sqlx::query("INSERT INTO invoices (order_id) VALUES ($1)")
        .bind(event.order_id)
        .execute(&mut **ctx)
        .await?;
    ctx.record(InvoiceRequested {
        order_id: event.order_id,
    });
    Ok(())
}

/// A `std::error::Error` of the application.
#[derive(Debug)]
pub struct ShippingError;

impl fmt::Display for ShippingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("shipping is closed")
    }
}

impl std::error::Error for ShippingError {}

/// A typed error.
#[inbox_handler(name = "shipping.on_order_created")]
pub(crate) async fn ship(
    _ctx: &mut HandlerContext<'_>,
    _event: OrderCreated,
) -> Result<(), ShippingError> {
    Err(ShippingError)
}

/// An error like `anyhow::Error`: not a `std::error::Error` itself, but
/// convertible into a boxed one.
#[derive(Debug)]
pub struct Opaque(String);

impl From<Opaque> for BoxError {
    fn from(error: Opaque) -> Self {
        error.0.into()
    }
}

/// What `anyhow::Result<()>` looks like.
pub type OpaqueResult<T, E = Opaque> = Result<T, E>;

#[inbox_handler]
#[allow(clippy::unused_async)]
async fn audit(ctx: &mut HandlerContext<'_>, event: OrderCreated) -> OpaqueResult<()> {
    if ctx.incoming().event_id.is_nil() {
        return Err(Opaque(format!("no id for {}", event.order_id)));
    }
    Ok(())
}

/// A `String` error, a `mut` argument.
#[inbox_handler]
async fn count(ctx: &mut HandlerContext<'_>, mut event: OrderCreated) -> Result<(), String> {
    event.order_id = Uuid::nil();
    let _ = ctx.recorded_events();
    Err(event.order_id.to_string())
}

/// Registration with the consumer reads `.handler(name)`.
pub fn consumer(pool: sqlx::PgPool) -> outbox::runtime::ConsumerBuilder {
    outbox::runtime::Consumer::builder(pool)
        .group("invoicing")
        .handler(on_order_created)
        .handler(ship)
        .handler(audit)
        .handler(count)
}

fn register<H: InboxHandler>(handler: H) -> &'static str {
    let _ = handler;
    H::NAME
}

fn main() {
    assert_eq!(register(on_order_created), "on_order_created");
    assert_eq!(register(ship), "shipping.on_order_created");
    assert_eq!(register(audit), "audit");
    assert_eq!(register(count), "count");
    assert_eq!(format!("{on_order_created:?}"), "on_order_created");

    // The function itself stays callable.
    let _ = |ctx: &'static mut HandlerContext<'static>, incoming: IncomingEvent| {
        let _ = incoming;
        on_order_created::call(
            ctx,
            OrderCreated {
                order_id: Uuid::nil(),
            },
        )
    };
}
