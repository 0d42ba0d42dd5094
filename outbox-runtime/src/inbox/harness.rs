//! Driving a consumer's real per-message path without a broker (the
//! `testing` feature; used by [`crate::testing`]): messages handed over as
//! the poller would hand them — parsed by `record.rs` (headers, identity,
//! decoding, the size limit, routing) — are applied by the dedup mode's
//! [`Applier`](super::dedup::Applier) (the `processed_event` bookkeeping,
//! the handlers in the guarded transaction, dead letters; a failing event
//! and its key set aside), or in inbox mode stored by the
//! [`Store`](super::store::Store); then, in both modes, what `inbox_event`
//! holds is processed by a [`Processor`](super::processor::Processor)
//! (retries, dead letters) until nothing claimable is left. Only the broker and the offset commits are left out; retry
//! back-offs wait on a [`TestClock`].

use std::borrow::Cow;
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::clock::TestClock;
use super::dispatch::{Registry, Route};
use super::poller::Shared;
use super::processor::{Processor, Round};
use super::record::{self, Body, Check, Raw, Record};
use super::txn::GuardedConn;
use super::{Consumer, ConsumerConfig, ConsumerCounts, ConsumerStats, Mode, dedup, store};
use crate::backoff::Health;

/// A message as the broker would deliver it.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    pub payload: Option<Vec<u8>>,
}

/// Most processor rounds one delivery runs in inbox mode before it gives up
/// (each round settles at least one row, or waits out a retry).
const MAX_INBOX_ROUNDS: usize = 100_000;

/// One consumer, driven by hand.
pub(crate) struct Driver {
    pool: PgPool,
    config: Arc<ConsumerConfig>,
    registry: Arc<Registry>,
    stats: Arc<ConsumerStats>,
    shared: Shared,
    clock: TestClock,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("group", &self.config.group)
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

/// Where a message of (topic, event type) goes in one consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Routed {
    Handled,
    Ignored,
    Unknown,
}

impl Driver {
    pub fn new(consumer: Consumer, clock: TestClock) -> Self {
        let Consumer {
            pool,
            config,
            registry,
            stats,
        } = consumer;
        // The kit applies each delivery to the end: a failing event is set
        // aside in `inbox_event` (its retries then wait on the test clock),
        // never held in a memory that ends with the delivery.
        let config = if config.memory_retries.is_some() {
            let mut config = (*config).clone();
            config.memory_retries = None;
            Arc::new(config)
        } else {
            config
        };
        Self {
            pool,
            config,
            registry,
            stats,
            shared: Shared::new(false),
            clock,
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    pub fn counts(&self) -> ConsumerCounts {
        self.stats.snapshot()
    }

    /// True when the consumer subscribes to `topic`.
    pub fn subscribes(&self, topic: &str) -> bool {
        self.registry.topics().iter().any(|t| t == topic)
    }

    pub fn route(&self, topic: &str, event_type: &str) -> Routed {
        match self.registry.route(topic, event_type) {
            Route::Handlers(_) => Routed::Handled,
            Route::Ignored => Routed::Ignored,
            Route::Unknown => Routed::Unknown,
        }
    }

    /// Parses `messages` as the polling thread does.
    fn records(&self, messages: &[&Message]) -> Vec<Record> {
        let check = match self.config.mode {
            Mode::Dedup => Check::Decode,
            Mode::Inbox => Check::Json,
        };
        self.parse(messages, check)
    }

    /// The saga instances each of `messages` moves in this consumer
    /// (`(saga type, saga id)`, one per saga handler of its type).
    pub fn saga_instances(&self, messages: &[&Message]) -> Vec<Vec<(&'static str, String)>> {
        self.parse(messages, Check::Decode)
            .iter()
            .map(|r| {
                let Body::Event(e) = &r.body else {
                    return Vec::new();
                };
                e.handlers
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &h)| {
                        let value = e.decoded.get(i)?.as_ref()?;
                        self.registry.handler(h).saga_instance(value)
                    })
                    .collect()
            })
            .collect()
    }

    fn parse(&self, messages: &[&Message], check: Check) -> Vec<Record> {
        messages
            .iter()
            .map(|m| {
                let raw = Raw {
                    topic: &m.topic,
                    partition: m.partition,
                    offset: m.offset,
                    key: m.key.as_deref(),
                    payload: m.payload.as_deref(),
                    headers: m
                        .headers
                        .iter()
                        .map(|(k, v)| (Cow::Borrowed(k.as_str()), v.as_deref()))
                        .collect(),
                    bad_names: 0,
                };
                Record {
                    topic: m.topic.clone(),
                    partition: m.partition,
                    offset: m.offset,
                    generation: 0,
                    body: record::parse(&raw, &self.registry, self.config.max_payload_bytes, check),
                }
            })
            .collect()
    }

