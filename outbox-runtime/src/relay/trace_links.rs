//! The relay batch span's OpenTelemetry links (feature `otel`): one per
//! distinct trace context among the events the batch sends (the
//! `traceparent` in each row's headers), at most [`MAX_LINKS`]. A batch
//! carries events of many traces, so it is no span's child: it is a root
//! that links to each of them.

use std::collections::HashSet;

use outbox_core::TraceParent;
use serde::Deserialize;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::claim::Row;

/// Links per batch span at most (the OpenTelemetry SDK's default limit of
/// links per span, beyond which it drops them anyway); the span's
/// `links_dropped` field counts the contexts left out.
pub(crate) const MAX_LINKS: usize = 128;

/// The trace entries of a row's stored headers.
#[derive(Deserialize)]
struct TraceHeaders {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

/// Links `span` to the trace context of each row of `rows` at `sent`
/// (distinct contexts, at most [`MAX_LINKS`]) and records how many it
/// linked and left out. Reads nothing when the span is disabled.
pub(crate) fn link_events(span: &tracing::Span, rows: &[Row], sent: &[usize]) {
    if span.is_disabled() {
        return;
    }
    let mut linked: HashSet<TraceParent> = HashSet::new();
    let mut dropped = 0_usize;
    for row in sent.iter().filter_map(|&i| rows.get(i)) {
        let Some((parent, state)) = trace_of(&row.headers) else {
            continue;
        };
        if linked.contains(&parent) {
            continue;
        }
        if linked.len() >= MAX_LINKS {
            dropped += 1;
            continue;
        }
        span.add_link(parent.to_span_context(state.as_deref()));
        linked.insert(parent);
    }
    span.record("links", linked.len());
    span.record("links_dropped", dropped);
}

/// The `traceparent` (and `tracestate`) of a row's headers, if valid.
fn trace_of(headers: &str) -> Option<(TraceParent, Option<String>)> {
    let headers: TraceHeaders = serde_json::from_str(headers).ok()?;
    let parent = headers.traceparent?.parse().ok()?;
    Some((parent, headers.tracestate))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_trace_of_stored_headers() {
        let (parent, state) = trace_of(
            r#"{"correlation_id": "0190f0f0-0000-7000-8000-000000000000", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "rojo=1"}"#,
        )
        .unwrap();
        assert_eq!(
            parent.to_string(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(state.as_deref(), Some("rojo=1"));
        assert!(trace_of("{}").is_none());
        assert!(trace_of(r#"{"traceparent": "nonsense"}"#).is_none());
        assert!(trace_of("not json").is_none());
    }
}
