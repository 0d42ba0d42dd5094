//! Upgrading an installation that already holds data: the migrations that
//! change keys and constraints keep every existing row.

use std::borrow::Cow;

use sqlx::PgPool;
use sqlx::migrate::Migrator;
use uuid::Uuid;

/// The embedded migrations up to and including `version`.
fn up_to(version: i64) -> Migrator {
    Migrator {
        migrations: Cow::Owned(
            outbox::MIGRATOR
                .iter()
                .filter(|m| m.version <= version)
                .cloned()
                .collect(),
        ),
        ignore_missing: true,
        locking: true,
        no_tx: false,
    }
}

#[sqlx::test(migrations = false)]
async fn keying_the_inbox_per_group_keeps_every_existing_row(pool: PgPool) {
    up_to(20261130000040).run(&pool).await.unwrap();
    let event = Uuid::now_v7();
    // One event stored by a consumer group, one by a tool that set no
    // consumer, and the same event id again under another group is refused
    // by the old key (event_id alone).
    sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, consumer, processed)
         VALUES ($1, '{}', 'billing', true), ($2, '{}', NULL, false)",
    )
    .bind(event)
    .bind(Uuid::now_v7())
    .execute(&pool)
    .await
    .unwrap();
    assert!(
        sqlx::query(
            "INSERT INTO inbox_event (event_id, payload, consumer) VALUES ($1, '{}', 'shipping')"
        )
        .bind(event)
        .execute(&pool)
        .await
        .is_err()
    );

    outbox::migrate(&pool).await.unwrap();

    let rows: Vec<(String, bool)> =
        sqlx::query_as("SELECT consumer, processed FROM inbox_event ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![("billing".to_owned(), true), (String::new(), false)]
    );
    // Now the second group keeps its own row of the same event.
    sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, consumer) VALUES ($1, '{}', 'shipping')",
    )
    .bind(event)
    .execute(&pool)
    .await
    .unwrap();
    let again = sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, consumer) VALUES ($1, '{}', 'shipping')",
    )
    .bind(event)
    .execute(&pool)
    .await;
    assert!(again.is_err(), "a group still stores an event once");
}
