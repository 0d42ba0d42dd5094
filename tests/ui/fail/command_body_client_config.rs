use outbox::prelude::*;
use outbox::BoxError;
use rdkafka::ClientConfig;

type Kafka = rdkafka::producer::FutureProducer;

struct PlaceOrder;

// In a chain.
#[command_handler]
async fn chained(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Result<(), BoxError> {
    let _producer: Kafka = ClientConfig::new()
        .set("bootstrap.servers", "127.0.0.1:9092")
        .create()?;
    Ok(())
}

// Through a variable.
#[command_handler]
async fn through_variable(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Result<(), BoxError> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", "127.0.0.1:9092");
    let _producer: Kafka = config.create_with_context(rdkafka::client::DefaultClientContext)?;
    Ok(())
}

// Handed in from outside: the configuration is a parameter-free global, the
// creation still shows.
fn settings() -> &'static ClientConfig {
    unimplemented!()
}

#[command_handler]
async fn from_settings(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Result<(), BoxError> {
    let config: &ClientConfig = settings();
    let _producer: Kafka = config.create()?;
    Ok(())
}

fn main() {}
