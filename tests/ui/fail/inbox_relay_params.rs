use outbox::prelude::*;
use outbox::runtime::{Relay, RelayHandle};
use outbox::BoxError;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[inbox_handler]
async fn with_handle(
    _ctx: &mut HandlerContext<'_>,
    _event: OrderCreated,
    _relay: &RelayHandle,
) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler]
async fn with_relay(
    _ctx: &mut HandlerContext<'_>,
    _event: OrderCreated,
    _relay: Option<Relay>,
) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler]
async fn with_builder(
    _ctx: &mut HandlerContext<'_>,
    _event: OrderCreated,
    _relay: outbox::runtime::RelayBuilder,
) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler]
async fn with_config(
    _ctx: &mut HandlerContext<'_>,
    _event: OrderCreated,
    _config: &rdkafka::ClientConfig,
) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
