use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 0)]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
enum OrderEvent {
    #[event(version = 2147483648)]
    Placed(#[event(aggregate_id)] u64),
}

fn main() {}
