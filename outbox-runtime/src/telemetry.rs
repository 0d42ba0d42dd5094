//! OpenTelemetry export (feature `otel`): a `tracing` layer that sends the
//! spans to an OTLP collector over HTTP/protobuf, configured only by the
//! standard `OTEL_*` environment variables, and the guard that flushes it.
//!
//! What the spans are: the command's span is the parent of the Unit of
//! Work's `outbox.commit`, whose context the outbox rows carry
//! (`traceparent`); each relay batch is an `outbox.relay.batch` root span
//! linked to its events' contexts; a consumer's `handle_event` span is a
//! child of the event's context, and the events its handlers record carry
//! the `handle_event` span's context, so the next handler's span is its
//! child — one trace from the command to the last handler.
//!
//! The environment, as the OpenTelemetry SDK and the OTLP exporter read it:
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`),
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT` (and their
//! `_TRACES_` forms),
//! `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
//! `OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_*` (the batch span processor),
//! `OTEL_SDK_DISABLED`. Only `http/protobuf` is built in
//! (`OTEL_EXPORTER_OTLP_PROTOCOL`, if set, must name it), without
//! compression (`OTEL_EXPORTER_OTLP_COMPRESSION` set is an error at start).

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetryLayer;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::error::{Error, Result};

/// How long dropping the [`TelemetryGuard`] waits for the last spans to be
/// exported, at most.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The layer [`layer`] returns: `tracing` spans to OpenTelemetry.
pub type OtelLayer<S> = OpenTelemetryLayer<S, SdkTracer>;

/// Whether the environment asks for export: `OTEL_EXPORTER_OTLP_ENDPOINT`
/// or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (not empty) and
/// `OTEL_SDK_DISABLED` is not `true`.
pub fn configured() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled =
        std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Flushes and shuts the exporter down when dropped (at most 5 s): keep it
/// alive until the process ends.
#[must_use = "dropping the guard shuts the exporter down"]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
}

impl std::fmt::Debug for TelemetryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryGuard").finish_non_exhaustive()
    }
}

impl TelemetryGuard {
    /// The tracer provider, e.g. to make it the global one
    /// (`opentelemetry::global::set_tracer_provider`) for code that uses
    /// the OpenTelemetry API directly.
    pub fn provider(&self) -> &SdkTracerProvider {
        &self.provider
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Err(error) = self.provider.force_flush() {
            eprintln!("OpenTelemetry: flushing the last spans failed: {error}");
        }
        if let Err(error) = self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
            eprintln!("OpenTelemetry: shutting the exporter down failed: {error}");
        }
    }
}

/// The OpenTelemetry layer for a subscriber the application composes
/// itself, exporting by OTLP as the `OTEL_*` variables say, and its guard.
/// `service` is the `service.name` unless `OTEL_SERVICE_NAME` or
/// `OTEL_RESOURCE_ATTRIBUTES` names one. An invalid endpoint or an
/// unsupported protocol is an [`Error::Config`] that names it.
///
/// ```ignore
/// use tracing_subscriber::prelude::*;
/// let (otel, _guard) = outbox::telemetry::layer("billing")?;
/// tracing_subscriber::registry().with(EnvFilter::from_default_env()).with(fmt::layer()).with(otel).init();
/// ```
pub fn layer<S>(service: &str) -> Result<(OtelLayer<S>, TelemetryGuard)>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    check_protocol()?;
    check_endpoints()?;
    let exporter = SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|e| Error::Config(format!("OpenTelemetry: the OTLP exporter: {e}")))?;
    let mut resource = Resource::builder();
    if !names_service() {
        resource = resource.with_service_name(service.to_owned());
    }
    let provider = SdkTracerProvider::builder()
        .with_resource(resource.build())
        .with_batch_exporter(exporter)
        .build();
    let tracer = provider.tracer("outbox");
    let layer = tracing_opentelemetry::layer().with_tracer(tracer);
    Ok((layer, TelemetryGuard { provider }))
}

/// Installs the global `tracing` subscriber: the `RUST_LOG` filter (default
/// `info`), logs to stderr, and — when [`configured`] — the OpenTelemetry
/// layer of [`layer`]. Returns its guard (`None` without export). An error
/// if a global subscriber is already installed, or as [`layer`].
pub fn init(service: &str) -> Result<Option<TelemetryGuard>> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let (otel, guard) = if configured() {
        let (layer, guard) = layer(service)?;
        (Some(layer), Some(guard))
    } else {
        (None, None)
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()
        .map_err(|e| Error::Config(format!("OpenTelemetry: installing the subscriber: {e}")))?;
    Ok(guard)
}

/// Refuses an `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL` this build cannot speak.
fn check_protocol() -> Result<()> {
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Ok(value) = std::env::var(name) {
            let value = value.trim();
            if !value.is_empty() && value != "http/protobuf" {
                return Err(Error::Config(format!(
                    "OpenTelemetry: {name}={value} is not supported: this build exports over http/protobuf only"
                )));
            }
        }
    }
    Ok(())
}

/// Refuses an endpoint that is not an `http://` or `https://` URL (the
/// exporter would quietly fall back to `localhost:4318`).
fn check_endpoints() -> Result<()> {
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ] {
        let Ok(value) = std::env::var(name) else {
            continue;
        };
        let value = value.trim();
        if value.is_empty() {
            continue;
        }
        let valid = reqwest::Url::parse(value).is_ok_and(|url| {
            matches!(url.scheme(), "http" | "https")
                && url.host_str().is_some_and(|h| !h.is_empty())
        });
        if !valid {
            return Err(Error::Config(format!(
                "OpenTelemetry: {name}={value} is not an http:// or https:// URL"
            )));
        }
    }
    Ok(())
}

/// Whether the environment names the service itself.
fn names_service() -> bool {
    std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.trim().is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| {
            v.split(',')
                .any(|kv| kv.split('=').next().map(str::trim) == Some("service.name"))
        })
}
