//! Scenarios where the application, not the infrastructure, misbehaves:
//! handlers that swallow SQL errors, commit by hand, panic or hang, mixed
//! into normal traffic; hostile messages injected into the topic under
//! load; two inbox-mode consumer groups sharing one database. The usual
//! writers, relay and checker; every bad event must end as a dead letter
//! (never applied), every good one applied once, in per-key order.

use std::collections::HashSet;
use std::time::Duration;

use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, ConsumerHandle, Mode};
use sqlx::PgPool;
use uuid::Uuid;

use super::checker::{self, Evidence};
use super::common::{TestMessage, brokers, init_tracing, produce, reset_topic};
use super::harness::{
    Effect, Load, Writers, collect, effect_table, pool_of, scaled, scenario_event,
};
use super::{SERIAL, group_of, relay};

/// What the misbehaving application does with an event, decided by its id
/// (the random low bits of a UUIDv7), so that the checker knows too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    Good,
    /// Runs a failing statement and logs the error instead of returning it.
    Swallow,
    /// Sends `COMMIT` through its connection (and returns its error).
    Commit,
    /// Sends `ROLLBACK` through its connection, then writes its effect.
    Rollback,
    Panic,
    /// Hangs longer than the handler timeout.
    Hang,
}

fn act(id: Uuid) -> Act {
    match id.as_u128() % 1000 {
        0..=7 => Act::Swallow,
        8..=15 => Act::Commit,
        16..=23 => Act::Rollback,
        24..=31 => Act::Panic,
        32..=33 => Act::Hang,
        _ => Act::Good,
    }
}

scenario_event!(MisbehavingEvent, "reliability-misbehaving-handlers");

/// The application's handler: the usual effect row, then its mistake.
struct Misbehaving;

impl InboxHandler for Misbehaving {
    type Event = MisbehavingEvent;
    const NAME: &'static str = "misbehaving";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: MisbehavingEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let id = ctx.incoming().event_id;
            super::harness::apply(ctx, id, &event.key, event.seq).await?;
            match act(id) {
                Act::Good => {}
                Act::Swallow => {
                    if let Err(error) = sqlx::query("SELECT 1 / 0").execute(&mut **ctx).await {
                        tracing::debug!(%error, "ignored");
                    }
                }
                Act::Commit => {
                    sqlx::query("COMMIT").execute(&mut **ctx).await?;
                }
                Act::Rollback => {
                    sqlx::query("ROLLBACK").execute(&mut **ctx).await?;
                    let _ = super::harness::apply(ctx, id, &event.key, event.seq).await;
                }
                Act::Panic => panic!("the application has a bug"),
                Act::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
            }
            Ok(())
        })
    }
}

/// The events of `group` in the dead-letter table.
async fn dead_lettered(pool: &PgPool, group: &str) -> HashSet<Uuid> {
    sqlx::query_scalar(
        "SELECT event_id FROM dead_letter WHERE consumer = $1 AND event_id IS NOT NULL",
    )
    .bind(group)
    .fetch_all(pool)
    .await
    .expect("dead letters")
    .into_iter()
    .collect()
}

/// Handlers that swallow SQL errors, commit or roll back by hand, panic or
/// hang, for ~4% of the events, mixed into normal traffic under the usual
/// writers: each bad event must end as a dead letter and never be applied,
/// each good one must be applied once, in per-key order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn misbehaving_handlers_in_normal_traffic(pool: PgPool) {
    misbehaving_handlers(pool, Variant::Dedup).await;
}

/// The same with the failing events' retries held in the consumer's memory
/// (`ConsumerBuilder::memory_retries`): the same outcome.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn misbehaving_handlers_with_retries_from_memory(pool: PgPool) {
    misbehaving_handlers(pool, Variant::Memory).await;
}

/// The same in inbox mode with the processor in the progress mode (no
/// mark per event; failures and the rows behind them set aside): the same
/// outcome.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn misbehaving_handlers_in_the_inbox_progress_mode(pool: PgPool) {
    misbehaving_handlers(pool, Variant::InboxProgress).await;
}

