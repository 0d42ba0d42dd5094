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
fn on_order_created(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
