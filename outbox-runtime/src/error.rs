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
    Kafka(#[from] rdkafka::error::KafkaError),

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

    /// A background task panicked or was aborted.
    #[error("background task failed: {0}")]
    Task(String),
}

/// `Result` with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