/// How the misbehaving handlers' consumer runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Dedup mode, failures set aside in the inbox.
    Dedup,
    /// Dedup mode, failures retried from memory first.
    Memory,
    /// Inbox mode, the processor in the progress mode.
    InboxProgress,
}

async fn misbehaving_handlers(pool: PgPool, variant: Variant) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = MisbehavingEvent::TOPIC;
    reset_topic(&brokers, topic).await;
    effect_table(&pool).await;
    let relay = relay(&pool, &brokers).await.spawn().unwrap();
    let group = format!(
        "{}{}",
        group_of(topic),
        match variant {
            Variant::Dedup => "",
            Variant::Memory => "-memory",
            Variant::InboxProgress => "-inbox-progress",
        }
    );
    let builder = Consumer::builder(pool_of(&pool, 3).await)
        .group(&group)
        .brokers(&brokers)
        .batch_size(200)
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(50))
        .handler_timeout(Duration::from_millis(300))
        .handler(Misbehaving);
    let builder = match variant {
        Variant::Dedup => builder,
        Variant::Memory => builder.memory_retries(Duration::from_secs(1)),
        Variant::InboxProgress => {
            outbox_runtime::inbox::progress::enable(&pool, &group)
                .await
                .expect("the inbox progress mode");
            builder
                .mode(Mode::Inbox)
                .processor_poll_interval(Duration::from_millis(50))
        }
    };
    let consumer = builder.spawn().expect("consumer");
    let writers = Writers::start(&pool, topic, Load::default()).await;
    tokio::time::sleep(scaled(Duration::from_secs(10))).await;
    let ledger = writers.stop().await;

    let bad: HashSet<Uuid> = ledger
        .committed
        .iter()
        .map(|w| w.event_id)
        .filter(|id| act(*id) != Act::Good)
        .collect();
    let good: HashSet<Uuid> = ledger
        .committed
        .iter()
        .map(|w| w.event_id)
        .filter(|id| !bad.contains(id))
        .collect();
    // Every bad event dead-lettered (the good ones are waited for below).
    let settled = super::common::eventually(Duration::from_secs(120), || async {
        dead_lettered(&pool, &group).await.is_superset(&bad)
    })
    .await;
    let mut evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        Some(good.clone()),
        Duration::from_secs(120),
    )
    .await;
    let letters = dead_lettered(&pool, &group).await;
    // A bad event must reach Kafka, must not be applied, must be a dead
    // letter: the checker counts an applied one as a phantom.
    evidence.expected_dead = bad.clone();
    evidence.dead_lettered = letters.clone();
    let mut figures = checker::check(
        match variant {
            Variant::Dedup => "misbehaving handlers in normal traffic",
            Variant::Memory => "misbehaving handlers, retries from memory",
            Variant::InboxProgress => "misbehaving handlers, inbox progress mode",
        },
        &evidence,
    );
    let count = |a: Act| bad.iter().filter(|id| act(**id) == a).count();
    figures.note(
        "bad events: swallowed error / COMMIT / ROLLBACK / panic / hang",
        format!(
            "{} / {} / {} / {} / {}",
            count(Act::Swallow),
            count(Act::Commit),
            count(Act::Rollback),
            count(Act::Panic),
            count(Act::Hang)
        ),
    );
    figures.note(
        "bad events dead-lettered",
        format!("{} of {}", bad.intersection(&letters).count(), bad.len()),
    );
    figures.note(
        "good events dead-lettered",
        good.intersection(&letters).count(),
    );
    figures.note("consumer", format!("{:?}", consumer.counts()));
    assert!(settled, "bad events not all dead-lettered");
    assert!(!bad.is_empty(), "the scenario produced no bad event");
    assert_eq!(
        good.intersection(&letters).count(),
        0,
        "a good event was dead-lettered"
    );
    assert!(!consumer.is_finished(), "the consumer stopped");
    consumer.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    figures.report_and_assert();
}

