use outbox::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

// Not an error type.
#[derive(Debug)]
struct Refused;

#[inbox_handler]
async fn on_order_created(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), Refused> {
    Err(Refused)
}

fn main() {}
