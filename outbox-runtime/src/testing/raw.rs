//! Messages of other producers for the [`TestBus`](super::TestBus): a
//! [`RawMessage`] is a Kafka message as it is — topic, key, headers,
//! payload, byte for byte — for a test of what a consumer does with a
//! message no outbox wrote (a CloudEvent of another system, a malformed
//! message).

use crate::cloudevents::header as ce;

/// A Kafka message written by another producer, for
/// [`TestBus::send`](super::TestBus::send): the next
/// [`deliver`](super::TestBus::deliver) hands it to the consumers
/// subscribed to its topic, through the same path as the outbox's events.
///
/// ```
/// # use outbox_runtime::testing::RawMessage;
/// // A CloudEvent as a system that does not use this framework sends it.
/// let placed = RawMessage::cloud_event("orders", "OrderPlaced", "inv-42")
///     .header("ce_source", "/legacy-shop")
///     .key("order-7")
///     .json(&serde_json::json!({ "order_id": "order-7", "amount_cents": 500 }));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage {
    pub(super) topic: String,
    pub(super) key: Option<Vec<u8>>,
    pub(super) headers: Vec<(String, Option<Vec<u8>>)>,
    pub(super) payload: Option<Vec<u8>>,
}

impl RawMessage {
    /// A message to `topic` (as the outbox names it: a consumer's topic
    /// prefix is added), with no key, headers or payload.
    pub fn new(topic: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            key: None,
            headers: Vec::new(),
            payload: None,
        }
    }

    /// A CloudEvent in Kafka binary mode, as a producer that speaks
    /// CloudEvents sends it: `ce_specversion` 1.0, `ce_type`, `ce_id` and
    /// `content-type: application/json`. No `ce_source` (add it with
    /// [`header`](Self::header): a consumer identifies the event by source
    /// and id together), no key, no payload.
    pub fn cloud_event(topic: impl Into<String>, event_type: &str, id: &str) -> Self {
        Self::new(topic)
            .header(ce::SPECVERSION, ce::SPEC_1_0)
            .header(ce::TYPE, event_type)
            .header(ce::ID, id)
            .header(
                crate::kafka::header::CONTENT_TYPE,
                crate::kafka::header::JSON,
            )
    }

    /// Sets the key.
    pub fn key(mut self, key: impl AsRef<[u8]>) -> Self {
        self.key = Some(key.as_ref().to_vec());
        self
    }

    /// Sets header `name` (replacing one of that name).
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers.retain(|(k, _)| k != name);
        self.headers
            .push((name.to_owned(), Some(value.as_ref().to_vec())));
        self
    }

    /// Removes header `name`.
    pub fn without_header(mut self, name: &str) -> Self {
        self.headers.retain(|(k, _)| k != name);
        self
    }

    /// Sets the payload, byte for byte.
    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = Some(payload.into());
        self
    }

    /// Sets the payload to `value` as JSON.
    ///
    /// # Panics
    ///
    /// If `value` does not serialize (a map with non-string keys).
    #[track_caller]
    pub fn json(self, value: &impl serde::Serialize) -> Self {
        match serde_json::to_vec(value) {
            Ok(payload) => self.payload(payload),
            Err(error) => panic!("RawMessage::json: {error}"),
        }
    }
}
