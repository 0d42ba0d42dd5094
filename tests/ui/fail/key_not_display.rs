use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct OrderId(u64);

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: OrderId,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
enum OrderEvent {
    Shipped(#[event(aggregate_id)] u64, #[event(partition_key)] Vec<u8>),
}

fn main() {}
