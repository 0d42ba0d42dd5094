//! Turning a Kafka message into what the consumer acts on: an event to
//! handle (identity and headers read from the relay's Kafka headers, payload
//! checked or decoded), an explicitly ignored event type, or a rejected
//! message with the reason it goes to the dead-letter table. Used for
//! messages from the broker and, identically, for dead letters re-driven
//! from the table.

use std::borrow::Cow;
use std::sync::Arc;

use outbox_core::{Headers, IncomingEvent};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::db::pg_text;
use super::dead_letter::DeadLetterReason;
use super::dispatch::{Decoded, Registry, Route};
use crate::cloudevents::header as ce;
use crate::kafka::header;

/// A message as it came from the broker (or from a dead-letter row).
pub(crate) struct Raw<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub payload: Option<&'a [u8]>,
    /// Header names (lossy UTF-8) and values, in order.
    pub headers: Vec<(Cow<'a, str>, Option<&'a [u8]>)>,
    /// How many header names were not UTF-8 (replaced in `headers`).
    pub bad_names: usize,
}

impl<'a> Raw<'a> {
    /// Headers whose names arrive as bytes (from the broker).
    pub fn with_byte_headers(mut self, headers: Vec<(&'a [u8], Option<&'a [u8]>)>) -> Self {
        self.headers = headers
            .into_iter()
            .map(|(name, value)| match std::str::from_utf8(name) {
                Ok(name) => (Cow::Borrowed(name), value),
                Err(_) => {
                    self.bad_names += 1;
                    (String::from_utf8_lossy(name), value)
                }
            })
            .collect();
        self
    }

    /// Size of the message as the limits count it (the size limit and the
    /// batch's byte budget): key, payload, header names and values.
    pub(crate) fn size(&self) -> usize {
        self.key.map_or(0, <[u8]>::len)
            + self.payload.map_or(0, <[u8]>::len)
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.map_or(0, <[u8]>::len))
                .sum::<usize>()
    }
}

/// Longest header value, key, or payload prefix a dead letter keeps of a
/// message over the size limit (the rest is summed up by its size and hash).
pub(crate) const KEPT_BYTES: usize = 64 * 1024;

/// Longest header value a dead letter keeps.
const KEPT_HEADER_BYTES: usize = 4 * 1024;

/// How far the payload is examined while parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Decode it with every handler of its route (dedup mode: decoding
    /// happens on the polling thread, off the database task).
    Decode,
    /// Only check that it is JSON (inbox mode: decoded by the processor).
    Json,
}

/// One received message, ready for the consumer.
pub(crate) struct Record {
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
    /// The assignment generation of its partition when it was polled.
    pub generation: u64,
    pub body: Body,
}

/// What to do with a message.
pub(crate) enum Body {
    /// Handle it.
    Event(Box<Event>),
    /// Its event type is ignored on purpose: only its offset is committed.
    Ignored,
    /// Dead-letter it.
    Rejected(Box<Rejected>),
}

/// A well-formed event.
pub(crate) struct Event {
    pub incoming: IncomingEvent,
    /// Handlers to run, in order.
    pub handlers: Vec<usize>,
    /// The JSON payload, as received.
    pub payload: Vec<u8>,
    /// Values decoded while parsing ([`Check::Decode`]), one per handler,
    /// taken by the first attempt; later attempts decode again.
    pub decoded: Vec<Option<Decoded>>,
}

/// A message for the dead-letter table.
#[derive(Debug, Clone)]
pub(crate) struct Rejected {
    pub key: Option<Vec<u8>>,
    pub event_id: Option<Uuid>,
    pub event_type: Option<String>,
    /// The Kafka headers as a JSON object (values as text, lossy UTF-8).
    pub headers: Map<String, Value>,
    pub payload: Option<Vec<u8>>,
    pub reason: DeadLetterReason,
    pub error: String,
    /// The handler that failed (`handler_failed`).
    pub handler: Option<&'static str>,
    /// Handler attempts made.
    pub attempts: i32,
    /// The payload's full size when `payload` keeps only a prefix of it.
    pub payload_bytes: Option<i64>,
}

