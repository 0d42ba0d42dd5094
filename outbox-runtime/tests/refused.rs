//! A statement the database refuses is not an outage: each process as its
//! README role with one privilege revoked reports the refusal once, at
//! error level, naming the statement and what it needs, and in its health;
//! it does not spin, publishes no event twice, applies none twice and
//! dead-letters none for it; given the privilege back, everything resumes
//! with nothing lost.
//!
//! The relay's tests run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command), the relay
//! role with the guide's grants for that mode: there the refused hold is
//! the missing topic's row of `outbox_held_topic` and the refused record of
//! what was published is the positions, the mode's own statements.

mod common;

use std::time::Duration;

use common::roles::*;
use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::{ConsumerHealth, Mode, Relay, RelayHealth};
use sqlx::PgPool;

/// 19 events of a topic the broker has and one of a topic it lacks,
/// committed by the application role; returns the good topic, the missing
/// one and the 19 event ids.
async fn good_and_missing(roles: &Roles) -> (String, String, Vec<uuid::Uuid>) {
    let good = unique_topic("roles-good");
    let missing = unique_topic("roles-missing");
    create_topic(&brokers(), &good).await;
    let app = roles.pool("outbox_app", 1);
    let mut uow = UnitOfWork::begin(&app).await.unwrap();
    let mut committed = Vec::new();
    for seq in 0..19 {
        committed.push(uow.record_message(message(&good, &format!("k{}", seq % 4), seq)));
    }
    uow.record_message(message(&missing, "k0", 19));
    uow.commit().await.unwrap();
    app.close().await;
    (good, missing, committed)
}

/// The relay role without one privilege (`revoke`, the statement that
/// needs it `statement`): the refusal is reported once, at error level,
/// naming the statement, and in the relay's health; the relay does not
/// spin (a claim per refusal delay at most) and publishes no event twice;
/// given the privilege back, it resumes and everything is published once.
async fn relay_refused(pool: PgPool, revoke: &str, statement: &str) {
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    roles.relay_mode().await;
    roles
        .sql(&format!("REVOKE {revoke} FROM outbox_relay"))
        .await;
    let (good, missing, committed) = good_and_missing(&roles).await;
    let relay = Relay::builder(roles.pool("outbox_relay", 4))
        .brokers(brokers())
        .poll_interval(Duration::from_millis(100))
        .outage_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .spawn()
        .unwrap();
    let refused = eventually(Duration::from_secs(20), || async {
        matches!(relay.health(), RelayHealth::Refused { error }
            if error.contains(statement) && error.contains("permission denied"))
    })
    .await;
    assert!(refused, "{:?}\n{}", relay.health(), logs.text());
    // Four seconds of refusals: a round per second at most, each refused
    // statement reported once.
    let batches = relay.counts().batches;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let rounds = relay.counts().batches - batches;
    assert!(rounds <= 6, "{rounds} batches in 4 s while refused");
    let reported = logs.refusals();
    assert!(reported.contains(&statement.to_owned()), "{reported:?}");
    assert_eq!(
        logs.count("permission denied"),
        reported.len(),
        "{}",
        logs.text()
    );
    assert!(matches!(relay.health(), RelayHealth::Refused { .. }));

    roles.sql(&format!("GRANT {revoke} TO outbox_relay")).await;
    let resumed = eventually(Duration::from_secs(30), || async {
        unpublished_of(&pool, &good).await == 0
            && held(&pool, &missing).await
            && relay.health() == RelayHealth::Running
    })
    .await;
    assert!(resumed, "{:?}\n{}", relay.health(), logs.text());
    relay.shutdown().await.unwrap();
    let received = read_all(&brokers(), &good, Duration::from_secs(30)).await;
    assert_eq!(received.len(), 19, "{}", logs.text());
    assert_eq!(verify(&committed, &received), 0);
    assert_eq!(logs.refusals(), reported, "{}", logs.text());
    assert!(logs.count("goes through again") >= 1, "{}", logs.text());
    roles.drop_all().await;
}

/// The case: holding a row writes `held_until`. In the progress
/// mode the missing topic is held as a row of `outbox_held_topic`: its
/// insert is refused.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_refused_hold_is_reported_once_and_costs_no_duplicate(pool: PgPool) {
    let (revoke, statement) = if progress_mode() {
        (
            "INSERT ON outbox_held_topic",
            "relay: hold or release a topic missing on the broker",
        )
    } else {
        (
            "UPDATE (held_until) ON outbox_event",
            "relay: record failed deliveries",
        )
    };
    relay_refused(pool, revoke, statement).await;
}

