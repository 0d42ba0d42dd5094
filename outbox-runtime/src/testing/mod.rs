//! A testing kit for applications (the `testing` feature): deliver what the
//! outbox holds to your inbox handlers, through the consumer's real path,
//! without a broker — then assert on what happened.
//!
//! A [`TestBus`] is built from the same [`ConsumerBuilder`]s the service
//! runs (group, handlers, mode, attempts, back-off). [`TestBus::deliver`]
//! reads the unpublished rows of every registered database's outbox in id
//! order, as the relay does, marks them published (a relay started later
//! does not send them again), turns each into the message the relay would
//! send (key, headers, payload), and hands them in batches to every
//! consumer subscribed to their topic, through the consumer's own parsing,
//! decoding, dedup or inbox bookkeeping, guarded transactions, retries and
//! dead letters. Follow-up events recorded by the handlers are delivered in
//! the next round, until no outbox holds anything new. What happened comes
//! back as a [`Delivery`]: every event recorded and every delivery with its
//! [`Outcome`], with typed access and assertions.
//!
//! ```no_run
//! # use outbox_runtime::{Consumer, testing::TestBus};
//! # async fn f(pool: sqlx::PgPool, handler: impl outbox_core::InboxHandler) {
//! let mut bus = TestBus::new().service(Consumer::builder(pool).group("billing").handler(handler));
//! // ... run a command that records an event ...
//! let delivery = bus.deliver().await.unwrap();
//! delivery.assert_no_dead_letters();
//! # }
//! ```
//!
//! Retry back-offs wait on the bus's [`TestClock`], which moves forward at
//! once: a handler that fails until it is dead-lettered costs milliseconds.
//! Scheduled events (`UnitOfWork::record_at`) wait for that clock too: the
//! bus's time is the database's plus [`TestClock::elapsed`].
//! [`TestBus::deliver`] delivers what is due, then jumps the clock to the
//! next scheduled event and delivers it, until none is left (a cancelled
//! one is never delivered); [`TestBus::deliver_due`] does not jump, so a
//! test can see what happens before a timeout, then move the clock
//! ([`TestClock::advance`]) past it. The clock moves the bus's time only,
//! not the database's: an event scheduled once the clock has moved is due
//! that much sooner on the bus (a new scenario: a new bus).
//! [`TestBus::send`] adds a message of another producer ([`RawMessage`]: a
//! CloudEvent of another system, a malformed message) to the next delivery.
//! [`Faults`] make the bus misbehave as a broker and a crashing consumer
//! can (every event delivered twice, a batch delivered again after its
//! transaction committed, keys interleaved); [`FailTimes`] makes a handler
//! fail its first calls. [`TestTopics`] creates a test's own topics on a
//! real broker and points relays and consumers at them (a topic prefix),
//! for the same typed tests run end to end. [`TestDb`] gives each test a
//! migrated database in milliseconds, cloned from a template.
//!
//! Sagas run through the bus like any handler, their timeouts as
//! scheduled events: [`TestBus::saga`] reads an instance back typed
//! ([`SagaInstance`], with assertions on its stage, completion and pending
//! timeouts), and [`Delivery::saga_history`] tells what each message of a
//! delivery did to it ([`SagaHistory`]: started, applied, ignored in
//! another stage, duplicate, dead-lettered…).
//!
//! Files: `report.rs` (the [`Delivery`] and its assertions), `saga.rs`,
//! `raw.rs`, `faults.rs`, `topics.rs`, `db.rs`.

mod db;
mod faults;
mod raw;
mod report;
mod saga;
mod topics;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;

use rdkafka::message::Headers as _;
use sqlx::PgPool;
use uuid::Uuid;

pub use self::db::{TestDb, TestDbBuilder, TestDbError};
pub use self::faults::{FailTimes, Faults};
pub use self::raw::RawMessage;
pub use self::report::{Delivered, Delivery, Outcome, Published, TypeCounts};
pub use self::saga::{SagaEffect, SagaEntry, SagaHistory, SagaInstance, SagaOutcome};
pub use self::topics::{FIRST_OFFSET, TestTopics};
pub use crate::inbox::TestClock;
use crate::inbox::harness::{Driver, Message, Routed};
use crate::inbox::{ConsumerBuilder, DeadLetterReason, Mode};
use crate::relay::claim::Row;

