use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
    #[event(aggregate_id)]
    customer_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
enum OrderEvent {
    Merged(#[event(aggregate_id)] u64, #[event(aggregate_id)] u64),
}

fn main() {}
