//! The reliability suite: real load through a real PostgreSQL and a real
//! broker while faults are injected, judged by one checker — every
//! committed event arrives (in Kafka and applied by the consumer), no
//! rolled-back event ever appears, per-key order holds, every effect is
//! applied once; duplicates and recovery time are reported.
//!
//! Each scenario prints one table row and writes
//! `target/reliability/<scenario>.json`.
//! Scenarios run one at a time (they share the machine's two cores).
//! `OUTBOX_SOAK=1` repeats or stretches every fault 5 times
//! (`OUTBOX_SOAK=N`: N times); not for CI. With
//! `OUTBOX_TEST_RELAY_MODE=progress` every scenario's relays run in the
//! progress mode (`profile::relay_mode`).

#[path = "../../../outbox-runtime/tests/common/mod.rs"]
mod common;

mod checker;
mod children;
mod groups;
mod harness;
mod misbehaving;
mod production;
mod profile;
mod sagas;
mod sharing;

use common::pg;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{
    PrivateBroker, Proxy, brokers, create_topic, database_url, free_port, init_tracing,
    relay_process, reset_topic, reset_warm_topic, signal,
};
use harness::{
    Effect, Load, Writers, collect, effect_table, pool_of, recovery, scaled, scenario_event, soak,
};
use outbox_core::{DomainEvent, InboxHandler};
use outbox_runtime::{Consumer, ConsumerHandle, Relay, RelayBuilder};
use profile::{Maintenance, Setup};
use sqlx::PgPool;
use uuid::Uuid;

/// The retention (and dedup window) of the scenarios that can run in the
/// production profile (`profile.rs`): longer than any of them.
const PROFILE_RETENTION: Duration = Duration::from_secs(120);

/// One scenario at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This run's id: each scenario's consumer group is its topic and the run,
/// so that a topic recreated on the shared broker never inherits a
/// previous run's offsets and scenarios never share a group.
static RUN: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| Uuid::new_v4().simple().to_string()[..8].to_owned());

fn group_of(topic: &str) -> String {
    format!("{topic}-{}", *RUN)
}

/// The relay as the scenarios run it: short timeouts and back-offs, so that
/// faults and recoveries fit in seconds; its outbox in the relay mode the
/// environment asks for ([`profile::relay_mode`]).
async fn relay(pool: &PgPool, brokers: &str) -> RelayBuilder {
    profile::relay_mode(pool).await;
    Relay::builder(pool_of(pool, 4).await)
        .brokers(brokers)
        .batch_size(500)
        .poll_interval(Duration::from_millis(100))
        .delivery_timeout(Duration::from_secs(2))
        .outage_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .retry_backoff(Duration::from_millis(100), Duration::from_secs(1))
}

/// The verifying consumer (dedup mode, the scenario's group).
async fn consumer<H: InboxHandler>(pool: &PgPool, brokers: &str, handler: H) -> ConsumerHandle {
    Consumer::builder(pool_of(pool, 3).await)
        .group(group_of(<H::Event as DomainEvent>::TOPIC))
        .brokers(brokers)
        .batch_size(200)
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .handler(handler)
        // The warm-up records of `reset_warm_topic`.
        .ignore_event_type(<H::Event as DomainEvent>::TOPIC, "WarmUp")
        .spawn()
        .expect("consumer")
}

/// The events published so far, in either relay mode.
async fn published_ids(pool: &PgPool) -> HashSet<Uuid> {
    let published = outbox_runtime::relay::progress::Published::of(pool)
        .await
        .expect("the relay mode");
    sqlx::query_scalar(&format!(
        "{}SELECT event_id FROM outbox_event WHERE {}",
        published.with, published.condition
    ))
    .fetch_all(pool)
    .await
    .expect("published ids")
    .into_iter()
    .collect()
}

/// A small deterministic spread of waits (no RNG dependency).
fn jitter(i: u32, min_ms: u64, span_ms: u64) -> Duration {
    Duration::from_millis(min_ms + (u64::from(i) * 7_919) % span_ms)
}

fn ms(d: Option<Duration>) -> Option<u64> {
    d.map(|d| d.as_millis() as u64)
}

