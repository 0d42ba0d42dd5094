//! CloudEvents 1.0 in Kafka binary mode: the relay's opt-in `ce_*` headers
//! ([`CloudEvents`], beside the framework's own headers or instead of
//! them), and how a consumer reads a message that carries only `ce_*`
//! headers (an event from another producer): `ce_type` is the event type,
//! `ce_id` the event id, `ce_eventversion` (an extension) the version.
//!
//! The event id of such a message: a CloudEvent is identified by its
//! `ce_source` and `ce_id` together, and producers use all kinds of ids
//! (request ids, trace ids, UUIDs in any spelling), so the id is derived
//! from both — the first 16 bytes of SHA-256 over `ce_source`, a NUL and
//! `ce_id`, as a version-8 UUID ([`event_id`]). The same event (same source
//! and id) always gets the same event id, so it is deduplicated like any
//! other; equal ids of two sources stay apart. Only a message in the form
//! this framework's relay writes keeps its `ce_id` as the event id: the
//! canonical lower-case hyphenated UUID, with the relay's `ce_aggregatetype`
//! extension beside it ([`relay_event_id`]) — so an event keeps its id
//! whether its relay writes CloudEvents headers or not.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};

/// Header names of CloudEvents binary mode on Kafka (`ce_` + attribute).
pub mod header {
    /// `specversion` (always `1.0`).
    pub const SPECVERSION: &str = "ce_specversion";
    /// `id`: the event id.
    pub const ID: &str = "ce_id";
    /// `type`: the event type.
    pub const TYPE: &str = "ce_type";
    /// `source`: who produced it ([`CloudEvents::source`](super::CloudEvents::source)).
    pub const SOURCE: &str = "ce_source";
    /// `time`: when the event was recorded (RFC 3339, UTC).
    pub const TIME: &str = "ce_time";
    /// `subject`: the aggregate id.
    pub const SUBJECT: &str = "ce_subject";
    /// Extension `eventversion`: the event type's schema version.
    pub const EVENT_VERSION: &str = "ce_eventversion";
    /// Extension `aggregatetype`: the aggregate type.
    pub const AGGREGATE_TYPE: &str = "ce_aggregatetype";
    /// The only `specversion` written and accepted.
    pub const SPEC_1_0: &str = "1.0";
}

/// Whether the relay writes CloudEvents headers, and whether the
/// framework's own identity headers stay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloudEventsMode {
    /// The framework's headers only (default).
    #[default]
    Off,
    /// CloudEvents headers beside the framework's.
    Both,
    /// CloudEvents headers instead of the framework's identity headers
    /// (`event_id`, `event_type`, `event_version`, `aggregate_type`,
    /// `aggregate_id`); `content-type` and the application's headers
    /// (correlation, trace context, custom entries) stay. Consumers of this
    /// framework read such messages as well.
    Only,
}

impl CloudEventsMode {
    /// `off`, `both` or `only`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Both => "both",
            Self::Only => "only",
        }
    }
}

impl fmt::Display for CloudEventsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CloudEventsMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "false" | "none" => Ok(Self::Off),
            "both" => Ok(Self::Both),
            "only" => Ok(Self::Only),
            _ => Err(Error::Config(format!(
                "cloud_events: `{s}` is not a mode: off (default), both (CloudEvents headers \
                 beside the framework's) or only (instead of them)"
            ))),
        }
    }
}

/// The default `ce_source` of the relay.
pub const DEFAULT_SOURCE: &str = "/outbox";

/// The relay's CloudEvents setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    /// Off, beside or instead of the framework's headers.
    pub mode: CloudEventsMode,
    /// The `ce_source` of every event (a URI reference naming the
    /// producing service, e.g. `/orders-service`; default `/outbox`).
    pub source: String,
}

impl Default for CloudEvents {
    fn default() -> Self {
        Self {
            mode: CloudEventsMode::Off,
            source: DEFAULT_SOURCE.to_owned(),
        }
    }
}

