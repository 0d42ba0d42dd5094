use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
enum OrderEvent {
    Placed(#[event(aggregate_id)] u64),
    #[event(event_type = "Placed")]
    PlacedAgain(#[event(aggregate_id)] u64),
    #[event(event_type = "order.shipped")]
    Shipped(#[event(aggregate_id)] u64),
    #[event(event_type = "order.shipped")]
    Delivered(#[event(aggregate_id)] u64),
}

fn main() {}
