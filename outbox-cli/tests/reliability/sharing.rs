//! Scenarios of sharing: several writers committing to the same keys at the
//! same time while relays are SIGKILLed, and two services' outboxes in two
//! schemas of one database, each with its own relay fleet. Both run in the
//! relay mode the environment asks for (`profile::relay_mode`).

use std::time::Duration;

use outbox_core::DomainEvent;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::checker::{self, Evidence};
use crate::common::{brokers, database_url, init_tracing, relay_process, reset_warm_topic, signal};
use crate::harness::{
    Effect, Load, Writers, collect, commit_order_table, effect_table, number_by_commit_order,
    recovery, scenario_event, soak,
};
use crate::{SERIAL, consumer, jitter, ms, profile};

/// The arguments of a relay of schema `schema`'s outbox.
fn relay_args(schema: &str) -> [&str; 6] {
    [
        "--schema",
        schema,
        "--batch-size",
        "100",
        "--delivery-timeout-ms",
        "5000",
    ]
}

/// Stops `outbox relay` processes with SIGTERM; each must exit 0.
async fn stop_relays(relays: Vec<tokio::process::Child>) {
    for mut relay in relays {
        signal(relay.id().expect("running"), "-TERM");
        let status = relay.wait().await.unwrap();
        assert!(status.success(), "a relay stops cleanly: {status}");
    }
}

scenario_event!(SharedKeysEvent, "reliability-shared-keys");

/// Four writers commit to the same four keys — two of them to the same key
/// at each tick, so a key's transactions overlap — while two `outbox relay`
/// processes are SIGKILLed in turn and replaced. A key's order is the order
/// in which its transactions committed, taken from the database (a counter
/// per key, advanced at commit, see `commit_order_table`); the first Kafka
/// occurrences and the applied effects must follow it.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn several_writers_per_key_while_relays_are_sigkilled(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = SharedKeysEvent::TOPIC;
    // Two relays write the recreated topic at once (see `reset_warm_topic`).
    reset_warm_topic(&brokers, topic).await;
    effect_table(&pool).await;
    commit_order_table(&pool).await;
    let consumer = consumer(&pool, &brokers, Effect::<SharedKeysEvent>::new()).await;
    let load = Load {
        keys: 4,
        shared_keys: true,
        ..Load::default()
    };
    let writers = Writers::start(&pool, topic, load).await;
    let waits = key_lock_waits(&pool);
    profile::relay_mode(&pool).await;
    let url = database_url(&pool);
    let args = ["--batch-size", "100", "--delivery-timeout-ms", "5000"];
    let mut relays: Vec<_> = (0..2)
        .map(|_| relay_process(&url, &brokers, &args))
        .collect();

    let kills = 6 * soak();
    for i in 0..kills {
        tokio::time::sleep(jitter(i, 400, 600)).await;
        let victim = i as usize % relays.len();
        signal(relays[victim].id().expect("running"), "-KILL");
        relays[victim].wait().await.unwrap();
        relays[victim] = relay_process(&url, &brokers, &args);
    }
    let recovered = recovery(&pool, &writers, None);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ledger = writers.stop().await;
    waits.0.cancel();
    let (waiting, samples) = waits.1.await.unwrap();
    let mut evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let numbered = number_by_commit_order(&pool, &mut evidence).await;
    assert_eq!(
        numbered,
        evidence.committed.len(),
        "every committed event has its key's commit order"
    );
    let mut figures = checker::check("several writers per key, relays SIGKILLed", &evidence);
    figures.recovery_ms = ms(recovered.await.unwrap());
    figures.note("relay processes killed", kills);
    figures.note(
        "writers",
        "4 writers on 4 shared keys, 2 on the same key at each tick; order = commit order from the database",
    );
    figures.note(
        "samples with a writer waiting for another's key lock",
        format!("{waiting} of {samples}"),
    );
    figures.note(
        "writer errors (commits failing otherwise than on purpose; resolved against the outbox)",
        ledger.errors,
    );
    figures.note("consumer", format!("{:?}", consumer.counts()));
    stop_relays(relays).await;
    consumer.shutdown().await.unwrap();
    figures.report_and_assert();
}