/// What can go wrong in [`TestBus::deliver`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database statement of the bus failed.
    #[error("test bus: database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Events kept causing events: the outboxes were still not empty after
    /// the bus's round limit ([`TestBus::max_rounds`]).
    #[error(
        "test bus: the outboxes still hold new events after {rounds} rounds of delivery (an \
         endless cascade of follow-up events?); what was delivered:\n{delivery}"
    )]
    Endless {
        /// Rounds run.
        rounds: usize,
        /// What happened until then.
        delivery: Box<Delivery>,
    },
    /// Inbox mode: the stored events could not all be processed.
    #[error("test bus: {0}")]
    Inbox(String),
}

/// The default limit of delivery rounds ([`TestBus::max_rounds`]).
pub const DEFAULT_MAX_ROUNDS: usize = 100;

/// An outbox the bus reads: one database (and `search_path`).
struct Outbox {
    name: String,
    pool: PgPool,
    identity: String,
}

/// An in-process stand-in for the relay and the broker. See the module
/// docs.
///
/// ```no_run
/// # use outbox_runtime::{Consumer, Mode, testing::{Faults, TestBus}};
/// # async fn f(orders: sqlx::PgPool, billing: sqlx::PgPool,
/// #     mark_paid: impl outbox_core::InboxHandler, charge: impl outbox_core::InboxHandler) {
/// // Two services, two databases: orders → billing → orders.
/// let mut bus = TestBus::new()
///     .service(Consumer::builder(orders).group("orders").handler(mark_paid).mode(Mode::Inbox))
///     .service(Consumer::builder(billing).group("billing").handler(charge))
///     .faults(Faults::new().deliver_twice());
/// let delivery = bus.deliver().await.unwrap();
/// assert_eq!(delivery.duplicates(), delivery.handled().count());
/// # }
/// ```
pub struct TestBus {
    outboxes: Vec<Outbox>,
    consumers: Vec<Driver>,
    /// Next offset per topic (one partition per topic).
    offsets: BTreeMap<String, i64>,
    faults: Faults,
    clock: TestClock,
    max_rounds: usize,
    cloud_events: crate::cloudevents::CloudEvents,
    /// Messages of other producers for the next delivery ([`Self::send`]).
    sent: Vec<RawMessage>,
}

impl std::fmt::Debug for TestBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestBus")
            .field(
                "outboxes",
                &self.outboxes.iter().map(|o| &o.name).collect::<Vec<_>>(),
            )
            .field("consumers", &self.consumers)
            .field("faults", &self.faults)
            .field("max_rounds", &self.max_rounds)
            .finish_non_exhaustive()
    }
}

impl Default for TestBus {
    fn default() -> Self {
        Self::new()
    }
}

/// Which outbox a pool reaches: host, port, database and session options
/// (a `search_path` names the schema of another outbox).
fn identity(pool: &PgPool) -> (String, String) {
    let o = pool.connect_options();
    let database = o.get_database().unwrap_or_default().to_owned();
    let options = o.get_options().unwrap_or_default().to_owned();
    let name = if options.is_empty() {
        database.clone()
    } else {
        format!("{database} ({options})")
    };
    (
        format!("{}:{}/{database}?{options}", o.get_host(), o.get_port()),
        name,
    )
}

impl TestBus {
    /// An empty bus: add services with [`service`](Self::service).
    pub fn new() -> Self {
        Self {
            outboxes: Vec::new(),
            consumers: Vec::new(),
            offsets: BTreeMap::new(),
            faults: Faults::default(),
            clock: TestClock::default(),
            max_rounds: DEFAULT_MAX_ROUNDS,
            cloud_events: Default::default(),
            sent: Vec::new(),
        }
    }