/// Headers that describe the event itself; the others become [`Headers`].
const IDENTITY: &[&str] = &[
    header::EVENT_ID,
    header::EVENT_TYPE,
    header::EVENT_VERSION,
    header::AGGREGATE_TYPE,
    header::AGGREGATE_ID,
    header::CONTENT_TYPE,
];

/// Header or key bytes as text PostgreSQL can store (lossy UTF-8, no NUL).
fn text(value: Option<&[u8]>) -> Option<String> {
    value.map(|v| pg_text(&String::from_utf8_lossy(v)).into_owned())
}

fn header<'a>(raw: &Raw<'a>, name: &str) -> Option<Option<&'a [u8]>> {
    raw.headers
        .iter()
        .rev()
        .find(|(k, _)| k == name)
        .map(|(_, v)| *v)
}

/// The message's headers as a JSON object, for a dead letter: values cut
/// to [`KEPT_HEADER_BYTES`] (a repeated name keeps its last value).
pub(crate) fn headers_json(raw: &Raw<'_>) -> Map<String, Value> {
    raw.headers
        .iter()
        .map(|(k, v)| {
            let value = v.map(|v| match v.len() > KEPT_HEADER_BYTES {
                true => format!(
                    "{}… ({} bytes)",
                    String::from_utf8_lossy(&v[..KEPT_HEADER_BYTES]),
                    v.len()
                ),
                false => String::from_utf8_lossy(v).into_owned(),
            });
            (
                pg_text(k).into_owned(),
                value.map_or(Value::Null, |v| Value::String(pg_text(&v).into_owned())),
            )
        })
        .collect()
}

/// CloudEvents headers that name the event (see [`Names`]).
const CE_IDENTITY: &[&str] = &[
    ce::SPECVERSION,
    ce::ID,
    ce::TYPE,
    ce::SOURCE,
    ce::EVENT_VERSION,
];

/// The headers that name the event: the framework's, or, on a message
/// without an `event_id` header that has a `ce_id` (from another producer,
/// or a relay writing CloudEvents headers only), the CloudEvents ones.
struct Names {
    event_type: &'static str,
    version: &'static str,
    cloud: bool,
}

impl Names {
    fn of(raw: &Raw<'_>) -> Self {
        if header(raw, header::EVENT_ID).is_none() && header(raw, ce::ID).is_some() {
            Names {
                event_type: ce::TYPE,
                version: ce::EVENT_VERSION,
                cloud: true,
            }
        } else {
            Names {
                event_type: header::EVENT_TYPE,
                version: header::EVENT_VERSION,
                cloud: false,
            }
        }
    }
}

/// The event id of a CloudEvents message (derived from `ce_source` and
/// `ce_id`, or `ce_id` itself in the relay's form: see `cloudevents.rs`), or
/// why it has none we can trust.
fn cloud_event_id(raw: &Raw<'_>) -> Result<Uuid, (DeadLetterReason, String)> {
    let value = |name| header(raw, name).flatten().map(String::from_utf8_lossy);
    match value(ce::SPECVERSION) {
        Some(v) if v == ce::SPEC_1_0 => {}
        Some(v) => {
            return Err((
                DeadLetterReason::InvalidHeaders,
                format!("CloudEvents `ce_specversion` `{v}`: only 1.0 is read"),
            ));
        }
        None => {
            return Err((
                DeadLetterReason::InvalidHeaders,
                "a `ce_id` header without `ce_specversion`: not a CloudEvents message".into(),
            ));
        }
    }
    let id = value(ce::ID).filter(|v| !v.trim().is_empty());
    let source = value(ce::SOURCE).filter(|v| !v.trim().is_empty());
    match (id, source) {
        (None, _) => Err((
            DeadLetterReason::NoEventId,
            "the `ce_id` header is empty".into(),
        )),
        (Some(_), None) => Err((
            DeadLetterReason::NoEventId,
            "no `ce_source` header: a CloudEvent is identified by its source and id together, \
             so it cannot be deduplicated without it"
                .into(),
        )),
        (Some(id), Some(source)) => {
            let relay = header(raw, ce::AGGREGATE_TYPE).flatten().is_some();
            Ok(crate::cloudevents::message_event_id(&source, &id, relay))
        }
    }
}