/// Samples, every 20 ms until cancelled, whether a writer waits for
/// another writer's outbox key lock (the Unit of Work's advisory lock
/// class 0x6F626B00): evidence that transactions of one key overlapped.
/// Returns (samples with a waiter, samples).
fn key_lock_waits(
    pool: &PgPool,
) -> (
    outbox_runtime::CancellationToken,
    tokio::task::JoinHandle<(u64, u64)>,
) {
    let token = outbox_runtime::CancellationToken::new();
    let (pool, stop) = (pool.clone(), token.clone());
    let task = tokio::spawn(async move {
        let (mut waiting, mut samples) = (0, 0);
        while !stop.is_cancelled() {
            let waiters: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
                   AND objsubid = 2 AND classid = x'6F626B00'::int8::oid",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(0);
            samples += 1;
            waiting += u64::from(waiters > 0);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (waiting, samples)
    });
    (token, task)
}

scenario_event!(SchemaAEvent, "reliability-schema-a");
scenario_event!(SchemaBEvent, "reliability-schema-b");

/// A pool of `pool`'s database whose `search_path` is `schema`, created and
/// migrated: one service's outbox among several in one database.
async fn schema_pool(pool: &PgPool, schema: &str) -> PgPool {
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(pool)
        .await
        .expect("schema");
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("search_path", schema)]);
    let schema_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options)
        .await
        .expect("schema pool");
    outbox_core::migrate(&schema_pool).await.expect("migrate");
    schema_pool
}

/// Two services' outboxes in schemas `svc_a` and `svc_b` of one database,
/// each with its writers, a fleet of two `outbox relay --schema` processes
/// and its verifying consumer; one relay of each fleet is SIGKILLed and
/// replaced. Each fleet must publish its own outbox completely, in per-key
/// order. (With lanes and wake-up locks per database, each fleet took a
/// share of the other's lanes and left those rows of its own unpublished.)
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn two_outbox_schemas_in_one_database(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let (a, b) = (
        schema_pool(&pool, "svc_a").await,
        schema_pool(&pool, "svc_b").await,
    );
    let (topic_a, topic_b) = (SchemaAEvent::TOPIC, SchemaBEvent::TOPIC);
    reset_warm_topic(&brokers, topic_a).await;
    reset_warm_topic(&brokers, topic_b).await;
    effect_table(&a).await;
    effect_table(&b).await;
    let consumer_a = consumer(&a, &brokers, Effect::<SchemaAEvent>::new()).await;
    let consumer_b = consumer(&b, &brokers, Effect::<SchemaBEvent>::new()).await;
    // Half the usual rate each: the usual load over the database.
    let load = |prefix| Load {
        rate: 150,
        prefix,
        ..Load::default()
    };
    let writers_a = Writers::start(&a, topic_a, load("a-")).await;
    let writers_b = Writers::start(&b, topic_b, load("b-")).await;
    profile::relay_mode(&a).await;
    profile::relay_mode(&b).await;
    let url = database_url(&pool);
    let fleet = |schema| {
        (0..2)
            .map(|_| relay_process(&url, &brokers, &relay_args(schema)))
            .collect::<Vec<_>>()
    };
    let (mut relays_a, mut relays_b) = (fleet("svc_a"), fleet("svc_b"));

    let mut kills = 0;
    for _ in 0..soak() {
        for (relays, schema) in [(&mut relays_a, "svc_a"), (&mut relays_b, "svc_b")] {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            signal(relays[0].id().expect("running"), "-KILL");
            relays[0].wait().await.unwrap();
            relays[0] = relay_process(&url, &brokers, &relay_args(schema));
            kills += 1;
        }
    }
    let recovered_a = recovery(&a, &writers_a, None);
    let recovered_b = recovery(&b, &writers_b, None);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (ledger_a, ledger_b) = (writers_a.stop().await, writers_b.stop().await);
    let timeout = Duration::from_secs(60);
    let evidence_a = collect(&a, &brokers, topic_a, &ledger_a, None, timeout).await;
    let evidence_b = collect(&b, &brokers, topic_b, &ledger_b, None, timeout).await;
    let (committed_a, committed_b) = (evidence_a.committed.len(), evidence_b.committed.len());
    let both = Evidence {
        committed: [evidence_a.committed, evidence_b.committed].concat(),
        rolled_back: [evidence_a.rolled_back, evidence_b.rolled_back].concat(),
        must_arrive: None,
        kafka: [evidence_a.kafka, evidence_b.kafka].concat(),
        effects: [evidence_a.effects, evidence_b.effects].concat(),
        ..Evidence::default()
    };
    let mut figures = checker::check("two outbox schemas in one database", &both);
    figures.recovery_ms = match (recovered_a.await.unwrap(), recovered_b.await.unwrap()) {
        (Some(x), Some(y)) => ms(Some(x.max(y))),
        _ => None,
    };
    figures.note(
        "committed per schema",
        format!("svc_a {committed_a}, svc_b {committed_b}"),
    );
    figures.note(
        "relays",
        format!("2 per schema, {kills} SIGKILLed and replaced"),
    );
    figures.note("consumer svc_a", format!("{:?}", consumer_a.counts()));
    figures.note("consumer svc_b", format!("{:?}", consumer_b.counts()));
    stop_relays(relays_a).await;
    stop_relays(relays_b).await;
    consumer_a.shutdown().await.unwrap();
    consumer_b.shutdown().await.unwrap();
    figures.report_and_assert();
}
