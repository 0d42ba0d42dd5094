//! Unique topics on a real broker for one test ([`TestTopics`]), deleted
//! when the test is done: tests that run end to end through Kafka on a
//! broker other tests use at the same time.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;

use crate::error::Result;
use crate::kafka;

/// Topics created for one test, each named `{name}-{unique suffix}`;
/// deleted by [`cleanup`](Self::cleanup), or when dropped.
///
/// ```no_run
/// # async fn f() -> outbox_runtime::Result<()> {
/// use outbox_runtime::testing::TestTopics;
/// let topics = TestTopics::create(&TestTopics::brokers(), &["payments"]).await?;
/// let payments: &str = topics.name("payments"); // e.g. "payments-0193…"
/// // ... record messages to `payments`, run a relay and a consumer ...
/// # let _ = payments;
/// topics.cleanup().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TestTopics {
    brokers: String,
    topics: Vec<(String, String)>,
    deleted: bool,
}

impl TestTopics {
    /// The test broker: `KAFKA_BROKERS`, else `127.0.0.1:9092`.
    pub fn brokers() -> String {
        std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| kafka::DEFAULT_BROKERS.to_owned())
    }

    /// Creates one topic (one partition) per name in `names`, each with a
    /// unique suffix, on `brokers`.
    ///
    /// # Errors
    ///
    /// When the broker does not create them.
    pub async fn create(brokers: &str, names: &[&str]) -> Result<Self> {
        let suffix = uuid::Uuid::now_v7().simple().to_string();
        let topics: Vec<(String, String)> = names
            .iter()
            .map(|n| ((*n).to_owned(), format!("{n}-{suffix}")))
            .collect();
        let unique: Vec<String> = topics.iter().map(|(_, t)| t.clone()).collect();
        kafka::create_topics(brokers, &[], &unique, 1, 1).await?;
        Ok(Self {
            brokers: brokers.to_owned(),
            topics,
            deleted: false,
        })
    }

    /// The unique topic created for `name`.
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

async fn delete(brokers: &str, topics: &[String]) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> =
        kafka::create(&kafka::client_config(brokers, &[]))?;
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.delete_topics(&names, &options).await? {
        if let Err((topic, code)) = result {
            return Err(crate::Error::TopicCreation {
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
            if let Ok(runtime) = runtime {
                if let Err(error) = runtime.block_on(delete(&brokers, &topics)) {
                    tracing::warn!(%error, ?topics, "test topics not deleted");
                }
            }
        });
        let _ = deleting.join();
    }
}
