//! The `DomainEvent` trait: what the outbox needs to know about an event type.

use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::error::{Error, Result};

/// A domain event that can be written to the outbox and published to Kafka.
///
/// Implement it with `#[derive(DomainEvent)]` (from the `outbox` crate), which
/// reads `#[event(...)]` attributes:
///
/// ```ignore
/// #[derive(Serialize, Deserialize, DomainEvent)]
/// #[event(topic = "orders", aggregate_type = "Order")]
/// struct OrderPlaced {
///     #[event(aggregate_id)]
///     order_id: Uuid,
///     amount_cents: i64,
/// }
/// ```
///
/// The payload is the value's serde JSON representation; the event type,
/// version and ids travel beside it (outbox columns, Kafka headers).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a domain event",
    label = "not a `DomainEvent`",
    note = "derive it: `#[derive(Serialize, Deserialize, DomainEvent)]` with `#[event(topic = \"...\")]`"
)]
pub trait DomainEvent: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The Kafka topic the event is published to.
    const TOPIC: &'static str;
    /// The aggregate type the event belongs to (e.g. `Order`).
    const AGGREGATE_TYPE: &'static str;
    /// Every event type name this Rust type can carry: one for a struct,
    /// one per variant for an enum.
    const EVENT_TYPES: &'static [&'static str];

    /// The event type name of this value (for an enum, of its variant).
    fn event_type(&self) -> &'static str;

    /// The schema version of this value's event type (1 unless declared).
    fn event_version(&self) -> u32;

    /// The id of the aggregate instance the event belongs to.
    fn aggregate_id(&self) -> String;

    /// The Kafka message key: events with the same key keep their order.
    /// Defaults to the aggregate id.
    fn partition_key(&self) -> String {
        self.aggregate_id()
    }

    /// The event id carried by the value itself, if it has one
    /// (`#[event(event_id)]`); otherwise the outbox assigns a fresh UUIDv7.
    fn event_id(&self) -> Option<Uuid> {
        None
    }

    /// Serializes the value to its JSON payload.
    fn to_payload(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|source| Error::Serialize {
            event_type: self.event_type().to_owned(),
            source,
        })
    }

    /// Decodes a payload of the named event type.
    ///
    /// Fails with [`Error::UnknownEventType`] when `event_type` is not one of
    /// [`EVENT_TYPES`](Self::EVENT_TYPES), with [`Error::Deserialize`] when the
    /// JSON does not match the type, and with [`Error::EventTypeMismatch`] when
    /// it decodes into a different variant than the one named.
    fn from_payload(event_type: &str, payload: &[u8]) -> Result<Self> {
        if !Self::EVENT_TYPES.contains(&event_type) {
            return Err(Error::UnknownEventType {
                event_type: event_type.to_owned(),
                rust_type: std::any::type_name::<Self>(),
                expected: Self::EVENT_TYPES.join(", "),
            });
        }
        let value: Self = serde_json::from_slice(payload).map_err(|source| Error::Deserialize {
            event_type: event_type.to_owned(),
            source,
        })?;
        if value.event_type() != event_type {
            return Err(Error::EventTypeMismatch {
                event_type: event_type.to_owned(),
                decoded: value.event_type(),
            });
        }
        Ok(value)
    }
}
