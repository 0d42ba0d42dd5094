//! The running service: migrations at start, the relay and the payments
//! consumer beside the HTTP server, and a graceful shutdown of all three.
//!
//! On shutdown the server stops accepting requests and finishes those in
//! flight, then the relay delivers and marks the batch it holds, then the
//! consumer finishes its batch and commits its offsets.

use std::net::SocketAddr;

use outbox::BoxError;
use outbox::runtime::settings::{KafkaSettings, redact_url};
use outbox::runtime::{CancellationToken, Consumer, Mode, Relay};
use sqlx::postgres::PgPoolOptions;
use tokio::net::TcpListener;

use crate::api::router;
use crate::payments::mark_paid;

/// The service's settings, read from the environment by [`Config::from_env`].
/// `Debug` hides the database password and the Kafka secrets.
#[derive(Clone)]
pub struct Config {
    /// `DATABASE_URL` (default: the local `postgres` database); TLS with
    /// `?sslmode=verify-full&sslrootcert=ca.pem`.
    pub database_url: String,
    /// `KAFKA_BROKERS` (default `127.0.0.1:9092`) and any librdkafka
    /// setting as `OUTBOX_KAFKA_<PROPERTY>` (TLS, SASL).
    pub kafka: KafkaSettings,
    /// `LISTEN_ADDR` (default `127.0.0.1:3000`).
    pub listen: SocketAddr,
    /// `CONSUMER_GROUP`: the payments consumer's group (default `orders`).
    pub group: String,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &redact_url(&self.database_url))
            .field("kafka", &self.kafka)
            .field("listen", &self.listen)
            .field("group", &self.group)
            .finish()
    }
}

impl Config {
    /// Reads the settings; a malformed `LISTEN_ADDR` or `OUTBOX_KAFKA_*`
    /// variable is an error naming it.
    pub fn from_env() -> Result<Self, BoxError> {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        let listen = var("LISTEN_ADDR", "127.0.0.1:3000");
        Ok(Self {
            database_url: var(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            kafka: KafkaSettings::from_env()?,
            listen: listen
                .parse()
                .map_err(|e| format!("LISTEN_ADDR={listen:?} is not a socket address: {e}"))?,
            group: var("CONSUMER_GROUP", "orders"),
        })
    }
}

/// Runs the service until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), BoxError> {
    // HTTP handlers + the relay (3) + the inbox consumer (writers 2 +
    // processor 1 + 1).
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&config.database_url)
        .await?;
    crate::migrate(&pool).await?;

    let relay = Relay::builder(pool.clone()).kafka(&config.kafka).spawn()?;
    let consumer = Consumer::builder(pool.clone())
        .group(&config.group)
        .kafka(&config.kafka)
        // Latency over fetch requests: ask the broker to answer a fetch
        // within 50 ms when it has nothing new (librdkafka's default is
        // 500 ms, and some brokers hold every fetch that long).
        .kafka_setting("fetch.wait.max.ms", "50")
        .handler(mark_paid)
        .mode(Mode::Inbox)
        .spawn()?;

    let listener = TcpListener::bind(config.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, group = %config.group, "orders service listening");
    let served = axum::serve(listener, router(pool.clone()))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await;

    // Stop the background tasks even if the server failed.
    let relay_stopped = relay.shutdown().await;
    let consumer_stopped = consumer.shutdown().await;
    pool.close().await;
    served?;
    relay_stopped?;
    consumer_stopped?;
    tracing::info!("orders service stopped");
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
            database_url: "postgres://orders:db-s3cret@db/orders".into(),
            kafka,
            listen: "127.0.0.1:3000".parse().unwrap(),
            group: "orders".into(),
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("postgres://orders:***@db/orders"), "{shown}");
    }
}
