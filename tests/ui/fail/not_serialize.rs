use outbox::DomainEvent;
use serde::Deserialize;

#[derive(Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

fn main() {}
