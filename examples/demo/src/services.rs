//! The demo's topics and the two services, run as child processes.
//!
//! Each run empties the topics and gives the services consumer groups of
//! their own (`orders-<run>`, `billing-<run>`), so nothing of an earlier run
//! on a long-running broker — messages or committed offsets — leaks into
//! this one. The services' output goes to a log file each. Each serves its
//! relay's and consumer's Prometheus metrics on a free port (`METRICS_ADDR`),
//! printed at the start.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use outbox::BoxError;
use outbox::prelude::Uuid;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use tokio::process::{Child, Command};

/// Partitions of each demo topic.
const PARTITIONS: i32 = 4;

/// How long an order waits for its payment in the demo: a declined
/// card's order is cancelled after that. Well above the stream's commit →
/// paid latency, so that no paid order's timeout fires first.
pub const PAYMENT_TIMEOUT_MS: &str = "10000";

/// Deletes and recreates the demo's topics, so a run starts from empty ones.
// An admin client, not a producer: the demo's events are published by the
// services' relays only.
#[allow(clippy::disallowed_methods)]
pub async fn reset_topics(brokers: &str) -> Result<(), BoxError> {
    let topics = [
        demo_events::ORDERS_TOPIC,
        demo_events::PAYMENTS_TOPIC,
        demo_events::STOCK_TOPIC,
        demo_events::ORDER_TIMEOUTS_TOPIC,
    ];
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    // A topic that does not exist yet is fine: there is nothing to empty.
    let _ = admin.delete_topics(&topics, &options).await;
    let names: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // Deletion completes asynchronously on some brokers: retry until
        // every topic is created anew.
        let created =
            outbox::runtime::kafka::create_topics(brokers, &[], &names, PARTITIONS, 1).await;
        match created {
            Ok(created) if created.iter().all(|(_, new)| *new) => return Ok(()),
            other if Instant::now() >= deadline => {
                return Err(format!(
                    "could not recreate the topics {names:?} on {brokers} within 30 s: {other:?}"
                )
                .into());
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Where the services come from and what they connect to.
#[derive(Debug, Clone)]
pub struct StartOptions {
    /// The directory of the `orders-service` and `billing-service` programs.
    pub bin_dir: PathBuf,
    /// The directory of their logs.
    pub log_dir: PathBuf,
    /// The orders service's database.
    pub orders_database_url: String,
    /// The billing service's database.
    pub billing_database_url: String,
    /// Kafka bootstrap servers.
    pub brokers: String,
}

/// One running service.
struct Service {
    name: &'static str,
    child: Child,
    log: PathBuf,
    exit: Option<ExitStatus>,
}

impl Service {
    fn spawn(
        name: &'static str,
        options: &StartOptions,
        env: &[(&str, &str)],
    ) -> Result<Self, BoxError> {
        let program = options.bin_dir.join(name);
        if !program.is_file() {
            return Err(format!(
                "{} not found: build it first (cargo build -p {name}; scripts/demo.sh does)",
                program.display()
            )
            .into());
        }
        let log = options.log_dir.join(format!("{name}.log"));
        let out = File::create(&log)
            .map_err(|e| format!("cannot create the log {}: {e}", log.display()))?;
        let mut command = Command::new(&program);
        command
            .envs(env.iter().copied())
            .env("KAFKA_BROKERS", &options.brokers)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            // If the demo itself dies, the services die with it.
            .kill_on_drop(true);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "info");
        }
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
        Ok(Self {
            name,
            child,
            log,
            exit: None,
        })
    }

    /// A message if the process has ended.
    fn exited(&mut self) -> Option<String> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().ok().flatten();
        }
        self.exit.map(|status| {
            format!(
                "{} ended on its own ({status}); its log ({}) ends with:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 15)
            )
        })
    }

    /// SIGTERM, then waits; a problem unless it exits with 0 within 30 s.
    async fn stop(mut self) -> Option<String> {
        if let Some(status) = self.exit {
            return Some(format!("{} had already ended ({status})", self.name));
        }
        let Some(pid) = self.child.id() else {
            return Some(format!("{} has no process id", self.name));
        };
        let signalled = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await;
        if !signalled.is_ok_and(|s| s.success()) {
            return Some(format!(
                "could not send SIGTERM to {} (pid {pid})",
                self.name
            ));
        }
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(Ok(status)) if status.success() => {
                println!("  {:<18}stopped, exit code 0", self.name);
                None
            }
            Ok(Ok(status)) => Some(format!(
                "{} stopped with {status}; its log ({}) ends with:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 15)
            )),
            Ok(Err(e)) => Some(format!("waiting for {}: {e}", self.name)),
            Err(_) => {
                let _ = self.child.kill().await;
                Some(format!(
                    "{} did not stop within 30 s of SIGTERM (killed)",
                    self.name
                ))
            }
        }
    }
}

