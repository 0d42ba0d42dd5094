use outbox::prelude::*;
use outbox::BoxError;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[inbox_handler]
async fn destructured(
    _ctx: &mut HandlerContext<'_>,
    OrderCreated { order_id }: OrderCreated,
) -> Result<(), BoxError> {
    let _ = order_id;
    Ok(())
}

#[inbox_handler]
async fn wildcard(_: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
