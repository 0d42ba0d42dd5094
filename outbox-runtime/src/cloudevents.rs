//! CloudEvents 1.0 in Kafka binary mode: the relay's opt-in `ce_*` headers
//! ([`CloudEvents`], beside the framework's own headers or instead of
//! them), and how a consumer reads a message that carries only `ce_*`
//! headers (an event from another producer): `ce_type` is the event type,
//! `ce_id` the event id, `ce_eventversion` (an extension) the version.
//!
//! A `ce_id` that is not a UUID gets a stable one: the first 16 bytes of
//! SHA-256 over `ce_source`, a NUL and `ce_id`, as a version-8 UUID. The
//! same event (same source and id, the CloudEvents identity) always gets
//! the same event id, so it is deduplicated like any other; events of two
//! sources that reuse an id are not confused.

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

/// The event id of a CloudEvents message: `ce_id` itself when it is a
/// UUID, else one derived from (`ce_source`, `ce_id`) (see the module docs).
pub fn event_id(source: &str, id: &str) -> Uuid {
    if let Ok(uuid) = id.parse::<Uuid>() {
        return uuid;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_kept_or_derived_stably() {
        let uuid = Uuid::now_v7();
        assert_eq!(event_id("/a", &uuid.to_string()), uuid);
        let derived = event_id("/billing", "inv-42");
        assert_eq!(derived, event_id("/billing", "inv-42"));
        assert_eq!(derived.get_version_num(), 8);
        assert_ne!(derived, event_id("/shipping", "inv-42"));
        assert_ne!(derived, event_id("/billing", "inv-43"));
        // The separator keeps (source, id) pairs apart.
        assert_ne!(event_id("/a", "bc"), event_id("/ab", "c"));
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
