use outbox::prelude::*;
use outbox::BoxError;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

struct Handlers;

impl Handlers {
    #[inbox_handler]
    async fn on_order_created(
        &self,
        _ctx: &mut HandlerContext<'_>,
        _event: OrderCreated,
    ) -> Result<(), BoxError> {
        Ok(())
    }
}

fn main() {}
