//! Held rows (work the relay cannot publish for a while, kept out of the
//! claim's index) against a real PostgreSQL and broker: rows of a missing
//! topic leave the claim and come back in key order, a key's later rows
//! wait behind its held row, and the claim's plan never walks held rows.
//! Each test runs in the progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`,
//! in the test command): there a missing topic is held as one row of
//! `outbox_held_topic` (its events passed over, none written), while a
//! key's rows held behind an earlier one are held rows in both modes.

mod common;

use std::time::Duration;

use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::relay::progress::Published;
use outbox_runtime::{Relay, ops};
use sqlx::PgPool;

fn relay(pool: &PgPool) -> outbox_runtime::RelayBuilder {
    Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
}

/// What a topic missing on the broker holds: its held rows (the default
/// mode), or the events the windows passed over, on its row of
/// `outbox_held_topic` (the progress mode: its events are not written).
async fn held(pool: &PgPool, topic: &str) -> i64 {
    let held = if progress_mode() {
        "SELECT coalesce(sum(rows), 0)::int8 FROM outbox_held_topic WHERE topic = $1"
    } else {
        "SELECT count(*) FROM outbox_event
         WHERE topic = $1 AND held_until IS NOT NULL AND published_at IS NULL"
    };
    sqlx::query_scalar(held)
        .bind(topic)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Why a topic missing on the broker waits: the error on its held rows (the
/// default mode), or on its row of `outbox_held_topic` (the progress mode).
async fn held_reason(pool: &PgPool, topic: &str) -> Option<String> {
    let reason = if progress_mode() {
        "SELECT reason FROM outbox_held_topic WHERE topic = $1"
    } else {
        "SELECT last_error FROM outbox_event WHERE topic = $1 AND held_until IS NOT NULL LIMIT 1"
    };
    sqlx::query_scalar(reason)
        .bind(topic)
        .fetch_optional(pool)
        .await
        .unwrap()
        .flatten()
}

/// The rows not published (in either mode): how many, how many of them
/// held, and their keys.
async fn waiting(pool: &PgPool) -> (i64, i64, Vec<String>) {
    let published = Published::of(pool).await.unwrap();
    sqlx::query_as(&format!(
        "{}SELECT count(*), count(*) FILTER (WHERE held_until IS NOT NULL),
                  coalesce(array_agg(DISTINCT partition_key), '{{}}')
         FROM outbox_event WHERE NOT {}",
        published.with, published.condition
    ))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Rows of `topic` whose delivery failed (attempts are counted for failed
/// deliveries only, not for holds).
async fn sent_to(pool: &PgPool, topic: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE topic = $1 AND attempts > 0")
        .bind(topic)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The rows of a topic missing on the broker are held (out of the claim's
/// index) while other topics drain; once the topic exists they are
/// released and published, each key in order, rows committed meanwhile
/// included.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_missing_topics_rows_are_held_then_published_in_key_order(pool: PgPool) {
    relay_mode(&pool).await;
    let good = unique_topic("held-good");
    let missing = unique_topic("held-missing");
    create_topic(&brokers(), &good).await;
    let mut committed_missing = commit_messages(&pool, &missing, 300, 5, 50).await;
    let committed_good = commit_messages(&pool, &good, 200, 10, 50).await;

    let handle = relay(&pool)
        .kafka_setting("topic.metadata.propagation.max.ms", "1000")
        .retry_backoff(Duration::from_millis(300), Duration::from_secs(1))
        .missing_topic_hold(Duration::from_secs(1), Duration::from_secs(2))
        .batch_size(50)
        .spawn()
        .unwrap();
    let received = read_topic(
        &brokers(),
        &good,
        committed_good.len(),
        Duration::from_secs(60),
    )
    .await;
    verify(&committed_good, &received);
    assert!(
        eventually(Duration::from_secs(30), || async {
            held(&pool, &missing).await > 0
        })
        .await,
        "the missing topic's rows are held"
    );
    let status = ops::status(&pool).await.unwrap();
    assert_eq!(status.parked, 0, "a missing topic never parks rows");
    assert_eq!(status.unpublished, 300, "held rows are still unpublished");
    assert_eq!(unpublished_of(&pool, &missing).await, 300);

    // Rows of the same keys committed while the topic is held.
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    for seq in 300..320 {
        committed_missing.push(uow.record_message(message(
            &missing,
            &format!("k{}", seq % 5),
            seq,
        )));
    }
    uow.commit().await.unwrap();

    create_topic(&brokers(), &missing).await;
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    handle.shutdown().await.unwrap();
    assert_eq!(held(&pool, &missing).await, 0);
    let received = read_topic(
        &brokers(),
        &missing,
        committed_missing.len(),
        Duration::from_secs(30),
    )
    .await;
    verify(&committed_missing, &received);
}

/// A held row holds back the later rows of its key, also for a relay that
/// never saw it fail (here: held before the relay started): they are held
/// behind it, other keys go on, and once its hold ends the key is published
/// in order. Both modes (the progress mode enabled first: enabling it
/// releases the rows held before).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn later_rows_of_a_held_key_wait_behind_it(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("held-key");
    create_topic(&brokers(), &topic).await;
    let first = commit_messages(&pool, &topic, 1, 1, 1).await;
    sqlx::query("UPDATE outbox_event SET held_until = now() + interval '1 hour'")
        .execute(&pool)
        .await
        .unwrap();
    // k0 (the held key) and k1..k3, interleaved.
    let mut committed = first.clone();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    for seq in 1..40 {
        committed.push(uow.record_message(message(&topic, &format!("k{}", seq % 4), seq)));
    }
    uow.commit().await.unwrap();

    let handle = relay(&pool).batch_size(7).spawn().unwrap();
    // Everything but k0 is published; k0's later rows end up held too.
    assert!(
        eventually(Duration::from_secs(30), || async {
            let (left, held, _) = waiting(&pool).await;
            left == 10 && held == 10
        })
        .await,
        "k0's ten rows held, the others published: {:?}",
        waiting(&pool).await
    );
    let (_, _, keys) = waiting(&pool).await;
    assert_eq!(keys, ["k0"]);

    // The holds end, the first row's last: a later row released before it
    // is held again behind it, and the key follows in order.
    sqlx::query(
        "UPDATE outbox_event
         SET held_until = now() + CASE WHEN event_id = $1 THEN interval '1 second' ELSE '0' END
         WHERE held_until IS NOT NULL",
    )
    .bind(first[0])
    .execute(&pool)
    .await
    .unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    verify(&committed, &received);
}

/// A topic missing on the broker costs the other topics nothing: 20,000
/// rows of it ahead of another topic's rows (lower ids, many claims' worth)
/// do not hold that topic up, and are never handed to the producer (no
/// delivery fails: the relay learns from the broker's metadata that the
/// topic is missing and holds its rows without sending them). Once the
/// topic is created they are published, each key in order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_missing_topic_costs_the_other_topics_nothing(pool: PgPool) {
    relay_mode(&pool).await;
    let good = unique_topic("held-other");
    let missing = unique_topic("held-absent");
    create_topic(&brokers(), &good).await;
    let committed_missing = commit_messages(&pool, &missing, 20_000, 50, 1000).await;
    let committed_good = commit_messages(&pool, &good, 2_000, 20, 200).await;

    let handle = relay(&pool).batch_size(500).spawn().unwrap();
    // Each send to the missing topic would wait for the delivery timeout
    // (10 s here) before failing: 40 batches of it ahead of the good rows.
    let received = read_topic(
        &brokers(),
        &good,
        committed_good.len(),
        Duration::from_secs(30),
    )
    .await;
    verify(&committed_good, &received);
    // The consumer can read the last batch before the relay has recorded
    // its acknowledgement.
    assert!(
        wait_until_topic_published(&pool, &good, Duration::from_secs(30)).await,
        "the other topic's rows are all published"
    );
    assert_eq!(
        sent_to(&pool, &missing).await,
        0,
        "nothing was sent to the missing topic"
    );
    assert_eq!(
        unpublished(&pool).await,
        20_000,
        "the missing topic's rows wait"
    );
    let reason = held_reason(&pool, &missing).await;
    assert!(
        reason.as_deref().is_some_and(|r| r.contains(&missing)),
        "a held row says why: {reason:?}"
    );
    // Past the first hold (5-10 s): the broker is asked again, the rows
    // are held longer, still without a send.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(sent_to(&pool, &missing).await, 0);
    assert_eq!(unpublished(&pool).await, 20_000);

    create_topic(&brokers(), &missing).await;
    assert!(
        wait_until_published(&pool, Duration::from_secs(90)).await,
        "published once the topic exists"
    );
    handle.shutdown().await.unwrap();
    let received = read_topic(
        &brokers(),
        &missing,
        committed_missing.len(),
        Duration::from_secs(60),
    )
    .await;
    verify(&committed_missing, &received);
}
