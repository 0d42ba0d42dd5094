//! Handing a claimed batch to the Kafka producer and collecting the
//! deliveries: the whole batch is enqueued before any delivery is awaited;
//! within a batch a key whose event failed to enqueue sends nothing after it.
//! Also owns the producer itself, which nothing outside the relay can reach.
//!
//! A broker refuses a whole record batch for one bad record (a schema
//! validation refusal, `INVALID_RECORD`, fails every message of the batch):
//! a row that failed before is therefore sent alone, through a second
//! producer that puts one message in each batch, so that its next outcome is
//! its own. Only such an outcome can park it (see the relay's `evaluate`).

use std::collections::HashSet;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;

use super::claim::Row;
use crate::cloudevents::{CloudEvents, CloudEventsMode, header as ce};
use crate::kafka::header;

/// How a failed delivery is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// Wrong for this message only (too large, invalid): counted, parked after
    /// `max_attempts`.
    Message,
    /// Wrong for the whole topic (missing, not authorized): counted, the topic
    /// is held back for a while, never parked.
    Topic,
    /// The broker or the network (outage, timeout, full queue): the row is
    /// left untouched and the relay backs off.
    Transient,
    /// The producer itself is unusable (fatal error, fenced or unknown
    /// producer id after an outage): handled like `Transient`, and the
    /// producer is recreated.
    Fatal,
}

/// Classifies a librdkafka error.
pub(crate) fn classify(error: &KafkaError) -> FailureKind {
    use RDKafkaErrorCode as C;
    match error.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::PolicyViolation
            | C::InvalidTopic
            | C::BadMessage
            | C::InvalidArgument,
        ) => FailureKind::Message,
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::TopicAuthorizationFailed) => {
            FailureKind::Topic
        }
        Some(
            C::Fatal
            | C::ProducerFenced
            | C::InvalidProducerEpoch
            | C::InvalidProducerIdMapping
            | C::OutOfOrderSequenceNumber
            | C::UnknownProducerId,
        ) => FailureKind::Fatal,
        _ => FailureKind::Transient,
    }
}

/// A human-readable reason for a failure, stored in `last_error`.
pub(crate) fn describe(error: &KafkaError, topic: &str) -> String {
    match classify(error) {
        FailureKind::Topic => format!(
            "topic `{topic}` is missing or not writable ({error}); create it, e.g. `outbox topics create {topic}`"
        ),
        _ => error.to_string(),
    }
}

/// What happened to one row of a batch.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The broker acknowledged it.
    Delivered,
    /// It failed; the error and its kind.
    Failed(FailureKind, String),
    /// Not sent: an earlier event of its key failed in this batch, or the
    /// producer queue refused it.
    Withheld,
    /// Not sent again: delivered in an earlier batch whose marks did not
    /// commit (the relay records it with this batch's marks).
    Unrecorded,
}

/// The relay's producer (idempotent, `acks=all`), recreated after a fatal error.
pub(crate) struct Publisher {
    config: ClientConfig,
    producer: FutureProducer,
    /// A client of its own for topic lookups (see [`topics`](super::topics)),
    /// made at the first one: the producer never hears of a topic the
    /// relay has found missing.
    lookups: Option<std::sync::Arc<rdkafka::producer::BaseProducer>>,
    cloud_events: CloudEvents,
    /// One message per record batch, for rows that failed before; created
    /// on first use.
    alone: Option<FutureProducer>,
    /// Prepended to each row's topic ([`RelayConfig::topic_prefix`](super::RelayConfig::topic_prefix)).
    topic_prefix: String,
}

/// Settings the relay always applies; user overrides cannot weaken them.
const ENFORCED: &[(&str, &str)] = &[("enable.idempotence", "true"), ("acks", "all")];

impl Publisher {
    pub fn new(mut config: ClientConfig) -> crate::error::Result<Self> {
        for (key, value) in ENFORCED {
            config.set(*key, *value);
        }
        let producer = crate::kafka::create(&config)?;
        Ok(Self {
            config,
            producer,
            lookups: None,
            cloud_events: CloudEvents::default(),
            alone: None,
            topic_prefix: String::new(),
        })
    }