/// The first identity header given more than once with different values.
fn conflicting_identity(raw: &Raw<'_>) -> Option<(&'static str, usize)> {
    IDENTITY.iter().chain(CE_IDENTITY).find_map(|name| {
        let mut values = raw
            .headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v);
        let first = values.next()?;
        let mut count = 1;
        let mut differ = false;
        for v in values {
            count += 1;
            differ |= v != first;
        }
        differ.then_some((*name, count))
    })
}

/// The application headers (correlation, causation, trace context, custom
/// entries) carried by the message.
fn app_headers(raw: &Raw<'_>) -> Headers {
    let mut headers = Headers::default();
    for (key, value) in &raw.headers {
        let key = key.as_ref();
        if IDENTITY.contains(&key) {
            continue;
        }
        let Some(value) = text(*value) else { continue };
        match key {
            "correlation_id" => match value.parse() {
                Ok(id) => headers.correlation_id = Some(id),
                Err(_) => {
                    headers.extra.insert(key.to_owned(), value);
                }
            },
            "causation_id" => match value.parse() {
                Ok(id) => headers.causation_id = Some(id),
                Err(_) => {
                    headers.extra.insert(key.to_owned(), value);
                }
            },
            "traceparent" => headers.traceparent = Some(value),
            "tracestate" => headers.tracestate = Some(value),
            _ => {
                headers.extra.insert(pg_text(key).into_owned(), value);
            }
        }
    }
    headers
}

/// True when `payload` is one JSON value (UTF-8, well-formed).
pub(crate) fn is_json(payload: &[u8]) -> bool {
    std::str::from_utf8(payload)
        .ok()
        .is_some_and(|s| serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok())
}

/// Classifies a decoding failure: not JSON at all, or JSON of another shape.
pub(crate) fn decode_failure(
    payload: &[u8],
    error: &outbox_core::Error,
) -> (DeadLetterReason, String) {
    match error {
        outbox_core::Error::UnknownEventType { .. } => {
            (DeadLetterReason::UnknownEventType, error.to_string())
        }
        outbox_core::Error::UnsupportedVersion { .. } => {
            (DeadLetterReason::UnsupportedVersion, error.to_string())
        }
        _ if !is_json(payload) => (
            DeadLetterReason::NotJson,
            format!("payload is not JSON: {error}"),
        ),
        _ => (DeadLetterReason::PayloadMismatch, error.to_string()),
    }
}

