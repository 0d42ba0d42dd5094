use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

// Every mistake below is reported in one compilation.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders!", colour = "red", version = 0)]
enum OrderEvent {
    #[event(event_type = "order.placed")]
    Placed { order_id: u64 },
    #[event(event_type = "order.placed")]
    Shipped(
        #[event(aggregate_id)] u64,
        #[event(partition_key, partition_key)] String,
    ),
    Cancelled {
        #[event(aggregate_id)]
        order_id: u64,
        #[event(aggregate_id)]
        customer_id: u64,
        #[event(primary)]
        reason: String,
    },
}

fn main() {}
