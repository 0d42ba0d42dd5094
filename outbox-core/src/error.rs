//! The error type of the core crate.

/// Errors raised by the Unit of Work, event (de)serialization and migrations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database operation failed (connection, statement or commit).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),

    /// An event could not be serialized to its JSON payload.
    #[error("could not serialize event `{event_type}` to JSON: {source}")]
    Serialize {
        /// The event type that failed.
        event_type: String,
        /// What serde_json reported.
        #[source]
        source: serde_json::Error,
    },

    /// A payload could not be decoded into the requested event type.
    #[error("could not decode payload of event `{event_type}`: {source}")]
    Deserialize {
        /// The event type named by the message.
        event_type: String,
        /// What serde_json reported.
        #[source]
        source: serde_json::Error,
    },

    /// The event type named by a message is not one the Rust type carries.
    #[error("unknown event type `{event_type}` for `{rust_type}` (expected one of: {expected})")]
    UnknownEventType {
        /// The event type named by the message.
        event_type: String,
        /// The Rust type that was asked to decode it.
        rust_type: &'static str,
        /// The event types the Rust type carries, comma separated.
        expected: String,
    },

    /// The payload decoded, but into a different event type than the message named.
    #[error("payload of event `{event_type}` decoded as `{decoded}`")]
    EventTypeMismatch {
        /// The event type named by the message.
        event_type: String,
        /// The event type of the decoded value.
        decoded: &'static str,
    },

    /// The message's schema version is not one the Rust type reads: newer
    /// than its declared version, or older than its oldest upcaster.
    #[error("{}", unsupported_version(event_type, *version, rust_type, *oldest, *current))]
    UnsupportedVersion {
        /// The event type named by the message.
        event_type: String,
        /// The version named by the message (`event_version` header).
        version: u32,
        /// The Rust type that was asked to decode it.
        rust_type: &'static str,
        /// The oldest version it reads (through its upcasters).
        oldest: u32,
        /// The version it declares.
        current: u32,
    },

    /// A W3C `traceparent` handed to the Unit of Work is malformed.
    #[error(transparent)]
    InvalidTraceParent(#[from] crate::trace::InvalidTraceParent),

    /// The Unit of Work's transaction was aborted before `commit`: one of
    /// its statements failed and the error was not returned (PostgreSQL then
    /// answers `COMMIT` with `ROLLBACK`). Nothing was written.
    #[error(
        "the Unit of Work's transaction is aborted: one of its statements failed and its error \
         was not returned; nothing was committed ({source})"
    )]
    TransactionAborted {
        /// What PostgreSQL answered (SQLSTATE 25P02).
        #[source]
        source: sqlx::Error,
    },

    /// The Unit of Work's transaction was ended by the command itself
    /// (`COMMIT` or `ROLLBACK` run through its connection) before `commit`.
    /// The events were not written; what the command committed by hand, if
    /// anything, stays committed.
    #[error(
        "the Unit of Work's transaction was ended by the command (COMMIT or ROLLBACK through its \
         connection): its events were not written; only `commit()` may end it"
    )]
    TransactionEnded,

    /// An application header uses a name the framework writes itself
    /// ([`RESERVED_HEADERS`](crate::RESERVED_HEADERS)). Nothing was written.
    #[error(
        "the header `{name}` is the framework's own: set correlation, causation and trace \
         context through their fields, and give custom headers other names; nothing was written"
    )]
    ReservedHeader {
        /// The refused name.
        name: String,
    },

    /// Applying the embedded migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),

    /// A schema change kept finding its table locked (each attempt gave up
    /// after its `lock_timeout`) until its maximum wait passed.
    #[error(
        "{what}: the tables stayed locked by other transactions (long transactions on outbox_event?) through {attempts} attempts over {waited:.1?}; nothing was changed by the last attempt; run it again or raise the maximum wait"
    )]
    LockTimeout {
        /// The change (`migrations`, `notify off`).
        what: String,
        /// Attempts made.
        attempts: u32,
        /// Time spent trying.
        waited: std::time::Duration,
    },
}

fn unsupported_version(
    event_type: &str,
    version: u32,
    rust_type: &str,
    oldest: u32,
    current: u32,
) -> String {
    let reads = match oldest == current {
        true => format!("version {current} only"),
        false => format!("versions {oldest} to {current}"),
    };
    if version > current {
        format!(
            "event `{event_type}` version {version} is newer than `{rust_type}` reads ({reads}): \
             deploy a handler that knows version {version}, then retry the dead letter"
        )
    } else {
        format!(
            "event `{event_type}` version {version} is older than `{rust_type}` reads ({reads}): \
             declare an upcaster from it (`upcast_from(...)` on the version after it)"
        )
    }
}

/// `Result` with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