scenario_event!(BrokerKillEvent, "reliability-broker-kill");

/// The broker is SIGKILLed under load and restarted. Its storage is in
/// memory: the topics, their messages and the group's offsets are gone. The
/// outbox still has every event: the relay is stopped, the rows published
/// before the kill are replayed (`outbox replay`, in id order) to the new
/// broker, then a relay publishes the backlog, so every committed event must
/// arrive, in per-key order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn broker_killed_and_restarted(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let port = free_port();
    let mut broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = BrokerKillEvent::TOPIC;
    create_topic(&brokers, topic).await;
    effect_table(&pool).await;
    profile::relay_mode(&pool).await;
    let relay_before = relay(&pool, &brokers).await.spawn().unwrap();
    let first = consumer(&pool, &brokers, Effect::<BrokerKillEvent>::new()).await;
    let writers = Writers::start(&pool, topic, Load::default()).await;

    tokio::time::sleep(scaled(Duration::from_secs(3))).await;
    // A consumer's positions and its group's offsets die with the broker's
    // memory: it is stopped here and started again on the new broker (same
    // group, same dedup table).
    first.shutdown().await.unwrap();
    broker.kill();
    tokio::time::sleep(scaled(Duration::from_secs(3))).await;
    // The replay goes first so that old events precede newer ones of their
    // keys in the new log: no relay publishes meanwhile.
    let relay_counts = relay_before.counts();
    relay_before.shutdown().await.unwrap();
    // What the dead broker had acknowledged. Taken once the relay has
    // stopped: a batch is marked only when all its deliveries are known, so
    // rows of a batch partly acknowledged before the kill are marked only
    // when the rest of it times out.
    let published_before = published_ids(&pool).await;

    let broker = PrivateBroker::start(port, port);
    create_topic(&brokers, topic).await;
    let restarted = Instant::now();
    let filter = outbox_runtime::replay::ReplayFilter {
        topic: Some(topic.to_owned()),
        ..Default::default()
    };
    let report = outbox_runtime::replay::replay(
        &pool,
        &outbox_runtime::replay::ReplayOptions::new(brokers.clone(), filter),
    )
    .await
    .expect("replay");
    assert_eq!(
        report.replayed as usize,
        published_before.len(),
        "the replay republishes what the broker lost"
    );
    let relay_after = relay(&pool, &brokers).await.spawn().unwrap();
    let unpublished_then: HashSet<Uuid> = writers
        .committed_ids()
        .into_iter()
        .filter(|id| !published_before.contains(id))
        .collect();
    let second = consumer(&pool, &brokers, Effect::<BrokerKillEvent>::new()).await;
    let recovered = recovery(&pool, &writers, Some(&unpublished_then));
    tokio::time::sleep(scaled(Duration::from_secs(3))).await;
    let ledger = writers.stop().await;

    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let mut figures = checker::check("broker killed, restarted, replayed", &evidence);
    figures.recovery_ms = ms(recovered.await.unwrap());
    figures.note(
        "published before the kill (lost with the broker's memory, replayed)",
        published_before.len(),
    );
    figures.note("replayed", format!("{report:?}"));
    figures.note("writer errors", ledger.errors);
    figures.note("relay before the kill", format!("{relay_counts:?}"));
    figures.note("relay after", format!("{:?}", relay_after.counts()));
    figures.note("consumer after restart", format!("{:?}", second.counts()));
    figures.note("since restart", format!("{:?}", restarted.elapsed()));
    second.shutdown().await.unwrap();
    relay_after.shutdown().await.unwrap();
    drop(broker);
    figures.report_and_assert();
}

scenario_event!(BrokerPauseEvent, "reliability-broker-pause");

