//! The database settings: the URL (TLS through its `sslmode`,
//! `sslrootcert`, `sslcert`, `sslkey`), the connect timeout, how schema
//! changes wait for locks; a pool with libpq's `sslmode=allow`; URLs with
//! their password hidden.

use std::fmt;
use std::time::Duration;

use outbox_core::LockPolicy;
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

use super::apply::ms;
use crate::error::{Error, Result};
use crate::kafka;

/// The database: its URL (with `sslmode`, `sslrootcert`, `sslcert`,
/// `sslkey` for TLS) and the connect timeout. `Debug` hides the URL's
/// password.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct DatabaseSettings {
    /// `postgres://user[:password]@host[:port]/database[?sslmode=verify-full&sslrootcert=ca.pem]`.
    pub url: Option<String>,
    /// How long to wait for a connection (TCP, TLS and authentication);
    /// default 10 s.
    pub connect_timeout_ms: Option<u64>,
    /// Schema changes (migrations, `outbox notify on|off`): how long one
    /// attempt waits for a table lock (default 2 s; see [`LockPolicy`]).
    pub lock_timeout_ms: Option<u64>,
    /// Schema changes: how long to keep trying (default 5 min).
    pub lock_max_wait_ms: Option<u64>,
    /// The schema holding this service's outbox tables, when services share
    /// a database (one schema each): the connections' `search_path`. Unset:
    /// the URL's or the role's `search_path`. A plain identifier.
    pub schema: Option<String>,
}

impl fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("lock_timeout_ms", &self.lock_timeout_ms)
            .field("lock_max_wait_ms", &self.lock_max_wait_ms)
            .field("schema", &self.schema)
            .finish()
    }
}

/// The default database connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl DatabaseSettings {
    /// The connect timeout (default 10 s).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout_ms
            .map_or(DEFAULT_CONNECT_TIMEOUT, Duration::from_millis)
    }

    /// The connection options the URL describes. Errors never repeat the
    /// URL (it may hold a password). `sslmode=allow` is resolved as libpq
    /// does only by [`DatabaseSettings::pool`]; here it stays as sqlx reads
    /// it (no TLS).
    pub fn connect_options(&self) -> Result<PgConnectOptions> {
        let url = self.url.as_deref().ok_or_else(|| {
            Error::Config(
                "no database: set DATABASE_URL (or [database] url in the configuration file)"
                    .into(),
            )
        })?;
        let invalid = |why: &str| {
            Error::Config(format!(
                "DATABASE_URL is not a valid PostgreSQL URL ({why}); expected postgres://user@host:5432/database"
            ))
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(invalid("it must start with postgres:// or postgresql://"));
        }
        let options = url.parse::<PgConnectOptions>().map_err(|error| {
            // sqlx's message names the bad part (an sslmode, a port), never
            // the password; the URL itself is not repeated.
            let text = error.to_string();
            let text = self
                .password()
                .map_or(text.clone(), |p| text.replace(&p, kafka::REDACTED));
            invalid(&text)
        })?;
        // No JIT: the framework's statements are short, and PostgreSQL's
        // estimates for them grow with the table (a status query reading
        // nothing spent 650 ms compiling itself on an outbox of 1M rows).
        let options = options.options([("jit", "off")]);
        Ok(match &self.schema {
            Some(schema) => {
                check_schema(schema)?;
                options.options([("search_path", schema.as_str())])
            }
            None => options,
        })
    }

    /// The URL's password, if it has one.
    fn password(&self) -> Option<String> {
        let url = self.url.as_deref()?;
        let rest = url.split_once("://")?.1;
        let authority = rest.split(['/', '?']).next()?;
        let userinfo = authority.rsplit_once('@')?.0;
        let password = userinfo.split_once(':')?.1;
        (!password.is_empty()).then(|| password.to_owned())
    }

    /// A pool of at most `max_connections` on this database, connecting
    /// lazily, with the connect timeout as its acquire timeout.
    /// `sslmode=allow` behaves as libpq's: plain text, unless the server
    /// insists on TLS (sqlx alone never tries TLS with `allow`); this asks
    /// the server once, here.
    pub async fn pool(&self, max_connections: u32) -> Result<sqlx::PgPool> {
        let mut options = self.connect_options()?;
        if matches!(options.get_ssl_mode(), PgSslMode::Allow) {
            options = resolve_allow(options, self.connect_timeout()).await;
        }
        Ok(PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(self.connect_timeout())
            .connect_lazy_with(options))
    }

    /// How schema changes wait for table locks.
    pub fn lock_policy(&self) -> LockPolicy {
        let default = LockPolicy::default();
        LockPolicy::new(
            self.lock_timeout_ms.map_or(default.lock_timeout, ms),
            self.lock_max_wait_ms.map_or(default.max_wait, ms),
        )
    }

    /// These settings with `higher`'s on top.
    pub fn overlay(self, higher: DatabaseSettings) -> DatabaseSettings {
        DatabaseSettings {
            url: higher.url.or(self.url),
            connect_timeout_ms: higher.connect_timeout_ms.or(self.connect_timeout_ms),
            lock_timeout_ms: higher.lock_timeout_ms.or(self.lock_timeout_ms),
            lock_max_wait_ms: higher.lock_max_wait_ms.or(self.lock_max_wait_ms),
            schema: higher.schema.or(self.schema),
        }
    }
}

