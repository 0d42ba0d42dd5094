//! Topics of one test on a real broker ([`TestTopics`]), deleted when the
//! test is done: tests that run end to end through Kafka on a broker other
//! tests use at the same time. A test's topics share a unique prefix
//! (`test-<id>.`); a relay and consumers given that prefix send and read
//! an event type's topic there, so typed handlers run unchanged.

use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use crate::error::{Error, Result};
use crate::inbox::ConsumerBuilder;
use crate::kafka;
use crate::relay::RelayBuilder;

/// The offset of a test topic's first record: offset 0 holds the warm-up
/// record (see [`TestTopics::create`]).
pub const FIRST_OFFSET: i64 = 1;

/// Topics created for one test, each named `test-<id>.{name}`; deleted by
/// [`cleanup`](Self::cleanup), or when dropped.
///
/// Name them after the event types' topics and wire the relay and the
/// consumers with [`relay`](Self::relay) and [`consumer`](Self::consumer):
/// they then send and read this test's topics, and the same typed handlers
/// run end to end through the broker, beside other tests doing the same.
///
/// ```no_run
/// # use outbox_runtime::{Consumer, Relay};
/// # async fn f(pool: sqlx::PgPool, handler: impl outbox_core::InboxHandler) -> outbox_runtime::Result<()> {
/// use outbox_runtime::testing::TestTopics;
/// let topics = TestTopics::create(&TestTopics::brokers(), &["orders"]).await?;
/// let relay = topics.relay(Relay::builder(pool.clone())).spawn()?;
/// let consumer = topics
///     .consumer(Consumer::builder(pool).group("billing").handler(handler))
///     .await?
///     .spawn()?;
/// // ... record events, wait for their effects ...
/// # let _ = (relay, consumer);
/// topics.cleanup().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TestTopics {
    brokers: String,
    prefix: String,
    topics: Vec<(String, String)>,
    deleted: bool,
}

impl TestTopics {
    /// The test broker: `KAFKA_BROKERS`, else `127.0.0.1:9092`.
    pub fn brokers() -> String {
        std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| kafka::DEFAULT_BROKERS.to_owned())
    }

    /// Creates one topic (one partition) per name in `names` (the event
    /// types' topics), each `test-<id>.{name}`, on `brokers`, and returns
    /// once each partition is readable: a warm-up record is written to it
    /// and read back first (the test's records start at [`FIRST_OFFSET`]).
    ///
    /// # Errors
    ///
    /// When the broker does not create them, or they do not become
    /// readable within 30 s.
    pub async fn create(brokers: &str, names: &[&str]) -> Result<Self> {
        let prefix = format!("test-{}.", uuid::Uuid::now_v7().simple());
        let topics: Vec<(String, String)> = names
            .iter()
            .map(|n| ((*n).to_owned(), format!("{prefix}{n}")))
            .collect();
        let created = Self {
            brokers: brokers.to_owned(),
            prefix,
            topics,
            deleted: false,
        };
        kafka::create_topics(brokers, &[], &created.unique(), 1, 1).await?;
        // A freshly created topic's first produce batch has been seen lost
        // on the test broker (tansu 0.6, in-memory storage): offsets
        // assigned and acknowledged but unreadable, when two producers
        // wrote to a new partition at once. So each partition gets one
        // record first, from one producer, and the topics are handed over
        // only once it reads back; then the record is deleted (the log
        // starts after it), so that consumers reading from the beginning
        // see only the test's messages — where the broker supports that
        // (tansu 0.6 does not); consumers wired with `consumer()` start
        // after it in any case.
        warm_up(brokers, &created.unique()).await?;
        Ok(created)
    }

    /// The topic created for `name`.
    ///
    /// # Panics
    ///
    /// If `name` was not given to [`create`](Self::create).
    #[track_caller]
    pub fn name(&self, name: &str) -> &str {
        match self.topics.iter().find(|(n, _)| n == name) {
            Some((_, topic)) => topic,
            None => panic!(
                "TestTopics: no topic `{name}` (created: {:?})",
                self.topics.iter().map(|(n, _)| n).collect::<Vec<_>>()
            ),
        }
    }

    /// The prefix of this test's topics (`test-<id>.`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `relay` sending to this test's topics, on the test broker.
    pub fn relay(&self, relay: RelayBuilder) -> RelayBuilder {
        relay.brokers(&self.brokers).topic_prefix(&self.prefix)
    }

    /// `consumer` reading this test's topics, on the test broker, from
    /// the first record after the warm-up: its group's offsets are
    /// committed past it (set the group first).
    ///
    /// # Errors
    ///
    /// When the broker does not take the offsets.
    pub async fn consumer(&self, consumer: ConsumerBuilder) -> Result<ConsumerBuilder> {
        let group = consumer.current().group.clone();
        if !group.trim().is_empty() {
            let mut offsets = TopicPartitionList::new();
            for topic in self.unique() {
                offsets
                    .add_partition_offset(&topic, 0, Offset::Offset(FIRST_OFFSET))
                    .map_err(|e| warm_up_error(&topic, &e.to_string()))?;
            }
            let mut config = kafka::client_config(&self.brokers, &[]);
            config
                .set("group.id", &group)
                .set("enable.auto.commit", "false");
            tokio::task::spawn_blocking(move || -> Result<()> {
                let committer: BaseConsumer = kafka::create(&config)?;
                committer
                    .commit(&offsets, CommitMode::Sync)
                    .map_err(|e| warm_up_error("?", &format!("committing past it: {e}")))
            })
            .await
            .map_err(|e| warm_up_error("?", &e.to_string()))??;
        }
        Ok(consumer.brokers(&self.brokers).topic_prefix(&self.prefix))
    }

    /// Deletes the topics.
    ///
    /// # Errors
    ///
    /// When the broker refuses or does not answer.
    pub async fn cleanup(mut self) -> Result<()> {
        self.deleted = true;
        delete(&self.brokers, &self.unique()).await
    }

    fn unique(&self) -> Vec<String> {
        self.topics.iter().map(|(_, t)| t.clone()).collect()
    }
}

