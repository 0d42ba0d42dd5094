//! CloudEvents both ways, against a real PostgreSQL and the real broker: a
//! relay with CloudEvents on writes the binary-mode `ce_*` headers beside
//! the framework's own (`both`) or instead of them (`only`), as a plain
//! Kafka consumer sees them, and a consumer keeps the relay's event ids;
//! messages from another producer that carry only CloudEvents headers are
//! handled by a typed handler, each exactly once — its event id derived from
//! (`ce_source`, `ce_id`), whatever the id looks like, so two sources that
//! reuse an id are never confused — while one without the identity
//! CloudEvents requires is dead-lettered with its reason. The tests with a
//! relay run in the progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`,
//! in the test command): "published" is then "passed by its slot's
//! position" (see `common::unpublished`).

mod common;

use std::time::{Duration, Instant};

use common::*;
use outbox_core::DomainEvent;
use outbox_runtime::cloudevents::{self, CloudEventsMode};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox_runtime::{Consumer, Mode, Relay};
use sqlx::PgPool;
use uuid::Uuid;

keyed_event!(ForeignDedup, "cloud-events-foreign-dedup");
keyed_event!(ForeignInbox, "cloud-events-foreign-inbox");
keyed_event!(SharedIdsDedup, "cloud-events-shared-ids-dedup");
keyed_event!(SharedIdsInbox, "cloud-events-shared-ids-inbox");
keyed_event!(RelayOnlyDedup, "cloud-events-relay-only-dedup");
keyed_event!(RelayOnlyInbox, "cloud-events-relay-only-inbox");