    /// Adds a consumer, configured as the service configures it (its
    /// brokers and Kafka settings are not used). Its pool's outbox is read
    /// too, once however many consumers share the database.
    ///
    /// # Panics
    ///
    /// If the consumer's configuration is invalid (the message says why,
    /// as [`ConsumerBuilder::build`] would).
    #[track_caller]
    pub fn service(mut self, consumer: ConsumerBuilder) -> Self {
        let consumer = match consumer.build() {
            Ok(c) => c,
            Err(e) => panic!("TestBus::service: {e}"),
        };
        let driver = Driver::new(consumer, self.clock.clone());
        self.add_outbox(driver.pool().clone());
        self.consumers.push(driver);
        self
    }

    /// Reads the outbox of `pool` too: a service that only publishes.
    pub fn outbox(mut self, pool: PgPool) -> Self {
        self.add_outbox(pool);
        self
    }

    fn add_outbox(&mut self, pool: PgPool) {
        let (identity, name) = identity(&pool);
        if !self.outboxes.iter().any(|o| o.identity == identity) {
            self.outboxes.push(Outbox {
                name,
                pool,
                identity,
            });
        }
    }

    /// Makes the bus misbehave ([`Faults`]).
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// Most rounds one [`deliver`](Self::deliver) runs (default
    /// [`DEFAULT_MAX_ROUNDS`]): a round delivers what the outboxes hold,
    /// the next one the follow-up events, and so on.
    pub fn max_rounds(mut self, rounds: usize) -> Self {
        self.max_rounds = rounds.max(1);
        self
    }

    /// Writes the headers a relay with this CloudEvents setting writes
    /// (default: off, the framework's headers only).
    pub fn cloud_events(mut self, cloud_events: crate::cloudevents::CloudEvents) -> Self {
        self.cloud_events = cloud_events;
        self
    }

    /// Adds a message of another producer to the next
    /// [`deliver`](Self::deliver): delivered first, in the order sent, to
    /// the consumers subscribed to its topic (its outcome in
    /// [`Delivery::delivered`]; it is not in [`Delivery::published`]).
    pub fn send(&mut self, message: RawMessage) -> &mut Self {
        self.sent.push(message);
        self
    }

    /// The clock the consumers' retries wait on.
    pub fn clock(&self) -> &TestClock {
        &self.clock
    }

    /// Reads instance `saga_id` of saga `S` from the bus's databases (its
    /// services' and [`outbox`](Self::outbox)es' pools, the first that
    /// holds it); `None` if none does. [`SagaInstance::load`] reads one
    /// pool's.
    ///
    /// # Errors
    ///
    /// [`Error::Database`]: a statement failed, or the stored state does
    /// not decode as `S`.
    pub async fn saga<S: outbox_core::Saga>(
        &self,
        saga_id: impl std::fmt::Display,
    ) -> Result<Option<SagaInstance<S>>, Error> {
        let saga_id = saga_id.to_string();
        for outbox in &self.outboxes {
            if let Some(instance) = SagaInstance::load(&outbox.pool, &saga_id).await? {
                return Ok(Some(instance));
            }
        }
        Ok(None)
    }

    /// Delivers what the outboxes hold, then the follow-up events, until no
    /// outbox holds a new event. See the module docs. Scheduled events are
    /// delivered in the order of their times: once nothing else is left,
    /// the bus's [`clock`](Self::clock) jumps to the next one's time.
    ///
    /// # Errors
    ///
    /// [`Error::Endless`] after [`max_rounds`](Self::max_rounds) rounds,
    /// [`Error::Database`] when a statement of the bus fails.
    pub async fn deliver(&mut self) -> Result<Delivery, Error> {
        self.deliver_with(true).await
    }

