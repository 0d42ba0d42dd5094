//! Who may write: the write token, the login form that trades it for a
//! session cookie, and the checks every write makes.
//!
//! The session cookie is signed (the `cookie` crate's signed jar, HMAC-SHA256
//! keyed by a key derived from the write token): it holds the operator's
//! name, when the session began and the session's form token. Nothing is
//! stored server-side, the write token never travels again after the login,
//! and a restart with another token ends every session. A session lasts at
//! most [`ConsoleConfig::session_lifetime`](crate::ConsoleConfig::session_lifetime),
//! counted from its login at every check (a signed cookie kept past that is
//! refused). The cookie is `HttpOnly`, `SameSite=Strict`, and `Secure` when
//! configured.
//!
//! Every form that POSTs carries the session's form token (a hidden
//! field, [`CSRF_FIELD`]); a write (and the logout) is refused (403) unless
//! it matches the cookie's, compared in constant time. The login form has
//! none (there is no session yet): it needs the write token itself. Every
//! POST also passes the cross-site check of [`crate::guard`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Form;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use cookie::{Cookie, CookieJar, Key, SameSite};
use maud::html;
use serde::Deserialize;
use sha2::{Digest, Sha256, Sha512};
use subtle::ConstantTimeEq;

use crate::error::ConsoleError;
use crate::html::{Nav, page};
use crate::{Console, Shared};

/// The session cookie's name.
pub const COOKIE: &str = "outbox_console";

/// The form field that carries the session's form token.
pub const CSRF_FIELD: &str = "csrf";

/// How long a login lasts unless configured otherwise.
pub const SESSION: Duration = Duration::from_secs(12 * 3600);

/// How far in the future a session's start may be (clocks of several
/// instances behind one address differ a little).
const CLOCK_SKEW: u64 = 60;

/// Longest operator name.
pub const MAX_NAME: usize = 64;

/// An operator's session: who, and the token its forms carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The name given at login.
    pub operator: String,
    /// The form token (hex), the same for the session's whole life.
    pub csrf: String,
}

/// The cookie signing key of a write token.
pub fn key(token: &str) -> Key {
    let mut hash = Sha512::new();
    hash.update(b"outbox-console session key\0");
    hash.update(token.as_bytes());
    Key::from(&hash.finalize())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A new form token: 32 random bytes, hex.
fn new_csrf() -> Result<String, ConsoleError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| {
        ConsoleError::Failed(outbox_runtime::Error::Config(format!(
            "no randomness for the session: {e}"
        )))
    })?;
    Ok(hex::encode(bytes))
}

/// The session cookie (signed with `key`) of `session`, begun at `since`
/// (Unix seconds): `since.csrf.name`, the name in hex.
fn session_cookie(console: &Console, key: &Key, session: &Session, since: u64) -> Cookie<'static> {
    let value = format!(
        "{since}.{}.{}",
        session.csrf,
        hex::encode(session.operator.as_bytes())
    );
    let cookie = cookie_attributes(console, Cookie::build((COOKIE, value))).max_age(
        cookie::time::Duration::seconds(console.config.session_lifetime.as_secs() as i64),
    );
    let mut jar = CookieJar::new();
    jar.signed_mut(key).add(cookie);
    jar.get(COOKIE).cloned().expect("just added")
}

fn cookie_attributes<'c>(
    console: &Console,
    cookie: cookie::CookieBuilder<'c>,
) -> cookie::CookieBuilder<'c> {
    let path = if console.config.base_path.is_empty() {
        "/".to_owned()
    } else {
        console.config.base_path.clone()
    };
    cookie
        .path(path)
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(console.config.secure_cookie)
}

/// The session a verified cookie value names, if it began at most
/// `lifetime` before `now` (and not in the future, beyond a minute).
fn check_session(value: &str, now: u64, lifetime: Duration) -> Option<Session> {
    let mut parts = value.splitn(3, '.');
    let (since, csrf, name) = (parts.next()?, parts.next()?, parts.next()?);
    let since: u64 = since.parse().ok()?;
    if since > now.saturating_add(CLOCK_SKEW) || now >= since.saturating_add(lifetime.as_secs()) {
        return None;
    }
    if csrf.len() != 64 || hex::decode(csrf).is_err() {
        return None;
    }
    let operator = String::from_utf8(hex::decode(name).ok()?).ok()?;
    Some(Session {
        operator,
        csrf: csrf.to_owned(),
    })
}

