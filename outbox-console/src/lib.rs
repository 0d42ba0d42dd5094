//! A web console for the operators of an outbox: per topic backlog, oldest
//! unpublished age and throughput (with a live chart), the relays and their
//! lanes, the consumer groups (with their lag when a broker is configured),
//! parked rows and dead letters (filtered, paged, each with its error,
//! headers and payload), saga instances, and the writes an operator makes on them —
//! requeue or drop parked rows, retry or drop dead letters — each confirmed,
//! with a mandatory reason and an audit record (`outbox_audit`).
//!
//! Server-rendered HTML (maud templates, no front-end build): one
//! stylesheet, and a small inline script that polls `api/overview` for the
//! chart. Every value is HTML-escaped by the templates (payloads and errors
//! are hostile input); secret-looking headers and passwords in URLs are
//! shown as `***`; long errors and payloads are cut.
//!
//! Read-only unless started with a write token ([`ConsoleConfig::write_token`]):
//! an operator then logs in once with the token and a name; the console
//! sets a signed `HttpOnly`, `SameSite=Strict` cookie (`Secure` if
//! configured) holding the name, when the session began and the session's
//! form token. Every write is a POST carrying that token from the page's
//! form, refused (403) without it; a POST from another site is refused
//! whatever it carries; no page can be framed.
//!
//! Every query reads an index and is bounded (keyset pages with a limit,
//! partial indexes for backlogs, the primary key for single rows): the
//! pages stay fast on an outbox of millions of rows.
//!
//! Modules: `auth` (token, session cookie, form token, login), `guard`
//! (cross-site requests, frame headers, the client's address), `html`
//! (layout, stylesheet, chart script, secrets), `views` (overview, relays,
//! consumer groups), `lag` (the groups' lag, read in the background),
//! `rows` (parked rows, dead letters), `sagas` (saga instances by type and
//! stage, stuck ones, one instance), `actions` (writes and the audit
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
//! // The peer's address (for the audit trail) comes from connect info.
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(
//!     listener,
//!     app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
//! )
//! .await?;
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod actions;
mod auth;
mod error;
mod guard;
mod html;
mod lag;
mod rows;
mod sagas;
mod sampler;
mod views;

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use outbox_runtime::{CancellationToken, Error};
use sqlx::PgPool;

pub use crate::actions::{AuditRecord, audit_log};
pub use crate::lag::MAX_GROUPS;

/// Environment variable the `outbox console` command reads the write token
/// from.
pub const WRITE_TOKEN_ENV: &str = "OUTBOX_CONSOLE_WRITE_TOKEN";

/// Shortest write token accepted (characters).
pub const MIN_TOKEN_LEN: usize = 16;

/// How long a login lasts unless configured otherwise (12 hours).
pub const SESSION_LIFETIME: Duration = auth::SESSION;

/// How often the consumer groups' lag is read at most, unless configured
/// otherwise (30 seconds).
pub const LAG_REFRESH: Duration = Duration::from_secs(30);

/// How the console runs. `Debug` never shows the token.
#[derive(Clone)]
pub struct ConsoleConfig {
    write_token: Option<String>,
    base_path: String,
    brokers: Option<String>,
    kafka_settings: Vec<(String, String)>,
    secure_cookie: bool,
    session_lifetime: Duration,
    trusted_proxies: Vec<IpAddr>,
    lag_refresh: Duration,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            write_token: None,
            base_path: String::new(),
            brokers: None,
            kafka_settings: Vec::new(),
            secure_cookie: false,
            session_lifetime: SESSION_LIFETIME,
            trusted_proxies: Vec::new(),
            lag_refresh: LAG_REFRESH,
        }
    }
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
            .field("secure_cookie", &self.secure_cookie)
            .field("session_lifetime", &self.session_lifetime)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("lag_refresh", &self.lag_refresh)
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

    /// Marks the session cookie `Secure` (sent over HTTPS only): set it when
    /// the console is reached over HTTPS (a TLS-terminating proxy).
    pub fn secure_cookie(mut self, secure: bool) -> Self {
        self.secure_cookie = secure;
        self
    }

    /// How long a login lasts (default [`SESSION_LIFETIME`]), counted from
    /// the login each time the session is checked: a cookie older than
    /// that is refused, whatever it says. At least a second.
    pub fn session_lifetime(mut self, lifetime: Duration) -> Result<Self, Error> {
        if lifetime < Duration::from_secs(1) {
            return Err(Error::Config(
                "the console's session lifetime is too short: at least 1 s".into(),
            ));
        }
        self.session_lifetime = lifetime;
        Ok(self)
    }

    /// The reverse proxies whose `X-Forwarded-For` is believed for the
    /// audit trail's client address; from any other peer the header is
    /// ignored and the peer's address recorded.
    pub fn trusted_proxies(mut self, proxies: impl IntoIterator<Item = IpAddr>) -> Self {
        self.trusted_proxies = proxies.into_iter().map(|ip| ip.to_canonical()).collect();
        self
    }

    /// How often the consumer groups' lag is read from the broker at most
    /// (default [`LAG_REFRESH`]); pages show the last reading.
    pub fn lag_refresh(mut self, every: Duration) -> Self {
        self.lag_refresh = every;
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
    /// The session cookie's key (from the write token), when writable.
    pub key: Option<cookie::Key>,
    /// The groups' lag, when brokers are configured.
    pub lag: Option<lag::Lag>,
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
/// Serve it with `into_make_service_with_connect_info::<SocketAddr>()` for
/// the audit trail to record the client's address.
pub fn router(pool: PgPool, config: ConsoleConfig) -> Router {
    let key = config.write_token.as_deref().map(auth::key);
    let lag = config
        .brokers
        .clone()
        .map(|brokers| lag::Lag::new(brokers, config.kafka_settings.clone(), config.lag_refresh));
    let state: Shared = Arc::new(Console {
        pool,
        config,
        sampler: sampler::Sampler::default(),
        key,
        lag,
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
        .route("/sagas", get(sagas::sagas_page))
        .route("/sagas/show", get(sagas::instance_page))
        .route("/audit", get(actions::audit_page))
        .route("/login", get(auth::login_page).post(auth::login))
        .route("/logout", post(auth::logout))
        .route("/console.css", get(html::stylesheet))
        .fallback(error::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            guard::protect,
        ))
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
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
    });
    Ok((local, task))
}
