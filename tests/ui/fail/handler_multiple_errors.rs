// Every mistake is reported at once, each on its own token.
use outbox::prelude::*;
use rdkafka::producer::FutureProducer;

struct PlaceOrder;

#[command_handler(nmae = "x")]
fn place_order<T>(
    &self,
    _uow: &mut UnitOfWork,
    (_a, _b): (PlaceOrder, T),
    _producer: FutureProducer,
) -> Result<(), String> {
    Ok(())
}

fn main() {}
