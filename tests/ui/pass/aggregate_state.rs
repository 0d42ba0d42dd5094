#![deny(warnings, missing_docs)]
//! The state struct is left as written: struct literals, serde and
//! `sqlx::FromRow` keep working, and the root is generated beside it.

use outbox::prelude::*;
use serde::{Deserialize, Serialize};

/// An order.
#[aggregate]
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct Order {
    /// Its id.
    pub id: Uuid,
    /// What it costs.
    pub amount_cents: i64,
}

/// An order was placed.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
pub struct OrderPlaced {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

impl OrderRoot {
    /// Places a new order.
    pub fn place(amount_cents: i64) -> Self {
        let id = Uuid::now_v7();
        let mut root = Order { id, amount_cents }.into_root();
        root.record(OrderPlaced { order_id: id });
        root
    }
}

fn main() {
    let mut root = OrderRoot::place(10);
    assert_eq!(root.amount_cents, 10);
    assert_eq!(root.pending_events(), 1);
    root.discard_events();
    let _: Order = root.into_inner();
}
