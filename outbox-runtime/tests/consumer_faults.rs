//! The consumer under faults: a database outage, a broker outage (a proxy
//! in front of a private broker is cut, then restored), and a rebalance (a
//! member leaves the group mid-stream). Each event's effect must be applied
//! exactly once and nothing may be lost.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, ConsumerBuilder, ConsumerHandle};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

macro_rules! fault_event {
    ($name:ident, $topic:literal) => {
        keyed_event!($name, $topic);

        impl InboxHandler for Effect<$name> {
            type Event = $name;
            const NAME: &'static str = "record_effect";

            fn handle<'a, 'c>(
                &'a self,
                ctx: &'a mut HandlerContext<'c>,
                event: $name,
            ) -> HandlerFuture<'a>
            where
                'c: 'a,
            {
                Box::pin(async move {
                    if !self.pace.is_zero() {
                        tokio::time::sleep(self.pace).await;
                    }
                    let event_id = ctx.incoming().event_id;
                    sqlx::query("INSERT INTO effect (event_id, key, seq) VALUES ($1, $2, $3)")
                        .bind(event_id)
                        .bind(&event.key)
                        .bind(event.seq as i64)
                        .execute(&mut **ctx)
                        .await?;
                    Ok(())
                })
            }
        }
    };
}

/// Records each handled event in the `effect` table, taking `pace` each.
struct Effect<E> {
    pace: Duration,
    _event: std::marker::PhantomData<fn() -> E>,
}

fn effect<E>(pace: Duration) -> Effect<E> {
    Effect {
        pace,
        _event: std::marker::PhantomData,
    }
}

async fn effect_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text, seq bigint)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Asserts every id has exactly one effect and nothing else was applied.
async fn assert_once(pool: &PgPool, ids: &[Uuid]) {
    let rows: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM effect GROUP BY event_id")
            .fetch_all(pool)
            .await
            .unwrap();
    let counts: std::collections::HashMap<Uuid, i64> = rows.into_iter().collect();
    let missing = ids.iter().filter(|id| !counts.contains_key(id)).count();
    let twice = counts.values().filter(|n| **n > 1).count();
    assert_eq!(missing, 0, "{missing} events never applied");
    assert_eq!(twice, 0, "{twice} events applied more than once");
    assert_eq!(counts.len(), ids.len(), "effects of unknown events");
}

fn events(range: std::ops::Range<u64>, keys: u64) -> (Vec<TestMessage>, Vec<Uuid>) {
    let mut messages = Vec::new();
    let mut ids = Vec::new();
    for seq in range {
        let id = Uuid::now_v7();
        let key = format!("k{}", seq % keys);
        ids.push(id);
        messages.push(TestMessage::event(
            id,
            "OrderPlaced",
            &key,
            serde_json::json!({ "key": key, "seq": seq }),
        ));
    }
    (messages, ids)
}

async fn processed(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM effect")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn consumer(pool: &PgPool, brokers: &str, group: &str) -> ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group(group)
        .brokers(brokers)
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .batch_size(100)
}

/// The offsets `group` has committed on `topic`, summed over its partitions
/// (a partition without a committed offset counts 0).
async fn committed(group: &str, topic: &str) -> i64 {
    committed_offsets(group, topic, PARTITIONS)
        .await
        .into_iter()
        .map(|o| o.max(0))
        .sum()
}

fault_event!(DbDownEvent, "consumer-test-db-outage");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_database_outage_stalls_the_consumer_and_loses_nothing(pool: PgPool) {
    init_tracing();
    let topic = DbDownEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let (messages, ids) = events(0..1_500, 30);
    produce(&brokers(), topic, &messages).await;

    let options = pool.connect_options().as_ref().clone();
    let upstream = format!("127.0.0.1:{}", options.get_port()).parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let consumer_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options.port(proxy.addr.port()))
        .await
        .unwrap();
    let group = unique_topic("db-outage");
    let handle = consumer(&consumer_pool, &brokers(), &group)
        .handler(effect::<DbDownEvent>(Duration::from_millis(1)))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            processed(&pool).await >= 300
        })
        .await
    );

    proxy.cut();
    // The offsets wait for the database: every message is applied exactly
    // once and none is dead-lettered here, so the offsets committed never
    // exceed the effects applied — before, during and after the outage
    // (committed offsets are read first, effects second: both only grow).
    let mut samples = Vec::new();
    for _ in 0..8 {
        let offsets = committed(&group, topic).await;
        let effects = processed(&pool).await;
        samples.push((offsets, effects));
        assert!(
            offsets <= effects,
            "offsets committed past unapplied messages during the outage: {samples:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        samples.last().is_some_and(|(_, e)| *e < 1_500),
        "the outage hit mid-stream: {samples:?}"
    );
    assert!(!handle.is_finished(), "the consumer keeps running");

    proxy.restore();
    assert!(
        eventually(Duration::from_secs(60), || async {
            processed(&pool).await == 1_500
        })
        .await,
        "backlog applied after the outage: {:?}",
        handle.counts()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            committed(&group, topic).await == 1_500
        })
        .await,
        "offsets committed up to the end once everything is applied"
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_once(&pool, &ids).await;
    eprintln!("database outage: {counts:?}");
}

