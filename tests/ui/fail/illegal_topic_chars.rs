use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "order events")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders/v2")]
struct OrderShipped {
    #[event(aggregate_id)]
    order_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "")]
struct OrderCancelled {
    #[event(aggregate_id)]
    order_id: u64,
}

fn main() {}
