#![deny(warnings, missing_docs)]
//! `#[command_handler]` turns the function into a unit struct implementing
//! `CommandHandler`, run by `outbox::execute`; `name::call` still runs the
//! function on a Unit of Work the caller manages.

use std::fmt;

use outbox::prelude::*;
use outbox::{BoxError, CommandHandler};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// An order was placed.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
pub struct OrderPlaced {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// Place an order.
pub struct PlaceOrder {
    /// What it costs.
    pub amount_cents: i64,
}

/// Why an order was refused.
#[derive(Debug)]
pub enum PlaceOrderError {
    /// Nothing to pay.
    Empty,
    /// The outbox failed (begin, queries, commit).
    Outbox(outbox::Error),
}

impl fmt::Display for PlaceOrderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlaceOrderError::Empty => f.write_str("empty order"),
            PlaceOrderError::Outbox(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for PlaceOrderError {}

impl From<outbox::Error> for PlaceOrderError {
    fn from(error: outbox::Error) -> Self {
        PlaceOrderError::Outbox(error)
    }
}

impl From<sqlx::Error> for PlaceOrderError {
    fn from(error: sqlx::Error) -> Self {
        PlaceOrderError::Outbox(error.into())
    }
}

/// Places an order: the row and its event, atomically.
#[command_handler]
pub async fn place_order(uow: &mut UnitOfWork, cmd: PlaceOrder) -> Result<Uuid, PlaceOrderError> {
    if cmd.amount_cents <= 0 {
        return Err(PlaceOrderError::Empty);
    }
    let order_id = Uuid::now_v7();
    sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2)")
        .bind(order_id)
        .bind(cmd.amount_cents)
        .execute(&mut **uow)
        .await?;
    uow.record(OrderPlaced { order_id });
    Ok(order_id)
}

/// What `anyhow::Result<T>` looks like.
pub type AppResult<T> = Result<T, BoxError>;

/// Cancel an order.
pub struct CancelOrder(pub Uuid);

#[command_handler(name = "orders.cancel")]
async fn cancel_order(uow: &mut UnitOfWork, cmd: CancelOrder) -> AppResult<()> {
    let _ = (uow.pending_events(), cmd.0);
    Ok(())
}

fn name<H: CommandHandler>(_: H) -> &'static str {
    H::NAME
}

/// Both ways of running a command compile.
pub async fn run(pool: &PgPool) -> Result<(), PlaceOrderError> {
    let order_id: Uuid =
        outbox::execute(pool, place_order, PlaceOrder { amount_cents: 100 }).await?;

    let mut uow = UnitOfWork::begin(pool).await?;
    place_order::call(&mut uow, PlaceOrder { amount_cents: 5 }).await?;
    place_order
        .handle(&mut uow, PlaceOrder { amount_cents: 7 })
        .await?;
    uow.commit().await?;

    let _ = order_id;
    Ok(())
}

fn main() {
    assert_eq!(name(place_order), "place_order");
    assert_eq!(name(cancel_order), "orders.cancel");
}