    fn health(&self) -> Health {
        Health::new(
            "database",
            self.config.outage_backoff,
            self.config.outage_backoff_max,
        )
        .reporting(self.stats.problems.clone())
    }

    /// Applies one batch, as the consumer applies a batch it polled; in
    /// inbox mode also processes the stored rows until none is left
    /// (retries wait on the test clock). Returns an error only when inbox
    /// processing does not settle.
    pub async fn deliver(&self, messages: &[&Message]) -> Result<(), String> {
        let batch = self.records(messages);
        let shutdown = CancellationToken::new();
        match self.config.mode {
            Mode::Dedup => {
                let mut applier = dedup::Applier {
                    pool: &self.pool,
                    config: &self.config,
                    registry: &self.registry,
                    stats: &self.stats,
                    shared: &self.shared,
                    db: self.health(),
                    latency: crate::metrics::ConsumerLatency::new(&self.config.group),
                    conn: GuardedConn::new(self.pool.clone(), self.config.handler_timeout),
                    wake: None,
                    held: Box::default(),
                };
                applier.process(batch, &shutdown).await;
                applier.conn.release().await;
                // What a failing handler set aside: retried by the
                // processor, as the consumer's own does.
                self.process_inbox().await
            }
            Mode::Inbox => {
                let wake = Notify::new();
                let mut store = store::Store {
                    pool: &self.pool,
                    config: &self.config,
                    stats: &self.stats,
                    shared: &self.shared,
                    wake: &wake,
                    db: self.health(),
                    progress: super::progress_mode(&self.pool, &self.config.group).await,
                };
                store.process(batch, &shutdown).await;
                self.process_inbox().await
            }
        }
    }

    /// Inbox mode: runs processor rounds until nothing is claimable, moving
    /// the test clock (and the waiting rows' `next_attempt_at`) past each
    /// retry's back-off.
    async fn process_inbox(&self) -> Result<(), String> {
        let mut config = (*self.config).clone();
        config.processors = 1;
        let processor = Processor::new(
            self.pool.clone(),
            Arc::new(config),
            self.registry.clone(),
            self.stats.clone(),
            Arc::new(Notify::new()),
            0,
        );
        let mut conn = GuardedConn::new(self.pool.clone(), self.config.handler_timeout);
        let mut careful = false;
        let mut result = Err(format!(
            "inbox processing of `{}` did not settle after {MAX_INBOX_ROUNDS} rounds",
            self.config.group
        ));
        for _ in 0..MAX_INBOX_ROUNDS {
            match processor
                .round(&mut conn, std::mem::take(&mut careful))
                .await
            {
                Ok(Round::Settled(n)) if n > 0 => continue,
                Ok(Round::Settled(_)) => {}
                Ok(Round::Suspect) => {
                    careful = true;
                    continue;
                }
                Err(error) => {
                    result = Err(error.to_string());
                    break;
                }
            }
            match self.skip_retry_wait().await {
                Ok(true) => continue,
                Ok(false) => {
                    result = Ok(());
                    break;
                }
                Err(error) => {
                    result = Err(error.to_string());
                    break;
                }
            }
        }
        conn.release().await;
        result
    }

    /// Moves the clock to the earliest pending retry of this consumer's
    /// inbox rows (recording that retry's back-off, as computed from its
    /// attempts), and the waiting rows' `next_attempt_at` back by what was
    /// left of it; false when none waits.
    ///
    /// A retry that came due (in real time) between the last round and
    /// this look is not skipped but is still waiting: true without moving
    /// the clock, and the next round takes it. (Asking only for rows still
    /// in the future would miss it, and delivery would end with the row
    /// neither handled nor dead-lettered.)
    async fn skip_retry_wait(&self) -> Result<bool, sqlx::Error> {
        let next: Option<(i32, f64)> = sqlx::query_as(
            "SELECT attempts, extract(epoch FROM next_attempt_at - now())::float8
             FROM inbox_event
             WHERE consumer = $1 AND NOT processed AND dead_lettered_at IS NULL
               AND next_attempt_at IS NOT NULL
             ORDER BY next_attempt_at LIMIT 1",
        )
        .bind(&self.config.group)
        .fetch_optional(&self.pool)
        .await?;
        let Some((attempts, left)) = next else {
            return Ok(false);
        };
        if left <= 0.0 {
            return Ok(true);
        }
        sqlx::query(
            "UPDATE inbox_event SET next_attempt_at = next_attempt_at - make_interval(secs => $2)
             WHERE consumer = $1 AND NOT processed AND dead_lettered_at IS NULL
               AND next_attempt_at IS NOT NULL",
        )
        .bind(&self.config.group)
        .bind(left.max(0.0))
        .execute(&self.pool)
        .await?;
        self.clock.advance(super::backoff::delay(
            self.config.retry_backoff,
            self.config.retry_backoff_max,
            u32::try_from(attempts).unwrap_or(u32::MAX),
        ));
        Ok(true)
    }
}
