//! The orders service's HTTP API and payment handler against a real
//! PostgreSQL (a fresh database per test, the service's migrations applied).
//!
//! Requests go through the router itself (`tower::ServiceExt::oneshot`), as
//! a client's would, without a socket. Bad input must answer 4xx with a JSON
//! `{"error": ...}` naming the problem, and leave no order row and no outbox
//! row behind.

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use demo_events::{OrderCreated, PaymentCaptured};
use orders_service::api::{OrderView, router};
use orders_service::payments::{PaymentError, mark_paid};
use outbox::prelude::*;
use outbox::{DomainEvent, IncomingEvent};
use serde_json::Value;
use sqlx::PgPool;
use tower::ServiceExt;

async fn app(pool: &PgPool) -> Router {
    orders_service::migrate(pool).await.expect("migrations");
    router(pool.clone())
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

#[sqlx::test(migrations = false)]
async fn bad_input_answers_4xx_with_a_json_error_and_writes_nothing(pool: PgPool) {
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

#[sqlx::test(migrations = false)]
async fn an_order_is_created_then_shown_and_its_event_is_in_the_outbox(pool: PgPool) {
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

#[sqlx::test(migrations = false)]
async fn unknown_ids_paths_and_methods_answer_a_json_error(pool: PgPool) {
    let app = app(&pool).await;
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

/// Runs `mark_paid` in a transaction the way the consumer does, and commits
/// on success.
async fn apply_payment(pool: &PgPool, payment: &PaymentCaptured) -> Result<(), PaymentError> {
    let incoming = IncomingEvent::new(
        Uuid::now_v7(),
        payment.event_type(),
        payment.event_version(),
        PaymentCaptured::TOPIC,
        payment.partition_key(),
        Headers::default(),
    );
    let mut tx = pool.begin().await.unwrap();
    let mut ctx = HandlerContext::new(&mut tx, &incoming);
    mark_paid::call(&mut ctx, payment.clone()).await?;
    drop(ctx);
    tx.commit().await.unwrap();
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn a_payment_marks_its_order_paid_and_a_wrong_one_is_refused(pool: PgPool) {
    let app = app(&pool).await;
    let (_, _, created) = send(
        &app,
        post_json(r#"{"customer": "bob", "amount_cents": 700}"#),
    )
    .await;
    let order_id: Uuid = created["id"].as_str().unwrap().parse().unwrap();

    // A payment for no known order, or of another amount, is an error (the
    // consumer retries it, then dead-letters it) and changes nothing.
    let stray = PaymentCaptured {
        payment_id: Uuid::now_v7(),
        order_id: Uuid::now_v7(),
        amount_cents: 700,
    };
    assert!(
        matches!(apply_payment(&pool, &stray).await, Err(PaymentError::UnknownOrder(id)) if id == stray.order_id)
    );
    let wrong = PaymentCaptured {
        payment_id: Uuid::now_v7(),
        order_id,
        amount_cents: 699,
    };
    assert!(matches!(
        apply_payment(&pool, &wrong).await,
        Err(PaymentError::AmountMismatch {
            expected: 700,
            charged: 699,
            ..
        })
    ));
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE status = 'paid'").await,
        0
    );

    let payment = PaymentCaptured {
        payment_id: Uuid::now_v7(),
        order_id,
        amount_cents: 700,
    };
    apply_payment(&pool, &payment).await.expect("applied");
    let (_, _, shown) = send(&app, get(&format!("/orders/{order_id}"))).await;
    let view: OrderView = serde_json::from_value(shown).unwrap();
    assert_eq!(view.status, "paid");
    assert_eq!(view.payment_id, Some(payment.payment_id));
    assert!(view.paid_at.is_some());

    // A second, distinct payment is counted, so a double charge is visible.
    let again = PaymentCaptured {
        payment_id: Uuid::now_v7(),
        ..payment.clone()
    };
    apply_payment(&pool, &again).await.expect("applied");
    let applied: i32 = sqlx::query_scalar("SELECT payments_applied FROM orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(applied, 2);
    let first: Option<Uuid> = sqlx::query_scalar("SELECT payment_id FROM orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        first,
        Some(payment.payment_id),
        "the first payment stays the order's"
    );
}
