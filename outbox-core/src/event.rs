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

    /// Decodes a payload of the named event type written as schema version
    /// `version` (the `event_version` header): the consumer's decode path,
    /// for messages from the broker, replays and re-driven dead letters.
    ///
    /// `#[derive(DomainEvent)]` implements it: the declared version decodes
    /// as is, an older one goes through the type's upcasters
    /// (`#[event(version = 3, upcast_from(OrderPlacedV2))]`), and any other
    /// fails with [`Error::UnsupportedVersion`]. The default (for a
    /// hand-written implementation) ignores the version.
    fn from_versioned_payload(event_type: &str, version: u32, payload: &[u8]) -> Result<Self> {
        let _ = version;
        Self::from_payload(event_type, payload)
    }
}

/// One version of one event type: what an upcaster chain links.
///
/// `#[derive(DomainEvent)]` implements it for a struct. An event type's
/// current struct names the struct of its previous version with
/// `upcast_from(...)` and converts it with `From`; that struct may name its
/// own predecessor, and so on: a message of any version in
/// [`OLDEST_VERSION`](Self::OLDEST_VERSION)`..=`[`VERSION`](Self::VERSION)
/// decodes into the current struct, each step converting one version into
/// the next.
///
/// ```ignore
/// #[derive(Serialize, Deserialize, DomainEvent)]
/// #[event(topic = "orders", event_type = "OrderPlaced", version = 1)]
/// struct OrderPlacedV1 { #[event(aggregate_id)] order_id: Uuid, amount: i64 }
///
/// #[derive(Serialize, Deserialize, DomainEvent)]
/// #[event(topic = "orders", version = 2, upcast_from(OrderPlacedV1))]
/// struct OrderPlaced { #[event(aggregate_id)] order_id: Uuid, amount_cents: i64 }
///
/// impl From<OrderPlacedV1> for OrderPlaced {
///     fn from(v1: OrderPlacedV1) -> Self {
///         Self { order_id: v1.order_id, amount_cents: v1.amount * 100 }
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not one version of an event type",
    label = "not a struct deriving `DomainEvent`",
    note = "`upcast_from(...)` names the struct of the event type's previous version: a struct with `#[derive(DomainEvent)]` and `#[event(version = N)]`"
)]
pub trait EventVersion {
    /// The event type name.
    const EVENT_TYPE: &'static str;
    /// The version this struct is.
    const VERSION: u32;
    /// The oldest version it can be decoded from (through upcasters);
    /// `VERSION` when it declares none.
    const OLDEST_VERSION: u32;
}

/// Decodes an older version (event type, version, payload) into `E`.
#[doc(hidden)]
pub type Older<E> = fn(&str, u32, &[u8]) -> Result<E>;

/// The derive's implementation of [`DomainEvent::from_versioned_payload`]
/// for a struct: `older` decodes a version before `E::VERSION` (through the
/// previous version's struct) when the struct declares an upcaster.
#[doc(hidden)]
pub fn decode_version<E: EventVersion + DomainEvent>(
    event_type: &str,
    version: u32,
    payload: &[u8],
    older: Option<Older<E>>,
) -> Result<E> {
    if version == E::VERSION {
        return E::from_payload(event_type, payload);
    }
    if !E::EVENT_TYPES.contains(&event_type) {
        return Err(Error::UnknownEventType {
            event_type: event_type.to_owned(),
            rust_type: std::any::type_name::<E>(),
            expected: E::EVENT_TYPES.join(", "),
        });
    }
    match older {
        Some(older) if version < E::VERSION && version >= E::OLDEST_VERSION => {
            older(event_type, version, payload)
        }
        _ => Err(Error::UnsupportedVersion {
            event_type: event_type.to_owned(),
            version,
            rust_type: std::any::type_name::<E>(),
            oldest: E::OLDEST_VERSION,
            current: E::VERSION,
        }),
    }
}

/// The derive's implementation of [`DomainEvent::from_versioned_payload`]
/// for an enum: each variant reads its declared version only.
#[doc(hidden)]
pub fn decode_variant_version<E: DomainEvent>(
    event_type: &str,
    version: u32,
    payload: &[u8],
    versions: &[u32],
) -> Result<E> {
    let declared = E::EVENT_TYPES
        .iter()
        .position(|t| *t == event_type)
        .and_then(|i| versions.get(i).copied());
    match declared {
        Some(current) if current != version => Err(Error::UnsupportedVersion {
            event_type: event_type.to_owned(),
            version,
            rust_type: std::any::type_name::<E>(),
            oldest: current,
            current,
        }),
        _ => E::from_payload(event_type, payload),
    }
}

/// `a == b`, in a constant (the derive's compile-time checks of an
/// upcaster chain).
#[doc(hidden)]
pub const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}
