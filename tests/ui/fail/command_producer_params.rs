use std::sync::Arc;

use outbox::prelude::*;
use outbox::BoxError;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, ThreadedProducer};

struct PlaceOrder;

// The classic: a producer next to the Unit of Work.
#[command_handler]
async fn place_order(
    _uow: &mut UnitOfWork,
    _cmd: PlaceOrder,
    _producer: &FutureProducer,
) -> Result<(), BoxError> {
    Ok(())
}

// Behind a smart pointer, by its full path.
#[command_handler]
async fn place_order_arc(
    _uow: &mut UnitOfWork,
    _cmd: PlaceOrder,
    _producer: Arc<rdkafka::producer::BaseProducer>,
) -> Result<(), BoxError> {
    Ok(())
}

// Smuggled in with the command.
#[command_handler]
async fn place_order_tuple(
    _uow: &mut UnitOfWork,
    _cmd: (PlaceOrder, Option<ThreadedProducer<DefaultProducerContext>>),
) -> Result<(), BoxError> {
    Ok(())
}

// Through a module path of rdkafka::producer.
#[command_handler]
async fn place_order_module(
    _uow: &mut UnitOfWork,
    _cmd: PlaceOrder,
    _producer: rdkafka::producer::future_producer::FutureProducer,
) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
