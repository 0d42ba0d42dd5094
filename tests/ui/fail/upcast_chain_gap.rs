use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", event_type = "OrderPlaced", version = 1)]
struct OrderPlacedV1 {
    #[event(aggregate_id)]
    order_id: u64,
}

// Version 3 names version 1: version 2 is missing from the chain.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 3, upcast_from(OrderPlacedV1))]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

impl From<OrderPlacedV1> for OrderPlaced {
    fn from(v1: OrderPlacedV1) -> Self {
        Self { order_id: v1.order_id }
    }
}

fn main() {}