    /// [`deliver`](Self::deliver), but scheduled events only once the bus's
    /// time (the database's plus the [`clock`](Self::clock)'s elapsed
    /// time) has reached theirs: the clock does not jump to them.
    ///
    /// ```no_run
    /// # use outbox_runtime::testing::TestBus;
    /// # async fn f(mut bus: TestBus) {
    /// // A command recorded a timeout due in 15 minutes.
    /// let before = bus.deliver_due().await.unwrap();
    /// assert_eq!(before.published.len(), 0);
    /// bus.clock().advance(std::time::Duration::from_secs(15 * 60));
    /// let after = bus.deliver_due().await.unwrap();
    /// assert_eq!(after.published.len(), 1);
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`deliver`](Self::deliver).
    pub async fn deliver_due(&mut self) -> Result<Delivery, Error> {
        self.deliver_with(false).await
    }

    async fn deliver_with(&mut self, jump: bool) -> Result<Delivery, Error> {
        let mut delivery = Delivery::default();
        let waits = self.clock.waits().len();
        let failures: u64 = self
            .consumers
            .iter()
            .map(|c| c.counts().handler_failures)
            .sum();
        let mut rounds = 0;
        loop {
            let mut messages = self.take_sent();
            for i in 0..self.outboxes.len() {
                messages.extend(self.take(i, &mut delivery).await?);
            }
            if messages.is_empty() {
                match self.next_due(jump).await? {
                    Some(wait) => {
                        self.clock.jump(wait);
                        continue;
                    }
                    None => break,
                }
            }
            rounds += 1;
            if rounds > self.max_rounds {
                delivery.rounds = rounds - 1;
                return Err(Error::Endless {
                    rounds: rounds - 1,
                    delivery: Box::new(delivery),
                });
            }
            for consumer in &self.consumers {
                // A consumer with a topic prefix reads the topics as the
                // relay with that prefix names them.
                let prefix = consumer.config().topic_prefix.as_str();
                let renamed: Vec<Message> = if prefix.is_empty() {
                    Vec::new()
                } else {
                    messages
                        .iter()
                        .map(|m| Message {
                            topic: Arc::from(format!("{prefix}{}", m.topic)),
                            ..m.clone()
                        })
                        .collect()
                };
                let all = if prefix.is_empty() {
                    &messages
                } else {
                    &renamed
                };
                let mine: Vec<&Message> = all
                    .iter()
                    .filter(|m| consumer.subscribes(&m.topic))
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                let mine = self.faults.arrange(mine);
                for chunk in mine.chunks(consumer.config().batch_size) {
                    deliver_chunk(consumer, chunk, &mut delivery).await?;
                    if self.faults.redeliver {
                        // The crash between the database commit and the
                        // offset commit: the same batch comes again.
                        deliver_chunk(consumer, chunk, &mut delivery).await?;
                    }
                }
            }
        }
        delivery.rounds = rounds;
        delivery.retry_waits = self.clock.waits().split_off(waits);
        delivery.handler_failures = self
            .consumers
            .iter()
            .map(|c| c.counts().handler_failures)
            .sum::<u64>()
            - failures;
        Ok(delivery)
    }

    /// The messages sent since the last delivery, with their offsets.
    fn take_sent(&mut self) -> Vec<Message> {
        std::mem::take(&mut self.sent)
            .into_iter()
            .map(|m| {
                let offset = self.offsets.entry(m.topic.clone()).or_insert(0);
                *offset += 1;
                Message {
                    topic: Arc::from(m.topic.as_str()),
                    partition: 0,
                    offset: *offset - 1,
                    key: m.key,
                    headers: m.headers,
                    payload: m.payload,
                }
            })
            .collect()
    }

    /// With `jump`: how far the clock must move for the next scheduled
    /// event of any outbox to be due (none: `None`).
    async fn next_due(&self, jump: bool) -> Result<Option<std::time::Duration>, Error> {
        if !jump {
            return Ok(None);
        }
        let mut next: Option<f64> = None;
        for outbox in &self.outboxes {
            let secs: Option<f64> = sqlx::query_scalar(
                "SELECT EXTRACT(EPOCH FROM min(due_at) - statement_timestamp())::float8
                 FROM outbox_event
                 WHERE due_at IS NOT NULL AND published_at IS NULL AND parked_at IS NULL",
            )
            .fetch_one(&outbox.pool)
            .await?;
            next = match (next, secs) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        // One due already was not taken (a relay holds it): no jump, or
        // the bus would spin.
        let wait = next.map(|secs| secs - self.clock.elapsed().as_secs_f64());
        Ok(wait.filter(|w| *w > 0.0).map(|w| {
            // A little past it: the next statement's time is compared.
            std::time::Duration::from_secs_f64(w + 0.001)
        }))
    }

    /// Takes the unpublished rows of outbox `i` in id order, scheduled ones
    /// only once the bus's time has reached theirs, marks them published,
    /// and returns them as messages (twice each with
    /// [`Faults::deliver_twice`], as a relay that resent them would).
    async fn take(&mut self, i: usize, delivery: &mut Delivery) -> Result<Vec<Message>, Error> {
        let outbox = &self.outboxes[i];
        let mut tx = outbox.pool.begin().await?;
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version,
                    created_at, topic, partition_key, payload::text AS payload, headers::text AS headers, attempts,
                    NULL::float8 AS behind_held_secs, ctid::text AS tid
             FROM outbox_event WHERE published_at IS NULL AND parked_at IS NULL
               AND (due_at IS NULL
                    OR due_at <= statement_timestamp() + make_interval(secs => $1))
             ORDER BY id FOR UPDATE SKIP LOCKED",
        )
        .bind(self.clock.elapsed().as_secs_f64())
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        sqlx::query(
            "UPDATE outbox_event SET published_at = statement_timestamp() WHERE id = ANY($1)",
        )
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        let copies = if self.faults.twice { 2 } else { 1 };
        let mut messages = Vec::with_capacity(rows.len() * copies);
        for row in rows {
            let headers: Vec<(String, Option<Vec<u8>>)> =
                crate::relay::publish::headers_of(&row, &self.cloud_events)
                    .iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect();
            for _ in 0..copies {
                let offset = self.offsets.entry(row.topic.clone()).or_insert(0);
                messages.push(Message {
                    topic: Arc::from(row.topic.as_str()),
                    partition: 0,
                    offset: *offset,
                    key: Some(row.partition_key.clone().into_bytes()),
                    headers: headers.clone(),
                    payload: Some(row.payload.clone().into_bytes()),
                });
                *offset += 1;
            }
            let message_headers = headers
                .iter()
                .map(|(k, v)| {
                    let v = v.as_deref().unwrap_or_default();
                    (k.clone(), String::from_utf8_lossy(v).into_owned())
                })
                .collect();
            delivery
                .published
                .push(Published::of(&self.outboxes[i].name, row, message_headers));
        }
        Ok(messages)
    }
}

