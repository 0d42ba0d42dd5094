use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", event_type = "OrderPlaced", version = 1)]
struct OrderPlacedV1 {
    #[event(aggregate_id)]
    order_id: u64,
}

// An upcaster needs a version after 1 to convert into.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", upcast_from(OrderPlacedV1))]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: u64,
}

// An enum's variants read their declared version only.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 2, upcast_from(OrderPlacedV1))]
enum OrderEvent {
    Placed {
        #[event(aggregate_id)]
        order_id: u64,
    },
}

// One type in the parentheses; `=` is not the syntax.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", version = 2, upcast_from = OrderPlacedV1)]
struct OrderShipped {
    #[event(aggregate_id)]
    order_id: u64,
}

fn main() {}