/// The broker is frozen (SIGSTOP) for longer than the producer's delivery
/// timeout, then resumed: deliveries time out although they may have been
/// persisted, the idempotent producer's sequence is reset or the producer
/// is recreated, the consumer's session may expire.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn broker_paused_longer_than_the_delivery_timeout(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let port = free_port();
    let broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = BrokerPauseEvent::TOPIC;
    create_topic(&brokers, topic).await;
    effect_table(&pool).await;
    profile::relay_mode(&pool).await;
    let relay = relay(&pool, &brokers).await.spawn().unwrap();
    let consumer = consumer(&pool, &brokers, Effect::<BrokerPauseEvent>::new()).await;
    let writers = Writers::start(&pool, topic, Load::default()).await;

    let pauses = soak();
    let pause = Duration::from_secs(5);
    let mut recovered = None;
    for _ in 0..pauses {
        tokio::time::sleep(Duration::from_secs(2)).await;
        broker.pause();
        tokio::time::sleep(pause).await;
        broker.resume();
        recovered = Some(recovery(&pool, &writers, None));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ledger = writers.stop().await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let mut figures = checker::check("broker paused (SIGSTOP) 5 s", &evidence);
    figures.recovery_ms = ms(recovered.expect("paused").await.unwrap());
    figures.note(
        "pauses",
        format!("{pauses} × {pause:?}, delivery timeout 2 s"),
    );
    figures.note("relay", format!("{:?}", relay.counts()));
    figures.note("consumer", format!("{:?}", consumer.counts()));
    consumer.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    figures.report_and_assert();
}

scenario_event!(ProxyEvent, "reliability-proxy");

/// Every client reaches the broker through a proxy (the broker advertises
/// it), which delays data, then cuts all connections, twice.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn connections_cut_and_delayed_by_a_proxy(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let (proxy_port, broker_port) = (free_port(), free_port());
    let proxy = Proxy::start_on(
        proxy_port,
        format!("127.0.0.1:{broker_port}").parse().unwrap(),
    )
    .await;
    let _broker = PrivateBroker::start(broker_port, proxy_port);
    let brokers = format!("127.0.0.1:{proxy_port}");
    let topic = ProxyEvent::TOPIC;
    create_topic(&brokers, topic).await;
    effect_table(&pool).await;
    profile::relay_mode(&pool).await;
    let relay = relay(&pool, &brokers).await.spawn().unwrap();
    let consumer = consumer(&pool, &brokers, Effect::<ProxyEvent>::new()).await;
    let writers = Writers::start(&pool, topic, Load::default()).await;

    let mut recovered = None;
    for _ in 0..soak() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.set_delay(Duration::from_millis(300));
        tokio::time::sleep(Duration::from_secs(2)).await;
        proxy.set_delay(Duration::ZERO);
        proxy.cut();
        tokio::time::sleep(Duration::from_secs(2)).await;
        proxy.restore();
        tokio::time::sleep(Duration::from_millis(700)).await;
        proxy.cut();
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.restore();
        recovered = Some(recovery(&pool, &writers, None));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ledger = writers.stop().await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let mut figures = checker::check("connections delayed and cut", &evidence);
    figures.recovery_ms = ms(recovered.expect("cut").await.unwrap());
    figures.note(
        "faults",
        format!(
            "{} × (300 ms delay for 2 s, cut 2 s, 0.7 s up, cut 1 s)",
            soak()
        ),
    );
    figures.note("relay", format!("{:?}", relay.counts()));
    figures.note("consumer", format!("{:?}", consumer.counts()));
    consumer.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    figures.report_and_assert();
}

scenario_event!(RelayKillEvent, "reliability-relay-kill");