/// The session of a request at `now`, if writes are enabled and its cookie
/// is signed with this console's key and not past the lifetime.
fn session_at(console: &Console, headers: &HeaderMap, now: u64) -> Option<Session> {
    let key = console.key.as_ref()?;
    let jar = CookieJar::new();
    let signed = jar.signed(key);
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(Cookie::split_parse)
        .filter_map(Result::ok)
        .filter(|c| c.name() == COOKIE)
        .find_map(|c| signed.verify(c.into_owned()))
        .and_then(|c| check_session(c.value(), now, console.config.session_lifetime))
}

/// The operator's session on this request, if writes are enabled and the
/// cookie is valid.
pub fn session(console: &Console, headers: &HeaderMap) -> Option<Session> {
    session_at(console, headers, now_secs())
}

/// Whether `given` is the session's form token (constant time).
pub fn csrf_matches(session: &Session, given: Option<&str>) -> bool {
    given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(session.csrf.as_bytes())))
}

/// The session allowed to write with this form token, or the refusal (403).
pub fn require_writer(
    console: &Console,
    headers: &HeaderMap,
    csrf: Option<&str>,
) -> Result<Session, ConsoleError> {
    if !console.config.writable() {
        return Err(ConsoleError::Refused(
            "this console is read-only: it was started without a write token".into(),
        ));
    }
    let session = session(console, headers).ok_or_else(|| {
        ConsoleError::Refused(
            "writes need the write token: log in first (the session may have expired)".into(),
        )
    })?;
    if !csrf_matches(&session, csrf) {
        tracing::warn!(operator = %session.operator, "console write refused: no valid form token");
        return Err(ConsoleError::Refused(
            "the form's token is missing or not this session's: reload the page and submit it again"
                .into(),
        ));
    }
    Ok(session)
}

/// `GET /login`.
pub async fn login_page(State(console): State<Shared>, headers: HeaderMap) -> Response {
    login_form(&console, &headers, None, StatusCode::OK)
}

