//! Event versions against a real PostgreSQL, delivered by the testing kit
//! (no broker): rows written by old code are upcast through the declared
//! chain (v1 → v2 → v3) and handled, in both consumer modes; a version newer
//! than the handler's type, or older than its upcasters, is dead-lettered
//! as `unsupported_version` with the message kept; a consumer refuses a
//! handler registered twice.

use outbox::prelude::*;
use outbox::runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox::runtime::{Consumer, DeadLetterReason, Mode};
use outbox::testing::{Outcome, TestBus};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// Version 1, as the first release wrote it: the amount in whole euros.
#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(
    topic = "evo-orders",
    aggregate_type = "Order",
    event_type = "OrderPlaced",
    version = 1
)]
struct OrderPlacedV1 {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount: i64,
}

/// Version 2: the amount in cents.
#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(
    topic = "evo-orders",
    aggregate_type = "Order",
    event_type = "OrderPlaced",
    version = 2,
    upcast_from(OrderPlacedV1)
)]
struct OrderPlacedV2 {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
}

impl From<OrderPlacedV1> for OrderPlacedV2 {
    fn from(v1: OrderPlacedV1) -> Self {
        Self {
            order_id: v1.order_id,
            amount_cents: v1.amount * 100,
        }
    }
}

/// Version 3 (current): a required currency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(
    topic = "evo-orders",
    aggregate_type = "Order",
    version = 3,
    upcast_from(OrderPlacedV2)
)]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
    currency: String,
}

impl From<OrderPlacedV2> for OrderPlaced {
    fn from(v2: OrderPlacedV2) -> Self {
        Self {
            order_id: v2.order_id,
            amount_cents: v2.amount_cents,
            currency: "EUR".into(),
        }
    }
}

/// Version 2 of another event type, with no upcaster from version 1.
#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(topic = "evo-orders", aggregate_type = "Order", version = 2)]
struct OrderCancelled {
    #[event(aggregate_id)]
    order_id: Uuid,
    reason: String,
}

#[inbox_handler]
async fn book_order(ctx: &mut HandlerContext<'_>, event: OrderPlaced) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO booked (order_id, amount_cents, currency, version) VALUES ($1, $2, $3, $4)",
    )
    .bind(event.order_id)
    .bind(event.amount_cents)
    .bind(&event.currency)
    .bind(ctx.incoming().event_version as i32)
    .execute(&mut **ctx)
    .await?;
    Ok(())
}

/// The handler of a service still on version 2.
#[inbox_handler]
async fn book_order_v2(
    ctx: &mut HandlerContext<'_>,
    event: OrderPlacedV2,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO booked (order_id, amount_cents, currency, version) VALUES ($1, $2, 'EUR', $3)",
    )
    .bind(event.order_id)
    .bind(event.amount_cents)
    .bind(ctx.incoming().event_version as i32)
    .execute(&mut **ctx)
    .await?;
    Ok(())
}

#[inbox_handler]
async fn note_cancel(
    ctx: &mut HandlerContext<'_>,
    event: OrderCancelled,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO cancelled (order_id, reason) VALUES ($1, $2)")
        .bind(event.order_id)
        .bind(&event.reason)
        .execute(&mut **ctx)
        .await?;
    Ok(())
}

#[inbox_handler(name = "book_order")]
async fn book_order_again(
    _ctx: &mut HandlerContext<'_>,
    _event: OrderPlaced,
) -> Result<(), sqlx::Error> {
    Ok(())
}