/// A dead letter written during one batch.
#[derive(sqlx::FromRow)]
struct NewLetter {
    topic: String,
    partition: i32,
    offset: i64,
    reason: String,
    error: String,
    attempts: i32,
}

fn header<'m>(m: &'m Message, name: &str) -> Option<&'m str> {
    m.headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.as_deref())
        .and_then(|v| std::str::from_utf8(v).ok())
}

/// The event id the consumer uses: the `event_id` header, or that of a
/// message with CloudEvents headers only.
fn event_id(m: &Message) -> Option<Uuid> {
    use crate::cloudevents::header as ce;
    match header(m, crate::kafka::header::EVENT_ID) {
        Some(id) => id.parse().ok(),
        None => Some(crate::cloudevents::message_event_id(
            header(m, ce::SOURCE)?,
            header(m, ce::ID)?,
            header(m, ce::AGGREGATE_TYPE).is_some(),
        )),
    }
}

/// Whether the consumer reads the message's CloudEvents headers (no
/// `event_id` header, a `ce_id`), as `record.rs` decides.
fn cloud(m: &Message) -> bool {
    header(m, crate::kafka::header::EVENT_ID).is_none()
        && header(m, crate::cloudevents::header::ID).is_some()
}

/// The event's version as the consumer reads it (`event_version`, or
/// `ce_eventversion`): 1 if absent or not a number.
fn event_version(m: &Message) -> u32 {
    let name = match cloud(m) {
        true => crate::cloudevents::header::EVENT_VERSION,
        false => crate::kafka::header::EVENT_VERSION,
    };
    header(m, name).and_then(|v| v.parse().ok()).unwrap_or(1)
}

fn event_type(m: &Message) -> String {
    let name = match cloud(m) {
        true => crate::cloudevents::header::TYPE,
        false => crate::kafka::header::EVENT_TYPE,
    };
    header(m, name).unwrap_or_default().to_owned()
}