/// Parses one message. Never fails: what cannot be handled is `Rejected`.
pub(crate) fn parse(raw: &Raw<'_>, registry: &Registry, max_bytes: usize, check: Check) -> Body {
    let names = Names::of(raw);
    let reject = |reason: DeadLetterReason, error: String, id: Option<Uuid>| {
        Body::Rejected(Box::new(Rejected {
            key: raw.key.map(<[u8]>::to_vec),
            event_id: id,
            event_type: header(raw, names.event_type).and_then(text),
            headers: headers_json(raw),
            payload: raw.payload.map(<[u8]>::to_vec),
            reason,
            error,
            handler: None,
            attempts: 0,
            payload_bytes: None,
        }))
    };
    let cloud_id = names.cloud.then(|| cloud_event_id(raw));
    let event_id = match (&cloud_id, header(raw, header::EVENT_ID)) {
        (Some(id), _) => id.as_ref().ok().copied(),
        (None, None | Some(None)) => None,
        (None, Some(Some(v))) => std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()),
    };
    let size = raw.size();
    if size > max_bytes {
        return oversized(raw, size, max_bytes, event_id);
    }
    if raw.bad_names > 0 {
        return reject(
            DeadLetterReason::InvalidHeaders,
            format!(
                "{} header name(s) are not UTF-8 (kept with U+FFFD in their place)",
                raw.bad_names
            ),
            event_id,
        );
    }
    if let Some((name, count)) = conflicting_identity(raw) {
        return reject(
            DeadLetterReason::InvalidHeaders,
            format!("the `{name}` header is given {count} times with different values"),
            event_id,
        );
    }
    if let Some(Err((reason, error))) = cloud_id {
        return reject(reason, error, None);
    }
    let Some(event_id) = event_id else {
        let error = match header(raw, header::EVENT_ID) {
            None => "no `event_id` header".to_owned(),
            Some(None) => "the `event_id` header is empty".to_owned(),
            Some(Some(v)) => format!(
                "the `event_id` header `{}` is not a UUID",
                String::from_utf8_lossy(v)
            ),
        };
        return reject(DeadLetterReason::NoEventId, error, None);
    };
    if raw.key.is_none() {
        return reject(
            DeadLetterReason::NoKey,
            "the message has no key (the partition key, which orders an aggregate's events)".into(),
            Some(event_id),
        );
    }
    let Some(event_type) = header(raw, names.event_type).and_then(text) else {
        return reject(
            DeadLetterReason::UnknownEventType,
            format!("no `{}` header", names.event_type),
            Some(event_id),
        );
    };
    let handlers = match registry.route(raw.topic, &event_type) {
        Route::Handlers(h) => h,
        Route::Ignored => return Body::Ignored,
        Route::Unknown => {
            return reject(
                DeadLetterReason::UnknownEventType,
                format!(
                    "no handler for event type `{event_type}` on topic `{}` (handled: {}); \
                     register one, or opt out with ignore_event_type",
                    raw.topic,
                    registry.known_types(raw.topic)
                ),
                Some(event_id),
            );
        }
    };
    let event_version = match header(raw, names.version) {
        None | Some(None) => 1,
        Some(Some(v)) => match std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
        {
            Some(n) if n >= 1 => n,
            _ => {
                return reject(
                    DeadLetterReason::UnknownEventType,
                    format!(
                        "the `{}` header `{}` is not a positive integer",
                        names.version,
                        String::from_utf8_lossy(v)
                    ),
                    Some(event_id),
                );
            }
        },
    };
    let Some(payload) = raw.payload else {
        return reject(
            DeadLetterReason::NotJson,
            "the message has no payload".into(),
            Some(event_id),
        );
    };
    let mut decoded = Vec::new();
    match check {
        Check::Decode => {
            decoded.reserve(handlers.len());
            for &h in handlers {
                match registry
                    .handler(h)
                    .decode(&event_type, event_version, payload)
                {
                    Ok(value) => decoded.push(Some(value)),
                    Err(error) => {
                        let (reason, error) = decode_failure(payload, &error);
                        return reject(reason, error, Some(event_id));
                    }
                }
            }
        }
        Check::Json => {
            if !is_json(payload) {
                let error = match std::str::from_utf8(payload) {
                    Err(e) => format!("payload is not UTF-8 JSON: {e}"),
                    Ok(s) => match serde_json::from_str::<serde::de::IgnoredAny>(s) {
                        Err(e) => format!("payload is not JSON: {e}"),
                        Ok(_) => "payload is not JSON".into(),
                    },
                };
                return reject(DeadLetterReason::NotJson, error, Some(event_id));
            }
        }
    }
    let key = text(raw.key).unwrap_or_default();
    Body::Event(Box::new(Event {
        incoming: IncomingEvent::new(
            event_id,
            event_type,
            event_version,
            raw.topic,
            key,
            app_headers(raw),
        ),
        handlers: handlers.to_vec(),
        payload: payload.to_vec(),
        decoded,
    }))
}

/// The dead letter of a message over the size limit: its key, headers and
/// payload cut to [`KEPT_BYTES`], with the payload's full size and SHA-256.
fn oversized(raw: &Raw<'_>, size: usize, max_bytes: usize, event_id: Option<Uuid>) -> Body {
    use sha2::{Digest, Sha256};
    let payload = raw.payload.unwrap_or_default();
    let digest = Sha256::digest(payload);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let cut = |b: &[u8]| b[..b.len().min(KEPT_BYTES)].to_vec();
    Body::Rejected(Box::new(Rejected {
        key: raw.key.map(cut),
        event_id,
        event_type: header(raw, header::EVENT_TYPE)
            .and_then(|v| v.map(cut))
            .as_deref()
            .map(|v| pg_text(&String::from_utf8_lossy(v)).into_owned()),
        headers: headers_json(raw),
        payload: raw.payload.map(cut),
        reason: DeadLetterReason::Oversized,
        error: format!(
            "message of {size} bytes (key, headers and payload) exceeds the consumer's limit of \
             {max_bytes} bytes; the dead letter keeps the first {} of the payload's {} bytes \
             (sha256 {hex})",
            payload.len().min(KEPT_BYTES),
            payload.len()
        ),
        handler: None,
        attempts: 0,
        payload_bytes: (payload.len() > KEPT_BYTES).then_some(payload.len() as i64),
    }))
}