/// The last `n` lines of a log, indented.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("      {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The two services.
pub struct Services {
    orders: Service,
    billing: Service,
    base_url: String,
}

impl Services {
    /// Starts both services and waits until they are ready: the orders
    /// service answers `GET /health`, the billing service's table exists.
    pub async fn start(options: StartOptions) -> Result<Self, BoxError> {
        std::fs::create_dir_all(&options.log_dir)
            .map_err(|e| format!("cannot create {}: {e}", options.log_dir.display()))?;
        let run = Uuid::new_v4().simple().to_string();
        let run = &run[..8];
        let port = free_port()?;
        let listen = format!("127.0.0.1:{port}");
        let (orders_group, billing_group) = (format!("orders-{run}"), format!("billing-{run}"));
        let orders_metrics = format!("127.0.0.1:{}", free_port()?);
        let billing_metrics = format!("127.0.0.1:{}", free_port()?);
        println!(
            "== starting billing-service and orders-service (http://{listen}); logs in {}",
            options.log_dir.display()
        );
        println!(
            "  metrics: orders-service http://{orders_metrics}/metrics, \
             billing-service http://{billing_metrics}/metrics"
        );
        let billing = Service::spawn(
            "billing-service",
            &options,
            &[
                ("DATABASE_URL", &options.billing_database_url),
                ("CONSUMER_GROUP", &billing_group),
                ("METRICS_ADDR", &billing_metrics),
            ],
        )?;
        let orders = Service::spawn(
            "orders-service",
            &options,
            &[
                ("DATABASE_URL", &options.orders_database_url),
                ("CONSUMER_GROUP", &orders_group),
                ("LISTEN_ADDR", &listen),
                ("METRICS_ADDR", &orders_metrics),
                ("PAYMENT_TIMEOUT_MS", PAYMENT_TIMEOUT_MS),
            ],
        )?;
        let mut services = Self {
            orders,
            billing,
            base_url: format!("http://{listen}"),
        };
        services.wait_ready(&options.billing_database_url).await?;
        Ok(services)
    }

    async fn wait_ready(&mut self, billing_database_url: &str) -> Result<(), BoxError> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()?;
        let billing_db = sqlx::PgPool::connect(billing_database_url).await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let health = format!("{}/health", self.base_url);
        loop {
            if let Some(exited) = self.exited() {
                return Err(exited.into());
            }
            let orders_up = client
                .get(&health)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            let billing_up: bool =
                sqlx::query_scalar("SELECT to_regclass('public.charges') IS NOT NULL")
                    .fetch_one(&billing_db)
                    .await
                    .unwrap_or(false);
            if orders_up && billing_up {
                billing_db.close().await;
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the services were not ready within 60 s (orders-service up: {orders_up}, \
                     billing-service migrated: {billing_up}); see the logs"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The orders service's address, `http://127.0.0.1:<port>`.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// A message if either service has ended on its own.
    pub fn exited(&mut self) -> Option<String> {
        self.orders.exited().or_else(|| self.billing.exited())
    }

    /// Stops the orders service (its HTTP server, relay and consumer), then
    /// billing; returns the problems.
    pub async fn stop(self) -> Vec<String> {
        let mut problems = Vec::new();
        problems.extend(self.orders.stop().await);
        problems.extend(self.billing.stop().await);
        problems
    }
}

/// A port nobody listens on right now.
fn free_port() -> Result<u16, BoxError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