/// `outbox relay` is SIGKILLed mid-batch again and again under load (a
/// backlog builds up between runs, so every run is killed while it works).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relay_sigkilled_repeatedly(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = RelayKillEvent::TOPIC;
    reset_topic(&brokers, topic).await;
    let setup = Setup::prepare(&pool, PROFILE_RETENTION).await;
    let consumer = consumer(
        &setup.pool("outbox_consumer", 1).await,
        &brokers,
        Effect::<RelayKillEvent>::new(),
    )
    .await;
    let writers = Writers::start(&setup.pool("outbox_app", 1).await, topic, Load::default()).await;
    let url = setup.url("outbox_relay");
    let args = ["--batch-size", "200", "--delivery-timeout-ms", "5000"];

    let kills = 6 * soak();
    for i in 0..kills {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut relay = relay_process(&url, &brokers, &args);
        tokio::time::sleep(jitter(i, 300, 900)).await;
        signal(relay.id().expect("running"), "-KILL");
        relay.wait().await.unwrap();
    }
    let mut relay = relay_process(&url, &brokers, &args);
    let recovered = recovery(&pool, &writers, None);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ledger = writers.stop_checking(&pool).await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let mut figures = checker::check("relay SIGKILLed repeatedly", &evidence);
    figures.recovery_ms = ms(recovered.await.unwrap());
    figures.note("relay processes killed", kills);
    figures.note("consumer", format!("{:?}", consumer.counts()));
    signal(relay.id().expect("running"), "-TERM");
    let status = relay.wait().await.unwrap();
    consumer.shutdown().await.unwrap();
    let maintenance = setup.finish(&mut figures).await;
    assert!(status.success(), "the last relay stops cleanly: {status}");
    figures.report_and_assert();
    maintenance.inspect(Maintenance::assert_kept_up);
}

scenario_event!(ThreeRelaysEvent, "reliability-three-relays");

/// Three `outbox relay` processes share the outbox; one is SIGKILLed.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn three_relays_one_killed(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = ThreeRelaysEvent::TOPIC;
    // Three relays write the recreated topic at once: the test broker has
    // lost (or shown late) a fresh partition's first records written so.
    reset_warm_topic(&brokers, topic).await;
    effect_table(&pool).await;
    profile::relay_mode(&pool).await;
    let consumer = consumer(&pool, &brokers, Effect::<ThreeRelaysEvent>::new()).await;
    let writers = Writers::start(&pool, topic, Load::default()).await;
    let url = database_url(&pool);
    let args = ["--batch-size", "100", "--delivery-timeout-ms", "5000"];
    let mut relays: Vec<_> = (0..3)
        .map(|_| relay_process(&url, &brokers, &args))
        .collect();

    tokio::time::sleep(scaled(Duration::from_secs(3))).await;
    let mut victim = relays.remove(0);
    signal(victim.id().expect("running"), "-KILL");
    victim.wait().await.unwrap();
    let recovered = recovery(&pool, &writers, None);
    tokio::time::sleep(scaled(Duration::from_secs(3))).await;
    let ledger = writers.stop().await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let mut figures = checker::check("3 relays, one SIGKILLed", &evidence);
    figures.recovery_ms = ms(recovered.await.unwrap());
    figures.note("consumer", format!("{:?}", consumer.counts()));
    for mut relay in relays {
        signal(relay.id().expect("running"), "-TERM");
        assert!(relay.wait().await.unwrap().success());
    }
    consumer.shutdown().await.unwrap();
    figures.report_and_assert();
}

scenario_event!(PostgresRestartEvent, "reliability-postgres-restart");

/// A PostgreSQL server of the test's own crashes (`pg_ctl stop -m
/// immediate`) under load and comes back: writers see errors (a commit cut
/// off is resolved against the outbox afterwards), the relay and the
/// consumer reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_under_load() {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let Some(server) = pg::PrivatePostgres::start() else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&server.url())
        .await
        .expect("connect to the private server");
    outbox_core::migrate(&pool).await.expect("migrate");
    effect_table(&pool).await;
    profile::relay_mode(&pool).await;
    let brokers = brokers();
    let topic = PostgresRestartEvent::TOPIC;
    reset_topic(&brokers, topic).await;
    let relay = relay(&pool, &brokers).await.spawn().unwrap();
    let consumer = consumer(&pool, &brokers, Effect::<PostgresRestartEvent>::new()).await;
    let writers = Writers::start(&pool, topic, Load::default()).await;

    let mut recovered = None;
    for _ in 0..soak() {
        tokio::time::sleep(Duration::from_secs(3)).await;
        server.crash();
        tokio::time::sleep(Duration::from_secs(2)).await;
        server.start_again();
        recovered = Some(recovery(&pool, &writers, None));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ledger = writers.stop().await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let mut figures = checker::check("PostgreSQL crashed and restarted", &evidence);
    figures.recovery_ms = ms(recovered.expect("restarted").await.unwrap());
    figures.note("writer errors (failed begins and commits)", ledger.errors);
    figures.note("relay", format!("{:?}", relay.counts()));
    figures.note("consumer", format!("{:?}", consumer.counts()));
    consumer.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    figures.report_and_assert();
}

