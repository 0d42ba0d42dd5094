//! Per-key order with several relays (lanes), against a real PostgreSQL and
//! a real broker: relays share the lanes out and take over a stopped relay's
//! lanes; a relay with another lane count is refused; writers of one key
//! publish in commit order. (Relay processes killed and restarted: the
//! `outbox-cli` package's `lanes_processes` test.)

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::{CancellationToken, Error, Relay, RelayHandle};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

/// A relay with a pool of its own, as a separate service instance would
/// have (the test pool has only 5 connections).
fn relay(pool: &PgPool) -> outbox_runtime::RelayBuilder {
    let own = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with((*pool.connect_options()).clone());
    Relay::builder(own)
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
}

/// The lanes of each relay, when they are disjoint and cover all 16.
fn split(handles: &[&RelayHandle]) -> Option<Vec<usize>> {
    let mut all = BTreeSet::new();
    let mut sizes = Vec::new();
    for h in handles {
        let lanes = h.lanes();
        sizes.push(lanes.len());
        for lane in lanes {
            if !all.insert(lane) {
                return None;
            }
        }
    }
    (all.len() == 16).then_some(sizes)
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relays_share_the_lanes_and_take_over_a_stopped_relays_lanes(pool: PgPool) {
    let topic = unique_topic("lanes-share");
    create_topic(&brokers(), &topic).await;
    let a = relay(&pool).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async { a.lanes().len() == 16 }).await,
        "a lone relay owns every lane, got {:?}",
        a.lanes()
    );
    let b = relay(&pool).spawn().unwrap();
    let c = relay(&pool).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            split(&[&a, &b, &c]).is_some_and(|mut s| {
                s.sort_unstable();
                s == [5, 5, 6]
            })
        })
        .await,
        "three relays split 16 lanes 6/5/5, got {:?} {:?} {:?}",
        a.lanes(),
        b.lanes(),
        c.lanes()
    );

    // `outbox status` shows the three and their lanes.
    let relays = outbox_runtime::ops::relays(&pool).await.unwrap();
    assert_eq!(relays.len(), 3, "{relays:?}");
    let mut owned: Vec<i32> = relays.iter().flat_map(|r| r.lanes.clone()).collect();
    owned.sort_unstable();
    assert_eq!(owned, (0..16).collect::<Vec<_>>());
    assert!(relays.iter().all(|r| r.lane_count == Some(16)));

    // Events keep flowing, in per-key order, while the lanes move.
    let first = commit_messages(&pool, &topic, 3_000, 100, 100).await;
    let stopped = Instant::now();
    b.shutdown().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            split(&[&a, &c]).is_some_and(|s| s == [8, 8])
        })
        .await,
        "the two left split 8/8, got {:?} {:?}",
        a.lanes(),
        c.lanes()
    );
    eprintln!(
        "lanes of a stopped relay taken over in {:?}",
        stopped.elapsed()
    );
    let second = commit_messages(&pool, &topic, 3_000, 100, 100).await;
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    a.shutdown().await.unwrap();
    c.shutdown().await.unwrap();

    let committed: Vec<Uuid> = first.into_iter().chain(second).collect();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    let duplicates = verify(&committed, &received);
    assert_eq!(duplicates, 0, "graceful handovers publish nothing twice");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_with_another_lane_count_is_refused(pool: PgPool) {
    let running = relay(&pool).lanes(16).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            running.lanes().len() == 16
        })
        .await
    );
    let other = relay(&pool).lanes(8).build().unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), other.run(CancellationToken::new()))
        .await
        .expect("refused at once");
    match result {
        Err(Error::Config(message)) => {
            assert!(message.contains("16 lanes"), "{message}");
            assert!(message.contains("same lane count"), "{message}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    assert_eq!(
        running.lanes().len(),
        16,
        "the running relay keeps its lanes"
    );
    running.shutdown().await.unwrap();

    let too_many = relay(&pool).lanes(2000).build();
    assert!(matches!(too_many, Err(Error::Config(m)) if m.contains("0..=1024")));
}

/// Two writers of one key whose transactions overlap: the first draws its id
/// and then stays in its transaction (a trigger sleeps), the second starts
/// later and commits at once. Kafka must show them in commit order, also when
/// the relay only claims after both committed (it claims in id order).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn writers_of_one_key_publish_in_commit_order(pool: PgPool) {
    let topic = unique_topic("lanes-commit-order");
    create_topic(&brokers(), &topic).await;
    sqlx::raw_sql(
        "CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.event_type = 'Slow' THEN PERFORM pg_sleep(0.5); END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER slow_insert AFTER INSERT ON outbox_event
             FOR EACH ROW EXECUTE FUNCTION slow_insert();",
    )
    .execute(&pool)
    .await
    .unwrap();

    let commits = Arc::new(AtomicUsize::new(0));
    let write = |event_type: &'static str, delay: Duration| {
        let (pool, topic, commits) = (pool.clone(), topic.clone(), commits.clone());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut uow = UnitOfWork::begin(&pool).await.unwrap();
            let mut message = message(&topic, "the-key", 0);
            message.event_type = event_type.into();
            let id = uow.record_message(message);
            uow.commit().await.unwrap();
            (commits.fetch_add(1, Ordering::SeqCst), id)
        })
    };
    let slow = write("Slow", Duration::ZERO);
    let fast = write("Fast", Duration::from_millis(150));
    let (slow_rank, slow_id) = slow.await.unwrap();
    let (fast_rank, fast_id) = fast.await.unwrap();
    let commit_order = if slow_rank < fast_rank {
        vec![slow_id, fast_id]
    } else {
        vec![fast_id, slow_id]
    };
    // The second writer waited for the first's commit at its insert.
    assert_eq!(commit_order, vec![slow_id, fast_id]);

    let handle = relay(&pool).spawn().unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, 2, Duration::from_secs(30)).await;
    let order: Vec<Uuid> = received.iter().map(|r| r.event_id()).collect();
    assert_eq!(order, commit_order, "Kafka order is the commit order");
}