    /// Sends to `{prefix}{topic}` instead of each row's topic.
    pub fn topic_prefix(mut self, prefix: &str) -> Self {
        self.topic_prefix = prefix.to_owned();
        self
    }

    /// Writes CloudEvents headers as `cloud_events` says.
    pub fn with_cloud_events(mut self, cloud_events: CloudEvents) -> Self {
        self.cloud_events = cloud_events;
        self
    }

    /// The producer of rows sent alone, created on first use.
    fn alone(&mut self) -> Option<&FutureProducer> {
        if self.alone.is_none() {
            let mut config = self.config.clone();
            config.set("batch.num.messages", "1");
            config.set("linger.ms", "0");
            match crate::kafka::create(&config) {
                Ok(producer) => self.alone = Some(producer),
                Err(error) => {
                    tracing::error!(%error, "could not create the single-message producer")
                }
            }
        }
        self.alone.as_ref()
    }

    /// Recreates the producer if librdkafka raised a fatal error; returns
    /// whether it did.
    pub fn recover_if_fatal(&mut self) -> bool {
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            return self.recreate(&format!("{code}: {reason}"));
        }
        if let Some((code, reason)) = self.alone.as_ref().and_then(|p| p.client().fatal_error()) {
            tracing::error!(%code, reason, "single-message producer unusable: recreating it");
            self.alone = None;
            return true;
        }
        false
    }

    /// Replaces the producer by a new one (new producer id and epoch).
    pub fn recreate(&mut self, reason: &str) -> bool {
        tracing::error!(reason, "producer unusable: recreating it");
        match crate::kafka::create(&self.config) {
            Ok(producer) => {
                self.producer = producer;
                self.alone = None;
                true
            }
            Err(error) => {
                tracing::error!(%error, "could not recreate the producer");
                false
            }
        }
    }

    /// Checks, off the async threads, that the cluster answers a metadata
    /// request. Asks through a fresh client with the same connection
    /// settings: the answer must not depend on the state of the producer
    /// (which may be stuck, see `STUCK_ROUNDS` in the relay).
    pub async fn probe(&self, timeout: std::time::Duration) -> bool {
        let mut config = self.config.clone();
        config.set("enable.idempotence", "false");
        tokio::task::spawn_blocking(move || {
            let Ok(client) = crate::kafka::create::<rdkafka::producer::BaseProducer>(&config)
            else {
                return false;
            };
            client.client().fetch_metadata(None, timeout).is_ok()
        })
        .await
        .unwrap_or(false)
    }

    /// Asks the broker, off the async threads, whether it has each of
    /// `topics` (one metadata request each, within `timeout` in all). An
    /// error: no answer (the topics stay unknown).
    pub async fn lookup(
        &mut self,
        topics: Vec<String>,
        timeout: std::time::Duration,
    ) -> Result<Vec<(String, super::topics::Lookup)>, String> {
        let client = match &self.lookups {
            Some(client) => client.clone(),
            None => {
                let mut config = self.config.clone();
                config.set("enable.idempotence", "false");
                // As the producer's: a broker that creates topics on
                // demand creates it when asked, as it would on a send.
                let client = std::sync::Arc::new(
                    crate::kafka::create::<rdkafka::producer::BaseProducer>(&config)
                        .map_err(|e| e.to_string())?,
                );
                self.lookups = Some(client.clone());
                client
            }
        };
        let prefix = self.topic_prefix.clone();
        tokio::task::spawn_blocking(move || {
            let deadline = std::time::Instant::now() + timeout;
            let mut answers = Vec::with_capacity(topics.len());
            for topic in topics {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                // The topic the relay sends to: with a prefix, not the row's.
                let physical = format!("{prefix}{topic}");
                let metadata = client
                    .client()
                    .fetch_metadata(Some(&physical), left)
                    .map_err(|e| e.to_string())?;
                let answer = lookup_answer(&metadata, &physical);
                answers.push((topic, answer));
            }
            Ok(answers)
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Flushes what librdkafka still holds (shutdown).
    pub fn flush(&self, timeout: std::time::Duration) {
        if let Err(error) = self.producer.flush(timeout) {
            tracing::warn!(%error, "producer flush did not complete");
        }
        if let Some(Err(error)) = self.alone.as_ref().map(|p| p.flush(timeout)) {
            tracing::warn!(%error, "single-message producer flush did not complete");
        }
    }

    /// Enqueues the rows `which` (indices into `rows`, in order) without
    /// waiting; returns the pending deliveries. `outcomes` receives
    /// immediate failures and withheld rows. A row that failed before goes
    /// alone (see the module docs), and the later rows of its key wait for
    /// the next batch: two producers do not keep each other's order.
    pub fn send(
        &mut self,
        rows: &[Row],
        which: impl IntoIterator<Item = usize>,
        outcomes: &mut [Option<Outcome>],
    ) -> Vec<(usize, DeliveryFuture)> {
        let mut pending = Vec::new();
        let mut failed_keys: HashSet<&str> = HashSet::new();
        let mut queue_full = false;
        let cloud_events = self.cloud_events.clone();
        let topic_prefix = self.topic_prefix.clone();
        for i in which {
            let row = &rows[i];
            if queue_full || failed_keys.contains(row.partition_key.as_str()) {
                outcomes[i] = Some(Outcome::Withheld);
                continue;
            }
            let sent = if row.attempts > 0 {
                failed_keys.insert(row.partition_key.as_str());
                match self.alone() {
                    Some(alone) => send_with(alone, row, &cloud_events, &topic_prefix),
                    None => Err(Outcome::Withheld),
                }
            } else {
                self.send_one(row)
            };
            match sent {
                Ok(delivery) => pending.push((i, delivery)),
                Err(Outcome::Withheld) => {
                    queue_full = true;
                    outcomes[i] = Some(Outcome::Withheld);
                }
                Err(failed) => {
                    failed_keys.insert(row.partition_key.as_str());
                    outcomes[i] = Some(failed);
                }
            }
        }
        pending
    }

    /// Enqueues one row without waiting. An immediate failure is returned
    /// as its outcome: `Withheld` when the producer's queue is full.
    pub fn send_one(&self, row: &Row) -> Result<DeliveryFuture, Outcome> {
        send_with(&self.producer, row, &self.cloud_events, &self.topic_prefix)
    }
}

/// What a metadata answer says of `topic`: missing (or not writable) when
/// the broker says so for it, or names no partition of it.
pub(crate) fn lookup_answer(
    metadata: &rdkafka::metadata::Metadata,
    topic: &str,
) -> super::topics::Lookup {
    use super::topics::Lookup;
    let Some(entry) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Lookup::Missing(missing_reason(topic, "not in the broker's metadata"));
    };
    match entry.error().map(RDKafkaErrorCode::from) {
        Some(
            code @ (RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::InvalidTopic),
        ) => Lookup::Missing(missing_reason(topic, &code.to_string())),
        // Being created, or leaderless for a moment: the producer waits.
        Some(_) => Lookup::Present,
        None if entry.partitions().is_empty() => {
            Lookup::Missing(missing_reason(topic, "the broker lists no partition of it"))
        }
        None => Lookup::Present,
    }
}

/// `last_error` of the rows of a missing topic.
fn missing_reason(topic: &str, why: &str) -> String {
    format!(
        "topic `{topic}` is missing or not writable on the broker ({why}): its events are held \
         until it exists; create it, e.g. `outbox topics create {topic}`"
    )
}

/// Enqueues `row` on `producer` without waiting.
fn send_with(
    producer: &FutureProducer,
    row: &Row,
    cloud_events: &CloudEvents,
    topic_prefix: &str,
) -> Result<DeliveryFuture, Outcome> {
    let topic = if topic_prefix.is_empty() {
        std::borrow::Cow::Borrowed(row.topic.as_str())
    } else {
        std::borrow::Cow::Owned(format!("{topic_prefix}{}", row.topic))
    };
    let record = FutureRecord::to(&topic)
        .key(row.partition_key.as_bytes())
        .payload(row.payload.as_bytes())
        .headers(headers_of(row, cloud_events));
    producer
        .send_result(record)
        .map_err(|(error, _)| match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::QueueFull) => Outcome::Withheld,
            _ => Outcome::Failed(classify(&error), describe(&error, &topic)),
        })
}