scenario_event!(ConsumerKillEvent, "reliability-consumer-kill");

/// Environment of a consumer child process (see [`consumer_process`]).
const CHILD_DB: &str = "RELIABILITY_CONSUMER_DATABASE_URL";
const CHILD_SKIP_OFFSETS: &str = "RELIABILITY_CONSUMER_SKIP_OFFSETS";
const CHILD_GROUP: &str = "RELIABILITY_CONSUMER_GROUP";
/// A killed member holds its partitions until its session expires: short
/// sessions let the next incarnation in quickly.
const CHILD_SESSION_MS: &str = "3000";

async fn effects(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effect")
        .fetch_one(pool)
        .await
        .expect("effects")
}

/// The verifying consumer as a process of its own (this test binary,
/// running only [`consumer_process`]), so that it can be SIGKILLed.
fn consumer_child(database_url: &str, skip_offsets: bool) -> tokio::process::Child {
    tokio::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "consumer_process", "--ignored", "--nocapture"])
        .env(CHILD_DB, database_url)
        .env(CHILD_GROUP, group_of(ConsumerKillEvent::TOPIC))
        .env(CHILD_SKIP_OFFSETS, if skip_offsets { "1" } else { "0" })
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the consumer process")
}

/// Not a test: the body of the consumer child process of
/// [`consumer_killed_between_database_commit_and_offset_commit`]; returns at
/// once unless started by it.
#[tokio::test]
#[ignore = "runs only as a child process of the consumer-kill scenario"]
async fn consumer_process() {
    let Ok(url) = std::env::var(CHILD_DB) else {
        return;
    };
    init_tracing();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("child pool");
    let counts_pool = pool.clone();
    let handle = Consumer::builder(pool)
        .group(std::env::var(CHILD_GROUP).expect("group"))
        .brokers(brokers())
        .batch_size(200)
        .skip_offset_commits(std::env::var(CHILD_SKIP_OFFSETS).as_deref() == Ok("1"))
        .kafka_setting("session.timeout.ms", CHILD_SESSION_MS)
        .kafka_setting("heartbeat.interval.ms", "500")
        .handler(Effect::<ConsumerKillEvent>::new())
        .spawn()
        .expect("consumer");
    // Its counts, kept up to date for the parent (it dies by SIGKILL).
    let me = std::process::id() as i64;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let c = handle.counts();
        sqlx::query(
            "INSERT INTO consumer_incarnation (pid, received, duplicates) VALUES ($1, $2, $3)
             ON CONFLICT (pid) DO UPDATE SET received = $2, duplicates = $3",
        )
        .bind(me)
        .bind(c.received as i64)
        .bind(c.duplicates as i64)
        .execute(&counts_pool)
        .await
        .expect("record counts");
    }
}

