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
use outbox::runtime::settings::{KafkaSettings, redact_url};
use outbox::runtime::{CancellationToken, Consumer, ConsumerBuilder, Mode, Relay};
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
/// transaction; an order of [`demo_events::DECLINED_CUSTOMER`] is not
/// charged.
#[inbox_handler(name = "billing.charge_order")]
pub async fn charge_order(
    ctx: &mut HandlerContext<'_>,
    event: OrderCreated,
) -> Result<(), sqlx::Error> {
    if event.customer == demo_events::DECLINED_CUSTOMER {
        tracing::info!(order_id = %event.order_id, "card declined: no charge");
        return Ok(());
    }
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

/// The service's consumer, as it runs (and as its tests drive it): the
/// `charge_order` handler in dedup mode, in group `group`. It skips an
/// order's cancellation: billing never charged an order that gets
/// cancelled. The caller adds the broker settings.
pub fn consumer(pool: PgPool, group: &str) -> ConsumerBuilder {
    Consumer::builder(pool)
        .group(group)
        .handler(charge_order)
        .ignore_event_type(demo_events::ORDERS_TOPIC, "OrderCancelled")
        .mode(Mode::Dedup)
}

/// The service's settings, from the environment. `Debug` hides the
/// database password and the Kafka secrets.
#[derive(Clone)]
pub struct Config {
    /// `DATABASE_URL` (default: the local `postgres` database); TLS with
    /// `?sslmode=verify-full&sslrootcert=ca.pem`.
    pub database_url: String,
    /// `KAFKA_BROKERS` (default `127.0.0.1:9092`) and any librdkafka
    /// setting as `OUTBOX_KAFKA_<PROPERTY>` (TLS, SASL).
    pub kafka: KafkaSettings,
    /// `CONSUMER_GROUP`: the orders consumer's group (default `billing`).
    pub group: String,
    /// `METRICS_ADDR` (e.g. `127.0.0.1:9465`; unset: no metrics endpoint):
    /// where the relay's and the consumer's Prometheus metrics are served.
    pub metrics: Option<std::net::SocketAddr>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &redact_url(&self.database_url))
            .field("kafka", &self.kafka)
            .field("group", &self.group)
            .field("metrics", &self.metrics)
            .finish()
    }
}

impl Config {
    /// Reads the settings; a malformed `METRICS_ADDR` or `OUTBOX_KAFKA_*`
    /// variable is an error naming it.
    pub fn from_env() -> Result<Self, BoxError> {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        let metrics = var("METRICS_ADDR", "");
        let metrics = match metrics.trim() {
            "" => None,
            addr => Some(
                addr.parse()
                    .map_err(|e| format!("METRICS_ADDR={addr:?} is not a socket address: {e}"))?,
            ),
        };
        Ok(Self {
            database_url: var(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            kafka: KafkaSettings::from_env()?,
            group: var("CONSUMER_GROUP", "billing"),
            metrics,
        })
    }
}

/// Runs the consumer and the relay (and, with `metrics` set, their metrics
/// endpoint) until `shutdown` is cancelled, then stops
/// both gracefully (the consumer first: its last batch's payments are then
/// published by the relay before it stops).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), BoxError> {
    // Before the relay and the consumer: their series are registered with
    // the recorder when they start. Kept until the service stops.
    let _metrics = match config.metrics {
        Some(addr) => Some(outbox::runtime::metrics::serve(addr).await?),
        None => None,
    };
    // The relay (3) + the dedup consumer (2).
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&config.database_url)
        .await?;
    migrate(&pool).await?;
    let relay = Relay::builder(pool.clone()).kafka(&config.kafka).spawn()?;
    let consumer = consumer(pool.clone(), &config.group)
        .kafka(&config.kafka)
        // Latency over fetch requests: ask the broker to answer a fetch
        // within 50 ms when it has nothing new (librdkafka's default is
        // 500 ms, and some brokers hold every fetch that long).
        .kafka_setting("fetch.wait.max.ms", "50")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_debug_hides_secrets() {
        let mut kafka = KafkaSettings::default();
        kafka.set("sasl.password", "kafka-s3cret");
        let config = Config {
            database_url: "postgres://billing:db-s3cret@db/billing".into(),
            kafka,
            group: "billing".into(),
            metrics: None,
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("postgres://billing:***@db/billing"),
            "{shown}"
        );
    }
}