/// Writes one record to each partition of `topics`, waits until each reads
/// back, then deletes the records before it (the broker permitting).
async fn warm_up(brokers: &str, topics: &[String]) -> Result<()> {
    let config = kafka::client_config(brokers, &[]);
    let producer: FutureProducer = kafka::create(&config)?;
    let mut offsets = TopicPartitionList::new();
    for topic in topics {
        let record = FutureRecord::<(), _>::to(topic)
            .partition(0)
            .payload("outbox TestTopics warm-up");
        let delivery = producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(error, _)| warm_up_error(topic, &error.to_string()))?;
        let (partition, offset) = (delivery.partition, delivery.offset);
        offsets
            .add_partition_offset(topic, partition, Offset::Offset(offset + 1))
            .map_err(|e| warm_up_error(topic, &e.to_string()))?;
    }
    let (readable, mut reader) = (offsets.clone(), config.clone());
    reader
        .set(
            "group.id",
            format!("outbox-warm-up-{}", uuid::Uuid::now_v7().simple()),
        )
        .set("enable.auto.commit", "false");
    tokio::task::spawn_blocking(move || read_back(&reader, &readable))
        .await
        .map_err(|e| warm_up_error("?", &e.to_string()))??;
    // The warm-up records out of the way of consumers that read from the
    // beginning. A broker without DeleteRecords keeps them: a consumer not
    // wired with `TestTopics::consumer` (which starts it after them) sees
    // one record without headers first, at offset 0.
    let admin: AdminClient<DefaultClientContext> = kafka::create(&config)?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    if let Err(error) = admin.delete_records(&offsets, &options).await {
        tracing::debug!(%error, "TestTopics: warm-up records not deleted");
    }
    Ok(())
}

/// Reads each partition of `offsets` from the beginning until the record
/// before its offset (the warm-up record) arrives.
fn read_back(config: &rdkafka::ClientConfig, offsets: &TopicPartitionList) -> Result<()> {
    let consumer: BaseConsumer = kafka::create(config)?;
    let mut assignment = TopicPartitionList::new();
    let mut waiting = Vec::new();
    for e in offsets.elements() {
        assignment
            .add_partition_offset(e.topic(), e.partition(), Offset::Beginning)
            .map_err(|x| warm_up_error(e.topic(), &x.to_string()))?;
        if let Offset::Offset(next) = e.offset() {
            waiting.push((e.topic().to_owned(), e.partition(), next - 1));
        }
    }
    consumer
        .assign(&assignment)
        .map_err(|e| warm_up_error("?", &e.to_string()))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !waiting.is_empty() {
        if Instant::now() > deadline {
            let topics: Vec<&str> = waiting.iter().map(|(t, _, _)| t.as_str()).collect();
            return Err(warm_up_error(
                &topics.join(", "),
                "the warm-up record did not read back within 30 s",
            ));
        }
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            waiting
                .retain(|(t, p, o)| !(t == m.topic() && *p == m.partition() && *o <= m.offset()));
        }
    }
    Ok(())
}

fn warm_up_error(topic: &str, reason: &str) -> Error {
    Error::TopicCreation {
        topic: topic.to_owned(),
        reason: format!("test topic warm-up: {reason}"),
    }
}

async fn delete(brokers: &str, topics: &[String]) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> =
        kafka::create(&kafka::client_config(brokers, &[]))?;
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.delete_topics(&names, &options).await? {
        if let Err((topic, code)) = result {
            return Err(Error::TopicCreation {
                topic,
                reason: format!("deleting the test topic failed: {code}"),
            });
        }
    }
    Ok(())
}

impl Drop for TestTopics {
    /// Deletes the topics if [`cleanup`](Self::cleanup) did not (best
    /// effort, on a thread of its own: a failing test still cleans up).
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        let (brokers, topics) = (self.brokers.clone(), self.unique());
        let deleting = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(runtime) = runtime
                && let Err(error) = runtime.block_on(delete(&brokers, &topics))
            {
                tracing::warn!(%error, ?topics, "test topics not deleted");
            }
        });
        let _ = deleting.join();
    }
}
