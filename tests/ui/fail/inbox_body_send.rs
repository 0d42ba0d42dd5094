use std::time::Duration;

use outbox::prelude::*;
use outbox::BoxError;
use rdkafka::producer::{BaseProducer, BaseRecord, FutureProducer, FutureRecord};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
}

// Outside the handlers: a producer kept in a global, and records.
fn kafka() -> &'static FutureProducer {
    unimplemented!()
}
fn base_producer() -> &'static BaseProducer {
    unimplemented!()
}
fn record() -> FutureRecord<'static, str, str> {
    FutureRecord::to("invoices").key("k").payload("{}")
}
fn base_record() -> BaseRecord<'static, str, str> {
    BaseRecord::to("invoices").key("k").payload("{}")
}

#[inbox_handler]
async fn on_order_created(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), BoxError> {
    // `FutureProducer::send`: two arguments.
    let _ = kafka().send(record(), Duration::from_secs(1)).await;
    // `FutureProducer::send_result`.
    let _ = kafka().send_result(record());
    // `BaseProducer::send`: one argument, on a receiver named like a producer.
    let _ = base_producer().send(base_record());
    Ok(())
}

fn main() {}
