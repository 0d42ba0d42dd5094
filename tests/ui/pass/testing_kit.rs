// The testing kit's API as a handler test uses it.
use outbox::prelude::*;
use outbox::runtime::Consumer;
use outbox::testing::{FailTimes, Faults, TestBus};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
struct OrderCreated {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
}

#[inbox_handler]
async fn charge(_ctx: &mut HandlerContext<'_>, _event: OrderCreated) -> Result<(), outbox::BoxError> {
    Ok(())
}

#[allow(dead_code)]
async fn test(pool: sqlx::PgPool) -> Result<(), outbox::testing::Error> {
    let mut bus = TestBus::new()
        .service(Consumer::builder(pool).group("billing").handler(FailTimes::new(charge, 1)))
        .faults(Faults::new().deliver_twice().redeliver_batches().interleave_keys(1));
    let delivery = bus.deliver().await?;
    let order: OrderCreated = delivery.assert_published::<OrderCreated>(|e| e.amount_cents == 500);
    delivery.assert_handled::<OrderCreated>(|e| e.order_id == order.order_id);
    delivery.assert_sequence(order.order_id, &["OrderCreated"]);
    delivery.assert_no_dead_letters();
    let _: Vec<OrderCreated> = delivery.published();
    let _ = bus.clock().elapsed();
    Ok(())
}

fn main() {}
