//! The events the demo's two services exchange, shared as a small crate so
//! that the producer and the consumer of an event agree on its shape.
//!
//! - `orders-service` records [`OrderCreated`] when an order is placed;
//!   `billing-service` consumes it (dedup mode) and charges the order.
//! - `billing-service` records [`PaymentCaptured`] with the charge;
//!   `orders-service` consumes it (inbox mode) and marks the order paid.
//!
//! - `orders-service`'s order-payment saga records [`StockReserved`] when
//!   an order is created and, when no payment came in time, cancels the
//!   order ([`OrderCancelled`]) and releases the stock ([`StockReleased`],
//!   the compensation) on the warehouse's topic.
//!
//! All are keyed by the order id, so an order's events stay in order.
//! Each declares its schema version: a change a consumer cannot read as is
//! gets the next version, with an upcaster from this one (see the README's
//! "Evolving events").
//!
//! [`catalogue`] lists them with their JSON Schemas; `schemas/` holds the
//! committed snapshot, and a test fails when a change would break a
//! consumer without a new version (see the README).

#![forbid(unsafe_code)]

use outbox::contracts::Catalogue;
use outbox::prelude::*;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The topic of the orders service's events.
pub const ORDERS_TOPIC: &str = "demo.orders";
/// The topic of the billing service's events.
pub const PAYMENTS_TOPIC: &str = "demo.payments";

/// The topic of the warehouse's stock movements (no service of the demo
/// consumes it).
pub const STOCK_TOPIC: &str = "demo.stock";
/// The customer whose card billing always declines: it charges nothing and
/// never answers, so the orders service's payment timeout cancels the order
/// (the demo's compensation path).
pub const DECLINED_CUSTOMER: &str = "card-declined";

/// The topic of the orders service's saga timeouts.
pub const ORDER_TIMEOUTS_TOPIC: &str = "demo.order-timeouts";

/// An order was placed and awaits payment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema, DomainEvent)]
#[event(topic = "demo.orders", aggregate_type = "Order", version = 1)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema, DomainEvent)]
#[event(topic = "demo.payments", aggregate_type = "Payment", version = 1)]
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

/// No payment came in time: the order is cancelled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema, DomainEvent)]
#[event(topic = "demo.orders", aggregate_type = "Order", version = 1)]
pub struct OrderCancelled {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
    /// Why, for people.
    pub reason: String,
}

/// Stock was set aside for an order until it is paid or cancelled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema, DomainEvent)]
#[event(topic = "demo.stock", aggregate_type = "Order", version = 1)]
pub struct StockReserved {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// The stock set aside for a cancelled order is free again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema, DomainEvent)]
#[event(topic = "demo.stock", aggregate_type = "Order", version = 1)]
pub struct StockReleased {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// The demo's event types with a sample of each: the contracts exported to
/// `schemas/` and checked against it.
pub fn catalogue() -> Catalogue {
    let order_id = Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_0001);
    Catalogue::new("outbox demo")
        .event(&OrderCreated {
            order_id,
            customer: "ada".into(),
            amount_cents: 1250,
        })
        .event(&PaymentCaptured {
            payment_id: Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_0002),
            order_id,
            amount_cents: 1250,
        })
        .event(&OrderCancelled {
            order_id,
            reason: "no payment within 30 s".into(),
        })
        .event(&StockReserved { order_id })
        .event(&StockReleased { order_id })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_match_the_constants() {
        assert_eq!(OrderCreated::TOPIC, ORDERS_TOPIC);
        assert_eq!(PaymentCaptured::TOPIC, PAYMENTS_TOPIC);
        assert_eq!(OrderCancelled::TOPIC, ORDERS_TOPIC);
        assert_eq!(StockReserved::TOPIC, STOCK_TOPIC);
        assert_eq!(StockReleased::TOPIC, STOCK_TOPIC);
    }

    #[test]
    fn events_carry_their_versions() {
        use outbox::EventVersion;
        assert_eq!(<OrderCreated as EventVersion>::VERSION, 1);
        assert_eq!(<PaymentCaptured as EventVersion>::VERSION, 1);
        // A version-2 message is not read as version 1.
        let error = OrderCreated::from_versioned_payload(
            "OrderCreated",
            2,
            br#"{"order_id":"00000000-0000-0000-0000-000000000000","customer":"c","amount_cents":1}"#,
        )
        .unwrap_err();
        assert!(
            matches!(error, outbox::Error::UnsupportedVersion { version: 2, .. }),
            "{error}"
        );
    }
}
