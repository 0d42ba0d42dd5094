use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct LegacyOrder {
    order_id: u64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 2, upcast_from(LegacyOrder))]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

impl From<LegacyOrder> for OrderPlaced {
    fn from(old: LegacyOrder) -> Self {
        Self { order_id: old.order_id }
    }
}

fn main() {}
