use outbox::prelude::*;
use outbox::BoxError;

struct PlaceOrder;

#[command_handler]
async fn place_order(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Result<(), BoxError> {
    use rdkafka::producer::FutureRecord;
    use rdkafka::producer::{BaseProducer as Kafka, Producer};

    let producer: Option<rdkafka::producer::FutureProducer> = None;
    let _record: FutureRecord<'_, str, str> = FutureRecord::to("orders");
    let _kafka: Option<Kafka> = None;
    let _ = producer.map(|producer| producer.in_flight_count());
    Ok(())
}

fn main() {}
