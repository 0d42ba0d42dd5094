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
async fn on_order_created(_ctx: &mut HandlerContext<'_>, event: &OrderCreated) -> Result<(), BoxError> {
    let _ = event.order_id;
    Ok(())
}

fn main() {}
