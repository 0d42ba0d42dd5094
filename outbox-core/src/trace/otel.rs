//! The bridge between [`TraceParent`] and OpenTelemetry (feature `otel`):
//! conversion to and from an OpenTelemetry [`SpanContext`], and the context
//! of a `tracing` span when the `tracing-opentelemetry` layer is installed.
//! The Unit of Work, the handler context and the runtime's spans use it so
//! that the `traceparent` the outbox carries is the one of a real span.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::TraceParent;

impl TraceParent {
    /// This context as a remote OpenTelemetry span context (the parent of
    /// a span that continues it, or the target of a link), with `tracestate`
    /// if given and well-formed.
    pub fn to_span_context(&self, tracestate: Option<&str>) -> SpanContext {
        let state = tracestate
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        SpanContext::new(
            TraceId::from_bytes(self.trace_id.to_be_bytes()),
            SpanId::from_bytes(self.parent_id.to_be_bytes()),
            TraceFlags::new(self.flags),
            true,
            state,
        )
    }

    /// The `traceparent` of an OpenTelemetry span context: `None` if it is
    /// not valid (all-zero ids).
    pub fn from_span_context(context: &SpanContext) -> Option<Self> {
        if !context.is_valid() {
            return None;
        }
        Some(Self {
            trace_id: u128::from_be_bytes(context.trace_id().to_bytes()),
            parent_id: u64::from_be_bytes(context.span_id().to_bytes()),
            flags: context.trace_flags().to_u8(),
        })
    }

    /// The OpenTelemetry context of `span` and its `tracestate` (`None` if
    /// empty): `None` when the span has none, because no
    /// `tracing-opentelemetry` layer is installed or the span is disabled.
    /// Starts the span on the OpenTelemetry side (its parent can no longer
    /// be set).
    pub fn of_span(span: &tracing::Span) -> Option<(Self, Option<String>)> {
        if span.is_disabled() {
            return None;
        }
        let context = span.context();
        let span_ref = context.span();
        let span_context = span_ref.span_context();
        let parent = Self::from_span_context(span_context)?;
        let state = span_context.trace_state().header();
        Some((parent, (!state.is_empty()).then_some(state)))
    }

    /// [`of_span`](Self::of_span) of the current span.
    pub fn current() -> Option<(Self, Option<String>)> {
        Self::of_span(&tracing::Span::current())
    }
}

/// Makes the remote context `traceparent` (with `tracestate`) the
/// OpenTelemetry parent of `span`, which must not have been entered yet.
/// Does nothing without a `tracing-opentelemetry` layer or if `span` is
/// disabled.
pub fn set_remote_parent(
    span: &tracing::Span,
    traceparent: &TraceParent,
    tracestate: Option<&str>,
) {
    if span.is_disabled() {
        return;
    }
    let parent = opentelemetry::Context::new()
        .with_remote_span_context(traceparent.to_span_context(tracestate));
    // Without the layer there is nothing to parent; a started span keeps
    // the parent it has.
    let _ = span.set_parent(parent);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_through_a_span_context() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parent: TraceParent = s.parse().unwrap();
        let context = parent.to_span_context(Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"));
        assert_eq!(
            context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(context.span_id().to_string(), "00f067aa0ba902b7");
        assert!(context.is_sampled());
        assert!(context.is_remote());
        assert_eq!(
            context.trace_state().header(),
            "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
        );
        let back = TraceParent::from_span_context(&context).unwrap();
        assert_eq!(back, parent);
        assert_eq!(back.to_string(), s);
    }

    #[test]
    fn flags_and_a_bad_tracestate_carry_over() {
        let parent: TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
            .parse()
            .unwrap();
        let context = parent.to_span_context(Some("not a tracestate"));
        assert!(!context.is_sampled());
        assert_eq!(context.trace_state().header(), "");
        assert_eq!(
            TraceParent::from_span_context(&context)
                .unwrap()
                .to_string(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
        );
    }

    #[test]
    fn an_invalid_span_context_has_no_traceparent() {
        assert_eq!(
            TraceParent::from_span_context(&SpanContext::empty_context()),
            None
        );
        let no_span = SpanContext::new(
            TraceId::from_bytes([1; 16]),
            SpanId::INVALID,
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        );
        assert_eq!(TraceParent::from_span_context(&no_span), None);
    }

    #[test]
    fn a_span_has_no_context_without_the_layer() {
        let span = tracing::info_span!("no layer");
        assert_eq!(TraceParent::of_span(&span), None);
        assert_eq!(TraceParent::current(), None);
    }
}