async fn publish_with(pool: &PgPool, mode: CloudEventsMode) -> (String, Vec<Uuid>) {
    let brokers = brokers();
    let topic = unique_topic("cloud-events-relay");
    create_topic(&brokers, &topic).await;
    let ids = commit_messages(pool, &topic, 4, 2, 2).await;
    let relay = Relay::builder(pool.clone())
        .brokers(&brokers)
        .cloud_events(mode, "/orders-service")
        .spawn()
        .unwrap();
    assert!(
        wait_until_published(pool, Duration::from_secs(30)).await,
        "the relay did not publish"
    );
    relay.shutdown().await.unwrap();
    (topic, ids)
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_with_cloud_events_writes_ce_headers_beside_or_instead_of_its_own(pool: PgPool) {
    relay_mode(&pool).await;
    let before = sqlx::types::chrono::Utc::now();
    for mode in [CloudEventsMode::Both, CloudEventsMode::Only] {
        let (topic, ids) = publish_with(&pool, mode).await;
        let received = read_all(&brokers(), &topic, Duration::from_secs(30)).await;
        assert_eq!(received.len(), ids.len(), "{mode}");
        let rows: Vec<(Uuid, String, String)> = sqlx::query_as(
            "SELECT event_id, aggregate_id, partition_key FROM outbox_event WHERE topic = $1",
        )
        .bind(&topic)
        .fetch_all(&pool)
        .await
        .unwrap();
        for r in &received {
            let h = &r.headers;
            let ce_id: Uuid = h["ce_id"].parse().expect("ce_id is the event id");
            let (_, aggregate_id, key) = rows.iter().find(|(id, ..)| *id == ce_id).expect("a row");
            assert_eq!(h["ce_specversion"], "1.0");
            assert_eq!(h["ce_type"], "OrderPlaced");
            assert_eq!(h["ce_source"], "/orders-service");
            assert_eq!(h["ce_subject"], *aggregate_id);
            assert_eq!(h["ce_eventversion"], "1");
            assert_eq!(h["ce_aggregatetype"], "Order");
            assert_eq!(h["content-type"], "application/json");
            assert_eq!(r.key, *key, "the key still orders an aggregate's events");
            let time = sqlx::types::chrono::DateTime::parse_from_rfc3339(&h["ce_time"])
                .expect("ce_time is RFC 3339");
            assert!(
                time.timestamp() >= before.timestamp() - 5 && h["ce_time"].ends_with('Z'),
                "{}",
                h["ce_time"]
            );
            let framework = ["event_id", "event_type", "event_version", "aggregate_type"];
            match mode {
                CloudEventsMode::Both => {
                    assert_eq!(r.event_id(), ce_id);
                    assert!(framework.iter().all(|k| h.contains_key(*k)), "{h:?}");
                }
                _ => assert!(framework.iter().all(|k| !h.contains_key(*k)), "{h:?}"),
            }
        }
    }
}

/// A message as a producer that speaks CloudEvents (and not this framework)
/// sends it.
fn foreign(ce_id: &str, key: &str, seq: u64) -> TestMessage {
    TestMessage {
        key: Some(key.to_owned()),
        payload: Some(
            serde_json::json!({ "key": key, "seq": seq })
                .to_string()
                .into_bytes(),
        ),
        headers: vec![
            ("ce_specversion".into(), "1.0".into()),
            ("ce_id".into(), ce_id.into()),
            ("ce_source".into(), "/billing-legacy".into()),
            ("ce_type".into(), "OrderPlaced".into()),
            ("ce_time".into(), "2026-11-30T12:00:00Z".into()),
            ("content-type".into(), "application/json".into()),
        ],
        raw_headers: Vec::new(),
        partition: None,
    }
}

async fn foreign_events_are_handled_once<E: DomainEvent>(pool: &PgPool, mode: Mode) {
    sqlx::query("CREATE TABLE effect (event_id uuid NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let brokers = brokers();
    reset_topic(&brokers, E::TOPIC).await;
    let uuid_id = Uuid::now_v7();
    let messages = vec![
        foreign("inv-42", "k1", 1),
        foreign(&uuid_id.to_string(), "k2", 2),
        // The broker (or the producer) delivers both of them again.
        foreign("inv-42", "k1", 1),
        foreign(&uuid_id.to_string(), "k2", 2),
        // Same id from another source: another event.
        foreign("inv-42", "k3", 3).header("ce_source", "/billing-eu"),
        // No source: the id alone identifies nothing.
        foreign("inv-43", "k4", 4).without_header("ce_source"),
        // A spec version this consumer does not read.
        foreign("inv-44", "k5", 5).header("ce_specversion", "0.3"),
    ];
    produce(&brokers, E::TOPIC, &messages).await;

    let group = unique_topic("cloud-events");
    let handle = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(&brokers)
        .mode(mode)
        .processor_poll_interval(Duration::from_millis(50))
        .handler(RecordEffect::<E>::new())
        .spawn()
        .unwrap();
    let effects = || async {
        sqlx::query_scalar::<_, Uuid>("SELECT event_id FROM effect ORDER BY event_id")
            .fetch_all(pool)
            .await
            .unwrap()
    };
    let letters = || async {
        dead_letter::list(pool, &DeadLetterFilter::new().consumer(&group))
            .await
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while (effects().await.len() < 3 || letters().await.len() < 2) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let the duplicates (after the firsts, in their partitions) be seen.
    assert!(
        eventually(Duration::from_secs(30), || async {
            handle.counts().duplicates >= 2
        })
        .await,
        "{:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();

    let mut want = vec![
        cloudevents::event_id("/billing-legacy", "inv-42"),
        // A UUID from another producer is an id of that source too.
        cloudevents::event_id("/billing-legacy", &uuid_id.to_string()),
        cloudevents::event_id("/billing-eu", "inv-42"),
    ];
    want.sort();
    assert_eq!(effects().await, want, "each event handled exactly once");
    let mut letters: Vec<(String, String)> = letters()
        .await
        .into_iter()
        .map(|l| (l.reason, l.error))
        .collect();
    letters.sort();
    assert_eq!(letters.len(), 2, "{letters:?}");
    assert_eq!(letters[0].0, "invalid_headers", "{letters:?}");
    assert!(letters[0].1.contains("0.3"), "{letters:?}");
    assert_eq!(letters[1].0, "no_event_id", "{letters:?}");
    assert!(letters[1].1.contains("ce_source"), "{letters:?}");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_events_of_another_producer_with_only_ce_headers_are_handled_once(pool: PgPool) {
    foreign_events_are_handled_once::<ForeignDedup>(&pool, Mode::Dedup).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_events_of_another_producer_with_only_ce_headers_are_handled_once(pool: PgPool) {
    foreign_events_are_handled_once::<ForeignInbox>(&pool, Mode::Inbox).await;
}

/// Runs a consumer of `mode` over `E::TOPIC` (after producing `messages`
/// there) until `expected` effects are recorded and `duplicates` copies
/// were skipped; returns the effects' event ids, sorted.
async fn handle_all<E: DomainEvent>(
    pool: &PgPool,
    mode: Mode,
    messages: &[TestMessage],
    expected: usize,
    duplicates: u64,
) -> Vec<Uuid> {
    sqlx::query("CREATE TABLE effect (event_id uuid NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let brokers = brokers();
    produce(&brokers, E::TOPIC, messages).await;
    let group = unique_topic("cloud-events");
    let handle = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(&brokers)
        .mode(mode)
        .processor_poll_interval(Duration::from_millis(50))
        .handler(RecordEffect::<E>::new())
        .spawn()
        .unwrap();
    let effects = || async {
        sqlx::query_scalar::<_, Uuid>("SELECT event_id FROM effect ORDER BY event_id")
            .fetch_all(pool)
            .await
            .unwrap()
    };
    let settled = eventually(Duration::from_secs(60), || async {
        effects().await.len() >= expected && handle.counts().duplicates >= duplicates
    })
    .await;
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    let letters: Vec<String> = dead_letter::list(pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.error)
        .collect();
    assert!(
        settled,
        "{counts:?}; effects {:?}; dead letters {letters:?}",
        effects().await
    );
    assert!(letters.is_empty(), "{letters:?}");
    effects().await
}

/// Two producers that both use request ids as `ce_id` — in every form a
/// UUID parser accepts — each send an event with the same id; one of them
/// sends its event twice. Each producer's event is applied, once.
async fn equal_ids_of_two_sources_are_two_events<E: DomainEvent>(pool: &PgPool, mode: Mode) {
    let request = Uuid::now_v7();
    let forms = [
        request.to_string(),
        request.hyphenated().to_string().to_uppercase(),
        request.simple().to_string(),
        request.braced().to_string(),
        request.urn().to_string(),
    ];
    let mut messages = Vec::new();
    let mut want = Vec::new();
    for (i, id) in forms.iter().enumerate() {
        let seq = i as u64;
        for (source, key) in [("/billing", "k1"), ("/shipping", "k2")] {
            messages.push(foreign(id, key, seq).header("ce_source", source));
            want.push(cloudevents::event_id(source, id));
        }
        // The billing producer's message, delivered again.
        messages.push(foreign(id, "k1", seq).header("ce_source", "/billing"));
    }
    reset_topic(&brokers(), E::TOPIC).await;
    let events = 2 * forms.len();
    let effects = handle_all::<E>(pool, mode, &messages, events, forms.len() as u64).await;
    assert_eq!(effects.len(), events, "each source's event applied once");
    want.sort();
    assert_eq!(effects, want, "with the ids derived from (source, id)");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_equal_ids_of_two_sources_are_two_events_in_any_uuid_form(pool: PgPool) {
    equal_ids_of_two_sources_are_two_events::<SharedIdsDedup>(&pool, Mode::Dedup).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_equal_ids_of_two_sources_are_two_events_in_any_uuid_form(pool: PgPool) {
    equal_ids_of_two_sources_are_two_events::<SharedIdsInbox>(&pool, Mode::Inbox).await;
}

/// A relay writing CloudEvents headers only: the consumer's event ids are
/// the outbox's (the relay's `ce_id`, taken as is), each event applied once
/// though the relay's messages come twice.
async fn a_relays_own_event_ids_are_kept<E: DomainEvent>(pool: &PgPool, mode: Mode) {
    relay_mode(pool).await;
    let brokers = brokers();
    reset_topic(&brokers, E::TOPIC).await;
    let ids = commit_messages(pool, E::TOPIC, 6, 3, 2).await;
    let relay = Relay::builder(pool.clone())
        .brokers(&brokers)
        .cloud_events(CloudEventsMode::Only, "/orders-service")
        .spawn()
        .unwrap();
    assert!(
        wait_until_published(pool, Duration::from_secs(30)).await,
        "the relay did not publish"
    );
    relay.shutdown().await.unwrap();
    // What the relay sent, sent again (as by a relay that died before
    // marking it published).
    let sent = read_all(&brokers, E::TOPIC, Duration::from_secs(30)).await;
    assert_eq!(sent.len(), ids.len());
    let again: Vec<TestMessage> = sent
        .iter()
        .map(|r| TestMessage {
            key: Some(r.key.clone()),
            payload: Some(r.payload.to_string().into_bytes()),
            headers: r.header_list.clone(),
            ..TestMessage::default()
        })
        .collect();
    let effects = handle_all::<E>(pool, mode, &again, ids.len(), ids.len() as u64).await;
    let mut want = ids;
    want.sort();
    assert_eq!(effects, want, "the outbox's event ids, each applied once");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_relays_own_cloud_events_keep_their_event_ids(pool: PgPool) {
    a_relays_own_event_ids_are_kept::<RelayOnlyDedup>(&pool, Mode::Dedup).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_relays_own_cloud_events_keep_their_event_ids(pool: PgPool) {
    a_relays_own_event_ids_are_kept::<RelayOnlyInbox>(&pool, Mode::Inbox).await;
}
