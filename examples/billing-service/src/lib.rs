//! The demo's billing service: a consumer of `OrderCreated` in dedup mode
//! that records a charge and emits `PaymentCaptured` through its own outbox,
//! and the relay that publishes it.
//!
//! The charge row, the `PaymentCaptured` outbox row and the dedup row of the
//! handled event commit in one transaction: an order delivered twice is
//! charged once, and a payment event exists if and only if its charge does.

#![forbid(unsafe_code)]

use demo_events::{OrderCreated, PaymentCaptured};
use outbox::BoxError;
use outbox::prelude::*;
use outbox::runtime::{CancellationToken, Consumer, Mode, Relay};
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgPoolOptions;

/// The service's own migrations (the `charges` table).
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

/// Charges the order and records `PaymentCaptured`, in the consumer's
/// transaction.
#[inbox_handler(name = "billing.charge_order")]
pub async fn charge_order(
    ctx: &mut HandlerContext<'_>,
    event: OrderCreated,
) -> Result<(), sqlx::Error> {
    let payment_id = Uuid::now_v7();
    sqlx::query("INSERT INTO charges (id, order_id, amount_cents) VALUES ($1, $2, $3)")
        .bind(payment_id)
        .bind(event.order_id)
        .bind(event.amount_cents)
        .execute(&mut **ctx)
        .await?;
    ctx.record(PaymentCaptured {
        payment_id,
        order_id: event.order_id,
        amount_cents: event.amount_cents,
    });
    Ok(())
}

/// The service's settings, from the environment.
#[derive(Debug, Clone)]
pub struct Config {
    /// `DATABASE_URL` (default: the local `postgres` database).
    pub database_url: String,
    /// `KAFKA_BROKERS` (default `127.0.0.1:9092`).
    pub brokers: String,
    /// `CONSUMER_GROUP`: the orders consumer's group (default `billing`).
    pub group: String,
}

impl Config {
    /// Reads the settings.
    pub fn from_env() -> Self {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        Self {
            database_url: var(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            brokers: var("KAFKA_BROKERS", "127.0.0.1:9092"),
            group: var("CONSUMER_GROUP", "billing"),
        }
    }
}

/// Runs the consumer and the relay until `shutdown` is cancelled, then stops
/// both gracefully (the consumer first: its last batch's payments are then
/// published by the relay before it stops).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), BoxError> {
    // The relay (3) + the dedup consumer (2).
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&config.database_url)
        .await?;
    migrate(&pool).await?;
    let relay = Relay::builder(pool.clone())
        .brokers(&config.brokers)
        .spawn()?;
    let consumer = Consumer::builder(pool.clone())
        .group(&config.group)
        .brokers(&config.brokers)
        // Latency over fetch requests: ask the broker to answer a fetch
        // within 50 ms when it has nothing new (librdkafka's default is
        // 500 ms, and some brokers hold every fetch that long).
        .kafka_setting("fetch.wait.max.ms", "50")
        .handler(charge_order)
        .mode(Mode::Dedup)
        .spawn()?;
    tracing::info!(group = %config.group, "billing service running");
    shutdown.cancelled().await;
    let consumer_stopped = consumer.shutdown().await;
    let relay_stopped = relay.shutdown().await;
    pool.close().await;
    consumer_stopped?;
    relay_stopped?;
    tracing::info!("billing service stopped");
    Ok(())
}
