use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
#[event(topic = "orders.v2")]
struct OrderPlaced {
    #[event(aggregate_id, aggregate_id)]
    order_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
enum OrderEvent {
    #[event(version = 2, version = 3)]
    Placed(#[event(aggregate_id)] u64),
}

fn main() {}
