use std::time::Duration;

use outbox::prelude::*;
use outbox::BoxError;
use rdkafka::producer::{BaseProducer, BaseRecord, FutureProducer, FutureRecord};

struct PlaceOrder;

fn kafka() -> &'static FutureProducer {
    unimplemented!()
}
static PRODUCER: std::sync::OnceLock<BaseProducer> = std::sync::OnceLock::new();
fn record() -> FutureRecord<'static, str, str> {
    FutureRecord::to("orders").key("k").payload("{}")
}
fn base_record() -> BaseRecord<'static, str, str> {
    BaseRecord::to("orders").key("k").payload("{}")
}

// Publish after commit: the task runs beside the transaction, which may still
// roll back.
#[command_handler]
async fn place_order(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Result<(), BoxError> {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = kafka().send(record(), Duration::from_secs(1)).await;
    });
    std::thread::spawn(|| {
        let _ = PRODUCER.get().unwrap().send(base_record());
    });
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(async move { kafka().send_result(record()).is_ok() });
    Ok(())
}

fn main() {}
