//! The HTTP API.
//!
//! | request | answer |
//! |---|---|
//! | `POST /orders` `{"customer": "ann", "amount_cents": 1250}` | `201` the order (`status: "pending"`), `Location: /orders/{id}` |
//! | the same with `Idempotency-Key: K` | the first time as above; again with `K`: `201` the same order, `Idempotent-Replayed: true`, nothing written; `K` with another customer or amount: `422` |
//! | `GET /orders/{id}` | `200` the order with its payment status, `404` if unknown |
//! | `GET /health` | `200` once the service is up |
//! | anything else | `404` (unknown path) or `405` (wrong method) |
//!
//! Bad input never reaches the database: malformed JSON → `400`; a body that
//! is not JSON → `415`; unknown fields, missing fields, wrong types, an
//! amount ≤ 0, a blank customer, a control character (NUL, …) in it → `422`;
//! a body over 2 MB → `413`; an id that is not a UUID → `400`; an
//! `Idempotency-Key` that is not 1–255 visible ASCII characters → `400`.
//!
//! Limits ([`Limits`]): the order routes answer `503` with `Retry-After`
//! when more requests than the limit are in progress, and `503` when a
//! request runs longer than the request timeout (its transaction rolls
//! back; with an `Idempotency-Key` the client can safely send it again), or
//! when no database connection of the API's own pool frees up in that time.
//! `/health` is outside the limits.
//! Every error answer is `{"error": "..."}`.

use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{BoxError, Json, Router};
use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tower::ServiceBuilder;
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::domain::{Order, PlaceOrder, Placed, place_order};

/// The header that makes `POST /orders` idempotent.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Set on the answer to a request whose idempotency key had placed its
/// order before.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Longest accepted idempotency key.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Limits of the order routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A request running longer is answered `503` (default 10 s).
    pub request_timeout: Duration,
    /// Requests in progress at once; more are answered `503` at once, with
    /// `Retry-After: 1` (default 256).
    pub max_concurrent_requests: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(10),
            max_concurrent_requests: 256,
        }
    }
}

/// The API's routes over the API's pool, with `limits`.
pub fn router(pool: PgPool, limits: Limits) -> Router {
    let timeout = limits.request_timeout;
    let orders = Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(show_order))
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(move |error: BoxError| async move {
                    refused(&error, timeout)
                }))
                .load_shed()
                // One limit for every order route (a plain concurrency
                // limit layer would give each route its own).
                .layer(GlobalConcurrencyLimitLayer::new(
                    limits.max_concurrent_requests,
                ))
                .timeout(timeout),
        );
    Router::new()
        .merge(orders)
        .route("/health", get(health))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(pool)
}

/// The answer to a request the limits refused.
fn refused(error: &BoxError, timeout: Duration) -> Response {
    if error.is::<tower::load_shed::error::Overloaded>() {
        let mut response = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many requests in progress: try again shortly",
        )
        .into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    } else if error.is::<tower::timeout::error::Elapsed>() {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the request took longer than {} ms and was abandoned (nothing of it committed \
                 unless it had already): send it again, with the same Idempotency-Key to be \
                 sure it is not placed twice",
                timeout.as_millis()
            ),
        )
        .into_response()
    } else {
        ApiError::internal(error).into_response()
    }
}

/// The body of `POST /orders`. Unknown fields are refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewOrder {
    /// Who orders (1–200 characters).
    pub customer: String,
    /// The amount, in cents (> 0).
    pub amount_cents: i64,
}

/// An order as `GET /orders/{id}` shows it. Timestamps are RFC 3339.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct OrderView {
    /// The order's id.
    pub id: Uuid,
    /// Who ordered.
    pub customer: String,
    /// The amount, in cents.
    pub amount_cents: i64,
    /// `pending`, `paid` or `cancelled` (no payment in time).
    pub status: String,
    /// When the order was placed.
    pub created_at: String,
    /// When the payment was applied.
    pub paid_at: Option<String>,
    /// Billing's charge.
    pub payment_id: Option<Uuid>,
}

