use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", event_type = "OrderEvent")]
enum OrderEvent {
    Placed(#[event(aggregate_id)] u64),
    Shipped(#[event(aggregate_id)] u64),
}

fn main() {}
