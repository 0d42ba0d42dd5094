use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = ".")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "..")]
struct OrderShipped {
    #[event(aggregate_id)]
    order_id: u64,
}

fn main() {}
