use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderPlaced {
    order_id: u64,
    amount_cents: i64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderTouched;

fn main() {}
