use outbox::DomainEvent;
use outbox::prelude::Uuid;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
    #[event(event_id)]
    id: Uuid,
    #[event(event_id)]
    other_id: Uuid,
}

fn main() {}
