//! Several outboxes in one database, one schema per service, each chosen by
//! its connections' `search_path`: each outbox's relays, lanes, wake-up
//! lock, NOTIFY channel and cleanup leader are its own. Real PostgreSQL, real
//! broker.
//!
//! The tests that call `relay_mode` run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command), each schema's
//! outbox in it: "published" is then "passed by its slot's position" (see
//! `common::unpublished`), the positions each outbox's own.

mod common;

use std::time::Duration;

use common::*;
use outbox_runtime::cleanup::{Cleanup, Retention};
use outbox_runtime::{Relay, RelayHandle, ops};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// A pool of `n` connections to `pool`'s database whose `search_path` is
/// `schema` (created and migrated here).
async fn schema_pool(pool: &PgPool, schema: &str, n: u32) -> PgPool {
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .execute(pool)
        .await
        .unwrap();
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("search_path", schema)]);
    let schema_pool = PgPoolOptions::new()
        .max_connections(n)
        .connect_with(options)
        .await
        .unwrap();
    outbox_core::migrate(&schema_pool).await.unwrap();
    schema_pool
}

fn relay(pool: &PgPool) -> RelayHandle {
    let own = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with((*pool.connect_options()).clone());
    Relay::builder(own)
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
        .spawn()
        .unwrap()
}

/// Two services' outboxes in schemas `svc_a` and `svc_b` of one database, two
/// relays on each: both outboxes drain completely, each key in commit order.
/// With the lanes shared database-wide, each fleet took part of the lanes
/// and the rows of its outbox in the other fleet's lanes were never
/// published.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn two_outbox_schemas_drain_fully_in_per_key_order(pool: PgPool) {
    init_tracing();
    let a = schema_pool(&pool, "svc_a", 4).await;
    let b = schema_pool(&pool, "svc_b", 4).await;
    relay_mode(&a).await;
    relay_mode(&b).await;
    let (topic_a, topic_b) = (unique_topic("schema-a"), unique_topic("schema-b"));
    // Two relays write each fresh topic at once: warm its partitions up.
    create_warm_topic(&brokers(), &topic_a).await;
    create_warm_topic(&brokers(), &topic_b).await;
    let relays = [relay(&a), relay(&a), relay(&b), relay(&b)];

    let committed_a = commit_messages(&a, &topic_a, 2_000, 64, 20).await;
    let committed_b = commit_messages(&b, &topic_b, 2_000, 64, 20).await;
    let drained_a = wait_until_published(&a, Duration::from_secs(60)).await;
    let drained_b = wait_until_published(&b, Duration::from_secs(60)).await;
    let lanes: Vec<Vec<i32>> = relays.iter().map(|r| r.lanes()).collect();
    assert!(
        drained_a && drained_b,
        "both outboxes drained: svc_a {} and svc_b {} rows left; lanes per relay {lanes:?}",
        unpublished(&a).await,
        unpublished(&b).await,
    );
    // Each fleet shares its own 16 lanes.
    let mut of_a: Vec<i32> = lanes[0].iter().chain(&lanes[1]).copied().collect();
    let mut of_b: Vec<i32> = lanes[2].iter().chain(&lanes[3]).copied().collect();
    of_a.sort_unstable();
    of_b.sort_unstable();
    assert_eq!(of_a, (0..16).collect::<Vec<_>>(), "{lanes:?}");
    assert_eq!(of_b, (0..16).collect::<Vec<_>>(), "{lanes:?}");

    // `outbox status` of each schema lists its own relays only.
    let status_a = ops::status(&a).await.unwrap();
    let status_b = ops::status(&b).await.unwrap();
    assert_eq!(status_a.relays.len(), 2, "{:?}", status_a.relays);
    assert_eq!(status_b.relays.len(), 2, "{:?}", status_b.relays);
    assert_eq!(status_a.schema, "svc_a");
    assert_ne!(status_a.channel, status_b.channel);

    for r in relays {
        r.shutdown().await.unwrap();
    }
    for (topic, committed) in [(&topic_a, &committed_a), (&topic_b, &committed_b)] {
        let received =
            read_topic(&brokers(), topic, committed.len(), Duration::from_secs(60)).await;
        let duplicates = verify(committed, &received);
        assert_eq!(duplicates, 0, "{topic}");
    }
}

/// The cleanup jobs of two schemas' outboxes each have their own leader:
/// both run their passes.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn cleanup_jobs_of_two_schemas_each_have_a_leader(pool: PgPool) {
    let a = schema_pool(&pool, "svc_a", 3).await;
    let b = schema_pool(&pool, "svc_b", 3).await;
    relay_mode(&a).await;
    relay_mode(&b).await;
    let every = Duration::from_millis(100);
    let days = Duration::from_secs(30 * 86_400);
    let job_a = Cleanup::new(a.clone(), Retention::new(days), every)
        .unwrap()
        .spawn();
    let job_b = Cleanup::new(b.clone(), Retention::new(days), every)
        .unwrap()
        .spawn();
    assert!(
        eventually(Duration::from_secs(10), || async {
            job_a.counts().passes >= 2 && job_b.counts().passes >= 2
        })
        .await,
        "both lead: {:?} {:?}",
        job_a.counts(),
        job_b.counts()
    );
    job_a.shutdown().await.unwrap();
    job_b.shutdown().await.unwrap();
}

/// A relay waiting on schema `svc_b`'s outbox makes no writer of `svc_a`
/// notify, and a relay waiting on `svc_a` is notified on `svc_a`'s channel
/// only: each outbox has its own wake-up lock and channel.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn wake_up_lock_and_channel_are_per_outbox(pool: PgPool) {
    let a = schema_pool(&pool, "svc_a", 3).await;
    let b = schema_pool(&pool, "svc_b", 3).await;
    let scope_a = outbox_runtime::OutboxScope::of(&a).await.unwrap();
    let scope_b = outbox_runtime::OutboxScope::of(&b).await.unwrap();
    assert_ne!(scope_a, scope_b);
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener
        .listen_all([scope_a.channel().as_str(), scope_b.channel().as_str()])
        .await
        .unwrap();
    let topic = unique_topic("schema-wake");

    // "A relay waits on svc_b": it holds svc_b's wake lock.
    let mut waiting_b = b.acquire().await.unwrap();
    let armed: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(scope_b.wake_lock())
        .fetch_one(&mut *waiting_b)
        .await
        .unwrap();
    assert!(armed);
    let quiet = commit_messages(&a, &topic, 1, 1, 1).await;

    // Now a relay waits on svc_a too: the next commit in svc_a notifies.
    let mut waiting_a = a.acquire().await.unwrap();
    let armed: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(scope_a.wake_lock())
        .fetch_one(&mut *waiting_a)
        .await
        .unwrap();
    assert!(armed);
    let loud = commit_messages(&a, &topic, 1, 1, 1).await;

    // A marker after both commits: notifications arrive in commit order, so
    // everything the two commits sent arrives before it.
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(scope_a.channel())
        .execute(&pool)
        .await
        .unwrap();
    let mut before_marker = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("the marker arrives")
            .unwrap();
        if n.payload() == "marker" {
            break;
        }
        before_marker.push(n.channel().to_owned());
    }
    assert_eq!(
        before_marker,
        vec![scope_a.channel()],
        "one notification, on svc_a's channel, for the commit {loud:?} made while a relay \
         of svc_a waited; none for {quiet:?}, made while only svc_b's relay waited"
    );
}
