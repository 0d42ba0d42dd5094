//! The `Order` aggregate and the command that places an order.
//!
//! Placing an order writes the order row and records `OrderCreated`; the
//! command handler runs in a Unit of Work of its own (`outbox::execute`), so
//! the row and the outbox row commit together or not at all. A command with
//! an idempotency key places at most one order per key: repeated, it finds
//! the order placed the first time and records nothing.

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
    idempotency_key: Option<String>,
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
    /// The customer name holds a control character (NUL, a line break, …),
    /// which PostgreSQL's text cannot store (NUL) or a name has no use for.
    #[error("customer must not contain control characters, found {0:?}")]
    ControlCharacter(char),
}

impl PlaceOrder {
    /// A validated command: a positive amount and a non-blank customer name
    /// of at most [`MAX_CUSTOMER_LEN`] characters (trimmed), without control
    /// characters.
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
        if let Some(c) = customer.chars().find(|c| c.is_control()) {
            return Err(InvalidOrder::ControlCharacter(c));
        }
        Ok(Self {
            customer: customer.to_owned(),
            amount_cents,
            idempotency_key: None,
        })
    }

    /// The same command, placing at most one order for `key` (the API's
    /// `Idempotency-Key`, already checked to be short, visible ASCII).
    pub fn with_idempotency_key(mut self, key: Option<String>) -> Self {
        self.idempotency_key = key;
        self
    }
}

/// What placing an order did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placed {
    /// A new order; its `OrderCreated` commits with it.
    New(Order),
    /// The command's idempotency key already placed this order, for the
    /// same customer and amount: nothing was written.
    Replayed(Order),
    /// The command's idempotency key already placed another order (another
    /// customer or amount): nothing was written.
    KeyReused(Order),
}

/// Places an order: the order row and its `OrderCreated` event, in the
/// caller's Unit of Work. With an idempotency key already used, the order
/// placed with it (a request running concurrently with the same key waits
/// for the first one to commit, then finds its order).
#[command_handler]
pub async fn place_order(
    uow: &mut UnitOfWork,
    command: PlaceOrder,
) -> Result<Placed, outbox::Error> {
    let key = command.idempotency_key.clone();
    let mut order = OrderRoot::place(command);
    let inserted = sqlx::query(
        "INSERT INTO orders (id, customer, amount_cents, status, idempotency_key)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(order.id)
    .bind(&order.customer)
    .bind(order.amount_cents)
    .bind(&order.status)
    .bind(&key)
    .execute(&mut **uow)
    .await?
    .rows_affected();
    if inserted == 1 {
        uow.collect(&mut order);
        return Ok(Placed::New(order.into_inner()));
    }
    // The key placed an order before: that one stands, this one never was.
    order.discard_events();
    let first: Order = sqlx::query_as(
        "SELECT id, customer, amount_cents, status FROM orders WHERE idempotency_key = $1",
    )
    .bind(&key)
    .fetch_one(&mut **uow)
    .await?;
    let same = first.customer == order.customer && first.amount_cents == order.amount_cents;
    Ok(if same {
        Placed::Replayed(first)
    } else {
        Placed::KeyReused(first)
    })
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
        assert_eq!(
            PlaceOrder::new("a\0b", 100),
            Err(InvalidOrder::ControlCharacter('\0'))
        );
        assert_eq!(
            PlaceOrder::new("ann\nbob", 100),
            Err(InvalidOrder::ControlCharacter('\n'))
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
