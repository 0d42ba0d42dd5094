use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
enum OrderEvent {
    Placed {
        #[event(aggregate_id)]
        order_id: u64,
    },
    Shipped {
        order_id: u64,
        carrier: String,
    },
    Cancelled(u64),
    Archived,
}

fn main() {}
