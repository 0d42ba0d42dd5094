//! The demo's orders service.
//!
//! - [`domain`]: the `Order` aggregate and the `place_order` command handler
//!   (the order row and its `OrderCreated` event in one Unit of Work).
//! - [`api`]: the HTTP API (`POST /orders`, `GET /orders/{id}`), with input
//!   validation that answers 4xx and writes nothing.
//! - [`payments`]: the inbox handler that marks an order paid when billing
//!   reports `PaymentCaptured`, and the service's consumer.
//! - [`order_saga`]: the order-payment saga — stock reserved, the payment
//!   awaited, the order cancelled and its stock released when no payment
//!   comes in time.
//! - [`service`]: wiring — migrations, the relay and the consumer beside the
//!   HTTP server, graceful shutdown.

#![forbid(unsafe_code)]

pub mod api;
pub mod domain;
pub mod order_saga;
pub mod payments;
pub mod service;

use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// The service's own migrations (the `orders` table). They ignore the
/// outbox's versions, which share `_sqlx_migrations`.
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};

/// Applies the outbox's migrations, then the service's own.
pub async fn migrate(pool: &PgPool) -> Result<(), outbox::Error> {
    outbox::migrate(pool).await?;
    MIGRATOR.run(pool).await?;
    Ok(())
}
