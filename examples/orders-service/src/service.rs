//! The running service: migrations at start, the relay and the payments
//! consumer beside the HTTP server, and a graceful shutdown of all three.
//!
//! Two connection pools: the HTTP handlers' (`HTTP_DB_CONNECTIONS`, each
//! connection with the request timeout as its `statement_timeout`, waited
//! for at most that long) and the relay's and the consumer's
//! ([`WORKER_CONNECTIONS`]). However many requests are in flight, and
//! however long they wait on the database, they cannot take the
//! connections the relay and the consumer need.
//!
//! On shutdown the server stops accepting requests and finishes those in
//! flight, then the relay delivers and marks the batch it holds, then the
//! consumer finishes its batch and commits its offsets.
//!
//! With `METRICS_ADDR` set, the relay's and the consumer's metrics are
//! served there (Prometheus, `GET /metrics`).

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use outbox::BoxError;
use outbox::runtime::settings::{KafkaSettings, redact_url};
use outbox::runtime::{CancellationToken, Relay};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::TcpListener;

use crate::api::{Limits, router};
use crate::payments;

/// Connections of the relay's and the consumer's pool: the relay's 3 (a
/// claim, a batch in flight, a batch being marked) and the inbox consumer's
/// 4 (2 writers, a processor, the re-drive), and one to spare.
pub const WORKER_CONNECTIONS: u32 = 8;

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
    /// `REQUEST_TIMEOUT_MS` (default 10000) and `MAX_CONCURRENT_REQUESTS`
    /// (default 256).
    pub limits: Limits,
    /// `HTTP_DB_CONNECTIONS`: the HTTP handlers' pool (default 10).
    pub http_db_connections: u32,
    /// `METRICS_ADDR` (e.g. `127.0.0.1:9464`; unset: no metrics endpoint):
    /// where the relay's and the consumer's Prometheus metrics are served.
    pub metrics: Option<SocketAddr>,
    /// `PAYMENT_TIMEOUT_MS` (default 30000): how long an order waits for
    /// its payment before the order-payment saga cancels it.
    pub payment_timeout: Duration,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &redact_url(&self.database_url))
            .field("kafka", &self.kafka)
            .field("listen", &self.listen)
            .field("group", &self.group)
            .field("limits", &self.limits)
            .field("http_db_connections", &self.http_db_connections)
            .field("metrics", &self.metrics)
            .field("payment_timeout", &self.payment_timeout)
            .finish()
    }
}

impl Config {
    /// Reads the settings; a malformed `LISTEN_ADDR`, number or
    /// `OUTBOX_KAFKA_*` variable is an error naming it.
    pub fn from_env() -> Result<Self, BoxError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Like [`Config::from_env`], from `var` (the value of a variable, if
    /// set); the Kafka settings come from the process environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, BoxError> {
        let or = |name: &str, default: &str| var(name).unwrap_or_else(|| default.to_owned());
        fn parse<T: FromStr>(name: &str, value: Option<String>, default: T) -> Result<T, BoxError>
        where
            T::Err: std::fmt::Display,
        {
            match value {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse()
                    .map_err(|e| format!("{name}={v:?} is not valid: {e}").into()),
            }
        }
        let defaults = Limits::default();
        let timeout_ms: u64 = parse(
            "REQUEST_TIMEOUT_MS",
            var("REQUEST_TIMEOUT_MS"),
            defaults.request_timeout.as_millis() as u64,
        )?;
        let limits = Limits {
            request_timeout: Duration::from_millis(timeout_ms),
            max_concurrent_requests: parse(
                "MAX_CONCURRENT_REQUESTS",
                var("MAX_CONCURRENT_REQUESTS"),
                defaults.max_concurrent_requests,
            )?,
        };
        if limits.request_timeout < Duration::from_millis(100) {
            return Err("REQUEST_TIMEOUT_MS must be at least 100".into());
        }
        if limits.max_concurrent_requests == 0 {
            return Err("MAX_CONCURRENT_REQUESTS must be at least 1".into());
        }
        let http_db_connections = parse("HTTP_DB_CONNECTIONS", var("HTTP_DB_CONNECTIONS"), 10)?;
        if http_db_connections == 0 {
            return Err("HTTP_DB_CONNECTIONS must be at least 1".into());
        }
        let payment_timeout_ms: u64 =
            parse("PAYMENT_TIMEOUT_MS", var("PAYMENT_TIMEOUT_MS"), 30_000)?;
        if payment_timeout_ms < 100 {
            return Err("PAYMENT_TIMEOUT_MS must be at least 100".into());
        }
        let listen = or("LISTEN_ADDR", "127.0.0.1:3000");
        let metrics = match var("METRICS_ADDR").filter(|v| !v.trim().is_empty()) {
            None => None,
            Some(addr) => Some(
                addr.trim()
                    .parse()
                    .map_err(|e| format!("METRICS_ADDR={addr:?} is not a socket address: {e}"))?,
            ),
        };
        Ok(Self {
            database_url: or(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            kafka: KafkaSettings::from_env()?,
            listen: listen
                .parse()
                .map_err(|e| format!("LISTEN_ADDR={listen:?} is not a socket address: {e}"))?,
            group: or("CONSUMER_GROUP", "orders"),
            limits,
            http_db_connections,
            metrics,
            payment_timeout: Duration::from_millis(payment_timeout_ms),
        })
    }
}

/// The service's two pools.
#[derive(Debug, Clone)]
pub struct Pools {
    /// The HTTP handlers'.
    pub http: PgPool,
    /// The relay's and the consumer's.
    pub workers: PgPool,
}

impl Pools {
    /// Connects both pools to `config.database_url`.
    pub async fn connect(config: &Config) -> Result<Self, BoxError> {
        let options = PgConnectOptions::from_str(&config.database_url)?;
        let timeout = config.limits.request_timeout;
        let http = PgPoolOptions::new()
            .max_connections(config.http_db_connections)
            .acquire_timeout(timeout)
            .connect_with(
                options
                    .clone()
                    .options([("statement_timeout", timeout.as_millis().to_string())]),
            )
            .await?;
        let workers = PgPoolOptions::new()
            .max_connections(WORKER_CONNECTIONS)
            .connect_with(options)
            .await?;
        Ok(Self { http, workers })
    }

