//! W3C trace context (`traceparent`) without a tracing backend: parsing,
//! starting a new trace, and deriving the context of a follow-up event (same
//! trace id, new parent span id). The Unit of Work and the handler context
//! use it so that one trace id follows a business flow from the command,
//! through the outbox and Kafka, into the handlers and their follow-ups.
//! With the `otel` feature, its `otel` module turns it into OpenTelemetry span
//! contexts and back.

#[cfg(feature = "otel")]
pub mod otel;

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

/// A parsed W3C `traceparent` (version `00`):
/// `00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: u128,
    parent_id: u64,
    flags: u8,
}

/// A `traceparent` value that is not a valid W3C trace context.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid traceparent `{0}`: expected `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`, ids not all zero"
)]
pub struct InvalidTraceParent(pub String);

impl TraceParent {
    /// A new trace: random trace id and span id, sampled.
    pub fn new_root() -> Self {
        Self {
            trace_id: nonzero_u128(),
            parent_id: nonzero_u64(),
            flags: 0x01,
        }
    }

    /// The context of something caused by this one: the same trace id and
    /// flags, a new random parent span id.
    pub fn child(&self) -> Self {
        Self {
            parent_id: nonzero_u64(),
            ..*self
        }
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The parent span id as 16 lowercase hex digits.
    pub fn parent_id(&self) -> String {
        format!("{:016x}", self.parent_id)
    }

    /// The trace flags (bit 0: sampled).
    pub fn flags(&self) -> u8 {
        self.flags
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

impl FromStr for TraceParent {
    type Err = InvalidTraceParent;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidTraceParent(s.to_owned());
        let parts: Vec<&str> = s.trim().split('-').collect();
        let hex = |p: &str, len: usize| {
            p.len() == len && p.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        // Version 00 has exactly four fields; later versions may append
        // fields, which a version-00 reader ignores (W3C, "versioning").
        let [version, trace, parent, flags, rest @ ..] = parts.as_slice() else {
            return Err(invalid());
        };
        if !hex(version, 2)
            || *version == "ff"
            || (*version == "00" && !rest.is_empty())
            || !hex(trace, 32)
            || !hex(parent, 16)
            || !hex(flags, 2)
        {
            return Err(invalid());
        }
        let trace_id = u128::from_str_radix(trace, 16).map_err(|_| invalid())?;
        let parent_id = u64::from_str_radix(parent, 16).map_err(|_| invalid())?;
        let flags = u8::from_str_radix(flags, 16).map_err(|_| invalid())?;
        if trace_id == 0 || parent_id == 0 {
            return Err(invalid());
        }
        Ok(Self {
            trace_id,
            parent_id,
            flags,
        })
    }
}

fn nonzero_u128() -> u128 {
    loop {
        let v = Uuid::new_v4().as_u128();
        if v != 0 {
            return v;
        }
    }
}

fn nonzero_u64() -> u64 {
    loop {
        let (hi, lo) = Uuid::new_v4().as_u64_pair();
        let v = hi ^ lo;
        if v != 0 {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_the_w3c_example() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t: TraceParent = s.parse().unwrap();
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent_id(), "00f067aa0ba902b7");
        assert_eq!(t.flags(), 1);
        assert_eq!(t.to_string(), s);
    }

    #[test]
    fn refuses_malformed_values() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert!(bad.parse::<TraceParent>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_changes_the_span() {
        let root = TraceParent::new_root();
        let child = root.child();
        assert_eq!(child.trace_id(), root.trace_id());
        assert_ne!(child.parent_id(), root.parent_id());
        assert_eq!(child.to_string().parse::<TraceParent>().unwrap(), child);
        assert_ne!(TraceParent::new_root().trace_id(), root.trace_id());
    }
}
