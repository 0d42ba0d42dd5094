//! The consumer side: billing's `PaymentCaptured` marks an order paid.
//!
//! The service consumes in inbox mode: messages are stored in `inbox_event`
//! first, then applied from the table; the handler's update, the dedup row
//! and the mark-processed update commit together, so a payment is applied
//! once however often it is delivered.

use demo_events::PaymentCaptured;
use outbox::prelude::*;
use outbox::runtime::{Consumer, ConsumerBuilder, Mode};
use sqlx::PgPool;

use crate::order_saga::{OrderPayment, mark_cancelled};

/// The service's consumer, as it runs (and as its tests drive it), in
/// inbox mode, in group `group`: [`mark_paid`], the order-payment saga
/// ([`OrderPayment`]: `OrderCreated`, `PaymentCaptured` and its timeouts)
/// and [`mark_cancelled`]. The caller adds the broker settings.
pub fn consumer(pool: PgPool, group: &str) -> ConsumerBuilder {
    Consumer::builder(pool)
        .group(group)
        .handler(mark_paid)
        .saga::<OrderPayment>()
        .handler(mark_cancelled)
        .mode(Mode::Inbox)
}

/// Why a payment could not be applied. The consumer retries the event and
/// dead-letters it after its attempts run out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PaymentError {
    /// The database refused the update.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// No order has this id.
    #[error("no order {0}")]
    UnknownOrder(Uuid),
    /// The amount charged is not the order's amount.
    #[error("order {order_id} costs {expected} cents, the payment is of {charged} cents")]
    AmountMismatch {
        /// The order.
        order_id: Uuid,
        /// The order's amount.
        expected: i64,
        /// The amount charged.
        charged: i64,
    },
}

/// Marks the order paid and counts the payment (`payments_applied`: one is
/// right, more would be a double charge the demo reports).
#[inbox_handler(name = "orders.mark_paid")]
pub async fn mark_paid(
    ctx: &mut HandlerContext<'_>,
    event: PaymentCaptured,
) -> Result<(), PaymentError> {
    let order: Option<(i64,)> =
        sqlx::query_as("SELECT amount_cents FROM orders WHERE id = $1 FOR UPDATE")
            .bind(event.order_id)
            .fetch_optional(&mut **ctx)
            .await?;
    let Some((expected,)) = order else {
        return Err(PaymentError::UnknownOrder(event.order_id));
    };
    if expected != event.amount_cents {
        return Err(PaymentError::AmountMismatch {
            order_id: event.order_id,
            expected,
            charged: event.amount_cents,
        });
    }
    let (applied,): (i32,) = sqlx::query_as(
        "UPDATE orders SET status = 'paid',
                paid_at = coalesce(paid_at, clock_timestamp()),
                payment_id = coalesce(payment_id, $2),
                payments_applied = payments_applied + 1
         WHERE id = $1 RETURNING payments_applied",
    )
    .bind(event.order_id)
    .bind(event.payment_id)
    .fetch_one(&mut **ctx)
    .await?;
    if applied > 1 {
        tracing::warn!(order_id = %event.order_id, payment_id = %event.payment_id, applied, "order paid more than once");
    }
    Ok(())
}