    async fn close(&self) {
        self.http.close().await;
        self.workers.close().await;
    }
}

/// Runs the service until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), BoxError> {
    let listener = TcpListener::bind(config.listen).await?;
    serve(config, listener, shutdown).await
}

/// Runs the service on `listener` (instead of `config.listen`) until
/// `shutdown` is cancelled.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), BoxError> {
    // Before the relay and the consumer: their series are registered with
    // the recorder when they start. Kept until the service stops.
    let _metrics = match config.metrics {
        Some(addr) => Some(outbox::runtime::metrics::serve(addr).await?),
        None => None,
    };
    let pools = Pools::connect(&config).await?;
    crate::migrate(&pools.workers).await?;
    crate::order_saga::set_payment_timeout(config.payment_timeout);

    let relay = Relay::builder(pools.workers.clone())
        .kafka(&config.kafka)
        .spawn()?;
    let consumer = payments::consumer(pools.workers.clone(), &config.group)
        .kafka(&config.kafka)
        // Latency over fetch requests: ask the broker to answer a fetch
        // within 50 ms when it has nothing new (librdkafka's default is
        // 500 ms, and some brokers hold every fetch that long).
        .kafka_setting("fetch.wait.max.ms", "50")
        .spawn()?;

    tracing::info!(
        addr = %listener.local_addr()?,
        group = %config.group,
        limits = ?config.limits,
        http_db_connections = config.http_db_connections,
        "orders service listening"
    );
    let served = axum::serve(listener, router(pools.http.clone(), config.limits))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await;

    // Stop the background tasks even if the server failed.
    let relay_stopped = relay.shutdown().await;
    let consumer_stopped = consumer.shutdown().await;
    pools.close().await;
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
            limits: Limits::default(),
            http_db_connections: 10,
            metrics: None,
            payment_timeout: Duration::from_secs(30),
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("postgres://orders:***@db/orders"), "{shown}");
    }

    #[test]
    fn limits_and_pool_sizes_come_from_the_environment() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let config = Config::from_vars(vars(&[])).unwrap();
        assert_eq!(config.limits, Limits::default());
        assert_eq!(config.http_db_connections, 10);
        assert_eq!(config.payment_timeout, Duration::from_secs(30));
        let config = Config::from_vars(vars(&[
            ("REQUEST_TIMEOUT_MS", "2500"),
            ("MAX_CONCURRENT_REQUESTS", "8"),
            ("HTTP_DB_CONNECTIONS", "3"),
            ("PAYMENT_TIMEOUT_MS", "5000"),
        ]))
        .unwrap();
        assert_eq!(config.payment_timeout, Duration::from_secs(5));
        assert_eq!(config.limits.request_timeout, Duration::from_millis(2500));
        assert_eq!(config.limits.max_concurrent_requests, 8);
        assert_eq!(config.http_db_connections, 3);
        let error = Config::from_vars(vars(&[("MAX_CONCURRENT_REQUESTS", "lots")])).unwrap_err();
        assert!(
            error.to_string().contains("MAX_CONCURRENT_REQUESTS"),
            "{error}"
        );
        let error = Config::from_vars(vars(&[("HTTP_DB_CONNECTIONS", "0")])).unwrap_err();
        assert!(error.to_string().contains("HTTP_DB_CONNECTIONS"), "{error}");
        let error = Config::from_vars(vars(&[("PAYMENT_TIMEOUT_MS", "10")])).unwrap_err();
        assert!(error.to_string().contains("PAYMENT_TIMEOUT_MS"), "{error}");
    }

    #[test]
    fn the_metrics_address_comes_from_the_environment() {
        let with = |value: &'static str| {
            Config::from_vars(move |name| (name == "METRICS_ADDR").then(|| value.to_owned()))
        };
        assert_eq!(Config::from_vars(|_| None).unwrap().metrics, None);
        assert_eq!(with("").unwrap().metrics, None);
        assert_eq!(
            with("127.0.0.1:9464").unwrap().metrics,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        let error = with("localhost").unwrap_err();
        assert!(error.to_string().contains("METRICS_ADDR"), "{error}");
    }
}
