//! The `Order` aggregate and the command that places an order.
//!
//! Placing an order writes the order row and records `OrderCreated`; the
//! command handler runs in a Unit of Work of its own (`outbox::execute`), so
//! the row and the outbox row commit together or not at all.

use demo_events::OrderCreated;
use outbox::prelude::*;
use serde::{Deserialize, Serialize};

/// Longest accepted customer name, in characters.
pub const MAX_CUSTOMER_LEN: usize = 200;

/// The order aggregate's state, as stored in the `orders` table.
#[aggregate]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Order {
    /// The order's id (UUIDv7).
    pub id: Uuid,
    /// Who ordered.
    pub customer: String,
    /// The amount to charge, in cents.
    pub amount_cents: i64,
    /// `pending` until billing's payment arrives, then `paid`.
    pub status: String,
}

impl OrderRoot {
    /// A new pending order; records `OrderCreated`.
    pub fn place(command: PlaceOrder) -> Self {
        let id = Uuid::now_v7();
        let mut order = OrderRoot::new(Order {
            id,
            customer: command.customer,
            amount_cents: command.amount_cents,
            status: "pending".into(),
        });
        let event = OrderCreated {
            order_id: id,
            customer: order.customer.clone(),
            amount_cents: order.amount_cents,
        };
        order.record(event);
        order
    }
}

/// The command that places an order. Build it with [`PlaceOrder::new`],
/// which validates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceOrder {
    customer: String,
    amount_cents: i64,
}

/// Why a command was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidOrder {
    /// The amount is zero or negative.
    #[error("amount_cents must be greater than 0, got {0}")]
    Amount(i64),
    /// The customer name is empty or blank.
    #[error("customer must not be empty")]
    EmptyCustomer,
    /// The customer name is too long.
    #[error("customer must be at most {MAX_CUSTOMER_LEN} characters, got {0}")]
    CustomerTooLong(usize),
}

impl PlaceOrder {
    /// A validated command: a positive amount and a non-blank customer name
    /// of at most [`MAX_CUSTOMER_LEN`] characters (trimmed).
    pub fn new(customer: &str, amount_cents: i64) -> Result<Self, InvalidOrder> {
        if amount_cents <= 0 {
            return Err(InvalidOrder::Amount(amount_cents));
        }
        let customer = customer.trim();
        if customer.is_empty() {
            return Err(InvalidOrder::EmptyCustomer);
        }
        let len = customer.chars().count();
        if len > MAX_CUSTOMER_LEN {
            return Err(InvalidOrder::CustomerTooLong(len));
        }
        Ok(Self {
            customer: customer.to_owned(),
            amount_cents,
        })
    }
}

/// Places an order: the order row and its `OrderCreated` event, in the
/// caller's Unit of Work.
#[command_handler]
pub async fn place_order(
    uow: &mut UnitOfWork,
    command: PlaceOrder,
) -> Result<Order, outbox::Error> {
    let mut order = OrderRoot::place(command);
    sqlx::query("INSERT INTO orders (id, customer, amount_cents, status) VALUES ($1, $2, $3, $4)")
        .bind(order.id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .bind(&order.status)
        .execute(&mut **uow)
        .await?;
    uow.collect(&mut order);
    Ok(order.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_needs_a_positive_amount_and_a_customer() {
        assert_eq!(PlaceOrder::new("ann", 0), Err(InvalidOrder::Amount(0)));
        assert_eq!(PlaceOrder::new("ann", -5), Err(InvalidOrder::Amount(-5)));
        assert_eq!(PlaceOrder::new("  ", 100), Err(InvalidOrder::EmptyCustomer));
        let long = "x".repeat(MAX_CUSTOMER_LEN + 1);
        assert_eq!(
            PlaceOrder::new(&long, 100),
            Err(InvalidOrder::CustomerTooLong(MAX_CUSTOMER_LEN + 1))
        );
        let ok = PlaceOrder::new(" ann ", 1).unwrap();
        assert_eq!((ok.customer.as_str(), ok.amount_cents), ("ann", 1));
    }

    #[test]
    fn placing_an_order_records_order_created() {
        let mut order = OrderRoot::place(PlaceOrder::new("ann", 250).unwrap());
        assert_eq!(order.status, "pending");
        assert_eq!(order.pending_events(), 1);
        order.discard_events();
    }
}