/// The consumer is SIGKILLed repeatedly while it applies a stream. The
/// first incarnation never commits offsets (each of its database commits is
/// followed by a "crash" before the offset commit); the next ones are killed
/// at arbitrary points. Redelivered events must not be applied twice.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn consumer_killed_between_database_commit_and_offset_commit(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = ConsumerKillEvent::TOPIC;
    reset_topic(&brokers, topic).await;
    let setup = Setup::prepare(&pool, PROFILE_RETENTION).await;
    // One record per record batch: the test broker answers a fetch that
    // starts inside a batch wrongly (see `produce_unbatched`), and a killed
    // consumer resumes from wherever its last offset commit was.
    let relay = relay(&setup.pool("outbox_relay", 1).await, &brokers)
        .await
        .kafka_setting("batch.num.messages", "1")
        .spawn()
        .unwrap();
    let writers = Writers::start(&setup.pool("outbox_app", 1).await, topic, Load::default()).await;
    let url = setup.url("outbox_consumer");

    sqlx::query(
        "CREATE TABLE consumer_incarnation (pid bigint PRIMARY KEY, received bigint, duplicates bigint)",
    )
    .execute(&pool)
    .await
    .unwrap();
    setup
        .grant(
            "SELECT, INSERT, UPDATE ON consumer_incarnation",
            "outbox_consumer",
        )
        .await;
    let kills = 3 * soak();
    let mut applied_at_kills = Vec::new();
    let mut lifetimes = Vec::new();
    for i in 0..kills {
        let before = effects(&pool).await;
        let born = Instant::now();
        let mut child = consumer_child(&url, i == 0);
        // Killed once it is applying: some effects after it started.
        let progressed = common::eventually(Duration::from_secs(30), || async {
            effects(&pool).await >= before + 50
        })
        .await;
        assert!(progressed, "consumer incarnation {i} applied nothing");
        tokio::time::sleep(jitter(i, 0, 300)).await;
        signal(child.id().expect("running"), "-KILL");
        child.wait().await.unwrap();
        lifetimes.push(format!("{:.1} s", born.elapsed().as_secs_f64()));
        applied_at_kills.push(effects(&pool).await);
    }
    let consumer = Consumer::builder(setup.pool("outbox_consumer", 3).await)
        .group(group_of(ConsumerKillEvent::TOPIC))
        .kafka_setting("session.timeout.ms", CHILD_SESSION_MS)
        .kafka_setting("heartbeat.interval.ms", "500")
        .brokers(&brokers)
        .batch_size(200)
        .handler(Effect::<ConsumerKillEvent>::new())
        .spawn()
        .expect("consumer");
    let recovered = recovery(&pool, &writers, None);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ledger = writers.stop_checking(&pool).await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let mut figures = checker::check("consumer SIGKILLed repeatedly", &evidence);
    figures.recovery_ms = ms(recovered.await.unwrap());
    let counts = consumer.counts();
    figures.note("consumer processes killed", kills);
    figures.note(
        "effects applied at each kill",
        format!("{applied_at_kills:?}"),
    );
    figures.note("lifetime of each killed consumer", lifetimes.join(", "));
    let (received, skipped): (Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT sum(received)::int8, sum(duplicates)::int8 FROM consumer_incarnation",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    figures.note(
        "killed consumers: received / redelivered and skipped by the dedup table",
        format!("{} / {}", received.unwrap_or(0), skipped.unwrap_or(0)),
    );
    figures.note(
        "redelivered to the last consumer and skipped by the dedup table",
        counts.duplicates,
    );
    figures.note("last consumer", format!("{counts:?}"));
    consumer.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    let maintenance = setup.finish(&mut figures).await;
    figures.report_and_assert();
    maintenance.inspect(Maintenance::assert_kept_up);
}

scenario_event!(LongTransactionEvent, "reliability-long-transaction");

/// Publication latency (publish time − creation time) of the events created
/// between two database timestamps: count, p50, p99, max in ms.
async fn latency(
    pool: &PgPool,
    from: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    to: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
) -> String {
    let (n, p50, p99, max): (i64, Option<f64>, Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY ms),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY ms),
                max(ms)
         FROM (SELECT extract(epoch FROM published_at - created_at)::float8 * 1000 AS ms
               FROM outbox_event
               WHERE created_at >= $1 AND created_at < $2 AND published_at IS NOT NULL) l",
    )
    .bind(from)
    .bind(to)
    .fetch_one(pool)
    .await
    .expect("latency");
    format!(
        "{n} events, p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        p50.unwrap_or(0.0),
        p99.unwrap_or(0.0),
        max.unwrap_or(0.0)
    )
}

/// Commit-to-effect latency of the events created between two database
/// timestamps: p50 and max in ms.
async fn end_to_end(
    pool: &PgPool,
    from: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    to: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
) -> String {
    let (p50, max): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), max(ms)
         FROM (SELECT extract(epoch FROM e.applied_at - o.created_at)::float8 * 1000 AS ms
               FROM outbox_event o JOIN effect e USING (event_id)
               WHERE o.created_at >= $1 AND o.created_at < $2) l",
    )
    .bind(from)
    .bind(to)
    .fetch_one(pool)
    .await
    .expect("end-to-end latency");
    format!(
        "p50 {:.0} ms, max {:.0} ms",
        p50.unwrap_or(0.0),
        max.unwrap_or(0.0)
    )
}

