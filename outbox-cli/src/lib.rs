//! The `outbox` command: migrations, the relay, status, topics, parked rows,
//! replay, retention cleanup, the NOTIFY switch, the consumers' dead
//! letters, and the settings in effect. Settings come from flags, the
//! environment and a configuration file, in that order (`config`); secrets
//! are never printed.
//!
//! Modules: `args` (the command line), `config` (where settings come from),
//! `commands` (the subcommands), `console` (the web console's command),
//! `output` (tables), `schema` (event schemas).
//!
//! The library is the whole command: an application that wants
//! `outbox schema export` builds its own `outbox` binary around its event
//! catalogue with [`run_with`].

#![deny(missing_docs)]

mod args;
mod commands;
mod config;
mod console;
mod output;
mod schema;

use std::process::ExitCode;

use clap::Parser;
use outbox_runtime::Error;

use crate::args::Cli;
use crate::commands::Ctx;
use crate::config::Layers;

pub use outbox_core::contracts::Catalogue;

/// The `outbox` command as the published binary runs it: no event catalogue.
pub async fn run() -> ExitCode {
    main_with(None).await
}

/// The `outbox` command with the application's event catalogue: every
/// command of the published binary, plus `outbox schema export DIR`, and
/// `outbox schema check --against SNAPSHOT` against the catalogue. An
/// application's own binary (e.g. `src/bin/outbox.rs`):
///
/// ```ignore
/// #[tokio::main]
/// async fn main() -> std::process::ExitCode {
///     outbox_cli::run_with(my_events::catalogue()).await
/// }
/// ```
pub async fn run_with(catalogue: Catalogue) -> ExitCode {
    main_with(Some(catalogue)).await
}

/// [`run_with`] on the given arguments (the first is the program name)
/// instead of the process's.
pub async fn run_with_args<I, T>(catalogue: Option<Catalogue>, args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    run_cli(catalogue, Cli::parse_from(args)).await
}

async fn main_with(catalogue: Option<Catalogue>) -> ExitCode {
    run_cli(catalogue, Cli::parse()).await
}

async fn run_cli(catalogue: Option<Catalogue>, cli: Cli) -> ExitCode {
    // Exports the relay's spans while it runs; flushes them on return.
    let _telemetry = match init_tracing(&cli) {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("error: {}", describe(&error));
            return ExitCode::from(2);
        }
    };
    if let crate::args::Command::Schema(command) = cli.command {
        return schema::run(command, catalogue.as_ref());
    }
    match start(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", describe(&error));
            if matches!(error, Error::Config(_)) {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Logs to stderr (`RUST_LOG`, default `info`). With the `otel` feature,
/// `outbox relay` also exports its spans by OTLP when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set (see `outbox_runtime::telemetry`);
/// the guard flushes them.
#[cfg(feature = "otel")]
fn init_tracing(cli: &Cli) -> Result<Option<outbox_runtime::telemetry::TelemetryGuard>, Error> {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let export = matches!(cli.command, crate::args::Command::Relay(_))
        && outbox_runtime::telemetry::configured();
    let (otel, guard) = if export {
        let (layer, guard) = outbox_runtime::telemetry::layer("outbox-relay")?;
        (Some(layer), Some(guard))
    } else {
        (None, None)
    };
    let _ = tracing_subscriber::registry()
        .with(log_filter())
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(otel)
        .try_init();
    Ok(guard)
}

/// Logs to stderr (`RUST_LOG`, default `info`).
#[cfg(not(feature = "otel"))]
fn init_tracing(_cli: &Cli) -> Result<Option<()>, Error> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(log_filter())
        .with_writer(std::io::stderr)
        .try_init();
    Ok(None)
}

fn log_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
}

async fn start(cli: Cli) -> Result<(), Error> {
    let flags = cli.flag_settings()?;
    let layers = Layers::load(cli.config.as_deref(), flags)?;
    let settings = layers.merged();
    commands::run(Ctx { layers, settings }, cli.command).await
}

/// The error with its causes, and a hint for the usual TLS mistakes.
fn describe(error: &Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    if text.contains("certificate verify failed") || text.contains("certificate is not trusted") {
        text.push_str(
            "\n  hint: the server's TLS certificate was refused: sslrootcert must name the CA \
             that signed it, and with sslmode=verify-full the host in DATABASE_URL must be \
             one the certificate names",
        );
    } else if text.contains("server does not support TLS") {
        text.push_str(
            "\n  hint: the server has TLS off (ssl = off); use sslmode=prefer or disable, \
             or turn TLS on at the server",
        );
    }
    text
}
