use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

fn main() {}
