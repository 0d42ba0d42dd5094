//! The order-payment saga: an order created reserves its stock and waits
//! for its payment; paid, the saga ends; not paid within the payment
//! timeout, it cancels the order ([`OrderCancelled`], which
//! [`mark_cancelled`] applies to the `orders` row) and releases the stock
//! ([`StockReleased`], the compensation). Each step's state, the events it
//! records, the timeout it schedules or cancels and the dedup of the
//! message that moved it commit in one transaction.
//!
//! The payment may reach this service before the order's own
//! `OrderCreated` does (two topics): it then starts the saga and ends it
//! at once, and the late `OrderCreated` finds a completed saga and changes
//! nothing, so a paid order is never cancelled.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use demo_events::{OrderCancelled, OrderCreated, PaymentCaptured, StockReleased, StockReserved};
use outbox::prelude::*;
use outbox::{BoxError, SagaContext, SagaTimeout};
use serde::{Deserialize, Serialize};

/// How long an order waits for its payment, in ms (`PAYMENT_TIMEOUT_MS`,
/// set once at the service's start).
static PAYMENT_TIMEOUT_MS: AtomicU64 = AtomicU64::new(30_000);

/// Sets the payment timeout of the orders created from now on.
pub fn set_payment_timeout(timeout: Duration) {
    let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    PAYMENT_TIMEOUT_MS.store(ms, Ordering::Relaxed);
}

fn payment_timeout() -> Duration {
    Duration::from_millis(PAYMENT_TIMEOUT_MS.load(Ordering::Relaxed))
}

/// Where an order's payment stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Stage {
    /// Stock reserved, the payment awaited.
    AwaitingPayment,
    /// Paid: done.
    Paid,
    /// No payment in time: cancelled, its stock released.
    Cancelled,
}

/// One order's payment process (stored in `outbox_saga` as
/// `order-payment`).
#[derive(Debug, Serialize, Deserialize)]
pub struct OrderPayment {
    /// The order.
    pub order_id: Uuid,
    /// Whether stock is held for it.
    pub stock_reserved: bool,
    /// Where it stands.
    pub stage: Stage,
}

#[outbox::saga(
    name = "order-payment",
    timeouts = "demo.order-timeouts",
    stage = Stage,
    correlate = order_id
)]
impl OrderPayment {
    #[init]
    fn created(e: &OrderCreated) -> Self {
        OrderPayment {
            order_id: e.order_id,
            stock_reserved: false,
            stage: Stage::AwaitingPayment,
        }
    }

    /// Reserves the order's stock and waits for the payment.
    #[step(start)]
    async fn reserve(ctx: &mut SagaContext<Self>, e: OrderCreated) -> Result<Stage, BoxError> {
        ctx.record(StockReserved {
            order_id: e.order_id,
        });
        ctx.stock_reserved = true;
        ctx.schedule_timeout("payment", payment_timeout());
        Ok(Stage::AwaitingPayment)
    }

    #[init]
    fn paid_first(e: &PaymentCaptured) -> Self {
        OrderPayment {
            order_id: e.order_id,
            stock_reserved: false,
            stage: Stage::AwaitingPayment,
        }
    }

    /// The payment came before the order's own event: nothing to wait for.
    #[step(start)]
    async fn paid_before_created(
        ctx: &mut SagaContext<Self>,
        _e: PaymentCaptured,
    ) -> Result<Stage, BoxError> {
        ctx.complete();
        Ok(Stage::Paid)
    }

    /// Paid in time: the payment timeout will not fire.
    #[step(from = AwaitingPayment)]
    async fn paid(ctx: &mut SagaContext<Self>, _e: PaymentCaptured) -> Result<Stage, BoxError> {
        ctx.cancel_timeout("payment");
        ctx.complete();
        Ok(Stage::Paid)
    }

    /// No payment in time: cancel the order, release its stock.
    #[timeout(name = "payment", from = AwaitingPayment)]
    async fn unpaid(ctx: &mut SagaContext<Self>, _t: SagaTimeout<Self>) -> Result<Stage, BoxError> {
        let order_id = ctx.order_id;
        ctx.record(OrderCancelled {
            order_id,
            reason: format!("no payment within {} ms", payment_timeout().as_millis()),
        });
        if ctx.stock_reserved {
            ctx.record(StockReleased { order_id });
            ctx.stock_reserved = false;
        }
        ctx.complete();
        Ok(Stage::Cancelled)
    }
}

/// Marks the order cancelled (once: `cancellations_applied` counts the
/// applications; a paid order is never cancelled).
#[inbox_handler(name = "orders.mark_cancelled")]
pub async fn mark_cancelled(
    ctx: &mut HandlerContext<'_>,
    event: OrderCancelled,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE orders SET status = 'cancelled',
                cancelled_at = coalesce(cancelled_at, clock_timestamp()),
                cancellations_applied = cancellations_applied + 1
         WHERE id = $1 AND paid_at IS NULL",
    )
    .bind(event.order_id)
    .execute(&mut **ctx)
    .await?;
    Ok(())
}