/// Delivers one batch to `consumer` and records each message's outcome, as
/// the database shows it: a new dead letter at its coordinates, an ignored
/// type, an event applied (or stored) before, or applied now.
async fn deliver_chunk(
    consumer: &Driver,
    chunk: &[&Message],
    delivery: &mut Delivery,
) -> Result<(), Error> {
    let pool = consumer.pool();
    let group = &consumer.config().group;
    let ids: Vec<Uuid> = chunk.iter().filter_map(|m| event_id(m)).collect();
    let seen_sql = match consumer.config().mode {
        Mode::Inbox => {
            "SELECT event_id FROM inbox_event WHERE consumer = $1 AND event_id = ANY($2)"
        }
        _ => "SELECT event_id FROM processed_event WHERE consumer = $1 AND event_id = ANY($2)",
    };
    let seen: HashSet<Uuid> = sqlx::query_scalar(seen_sql)
        .bind(group)
        .bind(&ids)
        .fetch_all(pool)
        .await?
        .into_iter()
        .collect();
    let last_letter: i64 =
        sqlx::query_scalar("SELECT COALESCE(max(id), 0) FROM dead_letter WHERE consumer = $1")
            .bind(group)
            .fetch_one(pool)
            .await?;
    let (delivered, steps) = outbox_core::saga::observe_steps(consumer.deliver(chunk)).await;
    delivered.map_err(Error::Inbox)?;
    let sagas = consumer.saga_instances(chunk);
    let applied: HashSet<Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM processed_event WHERE consumer = $1 AND event_id = ANY($2)",
    )
    .bind(group)
    .bind(&ids)
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let mut letters: VecDeque<NewLetter> = sqlx::query_as(
        r#"SELECT topic, "partition" AS partition, "offset" AS offset, reason, error, attempts
           FROM dead_letter WHERE consumer = $1 AND id > $2
           ORDER BY id"#,
    )
    .bind(group)
    .bind(last_letter)
    .fetch_all(pool)
    .await?
    .into();
    let mut earlier: HashSet<Uuid> = HashSet::new();
    let mut credited: HashSet<Uuid> = HashSet::new();
    for (m, instances) in chunk.iter().zip(sagas) {
        let id = event_id(m);
        let event_type = event_type(m);
        let letter = letters
            .iter()
            .position(|l| {
                *l.topic == *m.topic && l.partition == m.partition && l.offset == m.offset
            })
            .and_then(|at| letters.remove(at));
        let outcome = if let Some(l) = letter {
            Outcome::DeadLettered {
                reason: l.reason.parse().unwrap_or(DeadLetterReason::HandlerFailed),
                error: l.error,
                attempts: l.attempts,
            }
        } else if consumer.route(&m.topic, &event_type) == Routed::Ignored {
            Outcome::Ignored
        } else if id.is_some_and(|id| seen.contains(&id) || earlier.contains(&id)) {
            Outcome::Duplicate
        } else if let Some(id) = id.filter(|id| applied.contains(id) && !credited.contains(id)) {
            credited.insert(id);
            Outcome::Handled
        } else {
            Outcome::Pending
        };
        if let Some(id) = id {
            earlier.insert(id);
        }
        let sagas = instances
            .into_iter()
            .map(|(saga_type, saga_id)| {
                // The last attempt's: earlier ones rolled back.
                let step = steps
                    .iter()
                    .rev()
                    .find(|s| {
                        Some(s.event_id) == id && s.saga_type == saga_type && s.saga_id == saga_id
                    })
                    .map(|s| s.outcome);
                SagaEffect {
                    saga_type: saga_type.to_owned(),
                    saga_id,
                    outcome: SagaOutcome::of(&outcome, step),
                }
            })
            .collect();
        delivery.delivered.push(Delivered {
            group: group.clone(),
            event_id: id,
            // The event's topic, as recorded (without a consumer's prefix).
            topic: m
                .topic
                .strip_prefix(consumer.config().topic_prefix.as_str())
                .unwrap_or(&m.topic)
                .to_owned(),
            key: m
                .key
                .as_deref()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .unwrap_or_default(),
            event_type,
            event_version: event_version(m),
            offset: m.offset,
            payload: m.payload.clone().unwrap_or_default(),
            outcome,
            sagas,
        });
    }
    Ok(())
}
