// An assertion's predicate reads the event type it asserts on.
use outbox::prelude::*;
use outbox::testing::Delivery;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(topic = "payments")]
struct PaymentCaptured {
    #[event(aggregate_id)]
    payment_id: Uuid,
}

fn check(delivery: &Delivery) {
    delivery.assert_published::<OrderCreated>(|e: &PaymentCaptured| e.payment_id.is_nil());
}

fn main() {}
