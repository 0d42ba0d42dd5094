//! The relay: publishes `outbox_event` rows to Kafka, at least once, in id
//! order per partition key, and marks them published. Several relays may run
//! at once: each owns a share of the lanes (see `lanes`), so a
//! key's events are published by one relay at a time, in order. It never
//! deletes rows.
//!
//! One loop per relay overlaps the database and the broker: while batch *n*
//! is being delivered, batch *n+1* is claimed; while batch *n+1* is being
//! delivered, batch *n* is marked published and committed. A batch is
//! bounded by rows and by bytes; after one cut at its byte budget (or, in
//! the progress mode, one holding window rows behind held rows), the next
//! claim waits until it has committed (`Loop::claim_after`). Batch *n+1* is
//! handed to the producer only after every delivery of batch *n* is known, so
//! a key that failed in batch *n* sends nothing of batch *n+1*; a key with a
//! row left unpublished in a batch stays out of claims and sends until that
//! batch's transaction ends (see `Loop::held`). Batch *n* is
//! marked as soon as its deliveries are known, even while the claim of *n+1*
//! still waits for a pool connection: the loop never waits for a connection
//! while holding one that a finished batch would free.
//!
//! A batch whose marks do not commit (an outage, or a statement the
//! database refuses: see `refusal`) leaves its delivered rows
//! unpublished in the table: the relay remembers them, marks them before it
//! claims again and sends nothing until it could (`Loop::unrecorded`), so
//! it never publishes the same rows round after round. A refusal is reported
//! once per statement and makes the next claim wait the outage back-off's
//! cap.
//!
//! Submodules: `config` (settings and the builder), `stats` (counters and
//! health), `cycle` (the loop that overlaps claims, deliveries and marks;
//! its `evaluate` child judges each batch's deliveries),
//! `claim` (the SQL), `held`
//! (rows held back out of the claim's index), `lanes`
//! (lane ownership across relays), `publish` (the producer),
//! `topics` (topics missing on the broker),
//! `wake` (LISTEN/NOTIFY and polling), `progress` (the progress mode's
//! reader: windows of snapshots instead of marks; no loop uses it yet),
//! `trace_links` (with
//! the `otel` feature: the links of each batch's `outbox.relay.batch` span
//! to its events' traces).

pub(crate) mod claim;
mod config;
mod cycle;
pub(crate) mod held;
pub(crate) mod lanes;
// The progress mode's reader. Not an API: its relay loop is not built yet;
// public for the benchmark program that measures it (`benches/progress.rs`).
#[doc(hidden)]
pub mod progress;
pub(crate) mod publish;
mod stats;
pub(crate) mod topics;
#[cfg(feature = "otel")]
mod trace_links;
mod wake;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::cycle::{Blocked, Loop};
use self::publish::Publisher;
use self::topics::Topics;
use self::wake::Waker;
use crate::backoff::Health;
use crate::error::{Error, Result};
use crate::kafka;
use crate::scope::OutboxScope;

pub use self::config::{DEFAULT_MAX_BATCH_BYTES, RelayBuilder, RelayConfig};
pub use self::stats::{RelayCounts, RelayHealth, RelayStats};

/// Publishes the outbox to Kafka. See the module docs.
///
/// ```no_run
/// use outbox_runtime::{Relay, RelayHealth};
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let relay = Relay::builder(pool).brokers("kafka:9092").spawn()?;
/// // For the readiness probe and the metrics:
/// if !matches!(relay.health(), RelayHealth::Running) {
///     eprintln!("relay: {:?}", relay.health());
/// }
/// relay.shutdown().await?; // finishes the batch in flight
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Relay {
    pool: PgPool,
    config: RelayConfig,
    stats: Arc<RelayStats>,
}

/// A relay running in the background ([`Relay::spawn`]).
#[derive(Debug)]
pub struct RelayHandle {
    token: CancellationToken,
    stats: Arc<RelayStats>,
    task: JoinHandle<Result<()>>,
}

impl RelayHandle {
    /// The relay's counters.
    pub fn counts(&self) -> RelayCounts {
        self.stats.snapshot()
    }
    /// The lanes the relay claims from right now (empty without lanes).
    pub fn lanes(&self) -> Vec<i32> {
        self.stats.lanes()
    }
    /// Running, degraded (retrying, and on what), refused (the database
    /// refuses one of its statements: see [`RelayHealth::Refused`]),
    /// stopped, or failed (with the error).
    pub fn health(&self) -> RelayHealth {
        self.stats.health()
    }
    /// A token that stops the relay when cancelled.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.token.clone()
    }
    /// True once the relay task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
    /// Stops the relay gracefully: the batch in flight is delivered and
    /// marked, the producer flushed. Returns the relay's result.
    pub async fn shutdown(self) -> Result<()> {
        self.token.cancel();
        self.join().await
    }
    /// Waits for the relay to end (after its token is cancelled or on error).
    pub async fn join(self) -> Result<()> {
        self.task.await.map_err(|e| Error::Task(e.to_string()))?
    }
}

impl Relay {
    /// Starts building a relay on `pool`. The relay works with any pool size;
    /// it takes up to 3 connections at once (a claim, the batch in flight,
    /// the batch being marked) and is fastest when the pool has them. LISTEN
    /// and, with lanes, the lane locks use connections of their own.
    pub fn builder(pool: PgPool) -> RelayBuilder {
        RelayBuilder {
            pool,
            config: RelayConfig::default(),
        }
    }

    /// The relay's counters.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Runs the relay on a tokio task until [`RelayHandle::shutdown`].
    pub fn spawn(self) -> RelayHandle {
        let token = CancellationToken::new();
        let stats = self.stats.clone();
        let task = tokio::spawn(self.run(token.clone()));
        RelayHandle { token, stats, task }
    }