impl Event {
    /// The value for handler number `i` of the route: the one decoded while
    /// parsing if still there, else decoded again.
    pub fn take_decoded(
        &mut self,
        i: usize,
        registry: &Registry,
    ) -> Result<Decoded, Box<Rejected>> {
        if let Some(value) = self.decoded.get_mut(i).and_then(Option::take) {
            return Ok(value);
        }
        let handler = registry.handler(self.handlers[i]);
        handler
            .decode(
                &self.incoming.event_type,
                self.incoming.event_version,
                &self.payload,
            )
            .map_err(|error| {
                let (reason, error) = decode_failure(&self.payload, &error);
                Box::new(self.rejected(reason, error, None, 0))
            })
    }

    /// The event as a dead letter.
    pub fn rejected(
        &self,
        reason: DeadLetterReason,
        error: String,
        handler: Option<&'static str>,
        attempts: i32,
    ) -> Rejected {
        let i = &self.incoming;
        let mut headers = Map::new();
        headers.insert(header::EVENT_ID.into(), i.event_id.to_string().into());
        headers.insert(header::EVENT_TYPE.into(), i.event_type.clone().into());
        headers.insert(
            header::EVENT_VERSION.into(),
            i.event_version.to_string().into(),
        );
        if let Ok(Value::Object(app)) = serde_json::to_value(&i.headers) {
            for (k, v) in app {
                let v = match v {
                    Value::String(s) => Value::String(s),
                    other => Value::String(other.to_string()),
                };
                headers.insert(k, v);
            }
        }
        Rejected {
            key: Some(i.partition_key.as_bytes().to_vec()),
            event_id: Some(i.event_id),
            event_type: Some(i.event_type.clone()),
            headers,
            payload: Some(self.payload.clone()),
            reason,
            error,
            handler,
            attempts,
            payload_bytes: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn app_headers_split_known_entries_from_custom_ones() {
        let corr = Uuid::now_v7().to_string();
        let raw = Raw {
            topic: "t",
            partition: 0,
            offset: 0,
            key: Some(b"k"),
            payload: Some(b"{}"),
            headers: Vec::new(),
            bad_names: 0,
        }
        .with_byte_headers(vec![
            (b"event_id", Some(b"x")),
            (b"correlation_id", Some(corr.as_bytes())),
            (b"causation_id", Some(b"not-a-uuid")),
            (b"traceparent", Some(b"00-a-b-01")),
            (b"tenant", Some(b"acme")),
            (b"empty", None),
            (b"caf\xe9", Some(b"latin-1 name")),
        ]);
        assert_eq!(raw.bad_names, 1);
        let h = app_headers(&raw);
        assert_eq!(h.correlation_id.map(|c| c.to_string()), Some(corr.clone()));
        assert_eq!(h.causation_id, None);
        assert_eq!(h.extra["causation_id"], "not-a-uuid");
        assert_eq!(h.traceparent.as_deref(), Some("00-a-b-01"));
        assert_eq!(h.extra["tenant"], "acme");
        assert!(!h.extra.contains_key("event_id"));
        assert!(!h.extra.contains_key("empty"));
        let json = headers_json(&raw);
        assert_eq!(json["empty"], Value::Null);
        assert_eq!(json["tenant"], "acme");
    }

    #[test]
    fn json_check() {
        assert!(is_json(br#"{"a":1}"#));
        assert!(!is_json(b"{\"a\":"));
        assert!(!is_json(b"\xff\xfe"));
        assert!(!is_json(b"{} {}"));
    }
}
