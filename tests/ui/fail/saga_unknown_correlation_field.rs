use outbox::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "payments")]
struct PaymentTaken {
    #[event(aggregate_id)]
    order_id: Uuid,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Stage {
    AwaitingPayment,
    Shipped,
}

#[derive(Serialize, Deserialize)]
struct Order {
    order_id: Uuid,
    stage: Stage,
}

#[saga(name = "order", timeouts = "order-timeouts", stage = Stage)]
impl Order {
    #[init]
    fn begin(e: &OrderPlaced) -> Self {
        Order { order_id: e.order_id, stage: Stage::AwaitingPayment }
    }

    #[step(start, correlate = order_id)]
    async fn placed(_ctx: &mut SagaContext<Self>, _e: OrderPlaced) -> Result<Stage, outbox::BoxError> {
        Ok(Stage::AwaitingPayment)
    }

    #[step(from = AwaitingPayment, correlate = order)]
    async fn paid(ctx: &mut SagaContext<Self>, _e: PaymentTaken) -> Result<Stage, outbox::BoxError> {
        ctx.complete();
        Ok(Stage::Shipped)
    }
}

fn main() {}