scenario_event!(HostileTrafficEvent, "reliability-hostile-messages");

/// The hostile messages injected: every kind the consumer must survive.
pub(crate) fn hostile(i: usize) -> TestMessage {
    let good = || {
        TestMessage::event(
            Uuid::now_v7(),
            "OrderPlaced",
            &format!("hostile-{i}"),
            serde_json::json!({ "key": format!("hostile-{i}"), "seq": 0 }),
        )
    };
    match i % 9 {
        0 => good().raw_header(b"name\xff", Some(b"v")),
        1 => good().raw_header(b"event_id", Some(Uuid::now_v7().to_string().as_bytes())),
        2 => {
            let mut m = good();
            m.key = None;
            m
        }
        3 => good().payload(Vec::new()),
        4 => good().payload(vec![b'x'; 2 * 1024 * 1024]),
        5 => good().payload(br#"{"amount_cents": 1}"#.to_vec()),
        6 => good().payload(
            (0..300u32)
                .map(|b| (b * 151 % 256) as u8)
                .collect::<Vec<u8>>(),
        ),
        7 => good().header("blob", &"h".repeat(2 * 1024 * 1024)),
        _ => good()
            .without_header("event_id")
            .raw_header(b"event_id", Some(b"\xfe\xff")),
    }
}

/// Hostile messages produced straight into the topic while the writers and
/// the relay run: each must become a dead letter, and the writers' events
/// must all be applied once, in order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn hostile_messages_under_load(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = HostileTrafficEvent::TOPIC;
    reset_topic(&brokers, topic).await;
    effect_table(&pool).await;
    let relay = relay(&pool, &brokers).await.spawn().unwrap();
    let group = group_of(topic);
    let consumer = super::consumer(&pool, &brokers, Effect::<HostileTrafficEvent>::new()).await;
    let writers = Writers::start(&pool, topic, Load::default()).await;
    let mut injected = 0;
    // The event ids the hostile messages carry: not the writers' events.
    let mut hostile_ids: HashSet<Uuid> = HashSet::new();
    let deadline = std::time::Instant::now() + scaled(Duration::from_secs(10));
    while std::time::Instant::now() < deadline {
        let batch: Vec<TestMessage> = (injected..injected + 9).map(hostile).collect();
        for m in &batch {
            let named = m
                .headers
                .iter()
                .map(|(k, v)| (k.as_bytes(), Some(v.as_bytes())));
            let raw = m
                .raw_headers
                .iter()
                .map(|(k, v)| (k.as_slice(), v.as_deref()));
            hostile_ids.extend(named.chain(raw).filter_map(|(k, v)| {
                (k == b"event_id").then_some(())?;
                std::str::from_utf8(v?).ok()?.parse::<Uuid>().ok()
            }));
        }
        produce(&brokers, topic, &batch).await;
        injected += batch.len();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ledger = writers.stop().await;
    let count_letters = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM dead_letter WHERE consumer = $1")
            .bind(&group)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let lettered = super::common::eventually(Duration::from_secs(60), || async {
        count_letters().await >= injected as i64
    })
    .await;
    let mut evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(120),
    )
    .await;
    evidence
        .kafka
        .retain(|s| !hostile_ids.contains(&s.event_id));
    let mut figures = checker::check("hostile messages under load", &evidence);
    let letters = count_letters().await;
    let reasons: Vec<(String, i64)> = sqlx::query_as(
        "SELECT reason, count(*) FROM dead_letter WHERE consumer = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(&group)
    .fetch_all(&pool)
    .await
    .unwrap();
    figures.note("hostile messages injected", injected);
    figures.note("dead letters", letters);
    figures.note("by reason", format!("{reasons:?}"));
    figures.note("consumer", format!("{:?}", consumer.counts()));
    assert!(
        lettered,
        "{letters} dead letters for {injected} hostile messages"
    );
    assert_eq!(letters, injected as i64);
    assert!(!consumer.is_finished(), "the consumer stopped");
    consumer.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    figures.report_and_assert();
}

scenario_event!(TwoGroupsEvent, "reliability-two-inbox-groups");

/// The second group's handler: its own effect table.
struct SecondGroup;

impl InboxHandler for SecondGroup {
    type Event = TwoGroupsEvent;
    const NAME: &'static str = "second_group";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: TwoGroupsEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            sqlx::query("INSERT INTO effect_b (event_id, key, seq) VALUES ($1, $2, $3)")
                .bind(ctx.incoming().event_id)
                .bind(&event.key)
                .bind(event.seq as i64)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}

async fn inbox_consumer<H: InboxHandler>(
    pool: &PgPool,
    brokers: &str,
    group: &str,
    handler: H,
) -> ConsumerHandle {
    Consumer::builder(pool_of(pool, 4).await)
        .group(group)
        .brokers(brokers)
        .mode(Mode::Inbox)
        .batch_size(200)
        .processor_poll_interval(Duration::from_millis(50))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .handler(handler)
        .spawn()
        .expect("inbox consumer")
}

/// Two services consume the same topic in inbox mode into one database,
/// the second with its processor in the progress mode: each must apply
/// every event once, in per-key order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn two_inbox_groups_in_one_database(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let brokers = brokers();
    let topic = TwoGroupsEvent::TOPIC;
    reset_topic(&brokers, topic).await;
    effect_table(&pool).await;
    sqlx::query("CREATE TABLE effect_b (LIKE effect INCLUDING ALL)")
        .execute(&pool)
        .await
        .unwrap();
    let relay = relay(&pool, &brokers).await.spawn().unwrap();
    let group = group_of(topic);
    let second = format!("{group}-second");
    // The second group's processor in the progress mode: two services, one
    // in each mode, in one database.
    outbox_runtime::inbox::progress::enable(&pool, &second)
        .await
        .expect("the inbox progress mode");
    let a = inbox_consumer(&pool, &brokers, &group, Effect::<TwoGroupsEvent>::new()).await;
    let b = inbox_consumer(&pool, &brokers, &second, SecondGroup).await;
    let writers = Writers::start(&pool, topic, Load::default()).await;
    tokio::time::sleep(scaled(Duration::from_secs(8))).await;
    let ledger = writers.stop().await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(120),
    )
    .await;
    // The second group's effects, judged the same way.
    let ids: Vec<Uuid> = ledger.committed.iter().map(|w| w.event_id).collect();
    let applied_b = super::common::eventually(Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(DISTINCT event_id) FROM effect_b WHERE event_id = ANY($1)",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await
        .unwrap()
            >= ids.len() as i64
    })
    .await;
    let effects_b = sqlx::query_as::<_, (Uuid, String, i64)>(
        "SELECT event_id, key, seq FROM effect_b ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(event_id, key, seq)| checker::Seen {
        event_id,
        key,
        seq: seq as u64,
    })
    .collect();
    let evidence_b = Evidence {
        effects: effects_b,
        committed: evidence.committed.clone(),
        rolled_back: evidence.rolled_back.clone(),
        must_arrive: None,
        kafka: evidence.kafka.clone(),
        ..Evidence::default()
    };
    let mut figures = checker::check("two inbox-mode groups in one database", &evidence);
    let figures_b = checker::check(
        "two inbox-mode groups (second group, progress mode)",
        &evidence_b,
    );
    figures.note("first group", format!("{:?}", a.counts()));
    figures.note("second group", format!("{:?}", b.counts()));
    figures.note(
        "second group: consumed / lost / applied twice / order violations",
        format!(
            "{} / {} / {} / {}",
            figures_b.consumed, figures_b.lost, figures_b.applied_twice, figures_b.order_violations
        ),
    );
    assert!(applied_b, "the second group did not apply every event");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    figures.report_and_assert();
    figures_b.report_and_assert();
}
