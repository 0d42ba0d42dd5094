//! `OutboxMessage` (an event serialized for the outbox) and its `Headers`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::event::DomainEvent;

/// Header names the framework writes itself: the event's identity (from the
/// row), `replay_id` (set by a replay), `content-type`, and the entries
/// [`Headers`] has fields for. An application header (`Headers::extra`) may
/// not use them (compared ignoring ASCII case): a consumer must be able to
/// trust them.
pub const RESERVED_HEADERS: &[&str] = &[
    "event_id",
    "event_type",
    "event_version",
    "aggregate_type",
    "aggregate_id",
    "replay_id",
    "content-type",
    "correlation_id",
    "causation_id",
    "traceparent",
    "tracestate",
];

/// Message metadata stored in `outbox_event.headers` and sent as Kafka headers:
/// correlation and causation ids, W3C trace context, and free-form entries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Headers {
    /// The id shared by every message of one business flow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<Uuid>,
    /// The id of the message that caused this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<Uuid>,
    /// W3C `traceparent` of the span that recorded the event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// W3C `tracestate` accompanying `traceparent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
    /// Application-defined entries.
    #[serde(flatten)]
    pub extra: BTreeMap<String, String>,
}

impl Headers {
    /// True when no entry is set.
    pub fn is_empty(&self) -> bool {
        self.correlation_id.is_none()
            && self.causation_id.is_none()
            && self.traceparent.is_none()
            && self.tracestate.is_none()
            && self.extra.is_empty()
    }

    /// Fills every entry not set here from `defaults`.
    pub fn fill_from(&mut self, defaults: &Headers) {
        if self.correlation_id.is_none() {
            self.correlation_id = defaults.correlation_id;
        }
        if self.causation_id.is_none() {
            self.causation_id = defaults.causation_id;
        }
        if self.traceparent.is_none() {
            self.traceparent.clone_from(&defaults.traceparent);
        }
        if self.tracestate.is_none() {
            self.tracestate.clone_from(&defaults.tracestate);
        }
        for (key, value) in &defaults.extra {
            self.extra
                .entry(key.clone())
                .or_insert_with(|| value.clone());
        }
    }

    /// Refuses application entries named like a header the framework writes
    /// ([`RESERVED_HEADERS`]).
    pub fn check(&self) -> Result<()> {
        match self
            .extra
            .keys()
            .find(|k| RESERVED_HEADERS.iter().any(|r| r.eq_ignore_ascii_case(k)))
        {
            Some(name) => Err(Error::ReservedHeader { name: name.clone() }),
            None => Ok(()),
        }
    }

    /// The headers as JSON text (never fails: every field is a string or a UUID).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"))
    }
}

/// One event, serialized and addressed: a future `outbox_event` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// Unique id of the event (consumers deduplicate by it).
    pub event_id: Uuid,
    /// Aggregate type, e.g. `Order`.
    pub aggregate_type: String,
    /// Aggregate instance id.
    pub aggregate_id: String,
    /// Event type name, e.g. `OrderPlaced`.
    pub event_type: String,
    /// Schema version of the event type.
    pub event_version: u32,
    /// Kafka topic.
    pub topic: String,
    /// Kafka message key.
    pub partition_key: String,
    /// JSON payload.
    pub payload: String,
    /// Correlation, causation, trace context and custom entries.
    pub headers: Headers,
}

impl OutboxMessage {
    /// Serializes `event`, taking its own event id or assigning a fresh UUIDv7.
    pub fn from_event<E: DomainEvent>(event: &E) -> Result<Self> {
        Ok(Self {
            event_id: event.event_id().unwrap_or_else(Uuid::now_v7),
            aggregate_type: E::AGGREGATE_TYPE.to_owned(),
            aggregate_id: event.aggregate_id(),
            event_type: event.event_type().to_owned(),
            event_version: event.event_version(),
            topic: E::TOPIC.to_owned(),
            partition_key: event.partition_key(),
            payload: event.to_payload()?,
            headers: Headers::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_skip_unset_entries_and_flatten_extra() {
        let mut h = Headers::default();
        assert_eq!(h.to_json(), "{}");
        h.extra.insert("tenant".into(), "acme".into());
        h.causation_id = Some(Uuid::nil());
        assert_eq!(
            h.to_json(),
            r#"{"causation_id":"00000000-0000-0000-0000-000000000000","tenant":"acme"}"#
        );
        let back: Headers = serde_json::from_str(&h.to_json()).unwrap();
        assert_eq!(back, h);
    }

    #[test]
    fn reserved_names_are_refused_in_any_case() {
        let mut h = Headers::default();
        h.extra.insert("tenant".into(), "acme".into());
        assert!(h.check().is_ok());
        for name in [
            "event_id",
            "Event_Type",
            "REPLAY_ID",
            "content-type",
            "traceparent",
        ] {
            let mut bad = h.clone();
            bad.extra.insert(name.into(), "x".into());
            let error = bad.check().unwrap_err();
            assert!(error.to_string().contains(name), "{error}");
        }
    }

    #[test]
    fn fill_from_keeps_own_entries() {
        let own_id = Uuid::now_v7();
        let mut own = Headers {
            correlation_id: Some(own_id),
            ..Headers::default()
        };
        own.extra.insert("k".into(), "own".into());
        let mut defaults = Headers {
            correlation_id: Some(Uuid::now_v7()),
            traceparent: Some("00-abc-def-01".into()),
            ..Headers::default()
        };
        defaults.extra.insert("k".into(), "default".into());
        defaults.extra.insert("other".into(), "x".into());
        own.fill_from(&defaults);
        assert_eq!(own.correlation_id, Some(own_id));
        assert_eq!(own.traceparent.as_deref(), Some("00-abc-def-01"));
        assert_eq!(own.extra["k"], "own");
        assert_eq!(own.extra["other"], "x");
    }
}
