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
async unsafe fn unsafe_handler(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler]
const fn const_handler(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler]
async extern "C" fn extern_handler(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
