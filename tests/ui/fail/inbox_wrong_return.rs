use outbox::prelude::*;
use outbox::BoxError;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

// Nothing returned.
#[inbox_handler]
async fn no_result(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) {}

// `()` spelled out.
#[inbox_handler]
async fn unit(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> () {}

// A value: a handler's output is its queries and the events it records.
#[inbox_handler]
async fn a_value(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<u64, BoxError> {
    Ok(1)
}

// Not a `Result` at all.
#[inbox_handler]
async fn a_bool(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> bool {
    true
}

fn main() {}
