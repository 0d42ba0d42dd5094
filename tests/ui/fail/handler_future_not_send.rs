// The consumer and `outbox::execute` run handlers on a multi-threaded
// runtime: a handler's future must be `Send`.
use std::rc::Rc;

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
async fn on_order_created(ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    let shared = Rc::new(1);
    sqlx::query("SELECT 1").execute(&mut **ctx).await?;
    drop(shared);
    Ok(())
}

struct PlaceOrder;

#[command_handler]
async fn place_order(uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Result<(), BoxError> {
    let shared = Rc::new(1);
    sqlx::query("SELECT 1").execute(&mut **uow).await?;
    drop(shared);
    Ok(())
}

fn main() {}
