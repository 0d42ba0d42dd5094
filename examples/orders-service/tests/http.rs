//! The orders service's HTTP API against a real PostgreSQL (a `TestDb` per
//! test: a clone of a template with the service's migrations); the payments
//! consumer is tested in `payments.rs`.
//!
//! Requests go through the router itself (`tower::ServiceExt::oneshot`), as
//! a client's would, without a socket. Bad input must answer 4xx with a JSON
//! `{"error": ...}` naming the problem, and leave no order row and no outbox
//! row behind. An `Idempotency-Key` places one order however often (and
//! however concurrently) it is sent; the limits refuse what is beyond them
//! with `503` (the database held up by a table lock the test takes).

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use demo_events::OrderCreated;
use orders_service::api::{Limits, OrderView, router};
use outbox::DomainEvent;
use outbox::prelude::*;
use outbox::testing::TestDb;
use serde_json::Value;
use sqlx::PgPool;
use tower::ServiceExt;

async fn app(pool: &PgPool) -> Router {
    app_with(pool, Limits::default()).await
}

async fn app_with(pool: &PgPool, limits: Limits) -> Router {
    router(pool.clone(), limits)
}

/// Sends one request; returns the status, the content type and the body as
/// JSON (`Value::Null` if it is not JSON).
async fn send(app: &Router, request: Request<Body>) -> (StatusCode, String, Value) {
    let response = app.clone().oneshot(request).await.expect("response");
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, content_type, body)
}

fn post_json(body: &str) -> Request<Body> {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn bad_input_answers_4xx_with_a_json_error_and_writes_nothing() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let app = app(&pool).await;
    // (body, expected status, a fragment the error message must contain)
    let cases: &[(&str, StatusCode, &str)] = &[
        (
            r#"{"customer": "ann", "amount_cents": "#,
            StatusCode::BAD_REQUEST,
            "malformed JSON: amount_cents: EOF while parsing a value",
        ),
        (r#"not json"#, StatusCode::BAD_REQUEST, "malformed JSON"),
        (r#""#, StatusCode::BAD_REQUEST, "malformed JSON"),
        (
            r#"{"customer": "ann", "amount_cents": 0}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount_cents must be greater than 0, got 0",
        ),
        (
            r#"{"customer": "ann", "amount_cents": -250}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount_cents must be greater than 0, got -250",
        ),
        (
            r#"{"customer": "ann", "amount_cents": 100, "discount": 5}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid order: discount: unknown field `discount`, expected `customer` or `amount_cents`",
        ),
        (
            r#"{"customer": "ann", "amount_cents": "100"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid order: amount_cents: invalid type: string \"100\", expected i64",
        ),
        (
            r#"{"customer": "ann", "amount_cents": 12.5}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid type",
        ),
        (
            r#"{"customer": 42, "amount_cents": 100}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid type",
        ),
        (
            r#"{"customer": "ann", "amount_cents": 99999999999999999999}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount_cents",
        ),
        (
            r#"{"customer": "ann"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "missing field `amount_cents`",
        ),
        (
            r#"[1, 2]"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid order",
        ),
        (
            r#"{"customer": "   ", "amount_cents": 100}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "customer must not be empty",
        ),
        // A NUL byte, escaped (PostgreSQL's text cannot store it) or raw.
        (
            r#"{"customer": "a\u0000b", "amount_cents": 100}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "customer must not contain control characters, found '\\0'",
        ),
        (
            "{\"customer\": \"a\0b\", \"amount_cents\": 100}",
            StatusCode::BAD_REQUEST,
            "control character (\\u0000-\\u001F) found",
        ),
        (
            "{\"customer\": \"ann\", \"amount_cents\": 100}\0",
            StatusCode::BAD_REQUEST,
            "malformed JSON",
        ),
    ];
    for (body, status, fragment) in cases {
        let (got, content_type, answer) = send(&app, post_json(body)).await;
        assert_eq!(got, *status, "status for {body:?}: {answer}");
        assert_eq!(
            content_type, "application/json",
            "content type for {body:?}"
        );
        let message = answer["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message for {body:?}: {answer}"));
        assert!(
            message.contains(fragment),
            "error for {body:?} should contain {fragment:?}: {message:?}"
        );
    }

    // A JSON body without the JSON content type is refused too.
    let request = Request::post("/orders")
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from(r#"{"customer": "ann", "amount_cents": 100}"#))
        .unwrap();
    let (got, _, answer) = send(&app, request).await;
    assert_eq!(got, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|m| m.contains("Content-Type")),
        "{answer}"
    );

    // A body over axum's 2 MB limit is refused before it is parsed.
    let huge = format!(
        r#"{{"customer": "{}", "amount_cents": 100}}"#,
        "x".repeat(3 << 20)
    );
    let (got, _, answer) = send(&app, post_json(&huge)).await;
    assert_eq!(got, StatusCode::PAYLOAD_TOO_LARGE, "{answer}");
    assert!(
        answer["error"].as_str().is_some_and(|m| !m.is_empty()),
        "{answer}"
    );

    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders").await,
        0,
        "no order written"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_event").await,
        0,
        "no event written"
    );
}

