//! `billing-service`: see the crate's README. Stops gracefully on SIGTERM or
//! Ctrl-C (exit code 0).

use std::io::IsTerminal;

use billing_service::{Config, run};
use outbox::runtime::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .init();
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
