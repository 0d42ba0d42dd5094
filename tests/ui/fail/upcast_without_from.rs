use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", event_type = "OrderPlaced", version = 1)]
struct OrderPlacedV1 {
    #[event(aggregate_id)]
    order_id: u64,
}

// No `impl From<OrderPlacedV1> for OrderPlaced`: nothing converts version 1.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 2, upcast_from(OrderPlacedV1))]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

fn main() {}
