use outbox::prelude::*;
use outbox::BoxError;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

// The connection alone: it would even coerce, but loses the event recorder.
#[inbox_handler]
async fn on_order_created(_conn: &mut sqlx::PgConnection, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

// A command handler's argument.
#[inbox_handler]
async fn on_order_created_too(_uow: &mut UnitOfWork, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

// A shared borrow.
#[inbox_handler]
async fn on_order_created_again(_ctx: &HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
