//! The headers that say what an event is (`event_id`, `event_type`, ...)
//! come from the framework only: a row whose stored headers carry the same
//! names (written by another tool or an older version) is published with
//! the framework's own identity headers once, and its spoofed ones dropped.
//! (Recording such a header is refused: see the root crate's tests.) It
//! runs in the progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the
//! test command): "published" is then "passed by its slot's position".

mod common;

use std::time::Duration;

use common::*;
use outbox_runtime::Relay;
use sqlx::PgPool;
use uuid::Uuid;

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn stored_headers_cannot_spoof_the_identity_headers(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("identity-headers");
    create_topic(&brokers(), &topic).await;
    let event_id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO outbox_event
               (event_id, aggregate_type, aggregate_id, event_type, payload, topic,
                partition_key, headers)
           VALUES ($1, 'Order', 'o-1', 'OrderPlaced', '{"key":"o-1","seq":1}', $2, 'o-1',
                   '{"event_id": "00000000-0000-0000-0000-000000000000",
                     "Event_Type": "Spoofed", "tenant": "acme"}')"#,
    )
    .bind(event_id)
    .bind(&topic)
    .execute(&pool)
    .await
    .unwrap();
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .spawn()
        .unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(received.len(), 1);
    let list = &received[0].header_list;
    let named = |name: &str| -> Vec<&str> {
        list.iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    };
    assert_eq!(
        named("event_id"),
        vec![event_id.to_string().as_str()],
        "{list:?}"
    );
    assert_eq!(named("event_type"), vec!["OrderPlaced"], "{list:?}");
    assert_eq!(named("tenant"), vec!["acme"], "{list:?}");
}
