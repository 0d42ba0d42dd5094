use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", partitions = 3)]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

fn main() {}