fn login_form(
    console: &Console,
    headers: &HeaderMap,
    problem: Option<&str>,
    status: StatusCode,
) -> Response {
    let current = session(console, headers);
    let body = if !console.config.writable() {
        html! {
            h1 { "Log in" }
            div.notice { "This console is read-only: it was started without a write token, \
                so there is nothing to log in to." }
        }
    } else {
        html! {
            h1 { "Log in to write" }
            @if let Some(p) = problem { div.notice.bad #problem { (p) } }
            form.stack method="post" action=(console.link("/login")) {
                p { label { "Your name (recorded in the audit trail)"
                    input #operator name="operator" required maxlength=(MAX_NAME) autocomplete="username";
                } }
                p { label { "Write token"
                    input #token name="token" type="password" required autocomplete="current-password";
                } }
                p { button #login type="submit" { "Log in" } }
            }
        }
    };
    (
        status,
        page(console, Nav::Login, "Log in", current.as_ref(), body),
    )
        .into_response()
}

/// The login form.
#[derive(Deserialize)]
pub struct Login {
    operator: String,
    token: String,
}

/// A valid operator name: 1 to [`MAX_NAME`] characters, no control
/// characters.
pub fn check_name(name: &str) -> Result<String, String> {
    let name = name.trim();
    if name.is_empty() {
        return Err("your name is required (it is recorded with every write)".into());
    }
    if name.chars().count() > MAX_NAME {
        return Err(format!(
            "the name is too long: at most {MAX_NAME} characters"
        ));
    }
    if name.chars().any(char::is_control) {
        return Err("the name holds control characters".into());
    }
    Ok(name.to_owned())
}

/// `POST /login`: the token and a name; a session cookie on success.
pub async fn login(
    State(console): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<Login>,
) -> Response {
    let (Some(token), Some(key)) = (console.config.write_token.as_deref(), &console.key) else {
        return ConsoleError::Refused(
            "this console is read-only: it was started without a write token".into(),
        )
        .render(&console);
    };
    let name = match check_name(&form.operator) {
        Ok(name) => name,
        Err(problem) => {
            return login_form(&console, &headers, Some(&problem), StatusCode::BAD_REQUEST);
        }
    };
    // Compare digests: equal lengths, so the time says nothing of the token.
    let given = Sha256::digest(form.token.trim().as_bytes());
    let expected = Sha256::digest(token.as_bytes());
    if !bool::from(given.ct_eq(&expected)) {
        tracing::warn!(operator = %name, "console login refused: wrong write token");
        return login_form(
            &console,
            &headers,
            Some("wrong write token"),
            StatusCode::FORBIDDEN,
        );
    }
    let csrf = match new_csrf() {
        Ok(csrf) => csrf,
        Err(e) => return e.render(&console),
    };
    tracing::info!(operator = %name, "console login");
    let session = Session {
        operator: name,
        csrf,
    };
    let cookie = session_cookie(&console, key, &session, now_secs());
    (
        [(header::SET_COOKIE, cookie.to_string())],
        Redirect::to(&console.link("/")),
    )
        .into_response()
}

/// The logout form.
#[derive(Deserialize)]
pub struct Logout {
    csrf: Option<String>,
}

/// `POST /logout`: clears the cookie (with the session's form token).
pub async fn logout(
    State(console): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<Logout>,
) -> Response {
    if let Err(e) = require_writer(&console, &headers, form.csrf.as_deref()) {
        return e.render(&console);
    }
    let mut cookie = cookie_attributes(&console, Cookie::build((COOKIE, ""))).build();
    cookie.make_removal();
    (
        [(header::SET_COOKIE, cookie.to_string())],
        Redirect::to(&console.link("/")),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIFE: Duration = Duration::from_secs(3600);

    fn value(since: u64, csrf: &str, name: &str) -> String {
        format!("{since}.{csrf}.{}", hex::encode(name))
    }

    #[test]
    fn sessions_check_their_age_and_form() {
        let csrf = "ab".repeat(32);
        let v = value(1_000, &csrf, "ann <ops>.x");
        let ann = Session {
            operator: "ann <ops>.x".into(),
            csrf: csrf.clone(),
        };
        assert_eq!(check_session(&v, 1_000, LIFE), Some(ann.clone()));
        assert_eq!(check_session(&v, 4_599, LIFE), Some(ann));
        assert_eq!(check_session(&v, 4_600, LIFE), None, "past the lifetime");
        let early = 1_000 - CLOCK_SKEW;
        assert!(
            check_session(&v, early, LIFE).is_some(),
            "clocks differ a little"
        );
        assert_eq!(check_session(&v, early - 1, LIFE), None, "from the future");
        assert_eq!(
            check_session(&value(1_000, "abc", "ann"), 1_000, LIFE),
            None
        );
        assert_eq!(
            check_session(&value(1_000, &"zz".repeat(32), "ann"), 1_000, LIFE),
            None
        );
        assert_eq!(check_session("garbage", 0, LIFE), None);
        assert_eq!(check_session("", 0, LIFE), None);
    }

    #[test]
    fn form_tokens_compare_whole() {
        let s = Session {
            operator: "ann".into(),
            csrf: "ab".repeat(32),
        };
        assert!(csrf_matches(&s, Some(&"ab".repeat(32))));
        assert!(!csrf_matches(&s, Some(&"ab".repeat(31))));
        assert!(!csrf_matches(&s, Some("")));
        assert!(!csrf_matches(&s, None));
        assert_ne!(new_csrf().unwrap(), new_csrf().unwrap());
    }

    #[test]
    fn keys_differ_by_token() {
        let (a, b) = (
            key("a-token-of-enough-length"),
            key("another-token-entirely"),
        );
        assert_ne!(a.signing(), b.signing());
        assert_eq!(a.signing(), key("a-token-of-enough-length").signing());
    }

    #[test]
    fn names_are_checked() {
        assert_eq!(check_name("  ann "), Ok("ann".into()));
        assert!(check_name(" ").is_err());
        assert!(check_name(&"x".repeat(MAX_NAME + 1)).is_err());
        assert!(check_name("a\u{7}b").is_err());
    }
}