async fn tables(pool: &PgPool) {
    for sql in [
        "CREATE TABLE booked (order_id uuid PRIMARY KEY, amount_cents bigint NOT NULL, currency text NOT NULL, version int NOT NULL)",
        "CREATE TABLE cancelled (order_id uuid PRIMARY KEY, reason text NOT NULL)",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// Writes an `OrderPlaced` row the way code of `version` did: through the
/// Unit of Work for the versions that have a struct, by hand otherwise.
async fn write_old(pool: &PgPool, event: impl DomainEvent) {
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    uow.record(event);
    uow.commit().await.unwrap();
}

async fn booked(pool: &PgPool) -> Vec<(Uuid, i64, String, i32)> {
    sqlx::query_as(
        "SELECT order_id, amount_cents, currency, version FROM booked ORDER BY amount_cents",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn rows_written_by_old_code_are_upcast_and_handled(pool: PgPool) {
    tables(&pool).await;
    for mode in [Mode::Dedup, Mode::Inbox] {
        sqlx::query("TRUNCATE booked").execute(&pool).await.unwrap();
        let (v1, v2, v3, raw) = (
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
        );
        // The first release wrote version 1, the second version 2, this one 3.
        write_old(
            &pool,
            OrderPlacedV1 {
                order_id: v1,
                amount: 7,
            },
        )
        .await;
        write_old(
            &pool,
            OrderPlacedV2 {
                order_id: v2,
                amount_cents: 850,
            },
        )
        .await;
        write_old(
            &pool,
            OrderPlaced {
                order_id: v3,
                amount_cents: 990,
                currency: "USD".into(),
            },
        )
        .await;
        // And a version-1 row as an application without the structs wrote it.
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, \
             event_version, topic, partition_key, payload) \
             VALUES ($1, 'Order', $2, 'OrderPlaced', 1, 'evo-orders', $2, $3)",
        )
        .bind(Uuid::now_v7())
        .bind(raw.to_string())
        .bind(serde_json::json!({ "order_id": raw, "amount": 3 }))
        .execute(&pool)
        .await
        .unwrap();

        let mut bus = TestBus::new().service(
            Consumer::builder(pool.clone())
                .group(format!("billing-{mode:?}"))
                .handler(book_order)
                .mode(mode),
        );
        let delivery = bus.deliver().await.unwrap();
        delivery.assert_no_dead_letters();
        assert_eq!(delivery.handled().count(), 4, "{mode:?}");
        assert_eq!(
            booked(&pool).await,
            vec![
                (raw, 300, "EUR".into(), 1),
                (v1, 700, "EUR".into(), 1),
                (v2, 850, "EUR".into(), 2),
                (v3, 990, "USD".into(), 3),
            ],
            "{mode:?}"
        );
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_testing_kit_reports_upcast_events_as_the_handler_got_them(pool: PgPool) {
    tables(&pool).await;
    let (v1, v3) = (Uuid::now_v7(), Uuid::now_v7());
    write_old(
        &pool,
        OrderPlacedV1 {
            order_id: v1,
            amount: 7,
        },
    )
    .await;
    write_old(
        &pool,
        OrderPlaced {
            order_id: v3,
            amount_cents: 990,
            currency: "USD".into(),
        },
    )
    .await;
    let mut bus = TestBus::new().service(
        Consumer::builder(pool.clone())
            .group("billing")
            .handler(book_order),
    );
    let delivery = bus.deliver().await.unwrap();
    delivery.assert_no_dead_letters();
    // The version-1 event, upcast to the current struct as the handler got it.
    let upcast = OrderPlaced {
        order_id: v1,
        amount_cents: 700,
        currency: "EUR".into(),
    };
    assert_eq!(
        delivery.handled_events::<OrderPlaced>(),
        vec![
            upcast.clone(),
            OrderPlaced {
                order_id: v3,
                amount_cents: 990,
                currency: "USD".into(),
            }
        ],
        "{delivery}"
    );
    assert_eq!(
        delivery.assert_handled::<OrderPlaced>(|e| e.order_id == v1),
        upcast
    );
    assert_eq!(delivery.published::<OrderPlaced>().len(), 2, "{delivery}");
    assert_eq!(delivery.counts()["OrderPlaced"].handled, 2);
    delivery.assert_each_handled_once();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_version_newer_than_the_handler_reads_is_dead_lettered_as_unsupported(pool: PgPool) {
    tables(&pool).await;
    for mode in [Mode::Dedup, Mode::Inbox] {
        let group = format!("billing-{mode:?}");
        let order = Uuid::now_v7();
        write_old(
            &pool,
            OrderPlaced {
                order_id: order,
                amount_cents: 100,
                currency: "EUR".into(),
            },
        )
        .await;
        // This service still runs the version-2 handler.
        let mut bus = TestBus::new().service(
            Consumer::builder(pool.clone())
                .group(group.clone())
                .handler(book_order_v2)
                .mode(mode),
        );
        let delivery = bus.deliver().await.unwrap();
        let dead: Vec<_> = delivery.dead_lettered().collect();
        assert_eq!(dead.len(), 1, "{mode:?}: {delivery}");
        let Outcome::DeadLettered {
            reason,
            error,
            attempts,
        } = &dead[0].outcome
        else {
            unreachable!()
        };
        assert_eq!(
            *reason,
            DeadLetterReason::UnsupportedVersion,
            "{mode:?}: {error}"
        );
        assert_eq!(
            *attempts, 0,
            "{mode:?}: decoding is not retried as a handler failure"
        );
        assert!(
            error.contains("version 3 is newer") && error.contains("versions 1 to 2"),
            "{mode:?}: {error}"
        );
        assert!(booked(&pool).await.is_empty());

        // Nothing is lost: the dead letter keeps the message byte for byte,
        // with its version, ready to be retried by a newer handler.
        let letters = dead_letter::list(
            &pool,
            &DeadLetterFilter::new()
                .consumer(group.as_str())
                .reason(DeadLetterReason::UnsupportedVersion),
        )
        .await
        .unwrap();
        assert_eq!(letters.len(), 1, "{mode:?}");
        let letter = &letters[0];
        assert_eq!(letter.event_type.as_deref(), Some("OrderPlaced"));
        let payload: serde_json::Value =
            serde_json::from_str(letter.payload.as_deref().unwrap()).unwrap();
        assert_eq!(payload["currency"], "EUR");
        assert_eq!(letter.headers["event_version"], "3", "{:?}", letter.headers);
        sqlx::query("DELETE FROM dead_letter")
            .execute(&pool)
            .await
            .unwrap();
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_old_version_without_an_upcaster_is_dead_lettered_with_a_clear_reason(pool: PgPool) {
    tables(&pool).await;
    let order = Uuid::now_v7();
    // Written as version 1, which `OrderCancelled` (version 2) cannot read.
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.record_message(outbox::OutboxMessage {
        event_id: Uuid::now_v7(),
        aggregate_type: "Order".into(),
        aggregate_id: order.to_string(),
        event_type: "OrderCancelled".into(),
        event_version: 1,
        topic: "evo-orders".into(),
        partition_key: order.to_string(),
        payload: serde_json::json!({ "order_id": order, "reason": "changed my mind" }).to_string(),
        headers: Headers::default(),
    });
    uow.commit().await.unwrap();
    let mut bus = TestBus::new().service(
        Consumer::builder(pool.clone())
            .group("billing")
            .handler(note_cancel),
    );
    let delivery = bus.deliver().await.unwrap();
    let dead: Vec<_> = delivery.dead_lettered().collect();
    assert_eq!(dead.len(), 1, "{delivery}");
    let Outcome::DeadLettered { reason, error, .. } = &dead[0].outcome else {
        unreachable!()
    };
    assert_eq!(*reason, DeadLetterReason::UnsupportedVersion);
    assert!(
        error.contains("version 1 is older")
            && error.contains("version 2 only")
            && error.contains("upcast_from"),
        "{error}"
    );
    // The payload would have decoded: the version, not the shape, refused it.
    let cancelled: i64 = sqlx::query_scalar("SELECT count(*) FROM cancelled")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(cancelled, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_handler_registered_twice_is_refused_at_build(pool: PgPool) {
    let error = Consumer::builder(pool.clone())
        .group("billing")
        .handler(book_order)
        .handler(note_cancel)
        .handler(book_order)
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("the same handler is registered twice")
            && error.contains("`OrderPlaced` on topic `evo-orders`")
            && error.matches("handler `book_order`").count() == 2,
        "{error}"
    );

    // Two handlers under one name for one event type: a dead letter could
    // not say which failed. The error names both functions.
    let error = Consumer::builder(pool.clone())
        .group("billing")
        .handler(book_order)
        .handler(book_order_again)
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("two handlers share one name")
            && error.contains("book_order_again")
            && error.contains("evolving_events::book_order"),
        "{error}"
    );

    // Distinct handlers of one event type still run side by side.
    Consumer::builder(pool)
        .group("billing")
        .handler(book_order)
        .handler(book_order_v2)
        .build()
        .unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn with_cloud_events_headers_only_events_are_deduplicated_and_versions_still_count(
    pool: PgPool,
) {
    use outbox::runtime::cloudevents::{CloudEvents, CloudEventsMode};
    use outbox::testing::Faults;
    tables(&pool).await;
    let (a, b, newer) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    write_old(
        &pool,
        OrderPlacedV1 {
            order_id: a,
            amount: 1,
        },
    )
    .await;
    write_old(
        &pool,
        OrderPlacedV2 {
            order_id: b,
            amount_cents: 250,
        },
    )
    .await;
    write_old(
        &pool,
        OrderPlaced {
            order_id: newer,
            amount_cents: 5,
            currency: "EUR".into(),
        },
    )
    .await;
    // A relay writing CloudEvents headers instead of its own, every message
    // delivered twice, to a service on version 2.
    let mut bus = TestBus::new()
        .cloud_events(CloudEvents {
            mode: CloudEventsMode::Only,
            source: "/orders-service".into(),
        })
        .faults(Faults::new().deliver_twice())
        .service(
            Consumer::builder(pool.clone())
                .group("billing")
                .handler(book_order_v2),
        );
    let delivery = bus.deliver().await.unwrap();
    for published in &delivery.published {
        let names: Vec<&str> = published
            .message_headers
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert!(
            names.contains(&"ce_id") && !names.contains(&"event_id"),
            "{names:?}"
        );
    }
    // Versions 1 and 2 handled once each (the copies are duplicates, by ce_id) …
    assert_eq!(delivery.handled().count(), 2, "{delivery}");
    assert_eq!(delivery.duplicates(), 2, "{delivery}");
    assert_eq!(
        booked(&pool).await,
        vec![(a, 100, "EUR".into(), 1), (b, 250, "EUR".into(), 2)]
    );
    // … version 3 (`ce_eventversion`) is too new for it (both copies: a
    // dead letter is kept per delivered message).
    let newer_id: Uuid =
        sqlx::query_scalar("SELECT event_id FROM outbox_event WHERE aggregate_id = $1")
            .bind(newer.to_string())
            .fetch_one(&pool)
            .await
            .unwrap();
    let dead: Vec<_> = delivery.dead_lettered().collect();
    assert_eq!(dead.len(), 2, "{delivery}");
    for d in dead {
        assert_eq!(d.event_id, Some(newer_id), "{delivery}");
        assert!(
            matches!(
                &d.outcome,
                Outcome::DeadLettered {
                    reason: DeadLetterReason::UnsupportedVersion,
                    ..
                }
            ),
            "{delivery}"
        );
    }
}
