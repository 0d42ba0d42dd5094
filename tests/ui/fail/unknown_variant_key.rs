use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
enum OrderEvent {
    #[event(name = "order.placed")]
    Placed(#[event(aggregate_id)] u64),
    #[event(topic = "shipping")]
    Shipped(#[event(aggregate_id)] u64),
}

fn main() {}
