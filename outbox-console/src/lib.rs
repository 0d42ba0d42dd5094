//! A web console for the operators of an outbox: per topic backlog, oldest
//! unpublished age and throughput (with a live chart), the relays and their
//! lanes, the consumer groups (with their lag when a broker is configured),
//! parked rows and dead letters (filtered, paged, each with its error,
//! headers and payload), and the writes an operator makes on them —
//! requeue or drop parked rows, retry or drop dead letters — each confirmed,
//! with a mandatory reason and an audit record (`outbox_audit`).
//!
//! Server-rendered HTML (no front-end build): one stylesheet, and a small
//! inline script that polls `api/overview` for the chart. Every value is
//! HTML-escaped (payloads and errors are hostile input); secret-looking
//! headers and passwords in URLs are shown as `***`.
//!
//! Read-only unless started with a write token ([`ConsoleConfig::write_token`]):
//! an operator then logs in once with the token and a name; the console
//! sets an `HttpOnly`, `SameSite=Strict` cookie holding the name, an expiry
//! and an HMAC of both keyed by the token (checked in constant time). Every
//! write is a POST that checks it and is refused (403) otherwise.
//!
//! Every query reads an index and is bounded (keyset pages with a limit,
//! partial indexes for backlogs, the primary key for single rows): the
//! pages stay fast on an outbox of millions of rows.
//!
//! Modules: `auth` (token, session cookie, login), `html` (escaping, layout,
//! stylesheet, chart script), `views` (overview, relays, consumer groups),
//! `rows` (parked rows, dead letters), `actions` (writes and the audit
//! trail), `sampler` (throughput), `error` (error pages).
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_console::ConsoleConfig;
//! let token = std::env::var("OUTBOX_CONSOLE_WRITE_TOKEN")?;
//! let console = outbox_console::router(
//!     pool,
//!     ConsoleConfig::new().base_path("/console")?.write_token(token)?,
//! );
//! let app = axum::Router::new().nest("/console", console);
//! # let _ = app; Ok(()) }
//! ```

mod actions;
mod auth;
mod error;
mod html;
mod rows;
mod sampler;
mod views;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use outbox_runtime::{CancellationToken, Error};
use sqlx::PgPool;

pub use crate::actions::{AuditRecord, audit_log};

/// Environment variable the `outbox console` command reads the write token
/// from.
pub const WRITE_TOKEN_ENV: &str = "OUTBOX_CONSOLE_WRITE_TOKEN";

/// Shortest write token accepted (characters).
pub const MIN_TOKEN_LEN: usize = 16;

/// How the console runs. `Debug` never shows the token.
#[derive(Clone, Default)]
pub struct ConsoleConfig {
    write_token: Option<String>,
    base_path: String,
    brokers: Option<String>,
    kafka_settings: Vec<(String, String)>,
}

impl fmt::Debug for ConsoleConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsoleConfig")
            .field("write_token", &self.write_token.as_ref().map(|_| "***"))
            .field("base_path", &self.base_path)
            .field("brokers", &self.brokers)
            .field(
                "kafka_settings",
                &outbox_runtime::kafka::Redacted(&self.kafka_settings),
            )
            .finish()
    }
}

impl ConsoleConfig {
    /// A read-only console served at the root, without a broker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allows writes to operators who log in with `token` (at least
    /// [`MIN_TOKEN_LEN`] characters; surrounding whitespace, such as a
    /// file's final newline, is ignored).
    pub fn write_token(mut self, token: impl Into<String>) -> Result<Self, Error> {
        let token = token.into().trim().to_owned();
        if token.chars().count() < MIN_TOKEN_LEN {
            return Err(Error::Config(format!(
                "the console's write token is too short: at least {MIN_TOKEN_LEN} characters"
            )));
        }
        self.write_token = Some(token);
        Ok(self)
    }

    /// The path the router is nested under (`/console`), for its links; the
    /// default is the root.
    pub fn base_path(mut self, path: &str) -> Result<Self, Error> {
        let path = path.trim_end_matches('/');
        let valid = path.is_empty()
            || (path.starts_with('/')
                && path
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "/-_.".contains(c)));
        if !valid {
            return Err(Error::Config(format!(
                "invalid base path `{path}`: a path such as /console (letters, digits, / - _ .)"
            )));
        }
        self.base_path = path.to_owned();
        Ok(self)
    }

    /// Shows the consumer groups' lag, read from these brokers with these
    /// librdkafka settings (as the relay takes them).
    pub fn brokers(mut self, brokers: impl Into<String>, settings: Vec<(String, String)>) -> Self {
        self.brokers = Some(brokers.into());
        self.kafka_settings = settings;
        self
    }

    /// Whether writes are possible (a write token is set).
    pub fn writable(&self) -> bool {
        self.write_token.is_some()
    }
}

/// What the handlers share.
pub(crate) struct Console {
    pub pool: PgPool,
    pub config: ConsoleConfig,
    pub sampler: sampler::Sampler,
}

impl Console {
    /// A link inside the console (`path` starts with `/`).
    pub fn link(&self, path: &str) -> String {
        format!("{}{path}", self.config.base_path)
    }
}

pub(crate) type Shared = Arc<Console>;

/// The console as an axum router, to serve alone ([`serve`]) or nest in a
/// service's router (give the prefix to [`ConsoleConfig::base_path`]).
pub fn router(pool: PgPool, config: ConsoleConfig) -> Router {
    let state: Shared = Arc::new(Console {
        pool,
        config,
        sampler: sampler::Sampler::default(),
    });
    Router::new()
        .route("/", get(views::overview))
        .route("/api/overview", get(views::overview_json))
        .route("/relays", get(views::relays))
        .route("/consumers", get(views::consumers))
        .route("/parked", get(rows::parked_list))
        .route("/parked/{id}", get(rows::parked_detail))
        .route("/parked/action", post(actions::parked_action))
        .route("/dead-letters", get(rows::dead_letter_list))
        .route("/dead-letters/{id}", get(rows::dead_letter_detail))
        .route("/dead-letters/action", post(actions::dead_letter_action))
        .route("/audit", get(actions::audit_page))
        .route("/login", get(auth::login_page).post(auth::login))
        .route("/logout", post(auth::logout))
        .route("/console.css", get(html::stylesheet))
        .fallback(error::not_found)
        .with_state(state)
}

/// Serves the console on `addr` until `shutdown` is cancelled; returns the
/// address it listens on once bound, and the server's task.
pub async fn serve(
    addr: SocketAddr,
    pool: PgPool,
    config: ConsoleConfig,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>), Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Config(format!("cannot listen on {addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Config(format!("cannot listen on {addr}: {e}")))?;
    let app = router(pool, config);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
    });
    Ok((local, task))
}
