use outbox::prelude::*;
use outbox::BoxError;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[inbox_handler(nmae = "orders")]
async fn unknown_key(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler(name = "")]
async fn empty_name(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler(name = orders)]
async fn not_a_string(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler(name = "a", name = "b")]
async fn duplicate(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler(name)]
async fn no_value(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
