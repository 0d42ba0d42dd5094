use outbox::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "payments")]
struct PaymentTaken {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Stage {
    AwaitingPayment,
    Shipped,
}

#[derive(Serialize, Deserialize)]
struct Order {
    order_id: Uuid,
    stage: Stage,
}

#[saga(name = "order", timeouts = "order-timeouts", stage = Stage)]
struct Process;

fn main() {}
