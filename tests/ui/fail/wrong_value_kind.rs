use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = 5, version = "2", aggregate_type)]
struct OrderPlaced {
    #[event(aggregate_id = 3)]
    order_id: u64,
    #[event(partition_key("customer"))]
    customer: String,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = -1, aggregate_type = "")]
enum OrderEvent {
    #[event(event_type = "", version = 1.5)]
    Placed(#[event(aggregate_id)] u64),
}

fn main() {}