/// A schema name as [`DatabaseSettings::schema`] takes it: a plain
/// identifier (what `search_path` is set to, and what `outbox migrate`
/// creates).
pub fn check_schema(schema: &str) -> Result<()> {
    let mut chars = schema.chars();
    let plain = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && schema.len() <= 63;
    if plain {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid schema `{schema}`: use a plain identifier (a-z, 0-9, _, not starting \
             with a digit, at most 63 characters)"
        )))
    }
}

/// libpq's `sslmode=allow`: try without TLS; if the server refuses a
/// connection without encryption, use TLS (without verifying the
/// certificate, as `allow` does not).
async fn resolve_allow(options: PgConnectOptions, timeout: Duration) -> PgConnectOptions {
    use sqlx::{ConnectOptions, Connection};
    let plain = options.clone().ssl_mode(PgSslMode::Disable);
    match tokio::time::timeout(timeout, plain.connect()).await {
        Ok(Err(sqlx::Error::Database(error)))
            if error.code().as_deref() == Some("28000")
                && error.message().contains("no encryption") =>
        {
            tracing::debug!("sslmode=allow: the server requires TLS; using it");
            options.ssl_mode(PgSslMode::Require)
        }
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            options.ssl_mode(PgSslMode::Disable)
        }
        // Unreachable or another refusal: the pool reports it when used.
        _ => options.ssl_mode(PgSslMode::Disable),
    }
}

/// `postgres://user:***@host/db`: the URL with its password hidden (the
/// user-info's, and a `password` query parameter). Anything that is not a
/// URL with an authority (`scheme://…`) is hidden whole.
pub fn redact_url(url: &str) -> String {
    let Some(mut parsed) = url::Url::parse(url).ok().filter(url::Url::has_authority) else {
        return kafka::REDACTED.into();
    };
    if parsed.password().is_some() && parsed.set_password(Some(kafka::REDACTED)).is_err() {
        return kafka::REDACTED.into();
    }
    let password = |k: &str| k.eq_ignore_ascii_case("password");
    if parsed.query_pairs().any(|(k, _)| password(&k)) {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(k, v)| match password(&k) {
                true => (k.into_owned(), kafka::REDACTED.to_owned()),
                false => (k.into_owned(), v.into_owned()),
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_passwords() {
        assert_eq!(
            redact_url("postgres://u:s3cret@h:5432/d?sslmode=require"),
            "postgres://u:***@h:5432/d?sslmode=require"
        );
        assert_eq!(redact_url("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(
            redact_url("postgres://h/d?user=u&password=s3cret"),
            "postgres://h/d?user=u&password=***"
        );
        assert_eq!(redact_url("garbage s3cret"), "***");
        // Not a URL with an authority: hidden whole.
        assert_eq!(redact_url("u:s3cret@h/d"), "***");
        assert_eq!(
            redact_url("postgres://u:s%40cret@[::1]:5432/d"),
            "postgres://u:***@[::1]:5432/d"
        );
        assert_eq!(
            redact_url("postgres:///d?host=/run/pg&PASSWORD=s3cret"),
            "postgres:///d?host=%2Frun%2Fpg&PASSWORD=***"
        );
        assert_eq!(redact_url("postgres://h/d"), "postgres://h/d");
        let d = DatabaseSettings {
            url: Some("postgres://u:s3cret@h/d".into()),
            ..DatabaseSettings::default()
        };
        assert!(!format!("{d:?}").contains("s3cret"));
        assert_eq!(d.password().as_deref(), Some("s3cret"));
    }
}