async fn now(pool: &PgPool) -> sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .expect("clock")
}

/// Dead tuples of `outbox_event` (statistics are flushed about once a
/// second, hence the wait) and the time of the relay's claim query on the
/// table as it is.
async fn table_state(pool: &PgPool) -> String {
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // The table's, or its partitions' (production profile).
    let dead: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(n_dead_tup), 0)::int8 FROM pg_stat_user_tables
         WHERE relid IN (SELECT relid FROM pg_partition_tree('outbox_event'))",
    )
    .fetch_one(pool)
    .await
    .expect("n_dead_tup");
    let mut times = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        sqlx::query(
            "SELECT id FROM outbox_event WHERE published_at IS NULL AND parked_at IS NULL ORDER BY id LIMIT 500",
        )
        .execute(pool)
        .await
        .expect("claim query");
        times.push(start.elapsed());
    }
    times.sort();
    format!(
        "{dead} dead tuples, claim query {:.2} ms",
        times[2].as_secs_f64() * 1e3
    )
}

/// A transaction holds the xmin horizon (REPEATABLE READ with an xid) while
/// the relay works: published rows leave dead tuples that nothing can
/// remove until it ends. Reports publication latency and dead tuples before,
/// during and after.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn long_transaction_holding_the_xmin_horizon(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = LongTransactionEvent::TOPIC;
    reset_topic(&brokers, topic).await;
    let setup = Setup::prepare(&pool, PROFILE_RETENTION).await;
    let relay = relay(&setup.pool("outbox_relay", 1).await, &brokers)
        .await
        .spawn()
        .unwrap();
    let consumer = consumer(
        &setup.pool("outbox_consumer", 1).await,
        &brokers,
        Effect::<LongTransactionEvent>::new(),
    )
    .await;
    let writers = Writers::start(&setup.pool("outbox_app", 1).await, topic, Load::default()).await;

    tokio::time::sleep(Duration::from_secs(1)).await;
    let t0 = now(&pool).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t1 = now(&pool).await;
    let before = table_state(&pool).await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *holder)
        .await
        .unwrap();
    let xid: i64 = sqlx::query_scalar("SELECT txid_current()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let t2 = now(&pool).await;
    tokio::time::sleep(scaled(Duration::from_secs(8))).await;
    let t3 = now(&pool).await;
    sqlx::query("VACUUM outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let during = table_state(&pool).await;
    holder.commit().await.unwrap();
    let recovered = recovery(&pool, &writers, None);
    let t4 = now(&pool).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t5 = now(&pool).await;
    let ledger = writers.stop_checking(&pool).await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    // Everything is published: nothing changes the table any more.
    sqlx::query("VACUUM outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let after = table_state(&pool).await;
    let mut figures = checker::check("long transaction holding xmin", &evidence);
    figures.recovery_ms = ms(recovered.await.unwrap());
    figures.note("holding xid", xid);
    if profile::progress_mode() {
        figures.note(
            "publication latency",
            "not recorded in the progress mode (no time per row): see end-to-end",
        );
    }
    figures.note("latency before (3 s)", latency(&pool, t0, t1).await);
    figures.note("latency while held", latency(&pool, t2, t3).await);
    figures.note("latency after release (3 s)", latency(&pool, t4, t5).await);
    figures.note("end-to-end before", end_to_end(&pool, t0, t1).await);
    figures.note("end-to-end while held", end_to_end(&pool, t2, t3).await);
    figures.note("end-to-end after release", end_to_end(&pool, t4, t5).await);
    figures.note("consumer", format!("{:?}", consumer.counts()));
    figures.note("table before the hold", before);
    figures.note("table at the end of the hold, after VACUUM", during);
    figures.note("table after release and drain, after VACUUM", after);
    figures.note("relay", format!("{:?}", relay.counts()));
    consumer.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    let maintenance = setup.finish(&mut figures).await;
    figures.report_and_assert();
    maintenance.inspect(Maintenance::assert_kept_up);
}