/// Awaits the `pending` deliveries of `rows` into `outcomes`.
pub(crate) async fn settle(
    pending: Vec<(usize, DeliveryFuture)>,
    rows: &[Row],
    outcomes: &mut [Option<Outcome>],
) {
    for (i, delivery) in pending {
        outcomes[i] = Some(outcome(delivery.await, &rows[i].topic));
    }
}

/// The outcome of one delivery to `topic`.
pub(crate) fn outcome(
    delivery: <DeliveryFuture as std::future::Future>::Output,
    topic: &str,
) -> Outcome {
    match delivery {
        Ok(Ok(_)) => Outcome::Delivered,
        Ok(Err((error, _))) => Outcome::Failed(classify(&error), describe(&error, topic)),
        Err(_) => Outcome::Failed(FailureKind::Transient, "producer was dropped".into()),
    }
}

/// The headers the relay writes from the row's columns.
const IDENTITY: [&str; 6] = [
    header::EVENT_ID,
    header::EVENT_TYPE,
    header::EVENT_VERSION,
    header::AGGREGATE_TYPE,
    header::AGGREGATE_ID,
    header::CONTENT_TYPE,
];

/// Kafka headers of a row: the event's identity (the framework's headers,
/// CloudEvents headers, or both, as `ce` says) and the stored headers.
pub(crate) fn headers_of(row: &Row, ce: &CloudEvents) -> OwnedHeaders {
    let version = row.event_version.to_string();
    let event_id = row.event_id.to_string();
    let mut headers = OwnedHeaders::new_with_capacity(16);
    if ce.mode != CloudEventsMode::Only {
        headers = headers
            .insert(Header {
                key: header::EVENT_ID,
                value: Some(event_id.as_bytes()),
            })
            .insert(Header {
                key: header::EVENT_TYPE,
                value: Some(row.event_type.as_bytes()),
            })
            .insert(Header {
                key: header::EVENT_VERSION,
                value: Some(version.as_bytes()),
            })
            .insert(Header {
                key: header::AGGREGATE_TYPE,
                value: Some(row.aggregate_type.as_bytes()),
            })
            .insert(Header {
                key: header::AGGREGATE_ID,
                value: Some(row.aggregate_id.as_bytes()),
            });
    }
    headers = headers.insert(Header {
        key: header::CONTENT_TYPE,
        value: Some(header::JSON.as_bytes()),
    });
    if ce.mode != CloudEventsMode::Off {
        let time = row.created_at.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string();
        for (key, value) in [
            (ce::SPECVERSION, ce::SPEC_1_0),
            (ce::ID, event_id.as_str()),
            (ce::TYPE, row.event_type.as_str()),
            (ce::SOURCE, ce.source.as_str()),
            (ce::TIME, time.as_str()),
            (ce::SUBJECT, row.aggregate_id.as_str()),
            (ce::EVENT_VERSION, version.as_str()),
            (ce::AGGREGATE_TYPE, row.aggregate_type.as_str()),
        ] {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
    }
    if row.headers.len() > 2
        && let Ok(serde_json::Value::Object(map)) = serde_json::from_str(&row.headers)
    {
        for (key, value) in map {
            // The identity headers above are the only ones: a stored
            // entry of the same name (written by another tool or an
            // older version), or a `ce_` one while CloudEvents headers
            // are written, is not sent.
            if IDENTITY.iter().any(|h| h.eq_ignore_ascii_case(&key))
                || (ce.mode != CloudEventsMode::Off
                    && key.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce_")))
            {
                continue;
            }
            let text = match value {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            headers = headers.insert(Header {
                key: &key,
                value: Some(text.as_bytes()),
            });
        }
    }
    headers
}