/// An error answer: a status and `{"error": message}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn internal(error: impl std::fmt::Display) -> Self {
        tracing::error!(%error, "request failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
    }

    /// A database error: `503` when the database is busy (no connection of
    /// the API's pool freed up in time, a statement ran past its timeout),
    /// else `500`.
    fn database(error: outbox::Error) -> Self {
        let busy = match &error {
            outbox::Error::Database(sqlx::Error::PoolTimedOut) => true,
            // query_canceled: the statement_timeout of the API's connections.
            outbox::Error::Database(sqlx::Error::Database(e)) => {
                e.code().as_deref() == Some("57014")
            }
            _ => false,
        };
        if busy {
            tracing::warn!(%error, "request refused: the database is busy");
            Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the database is busy: try again shortly",
            )
        } else {
            Self::internal(error)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message });
        (self.status, Json(body)).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        // axum's text is "<generic sentence>: <serde's message with the
        // field's path and position>"; keep serde's part.
        let text = rejection.body_text();
        let detail = |prefix: &str| text.strip_prefix(prefix).unwrap_or(&text).to_owned();
        let message = match &rejection {
            JsonRejection::JsonSyntaxError(_) => format!(
                "malformed JSON: {}",
                detail("Failed to parse the request body as JSON: ")
            ),
            JsonRejection::JsonDataError(_) => format!(
                "invalid order: {}",
                detail("Failed to deserialize the JSON body into the target type: ")
            ),
            _ => text.clone(),
        };
        Self::new(rejection.status(), message)
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            format!("invalid order id: {}", rejection.body_text()),
        )
    }
}

/// The request's `Idempotency-Key`, if any: 1 to
/// [`MAX_IDEMPOTENCY_KEY_LEN`] visible ASCII characters.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let bad = |why: &str| {
        Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("invalid Idempotency-Key: {why}"),
        ))
    };
    if values.next().is_some() {
        return bad("given more than once");
    }
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_IDEMPOTENCY_KEY_LEN {
        return bad(&format!(
            "it must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} characters, got {}",
            bytes.len()
        ));
    }
    if !bytes.iter().all(u8::is_ascii_graphic) {
        return bad("only visible ASCII characters are allowed (no spaces)");
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

async fn create_order(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    body: Result<Json<NewOrder>, JsonRejection>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let Json(new) = body?;
    let command = PlaceOrder::new(&new.customer, new.amount_cents)
        .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?
        .with_idempotency_key(key.clone());
    let placed = outbox::execute(&pool, place_order, command)
        .await
        .map_err(ApiError::database)?;
    let created = |order: Order, replayed: bool| {
        let location = format!("/orders/{}", order.id);
        let mut response = (
            StatusCode::CREATED,
            [(header::LOCATION, location)],
            Json(order),
        )
            .into_response();
        if replayed {
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        response
    };
    match placed {
        Placed::New(order) => Ok(created(order, false)),
        Placed::Replayed(order) => Ok(created(order, true)),
        Placed::KeyReused(order) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "Idempotency-Key {} already placed order {} with another customer or amount: use a new key for a new order",
                key.unwrap_or_default(),
                order.id
            ),
        )),
    }
}

async fn show_order(
    State(pool): State<PgPool>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Json<OrderView>, ApiError> {
    let Path(id) = id?;
    let view: Option<OrderView> = sqlx::query_as(
        "SELECT id, customer, amount_cents, status,
                to_json(created_at) #>> '{}' AS created_at,
                to_json(paid_at) #>> '{}' AS paid_at,
                payment_id
         FROM orders WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&pool)
    .await
    .map_err(|e| ApiError::database(e.into()))?;
    view.map(Json)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no order {id}")))
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route {method} {}", uri.path()),
    )
}

async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
}
