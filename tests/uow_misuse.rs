//! Command code that breaks its Unit of Work's transaction through the
//! connection it is handed: a swallowed SQL error (the transaction is
//! aborted, and PostgreSQL answers `COMMIT` with `ROLLBACK`, which sqlx
//! reports as success), a `ROLLBACK` or a `COMMIT` run by hand. `commit()`
//! and `execute` must report each as an error — never `Ok` with nothing
//! written — and must never write the events outside the transaction
//! (a phantom event for a rolled-back change).

use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
}

async fn setup(pool: &PgPool) {
    sqlx::query("CREATE TABLE orders (id uuid PRIMARY KEY)")
        .execute(pool)
        .await
        .unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn insert_order(uow: &mut UnitOfWork, id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO orders (id) VALUES ($1)")
        .bind(id)
        .execute(&mut **uow)
        .await
        .map(|_| ())
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn committing_an_aborted_transaction_is_an_error_with_or_without_events(pool: PgPool) {
    setup(&pool).await;
    for with_event in [false, true] {
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        let id = Uuid::now_v7();
        insert_order(&mut uow, id).await.unwrap();
        // The same key again: a unique violation the command swallows.
        assert!(insert_order(&mut uow, id).await.is_err());
        if with_event {
            uow.record(OrderPlaced { order_id: id });
        }
        let result = uow.commit().await;
        let error = result.expect_err("commit of an aborted transaction must fail");
        assert!(
            error.to_string().contains("aborted"),
            "with_event={with_event}: {error}"
        );
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_rollback_run_by_hand_never_lets_the_events_out(pool: PgPool) {
    setup(&pool).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let id = Uuid::now_v7();
    insert_order(&mut uow, id).await.unwrap();
    sqlx::query("ROLLBACK").execute(&mut *uow).await.unwrap();
    uow.record(OrderPlaced { order_id: id });
    let error = uow
        .commit()
        .await
        .expect_err("the transaction was rolled back by hand");
    assert!(error.to_string().contains("ended"), "{error}");
    // No phantom: the order was rolled back, and so is its event.
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

/// The same for a scheduled event alone (its insert is a statement of its
/// own), and for one cancelled by hand-broken code: nothing written.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_rollback_run_by_hand_never_lets_a_scheduled_event_out(pool: PgPool) {
    setup(&pool).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let id = Uuid::now_v7();
    insert_order(&mut uow, id).await.unwrap();
    sqlx::query("ROLLBACK").execute(&mut *uow).await.unwrap();
    uow.record_after(
        std::time::Duration::from_secs(60),
        OrderPlaced { order_id: id },
    );
    let error = uow
        .commit()
        .await
        .expect_err("the transaction was rolled back by hand");
    assert!(error.to_string().contains("ended"), "{error}");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_commit_run_by_hand_is_reported_at_commit(pool: PgPool) {
    setup(&pool).await;
    for with_event in [false, true] {
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        insert_order(&mut uow, Uuid::now_v7()).await.unwrap();
        sqlx::query("COMMIT").execute(&mut *uow).await.unwrap();
        if with_event {
            uow.record(OrderPlaced {
                order_id: Uuid::now_v7(),
            });
        }
        let error = uow
            .commit()
            .await
            .expect_err("the transaction was committed by hand");
        assert!(error.to_string().contains("ended"), "{error}");
    }
    // What the command committed by hand stays committed (it is reported,
    // not undone); no event is written outside the transaction.
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

#[command_handler]
async fn place_swallowing(uow: &mut UnitOfWork, id: Uuid) -> Result<(), outbox::Error> {
    insert_order(uow, id).await?;
    if let Err(error) = insert_order(uow, id).await {
        tracing::info!(%error, "already there");
    }
    uow.record(OrderPlaced { order_id: id });
    Ok(())
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn execute_reports_a_command_that_swallowed_its_sql_error(pool: PgPool) {
    setup(&pool).await;
    let result = outbox::execute(&pool, place_swallowing, Uuid::now_v7()).await;
    let error = result.expect_err("the command left its transaction aborted");
    assert!(error.to_string().contains("aborted"), "{error}");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_unit_of_work_on_the_applications_own_transaction_is_checked_too(pool: PgPool) {
    setup(&pool).await;
    let tx = pool.begin().await.unwrap();
    let mut uow = UnitOfWork::from_transaction(tx);
    let id = Uuid::now_v7();
    insert_order(&mut uow, id).await.unwrap();
    assert!(insert_order(&mut uow, id).await.is_err());
    let error = uow.commit().await.expect_err("aborted");
    assert!(error.to_string().contains("aborted"), "{error}");

    // And a healthy one commits.
    let tx = pool.begin().await.unwrap();
    let mut uow = UnitOfWork::from_transaction(tx);
    insert_order(&mut uow, id).await.unwrap();
    uow.record(OrderPlaced { order_id: id });
    uow.commit().await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_header_named_like_the_frameworks_own_is_refused_and_nothing_is_written(pool: PgPool) {
    setup(&pool).await;
    for name in [
        "event_id",
        "event_type",
        "aggregate_id",
        "replay_id",
        "Content-Type",
    ] {
        // On the Unit of Work's inherited headers...
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        let id = Uuid::now_v7();
        insert_order(&mut uow, id).await.unwrap();
        uow.headers_mut()
            .extra
            .insert(name.into(), Uuid::now_v7().to_string());
        uow.record(OrderPlaced { order_id: id });
        let error = uow.commit().await.expect_err(name);
        assert!(
            matches!(error, outbox::Error::ReservedHeader { .. }),
            "{error}"
        );
        assert!(error.to_string().contains(name), "{error}");

        // ...and on one message's own.
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        let mut message = outbox::OutboxMessage::from_event(&OrderPlaced { order_id: id }).unwrap();
        message.headers.extra.insert(name.into(), "spoofed".into());
        uow.record_message(message);
        assert!(matches!(
            uow.commit().await,
            Err(outbox::Error::ReservedHeader { .. })
        ));
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}
