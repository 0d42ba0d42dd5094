//! Who may write: the write token, the login form that trades it for a
//! session cookie, and the check every write makes.
//!
//! The cookie holds the operator's name, an expiry and an HMAC-SHA256 of
//! both keyed by the write token: nothing is stored server-side, the token
//! itself never travels again after the login, and a restart with another
//! token ends every session. Both the token (at login) and the MAC (at each
//! write) are compared in constant time. The cookie is `HttpOnly` (no
//! script reads it) and `SameSite=Strict` (no other site's page can send a
//! write with it); writes are POSTs only.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Form;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ConsoleError;
use crate::html::{Nav, esc, page};
use crate::{Console, Shared};

/// The session cookie's name.
pub const COOKIE: &str = "outbox_console";

/// How long a login lasts.
pub const SESSION: Duration = Duration::from_secs(12 * 3600);

/// Longest operator name.
pub const MAX_NAME: usize = 64;

/// An operator allowed to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator(pub String);

type HmacSha256 = Hmac<Sha256>;

/// The MAC of a session's fields, keyed by the write token.
fn session_mac(token: &str, name_hex: &str, expires: u64) -> HmacSha256 {
    let mut mac =
        HmacSha256::new_from_slice(token.as_bytes()).expect("HMAC takes keys of any length");
    mac.update(format!("outbox-console|{name_hex}|{expires}").as_bytes());
    mac
}

/// Equality of two byte strings in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The cookie value for `name` until `expires` (Unix seconds).
fn session_value(token: &str, name: &str, expires: u64) -> String {
    let name = hex(name.as_bytes());
    let mac = session_mac(token, &name, expires).finalize().into_bytes();
    format!("{name}.{expires}.{}", hex(&mac))
}

/// The operator a valid, unexpired cookie value names.
fn check_session(token: &str, value: &str, now: u64) -> Option<Operator> {
    let mut parts = value.split('.');
    let (name_hex, expires, mac) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let expires: u64 = expires.parse().ok()?;
    let mac = unhex(mac)?;
    // verify_slice compares in constant time.
    if session_mac(token, name_hex, expires)
        .verify_slice(&mac)
        .is_err()
        || expires <= now
    {
        return None;
    }
    String::from_utf8(unhex(name_hex)?).ok().map(Operator)
}

/// The session cookie of a request, if any.
fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

/// The operator logged in on this request, if writes are enabled and the
/// cookie is valid.
pub fn operator(console: &Console, headers: &HeaderMap) -> Option<Operator> {
    let token = console.config.write_token.as_deref()?;
    check_session(token, cookie(headers)?, now_secs())
}

/// The operator allowed to write, or the refusal (403).
pub fn require_writer(console: &Console, headers: &HeaderMap) -> Result<Operator, ConsoleError> {
    if !console.config.writable() {
        return Err(ConsoleError::Refused(
            "this console is read-only: it was started without a write token".into(),
        ));
    }
    operator(console, headers).ok_or_else(|| {
        ConsoleError::Refused(
            "writes need the write token: log in first (the session may have expired)".into(),
        )
    })
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
    let current = operator(console, headers);
    let body = if !console.config.writable() {
        "<h1>Log in</h1><div class=\"notice\">This console is read-only: it was started \
         without a write token, so there is nothing to log in to.</div>"
            .to_owned()
    } else {
        format!(
            "<h1>Log in to write</h1>{}\
             <form method=\"post\" action=\"{}\" class=\"stack\">\
             <p><label>Your name (recorded in the audit trail)\
             <input name=\"operator\" id=\"operator\" required maxlength=\"{MAX_NAME}\" autocomplete=\"username\"></label></p>\
             <p><label>Write token\
             <input name=\"token\" id=\"token\" type=\"password\" required autocomplete=\"current-password\"></label></p>\
             <p><button type=\"submit\" id=\"login\">Log in</button></p></form>",
            problem
                .map(|p| format!("<div class=\"notice bad\" id=\"problem\">{}</div>", esc(p)))
                .unwrap_or_default(),
            esc(&console.link("/login")),
        )
    };
    let name = current.as_ref().map(|o| o.0.as_str());
    (status, page(console, Nav::Login, "Log in", name, &body)).into_response()
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
    let Some(token) = console.config.write_token.as_deref() else {
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
    if !constant_time_eq(&given, &expected) {
        tracing::warn!(operator = %name, "console login refused: wrong write token");
        return login_form(
            &console,
            &headers,
            Some("wrong write token"),
            StatusCode::FORBIDDEN,
        );
    }
    tracing::info!(operator = %name, "console login");
    let value = session_value(token, &name, now_secs() + SESSION.as_secs());
    let path = if console.config.base_path.is_empty() {
        "/".to_owned()
    } else {
        console.config.base_path.clone()
    };
    let cookie = format!(
        "{COOKIE}={value}; Path={path}; HttpOnly; SameSite=Strict; Max-Age={}",
        SESSION.as_secs()
    );
    (
        [(header::SET_COOKIE, cookie)],
        Redirect::to(&console.link("/")),
    )
        .into_response()
}

/// `POST /logout`: clears the cookie.
pub async fn logout(State(console): State<Shared>) -> Response {
    let path = if console.config.base_path.is_empty() {
        "/".to_owned()
    } else {
        console.config.base_path.clone()
    };
    (
        [(
            header::SET_COOKIE,
            format!("{COOKIE}=; Path={path}; HttpOnly; SameSite=Strict; Max-Age=0"),
        )],
        Redirect::to(&console.link("/")),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2 of RFC 4231.
        let mut mac = HmacSha256::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn sessions_check_name_expiry_and_key() {
        let token = "a-token-of-enough-length";
        let value = session_value(token, "ann <ops>", 1_000);
        assert_eq!(
            check_session(token, &value, 999),
            Some(Operator("ann <ops>".into()))
        );
        assert_eq!(check_session(token, &value, 1_000), None, "expired");
        assert_eq!(check_session("another-token-entirely", &value, 999), None);
        // Another name or expiry with the same MAC.
        let (_, rest) = value.split_once('.').unwrap();
        let forged = format!("{}.{rest}", hex(b"mallory"));
        assert_eq!(check_session(token, &forged, 999), None);
        let later = value.replace(".1000.", ".9999.");
        assert_eq!(check_session(token, &later, 999), None);
        assert_eq!(check_session(token, "garbage", 0), None);
        assert_eq!(check_session(token, "", 0), None);
    }

    #[test]
    fn names_are_checked() {
        assert_eq!(check_name("  ann "), Ok("ann".into()));
        assert!(check_name(" ").is_err());
        assert!(check_name(&"x".repeat(MAX_NAME + 1)).is_err());
        assert!(check_name("a\u{7}b").is_err());
    }
}
