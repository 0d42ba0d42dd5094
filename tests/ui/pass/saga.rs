#![deny(warnings, missing_docs)]
//! `#[saga]` on an `impl` block: a start with its `#[init]`, steps per
//! stage, several steps of one message type, a fallback, a timeout, a
//! plain helper, correlation fields per step or for the saga, and errors
//! of any type that converts into `BoxError`.

use std::time::Duration;

use outbox::prelude::*;
use outbox::saga::OtherStage;
use serde::{Deserialize, Serialize};

/// An order was placed.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
pub struct OrderPlaced {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// A payment was taken, or refused.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "payments")]
pub struct PaymentResult {
    /// The order paid for.
    #[event(aggregate_id)]
    pub order: Uuid,
    /// Whether the payment was taken.
    pub ok: bool,
}

/// A note on an order.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "notes")]
pub struct Noted {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// Ship an order (a command).
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "shipping")]
pub struct Ship {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// The order's stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Stage {
    /// Placed, waiting for the payment.
    AwaitingPayment,
    /// Payment refused once.
    Retrying,
    /// Shipped (complete).
    Shipped,
    /// Cancelled (complete).
    Cancelled,
}

/// An order's saga.
#[derive(Serialize, Deserialize)]
pub struct Order {
    order_id: Uuid,
    notes: u32,
    status: Stage,
}

#[derive(Debug)]
struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("refused")
    }
}

impl std::error::Error for Refused {}

#[saga(
    name = "order",
    timeouts = "order-timeouts",
    stage = Stage,
    stage_field = status,
    other_stage = dead_letter,
    correlate = order_id
)]
impl Order {
    #[init]
    fn begin(e: &OrderPlaced) -> Self {
        Order {
            order_id: e.order_id,
            notes: 0,
            status: Stage::AwaitingPayment,
        }
    }

    #[step(start)]
    async fn placed(ctx: &mut SagaContext<Self>, _e: OrderPlaced) -> Result<Stage, outbox::BoxError> {
        ctx.schedule_timeout("payment", Duration::from_secs(600));
        Ok(Stage::AwaitingPayment)
    }

    #[step(from = AwaitingPayment, correlate = order)]
    async fn paid(ctx: &mut SagaContext<Self>, e: PaymentResult) -> Result<Stage, Refused> {
        if !e.ok {
            return Ok(Stage::Retrying);
        }
        ctx.cancel_timeout("payment");
        let order_id = ctx.order_id;
        ctx.send(Ship { order_id });
        ctx.complete();
        Ok(Stage::Shipped)
    }

    #[step(from = Stage::Retrying)]
    async fn paid_at_last(ctx: &mut SagaContext<Self>, e: PaymentResult) -> Result<Stage, String> {
        if e.ok {
            ctx.complete();
            Ok(Stage::Shipped)
        } else {
            Err("refused twice".to_owned())
        }
    }

    /// Any stage; correlated by the saga's `correlate`.
    #[step]
    async fn noted(ctx: &mut SagaContext<Self>, _e: Noted) -> Result<Stage, outbox::BoxError> {
        ctx.notes += 1;
        Ok(ctx.current())
    }

    #[timeout(name = "payment", from = [AwaitingPayment, Retrying])]
    async fn payment_late(
        ctx: &mut SagaContext<Self>,
        _t: SagaTimeout<Self>,
    ) -> Result<Stage, outbox::BoxError> {
        ctx.complete();
        Ok(Stage::Cancelled)
    }

    /// A helper, left as it is.
    fn current(&self) -> Stage {
        self.status.clone()
    }
}

fn main() {
    assert_eq!(<Order as Saga>::NAME, "order");
    assert_eq!(<Order as Saga>::TIMEOUT_TOPIC, "order-timeouts");
    assert_eq!(<Order as Saga>::other_stage(), OtherStage::DeadLetter);
    let mut order = Order::begin(&OrderPlaced { order_id: Uuid::nil() });
    order.set_stage(Stage::Shipped);
    assert_eq!(order.stage(), &Stage::Shipped);
    let _ = outbox::runtime::Consumer::builder;
}