fault_event!(RebalanceEvent, "consumer-test-rebalance");

/// A member joins mid-stream (its share of the partitions is handed over
/// from the first), then the first leaves mid-stream (the rest is handed to
/// the second): every event applied once, and nobody reads a processed
/// message again. On a private broker: the shared test broker, loaded by
/// the other tests running in parallel, could stall a member resuming
/// mid-stream after a rebalance.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_member_leaving_mid_stream_hands_its_partitions_over_without_loss(pool: PgPool) {
    init_tracing();
    let port = free_port();
    let _broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = RebalanceEvent::TOPIC;
    create_topic(&brokers, topic).await;
    effect_table(&pool).await;
    // Resumed from committed offsets: one record per batch on the test broker.
    let (messages, ids) = events(0..2_000, 40);
    produce_unbatched(&brokers, topic, &messages).await;
    let group = unique_topic("rebalance");

    let start = |pace: u64| {
        consumer(&pool, &brokers, &group)
            .handler(effect::<RebalanceEvent>(Duration::from_millis(pace)))
            .spawn()
            .unwrap()
    };
    let first = start(2);
    assert!(
        eventually(Duration::from_secs(30), || async {
            first.counts().processed >= 50
        })
        .await
    );
    // A second member joins: the partitions are split between them.
    let second = start(2);
    assert!(
        eventually(Duration::from_secs(30), || async {
            second.counts().processed >= 50
        })
        .await,
        "the joining member got partitions: {:?}",
        second.counts()
    );
    assert!(
        processed(&pool).await < 2_000,
        "still mid-stream when the first member leaves"
    );
    let first_counts = first.counts();
    first.shutdown().await.unwrap();
    assert!(
        eventually(Duration::from_secs(60), || async {
            processed(&pool).await == 2_000
        })
        .await,
        "the remaining member finished the stream: {:?}",
        second.counts()
    );
    let second_counts = second.counts();
    second.shutdown().await.unwrap();
    assert_once(&pool, &ids).await;
    // The batch in flight at each revocation committed before its offsets
    // were handed over, and what was polled for revoked partitions was
    // dropped: nobody read a processed message again.
    assert_eq!(
        first_counts.duplicates + second_counts.duplicates,
        0,
        "clean hand-over: {first_counts:?} {second_counts:?}"
    );
    eprintln!("rebalance: first {first_counts:?}, second {second_counts:?}");
}

fault_event!(BrokerDownEvent, "consumer-test-broker-outage");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_broker_outage_is_ridden_out_and_nothing_is_lost(pool: PgPool) {
    init_tracing();
    // Clients reach the private broker only through the proxy, which the
    // broker advertises as its address.
    let (proxy_port, broker_port) = (free_port(), free_port());
    let proxy = Arc::new(
        Proxy::start_on(
            proxy_port,
            format!("127.0.0.1:{broker_port}").parse().unwrap(),
        )
        .await,
    );
    let _broker = PrivateBroker::start(broker_port, proxy_port);
    let brokers = format!("127.0.0.1:{proxy_port}");
    create_topic(&brokers, BrokerDownEvent::TOPIC).await;
    effect_table(&pool).await;
    let (messages, mut ids) = events(0..1_000, 20);
    produce(&brokers, BrokerDownEvent::TOPIC, &messages).await;

    let handle: ConsumerHandle = consumer(&pool, &brokers, &unique_topic("broker-outage"))
        .handler(effect::<BrokerDownEvent>(Duration::from_millis(2)))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            processed(&pool).await >= 100
        })
        .await
    );
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!handle.is_finished(), "the consumer keeps running");
    proxy.restore();
    // More events after the outage.
    let (more, more_ids) = events(1_000..1_200, 20);
    produce(&brokers, BrokerDownEvent::TOPIC, &more).await;
    ids.extend(more_ids);
    assert!(
        eventually(Duration::from_secs(60), || async {
            processed(&pool).await == 1_200
        })
        .await,
        "everything applied after the outage: {:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_once(&pool, &ids).await;
    eprintln!("broker outage: {counts:?}");
}
