//! `billing-service`: see the crate's README. Stops gracefully on SIGTERM or
//! Ctrl-C (exit code 0).

use std::io::IsTerminal;

use billing_service::{Config, run};
use outbox::runtime::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Kept until the end: flushes the spans exported (feature `otel`).
    let _telemetry = match init_tracing() {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("billing-service: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("billing-service: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    match run(config, shutdown).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "billing service failed");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Logs (`RUST_LOG`, default `info`). Built with the `otel` feature and
/// with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the spans also go to that OTLP
/// collector (the other `OTEL_*` variables apply); the guard flushes them.
#[cfg(feature = "otel")]
fn init_tracing() -> Result<Option<outbox::telemetry::TelemetryGuard>, outbox::runtime::Error> {
    use tracing_subscriber::prelude::*;
    let (otel, guard) = if outbox::telemetry::configured() {
        let (layer, guard) = outbox::telemetry::layer("billing-service")?;
        (Some(layer), Some(guard))
    } else {
        (None, None)
    };
    tracing_subscriber::registry()
        .with(log_filter())
        .with(tracing_subscriber::fmt::layer().with_ansi(std::io::stderr().is_terminal()))
        .with(otel)
        .init();
    Ok(guard)
}

/// Logs (`RUST_LOG`, default `info`). No guard without the `otel` feature.
#[cfg(not(feature = "otel"))]
fn init_tracing() -> Result<Option<()>, std::convert::Infallible> {
    tracing_subscriber::fmt()
        .with_env_filter(log_filter())
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(None)
}

fn log_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())
}

/// Cancels `token` on SIGTERM or Ctrl-C.
async fn stop_on_signal(token: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
    token.cancel();
}
