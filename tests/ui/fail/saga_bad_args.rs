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

#[saga(name = "", timeouts = "order timeouts", other_stage = drop, colour = red)]
impl Order {
    #[init]
    fn begin(e: &OrderPlaced) -> Self {
        Order { order_id: e.order_id, stage: Stage::AwaitingPayment }
    }

    #[step(start, correlate = order_id)]
    async fn placed(ctx: &mut SagaContext<Self>, _e: OrderPlaced) -> Result<Stage, outbox::BoxError> {
        ctx.complete();
        Ok(Stage::Shipped)
    }

    #[step(from = AwaitingPayment, correlate = order_id, then = Shipped)]
    #[timeout(name = "payment")]
    async fn paid(_ctx: &mut SagaContext<Self>, _e: PaymentTaken) -> Result<Stage, outbox::BoxError> {
        Ok(Stage::Shipped)
    }
}

fn main() {}
