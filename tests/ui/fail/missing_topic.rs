use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

fn publish<E: DomainEvent>(event: E) -> &'static str {
    event.event_type()
}

fn main() {
    // The stub impl emitted next to the error keeps this from adding errors.
    publish(OrderPlaced { order_id: 1 });
}
