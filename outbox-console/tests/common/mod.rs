//! Shared helpers of the console's tests: rows put in the tables as the
//! relay and the consumers leave them (parked rows, dead letters), and
//! requests through the router.

#![allow(dead_code)]

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode, header};
use sqlx::PgPool;
use tower::ServiceExt;

pub const TOKEN: &str = "test-write-token-0123456789";

/// A parked outbox row, as the relay leaves one after repeated failures.
pub async fn parked_row(
    pool: &PgPool,
    topic: &str,
    key: &str,
    payload: serde_json::Value,
    headers: serde_json::Value,
    error: &str,
) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key, headers, attempts, last_error,
                                   last_attempt_at, parked_at)
         VALUES (gen_random_uuid(), 'Order', $2, 'OrderPlaced', $3, $1, $2, $4, 5, $5, now(), now())
         RETURNING id",
    )
    .bind(topic)
    .bind(key)
    .bind(payload)
    .bind(headers)
    .bind(error)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A dead letter, as a consumer leaves one.
pub async fn dead_letter(
    pool: &PgPool,
    consumer: &str,
    offset: i64,
    payload: &[u8],
    headers: serde_json::Value,
    error: &str,
) -> i64 {
    sqlx::query_scalar(
        r#"INSERT INTO dead_letter (consumer, topic, "partition", "offset", key, event_type,
                                   headers, payload, reason, error, attempts)
           VALUES ($1, 'orders', 0, $2, 'k1'::bytea, 'OrderPlaced', $3, $4, 'handler_failed', $5, 3)
           RETURNING id"#,
    )
    .bind(consumer)
    .bind(offset)
    .bind(headers)
    .bind(payload)
    .bind(error)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A response's status, headers, body and `Set-Cookie` header.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
    pub cookie: Option<String>,
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let cookie = headers
        .get(header::SET_COOKIE)
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20)
        .await
        .unwrap();
    Answer {
        status,
        headers,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
        cookie,
    }
}

pub async fn get(app: &Router, path: &str, cookie: Option<&str>) -> Answer {
    let mut request = Request::get(path);
    if let Some(c) = cookie {
        request = request.header(header::COOKIE, c);
    }
    send(app, request.body(Body::empty()).unwrap()).await
}

/// A form body, form-encoded.
pub fn form_body(form: &[(&str, &str)]) -> String {
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(form)
        .finish()
}

/// A POST of `form` with `cookie`, these request headers, and the peer
/// address the server would give (connect info).
pub async fn post_with(
    app: &Router,
    path: &str,
    form: &[(&str, &str)],
    cookie: Option<&str>,
    headers: &[(&str, &str)],
    peer: Option<SocketAddr>,
) -> Answer {
    let mut request =
        Request::post(path).header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(c) = cookie {
        request = request.header(header::COOKIE, c);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut request = request.body(Body::from(form_body(form))).unwrap();
    if let Some(peer) = peer {
        request.extensions_mut().insert(ConnectInfo(peer));
    }
    send(app, request).await
}

pub async fn post(app: &Router, path: &str, form: &[(&str, &str)], cookie: Option<&str>) -> Answer {
    post_with(app, path, form, cookie, &[], None).await
}

/// Logs in as `name`; the cookie to send back.
pub async fn login(app: &Router, name: &str) -> String {
    let answer = post(app, "/login", &[("operator", name), ("token", TOKEN)], None).await;
    assert_eq!(answer.status, StatusCode::SEE_OTHER, "{}", answer.body);
    let set = answer.cookie.expect("a session cookie");
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    set.split(';').next().unwrap().to_owned()
}

/// The form token of the session: read from a page's forms, as a browser
/// submits it.
pub async fn csrf(app: &Router, cookie: &str) -> String {
    let page = get(app, "/parked", Some(cookie)).await.body;
    form_tokens(&page)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no form token in {page}"))
}

/// The values of every form-token field of a page.
pub fn form_tokens(page: &str) -> Vec<String> {
    page.split("name=\"csrf\" value=\"")
        .skip(1)
        .map(|s| s.split('"').next().unwrap().to_owned())
        .collect()
}

/// Logs in as `name`: the cookie and the session's form token.
pub async fn session(app: &Router, name: &str) -> (String, String) {
    let cookie = login(app, name).await;
    let token = csrf(app, &cookie).await;
    (cookie, token)
}

/// Whether the row is still parked (not requeued, not dropped).
pub async fn still_parked(pool: &PgPool, id: i64) -> bool {
    sqlx::query_scalar(
        "SELECT parked_at IS NOT NULL AND discarded_at IS NULL FROM outbox_event WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

pub async fn audit_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_audit")
        .fetch_one(pool)
        .await
        .unwrap()
}
