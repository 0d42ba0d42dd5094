//! The error type of the runtime crate.

/// Errors raised by the relay, the consumers and the operations commands.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database operation failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),

    /// A Kafka client operation failed.
    #[error("kafka error: {0}")]
    Kafka(rdkafka::error::KafkaError),

    /// An error of the core crate (Unit of Work, payloads, migrations).
    #[error(transparent)]
    Core(#[from] outbox_core::Error),

    /// The configuration is invalid; the message says which setting and why.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A topic could not be created.
    #[error("could not create topic `{topic}`: {reason}")]
    TopicCreation {
        /// The topic.
        topic: String,
        /// What the broker answered.
        reason: String,
    },

    /// A replay stopped on deliveries that kept failing; what was sent
    /// before stays sent.
    #[error(
        "replay stopped after {replayed} events: {reason}; run it again from outbox id {resume_from} (--from-id {resume_from})"
    )]
    ReplayStopped {
        /// Events replayed before it stopped.
        replayed: u64,
        /// The first outbox id not (completely) replayed.
        resume_from: i64,
        /// The last delivery error.
        reason: String,
    },

    /// Another cleanup job holds the leader lock.
    #[error("another cleanup job is running (it holds the leader lock); nothing was deleted")]
    CleanupBusy,

    /// A background task panicked or was aborted.
    #[error("background task failed: {0}")]
    Task(String),
}

impl From<rdkafka::error::KafkaError> for Error {
    /// Wraps a Kafka error; a configuration error about a secret setting
    /// loses the rejected value (librdkafka echoes it).
    fn from(error: rdkafka::error::KafkaError) -> Self {
        Error::Kafka(crate::kafka::scrub_error(error))
    }
}

/// `Result` with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
