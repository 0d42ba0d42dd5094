//! `outbox console`: the web console ([`outbox_console`]) on an address,
//! with the database settings every subcommand takes, the write token from
//! the environment or a file (never from the command line), and the
//! brokers for the consumer groups' lag when some are configured.

use std::path::Path;

use outbox_console::{ConsoleConfig, WRITE_TOKEN_ENV};
use outbox_runtime::{CancellationToken, Error};

use crate::args::ConsoleArgs;
use crate::commands::{Ctx, stop_on_signal};

/// Reads the write token: the file named by `--write-token-file`, else the
/// environment; `None` for a read-only console.
fn write_token(file: Option<&Path>) -> Result<Option<String>, Error> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!(
                "cannot read the write token file {}: {e}",
                path.display()
            ))
        })?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(meta) = std::fs::metadata(path)
                && meta.permissions().mode() & 0o077 != 0
            {
                tracing::warn!(
                    file = %path.display(),
                    "the write token file can be read by other users (chmod 600)"
                );
            }
        }
        return Ok(Some(text));
    }
    match std::env::var(WRITE_TOKEN_ENV) {
        Ok(token) if !token.trim().is_empty() => Ok(Some(token)),
        _ => Ok(None),
    }
}

pub(crate) async fn run(ctx: &Ctx, args: ConsoleArgs) -> Result<(), Error> {
    let mut config = ConsoleConfig::new()
        .secure_cookie(args.secure_cookie)
        .trusted_proxies(args.trusted_proxy.iter().copied());
    if let Some(token) = write_token(args.write_token_file.as_deref())? {
        config = config.write_token(token)?;
    }
    if let Some(brokers) = ctx.settings.kafka.brokers.clone() {
        config = config.brokers(brokers, ctx.settings.kafka.pairs());
    }
    let writable = config.writable();
    let pool = ctx.pool(4).await?;
    // Fail now, not on the first page, if the database is unreachable.
    sqlx::query("SELECT 1").execute(&pool).await?;
    let token = CancellationToken::new();
    tokio::spawn(stop_on_signal(token.clone()));
    let (addr, task) = outbox_console::serve(args.addr, pool, config, token).await?;
    println!(
        "console on http://{addr}/ ({})",
        if writable {
            "writes allowed after login with the write token"
        } else {
            "read-only: no write token"
        }
    );
    task.await
        .map_err(|e| Error::Config(format!("the console stopped: {e}")))?
        .map_err(|e| Error::Config(format!("the console stopped: {e}")))
}