#[tokio::test]
async fn an_order_is_created_then_shown_and_its_event_is_in_the_outbox() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let app = app(&pool).await;
    let (status, _, created) = send(
        &app,
        post_json(r#"{"customer": " ann ", "amount_cents": 1250}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id: Uuid = created["id"].as_str().expect("id").parse().expect("a UUID");
    assert_eq!(created["customer"], "ann", "the name is trimmed");
    assert_eq!(created["amount_cents"], 1250);
    assert_eq!(created["status"], "pending");

    let (status, _, shown) = send(&app, get(&format!("/orders/{id}"))).await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    let view: OrderView = serde_json::from_value(shown).expect("an order view");
    assert_eq!(
        (view.id, view.customer.as_str(), view.amount_cents),
        (id, "ann", 1250)
    );
    assert_eq!(view.status, "pending");
    assert_eq!((view.paid_at, view.payment_id), (None, None));
    assert!(
        view.created_at.contains('T'),
        "RFC 3339: {}",
        view.created_at
    );

    // The order's event was committed with it, to the outbox, unpublished.
    let (event_type, topic, key, aggregate_id, payload, published): (
        String,
        String,
        String,
        String,
        sqlx::types::Json<OrderCreated>,
        bool,
    ) = sqlx::query_as(
        "SELECT event_type, topic, partition_key, aggregate_id, payload, published_at IS NOT NULL
             FROM outbox_event",
    )
    .fetch_one(&pool)
    .await
    .expect("exactly one outbox row");
    assert_eq!(
        (event_type.as_str(), topic.as_str()),
        ("OrderCreated", OrderCreated::TOPIC)
    );
    assert_eq!((key, aggregate_id), (id.to_string(), id.to_string()));
    assert_eq!(
        payload.0,
        OrderCreated {
            order_id: id,
            customer: "ann".into(),
            amount_cents: 1250
        }
    );
    assert!(!published);
}

#[tokio::test]
async fn unknown_ids_paths_and_methods_answer_a_json_error() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let app = app(&pool).await;
    let (status, _, answer) = send(&app, get("/orders/%00")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    let (status, _, answer) = send(&app, get("/orders/not-a-uuid")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|m| m.starts_with("invalid order id")),
        "{answer}"
    );

    let (status, _, answer) = send(&app, get("/order")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert_eq!(answer["error"], "no route GET /order");
    let (status, _, answer) = send(&app, get("/orders")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{answer}");
    assert_eq!(answer["error"], "GET is not allowed on /orders");

    let unknown = Uuid::now_v7();
    let (status, _, answer) = send(&app, get(&format!("/orders/{unknown}"))).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert_eq!(answer["error"], format!("no order {unknown}"));
}

fn post_keyed(key: &str, body: &str) -> Request<Body> {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

/// Sends one request; returns the status, the `Idempotent-Replayed` header
/// and the body as JSON.
async fn send_keyed(app: &Router, request: Request<Body>) -> (StatusCode, Option<String>, Value) {
    let response = app.clone().oneshot(request).await.expect("response");
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    (
        status,
        replayed,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn an_idempotency_key_places_one_order_however_often_it_is_sent() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let app = app(&pool).await;
    let body = r#"{"customer": "ann", "amount_cents": 1250}"#;
    let (status, replayed, first) = send_keyed(&app, post_keyed("checkout-41", body)).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    assert_eq!(replayed, None);
    let id = first["id"].as_str().expect("id").to_owned();

    // Sent again (a client retrying after a timeout): the same order.
    let (status, replayed, again) = send_keyed(&app, post_keyed("checkout-41", body)).await;
    assert_eq!(status, StatusCode::CREATED, "{again}");
    assert_eq!(replayed.as_deref(), Some("true"));
    assert_eq!(again, first);

    // The same key for another order is refused and writes nothing.
    let (status, _, refused) = send_keyed(
        &app,
        post_keyed("checkout-41", r#"{"customer": "ann", "amount_cents": 999}"#),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
    let message = refused["error"].as_str().unwrap();
    assert!(
        message.contains("checkout-41") && message.contains(&id),
        "{message}"
    );

    // Ten at once with a new key: one order, and every answer names it.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let app = app.clone();
        tasks.spawn(async move {
            send_keyed(
                &app,
                post_keyed("checkout-42", r#"{"customer": "bob", "amount_cents": 700}"#),
            )
            .await
        });
    }
    let mut ids = std::collections::HashSet::new();
    let mut fresh = 0;
    while let Some(done) = tasks.join_next().await {
        let (status, replayed, order) = done.unwrap();
        assert_eq!(status, StatusCode::CREATED, "{order}");
        ids.insert(order["id"].as_str().unwrap().to_owned());
        fresh += usize::from(replayed.is_none());
    }
    assert_eq!(ids.len(), 1, "one order for the key: {ids:?}");
    assert_eq!(fresh, 1, "one answer placed it, nine replayed it");

    // Without a key, the same body places a new order each time.
    for _ in 0..2 {
        let (status, _, _) = send_keyed(&app, post_json(body)).await;
        assert_eq!(status, StatusCode::CREATED);
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 4);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 4);
}

#[tokio::test]
async fn a_malformed_idempotency_key_is_refused_and_writes_nothing() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let app = app(&pool).await;
    let body = r#"{"customer": "ann", "amount_cents": 1250}"#;
    let long = "k".repeat(256);
    for (key, fragment) in [
        ("", "1 to 255 characters, got 0"),
        (long.as_str(), "1 to 255 characters, got 256"),
        ("two words", "visible ASCII"),
        ("caf\u{e9}", "visible ASCII"),
    ] {
        let request = Request::post("/orders")
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                "idempotency-key",
                axum::http::HeaderValue::from_bytes(key.as_bytes()).unwrap(),
            )
            .body(Body::from(body))
            .unwrap();
        let (status, _, answer) = send_keyed(&app, request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{key:?}: {answer}");
        let message = answer["error"].as_str().unwrap();
        assert!(message.contains(fragment), "{key:?}: {message}");
    }
    let twice = Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::from(body))
        .unwrap();
    let (status, _, answer) = send_keyed(&app, twice).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

/// Holds an `ACCESS EXCLUSIVE` lock on `orders` (every request that reads
/// or writes it waits) until dropped or committed.
async fn lock_orders(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Waits until `n` sessions of this database wait for a lock.
async fn waiting_for_locks(pool: &PgPool, n: i64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting = count(
            pool,
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await;
        if waiting >= n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{waiting} of {n} requests wait"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn requests_beyond_the_concurrency_limit_are_refused_with_retry_after() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let app = app_with(
        &pool,
        Limits {
            max_concurrent_requests: 2,
            ..Limits::default()
        },
    )
    .await;
    let lock = lock_orders(&pool).await;
    // Two requests in progress (waiting on the database).
    let mut slow = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let app = app.clone();
        slow.spawn(async move { send(&app, get(&format!("/orders/{}", Uuid::now_v7()))).await });
    }
    waiting_for_locks(&pool, 2).await;

    // A third is refused at once; health is outside the limit.
    let response = app
        .clone()
        .oneshot(post_json(r#"{"customer": "ann", "amount_cents": 100}"#))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|m| m.contains("too many requests")),
        "{answer}"
    );
    let (status, _, _) = send(&app, get("/health")).await;
    assert_eq!(status, StatusCode::OK);

    lock.rollback().await.unwrap();
    while let Some(done) = slow.join_next().await {
        assert_eq!(done.unwrap().0, StatusCode::NOT_FOUND);
    }
    // Capacity is back.
    let (status, _, _) = send(
        &app,
        post_json(r#"{"customer": "ann", "amount_cents": 100}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
}

#[tokio::test]
async fn a_request_past_its_timeout_answers_503_and_commits_nothing() {
    let db = TestDb::builder()
        .migrator(&orders_service::MIGRATOR)
        .create()
        .await
        .unwrap();
    let pool = db.pool().clone();
    let app = app_with(
        &pool,
        Limits {
            request_timeout: std::time::Duration::from_millis(300),
            ..Limits::default()
        },
    )
    .await;
    let lock = lock_orders(&pool).await;
    let (status, _, answer) = send(
        &app,
        post_keyed("slow-1", r#"{"customer": "ann", "amount_cents": 100}"#),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|m| m.contains("took longer than 300 ms") && m.contains("Idempotency-Key")),
        "{answer}"
    );
    lock.rollback().await.unwrap();

    // The abandoned request never committed; sent again (to a router with
    // the default timeout: the abandoned transaction's rollback may still
    // be on its way), it places the order.
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    let app = router(pool.clone(), Limits::default());
    let (status, _, order) = send(
        &app,
        post_keyed("slow-1", r#"{"customer": "ann", "amount_cents": 100}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{order}");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 1);
}