/// Marks refused: the delivered rows cannot be recorded, so the relay stops
/// publishing until they are. In the progress mode, the positions (what
/// records the delivered rows there) are refused.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn refused_marks_stop_the_relay_publishing_until_recorded(pool: PgPool) {
    let (revoke, statement) = if progress_mode() {
        ("INSERT ON outbox_progress", "relay: record progress")
    } else {
        (
            "UPDATE (published_at) ON outbox_event",
            "relay: mark rows published",
        )
    };
    relay_refused(pool, revoke, statement).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_refused_claim_is_reported_once(pool: PgPool) {
    relay_refused(pool, "SELECT ON outbox_event", "relay: claim rows").await;
}

/// The consumer role without one privilege (`revoke`; `statement` needs
/// it): reported once, at error level, naming the statement, and in the
/// consumer's health; nothing spins, nothing is applied or dead-lettered
/// for it; given the privilege back, every event is applied once and only
/// the malformed message is dead-lettered.
async fn consumer_refused(pool: PgPool, mode: Mode, revoke: &str, statement: &str) {
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    roles
        .sql(&format!("REVOKE {revoke} FROM outbox_consumer"))
        .await;
    let inbound = Inbound::produce(&roles, 20, 0).await;
    let consumer = inbound.consumer(&roles, mode);
    let refused = eventually(Duration::from_secs(30), || async {
        matches!(consumer.health(), ConsumerHealth::Refused { error }
            if error.contains(statement) && error.contains("permission denied"))
    })
    .await;
    assert!(refused, "{:?}\n{}", consumer.health(), logs.text());
    let lines = logs.text().lines().count();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let more = logs.text().lines().count() - lines;
    assert!(
        more <= 4,
        "{more} log lines in 4 s while refused:\n{}",
        logs.text()
    );
    let reported = logs.refusals();
    assert!(reported.contains(&statement.to_owned()), "{reported:?}");
    assert!(applied(&pool).await.is_empty());
    assert_eq!(consumer.counts().handler_failures, 0);
    assert!(
        dead_letters(&pool)
            .await
            .iter()
            .all(|(reason, _)| reason == "not_json"),
        "{:?}",
        dead_letters(&pool).await
    );
    assert!(matches!(consumer.health(), ConsumerHealth::Refused { .. }));

    roles
        .sql(&format!("GRANT {revoke} TO outbox_consumer"))
        .await;
    let resumed = eventually(Duration::from_secs(30), || async {
        applied(&pool).await.len() == inbound.good.len()
            && consumer.health() == ConsumerHealth::Running
    })
    .await;
    assert!(resumed, "{:?}\n{}", consumer.health(), logs.text());
    consumer.shutdown().await.unwrap();
    assert!(applied(&pool).await.iter().all(|n| *n == 1));
    assert_eq!(dead_letters(&pool).await, vec![("not_json".to_owned(), 1)]);
    let follow_ups: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(follow_ups as usize, inbound.good.len());
    assert_eq!(logs.refusals(), reported, "{}", logs.text());
    assert!(logs.count("goes through again") >= 1, "{}", logs.text());
    roles.drop_all().await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_rows_refused_are_reported_once(pool: PgPool) {
    consumer_refused(
        pool,
        Mode::Dedup,
        "INSERT ON processed_event",
        "consumer: record processed events",
    )
    .await;
}

/// The follow-up events of good events refused: the consumer's own
/// privilege, not the events' fault: none is dead-lettered.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn refused_follow_ups_dead_letter_nothing(pool: PgPool) {
    consumer_refused(
        pool,
        Mode::Dedup,
        "INSERT ON outbox_event",
        "consumer: write follow-up events",
    )
    .await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_refused_commit_guard_is_reported_once(pool: PgPool) {
    consumer_refused(
        pool,
        Mode::Dedup,
        "INSERT ON outbox_tx_guard",
        "consumer: arm the commit guard",
    )
    .await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn refused_inbox_claims_are_reported_once(pool: PgPool) {
    consumer_refused(
        pool,
        Mode::Inbox,
        "UPDATE ON inbox_event",
        "consumer (inbox): claim stored events",
    )
    .await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn refused_dead_letters_are_reported_once(pool: PgPool) {
    consumer_refused(
        pool,
        Mode::Inbox,
        "INSERT ON dead_letter",
        "consumer (inbox): store received events",
    )
    .await;
}
