#![deny(warnings, missing_docs)]
//! A struct with named fields, every optional attribute left out but one.

use outbox::prelude::*;
use serde::{Deserialize, Serialize};

/// An order was placed.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", aggregate_type = "Order")]
pub struct OrderPlaced {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
    /// What it costs.
    pub amount_cents: i64,
}

fn main() {
    assert_eq!(OrderPlaced::TOPIC, "orders");
    assert_eq!(OrderPlaced::EVENT_TYPES, ["OrderPlaced"]);
}
