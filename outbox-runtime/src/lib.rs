//! Runtime of the outbox framework: the [`relay`] that publishes the outbox
//! to Kafka, the consumer side ([`inbox`]: deduplicating or inbox consumers
//! with typed handlers, dead letters), the operations queries behind the
//! `outbox` CLI ([`ops`]), replay ([`replay`]), retention ([`cleanup`]), the
//! partitioned layout ([`partition`]), Prometheus metrics ([`metrics`]), the
//! shared Kafka client configuration ([`kafka`]), CloudEvents headers
//! ([`cloudevents`]), settings from the
//! environment and configuration files ([`settings`]), and which outbox of a
//! database they all work on ([`scope`]), and, with the `otel` feature,
//! OpenTelemetry export (`telemetry`).
//!
//! The relay's producer is private to it: nothing in this crate hands a
//! Kafka producer to application code.

#![deny(unsafe_code)] // one exception: `inbox::raw_headers` reads header names as bytes
#![deny(missing_docs)]

mod backoff;
pub mod cleanup;
pub mod cloudevents;
mod error;
pub mod inbox;
pub mod kafka;
pub mod metrics;
pub mod ops;
pub mod partition;
mod refusal;
pub mod relay;
pub mod replay;
pub mod scope;
pub mod settings;
#[cfg(feature = "otel")]
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::{Error, Result};
pub use inbox::{
    Consumer, ConsumerBuilder, ConsumerConfig, ConsumerCounts, ConsumerHandle, ConsumerHealth,
    ConsumerStats, DeadLetter, DeadLetterFilter, DeadLetterReason, Mode,
};
pub use relay::{Relay, RelayBuilder, RelayConfig, RelayCounts, RelayHandle, RelayHealth};
pub use scope::OutboxScope;
pub use tokio_util::sync::CancellationToken;