    /// Runs the relay until `shutdown` is cancelled. Returns an error only for
    /// problems a retry cannot fix (e.g. an invalid producer configuration).
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let stats = self.stats.clone();
        let result = self.publish(shutdown).await;
        *stats.ended.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(result.as_ref().err().map(ToString::to_string));
        result
    }

    async fn publish(self, shutdown: CancellationToken) -> Result<()> {
        let mut publisher = Publisher::new(self.config.producer_config())?
            .with_cloud_events(self.config.cloud_events.clone())
            .topic_prefix(&self.config.topic_prefix);
        let Some(scope) = self.outbox(&shutdown).await else {
            return Ok(());
        };
        // The mode is the outbox's: relays of both modes on one outbox
        // would publish everything twice.
        let Some(progress_mode) = self.mode(&shutdown).await else {
            return Ok(());
        };
        if progress_mode && self.config.lanes == 0 {
            return Err(progress::batch::needs_lanes());
        }
        let shared = Arc::new(lanes::Shared::new(scope, self.config.lanes));
        let manager = lanes::LaneManager::start(
            &self.pool,
            scope,
            self.config.lanes,
            self.config.lane_timeout,
            shared.clone(),
            self.stats.problems(),
        )
        .await?;
        // The lanes go with this future: a relay task that panics or is
        // dropped (aborted, its runtime shut down) stops its lane manager,
        // which releases them, instead of leaving it holding lanes nobody
        // publishes.
        let stop = CancellationToken::new();
        let _release_lanes = stop.clone().drop_guard();
        let manager = manager.spawn(stop.clone());
        tracing::info!(
            brokers = %self.config.brokers,
            settings = ?kafka::redacted(&self.config.kafka_settings),
            batch_size = self.config.batch_size,
            lanes = self.config.lanes,
            outbox = scope.oid(),
            progress_mode,
            "relay started"
        );
        let mut waker = Waker::new(
            &self.pool,
            scope,
            self.config.listen,
            self.config.poll_interval,
        );
        waker.also_wake_on(shared.clone());
        let begin = claim::begin(
            self.config.claim_idle_timeout(),
            self.config.statement_timeout,
        );
        let mut relay = Loop {
            pool: &self.pool,
            config: &self.config,
            stats: &self.stats,
            latency: crate::metrics::relay_batch_latency(),
            blocked: Blocked::default(),
            topics: Topics::new(
                self.config.missing_topic_hold,
                self.config.missing_topic_hold_max,
            ),
            waker,
            lanes: shared,
            manager: &manager,
            begin: &begin,
            broker: Health::new(
                "broker",
                self.config.outage_backoff,
                self.config.outage_backoff_max,
            )
            .reporting(self.stats.problems.clone()),
            database: Health::new(
                "database",
                self.config.outage_backoff,
                self.config.outage_backoff_max,
            )
            .reporting(self.stats.problems.clone()),
            unrecorded: HashMap::new(),
            refused_until: None,
            release_after: None,
            topic_updates: Vec::new(),
            in_flight: None,
            marking: None,
            held: HashMap::new(),
            stated: HashMap::new(),
            released_keys: HashMap::new(),
            ended: 0,
            claim_floor: 0,
            released: None,
            claim_after: None,
            paced: None,
            batches: 0,
            producer_unusable: false,
            answered_yet_failing: 0,
            probe_answered: false,
            progress: progress_mode.then(cycle::progress::ProgressMode::default),
        };
        let metrics_stop = CancellationToken::new();
        let _stop_metrics = metrics_stop.clone().drop_guard();
        let metrics = tokio::spawn(crate::metrics::relay_task(
            self.pool.clone(),
            self.stats.clone(),
            metrics_stop.clone(),
        ));
        let result = relay.run(&mut publisher, &shutdown).await;
        relay.waker.close().await;
        publisher.flush(Duration::from_secs(10));
        // Every claim transaction has ended: the lanes can go.
        stop.cancel();
        let _ = manager.await;
        metrics_stop.cancel();
        let _ = metrics.await;
        tracing::info!(counts = ?self.stats.snapshot(), "relay stopped");
        result
    }

    /// Whether the outbox is in the progress mode. Waits (backing off, a
    /// refusal reported) while the database is down or refuses to say;
    /// `None` if shut down meanwhile.
    async fn mode(&self, shutdown: &CancellationToken) -> Option<bool> {
        let mut health = Health::new(
            "database",
            self.config.outage_backoff,
            self.config.outage_backoff_max,
        )
        .reporting(self.stats.problems.clone());
        loop {
            match progress::batch::enabled(&self.pool).await {
                Ok(on) => {
                    health.up();
                    return Some(on.unwrap_or(false));
                }
                Err(error) => {
                    let wait = health
                        .down(crate::refusal::Trouble::from(error).during(progress::batch::MODE));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.cancelled() => return None,
                    }
                }
            }
        }
    }

    /// The outbox this relay publishes: the `outbox_event` table its pool's
    /// `search_path` finds. Waits (backing off) while the database is down
    /// or the table missing; `None` if shut down meanwhile.
    async fn outbox(&self, shutdown: &CancellationToken) -> Option<OutboxScope> {
        let mut health = Health::new(
            "database",
            self.config.outage_backoff,
            self.config.outage_backoff_max,
        )
        .reporting(self.stats.problems.clone());
        loop {
            match OutboxScope::of(&self.pool).await {
                Ok(scope) => {
                    health.up();
                    return Some(scope);
                }
                Err(error) => {
                    let wait = health.down(&error);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.cancelled() => return None,
                    }
                }
            }
        }
    }
}