impl CloudEvents {
    /// Checks the source: not empty, no control characters.
    pub fn validate(&self) -> Result<()> {
        if self.source.trim().is_empty() || self.source.chars().any(char::is_control) {
            return Err(Error::Config(format!(
                "cloud_events_source `{}` must be a non-empty URI reference (e.g. /orders-service)",
                self.source.escape_debug()
            )));
        }
        Ok(())
    }
}

/// The event id of a CloudEvents message of another producer: derived from
/// its `ce_source` and `ce_id` (see the module docs), whatever `id` looks
/// like — a UUID too.
pub fn event_id(source: &str, id: &str) -> Uuid {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(source.as_bytes());
    hasher.update([0]);
    hasher.update(id.as_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// `ce_id` as this framework's relay writes it — an event id in the
/// canonical lower-case hyphenated form — parsed; `None` for any other
/// spelling (upper case, 32 digits, braces, `urn:uuid:`) or id.
pub fn relay_event_id(id: &str) -> Option<Uuid> {
    let uuid = Uuid::try_parse(id).ok()?;
    let canonical = *uuid.hyphenated().encode_lower(&mut Uuid::encode_buffer()) == *id;
    canonical.then_some(uuid)
}

/// The event id a consumer gives a CloudEvents message: `ce_id` as is when
/// the message is in the relay's form (`relay_extension`: it carries
/// `ce_aggregatetype`, and `id` is canonical), else derived from `source`
/// and `id`.
pub(crate) fn message_event_id(source: &str, id: &str, relay_extension: bool) -> Uuid {
    relay_extension
        .then(|| relay_event_id(id))
        .flatten()
        .unwrap_or_else(|| event_id(source, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_kept_or_derived_stably() {
        let uuid = Uuid::now_v7();
        let canonical = uuid.to_string();
        assert_eq!(message_event_id("/a", &canonical, true), uuid);
        let derived = event_id("/billing", "inv-42");
        assert_eq!(derived, event_id("/billing", "inv-42"));
        assert_eq!(derived.get_version_num(), 8);
        assert_ne!(derived, event_id("/shipping", "inv-42"));
        assert_ne!(derived, event_id("/billing", "inv-43"));
        // The separator keeps (source, id) pairs apart.
        assert_ne!(event_id("/a", "bc"), event_id("/ab", "c"));
        // Without the relay's extension, a UUID is an id of its source.
        assert_eq!(
            message_event_id("/a", &canonical, false),
            event_id("/a", &canonical)
        );
        assert_ne!(event_id("/a", &canonical), uuid);
    }

    #[test]
    fn only_the_canonical_spelling_is_the_relays() {
        let uuid = Uuid::now_v7();
        assert_eq!(relay_event_id(&uuid.to_string()), Some(uuid));
        for other in [
            uuid.hyphenated().to_string().to_uppercase(),
            uuid.simple().to_string(),
            uuid.braced().to_string(),
            uuid.urn().to_string(),
            format!(" {uuid}"),
            "inv-42".to_owned(),
        ] {
            assert_eq!(relay_event_id(&other), None, "{other}");
            assert_eq!(
                message_event_id("/a", &other, true),
                event_id("/a", &other),
                "{other}"
            );
        }
    }

    #[test]
    fn modes_parse() {
        assert_eq!(
            "both".parse::<CloudEventsMode>().unwrap(),
            CloudEventsMode::Both
        );
        assert_eq!(
            "ONLY".parse::<CloudEventsMode>().unwrap(),
            CloudEventsMode::Only
        );
        assert_eq!(
            "off".parse::<CloudEventsMode>().unwrap(),
            CloudEventsMode::Off
        );
        let error = "binary".parse::<CloudEventsMode>().unwrap_err().to_string();
        assert!(error.contains("off (default), both"), "{error}");
    }
}
