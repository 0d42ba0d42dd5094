// `FailTimes` wraps an inbox handler, not any function.
use outbox::prelude::*;
use outbox::testing::FailTimes;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

async fn charge(_event: OrderCreated) -> Result<(), outbox::BoxError> {
    Ok(())
}

fn main() {
    let _ = FailTimes::new(charge, 2);
}
