use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders.v2", event_type = "order.shipped", version = 2)]
struct OrderShipped(#[event(aggregate_id)] u64, String);

fn main() {
    let event = OrderShipped(1, "dhl".to_owned());
    assert_eq!(event.event_type(), "order.shipped");
    assert_eq!(event.event_version(), 2);
    assert_eq!(event.aggregate_id(), "1");
}
