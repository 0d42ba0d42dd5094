//! The events the demo's two services exchange, shared as a small crate so
//! that the producer and the consumer of an event agree on its shape.
//!
//! - `orders-service` records [`OrderCreated`] when an order is placed;
//!   `billing-service` consumes it (dedup mode) and charges the order.
//! - `billing-service` records [`PaymentCaptured`] with the charge;
//!   `orders-service` consumes it (inbox mode) and marks the order paid.
//!
//! Both are keyed by the order id, so an order's events stay in order.

#![forbid(unsafe_code)]

use outbox::prelude::*;
use serde::{Deserialize, Serialize};

/// The topic of the orders service's events.
pub const ORDERS_TOPIC: &str = "demo.orders";
/// The topic of the billing service's events.
pub const PAYMENTS_TOPIC: &str = "demo.payments";

/// An order was placed and awaits payment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "demo.orders", aggregate_type = "Order")]
pub struct OrderCreated {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
    /// Who ordered.
    pub customer: String,
    /// The amount to charge, in cents (> 0).
    pub amount_cents: i64,
}

/// A charge for an order was recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "demo.payments", aggregate_type = "Payment")]
pub struct PaymentCaptured {
    /// The charge.
    #[event(aggregate_id)]
    pub payment_id: Uuid,
    /// The order it pays; the Kafka key, so an order's payments stay in order.
    #[event(partition_key)]
    pub order_id: Uuid,
    /// The amount charged, in cents.
    pub amount_cents: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_match_the_constants() {
        assert_eq!(OrderCreated::TOPIC, ORDERS_TOPIC);
        assert_eq!(PaymentCaptured::TOPIC, PAYMENTS_TOPIC);
    }
}
