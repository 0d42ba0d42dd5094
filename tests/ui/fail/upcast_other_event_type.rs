use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

// Version 1 of another event type.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 1)]
struct OrderCancelled {
    #[event(aggregate_id)]
    order_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 2, upcast_from(OrderCancelled))]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

impl From<OrderCancelled> for OrderPlaced {
    fn from(old: OrderCancelled) -> Self {
        Self { order_id: old.order_id }
    }
}

fn main() {}
