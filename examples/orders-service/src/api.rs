//! The HTTP API.
//!
//! | request | answer |
//! |---|---|
//! | `POST /orders` `{"customer": "ann", "amount_cents": 1250}` | `201` the order (`status: "pending"`), `Location: /orders/{id}` |
//! | `GET /orders/{id}` | `200` the order with its payment status, `404` if unknown |
//! | `GET /health` | `200` once the service is up |
//! | anything else | `404` (unknown path) or `405` (wrong method) |
//!
//! Bad input never reaches the database: malformed JSON → `400`; a body that
//! is not JSON → `415`; unknown fields, missing fields, wrong types, an
//! amount ≤ 0, a blank customer → `422`; a body over 2 MB → `413`; an id
//! that is not a UUID → `400`.
//! Every error answer is `{"error": "..."}`.

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::domain::{Order, PlaceOrder, place_order};

/// The API's routes over the service's pool.
pub fn router(pool: PgPool) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(show_order))
        .route("/health", get(health))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(pool)
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
    /// `pending` or `paid`.
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

async fn create_order(
    State(pool): State<PgPool>,
    body: Result<Json<NewOrder>, JsonRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let Json(new) = body?;
    let command = PlaceOrder::new(&new.customer, new.amount_cents)
        .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
    let order: Order = outbox::execute(&pool, place_order, command)
        .await
        .map_err(ApiError::internal)?;
    let location = format!("/orders/{}", order.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(order),
    ))
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
    .map_err(ApiError::internal)?;
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
