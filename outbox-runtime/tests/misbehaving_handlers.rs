//! Application code that misbehaves inside the consumer's transaction, in
//! both modes, against a real PostgreSQL and the real broker: a handler that
//! swallows its own SQL error (the transaction is left aborted and PostgreSQL
//! answers `COMMIT` with `ROLLBACK`), one that runs `COMMIT`, `ROLLBACK` or
//! `RELEASE` through the connection it is given, one slower than its
//! timeout, one that keeps hitting a deadlock. Each bad event must end as a
//! dead letter carrying what went wrong; every good event of the same
//! batches must be applied exactly once; nothing is silently dropped.
//!
//! Handlers are bound to their event's topic (`DomainEvent::TOPIC` is a
//! constant), so each test has its own fixed topic, emptied at its start.

mod common;

use std::collections::HashMap;
use std::marker::PhantomData;
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox_runtime::{Consumer, ConsumerBuilder, Mode};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

/// What the handler does with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Act {
    /// Applies the effect.
    Good,
    /// Applies the effect, then inserts a duplicate key and logs the unique
    /// violation instead of returning it.
    Swallow,
    /// Applies the effect, then runs `COMMIT` and returns its error, if any.
    Commit,
    /// Applies the effect, runs `COMMIT`, ignores its outcome, writes again.
    CommitSwallow,
    /// Applies the effect, runs `ROLLBACK`, then writes again (autocommit).
    Rollback,
    /// Runs `RELEASE SAVEPOINT` of a savepoint it never made, ignores it.
    Release,
    /// Applies the effect, then sleeps far longer than the handler timeout.
    Slow,
    /// Fails with a real deadlock error (SQLSTATE 40P01) every time.
    Deadlock,
}

macro_rules! act_event {
    ($name:ident, $topic:literal) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        struct $name {
            key: String,
            seq: u64,
            act: Act,
        }

        impl DomainEvent for $name {
            const TOPIC: &'static str = $topic;
            const AGGREGATE_TYPE: &'static str = "Order";
            const EVENT_TYPES: &'static [&'static str] = &["OrderPlaced"];
            fn event_type(&self) -> &'static str {
                "OrderPlaced"
            }
            fn event_version(&self) -> u32 {
                1
            }
            fn aggregate_id(&self) -> String {
                self.key.clone()
            }
        }

        impl ActEvent for $name {
            fn act(&self) -> Act {
                self.act
            }
        }
    };
}

trait ActEvent: DomainEvent {
    fn act(&self) -> Act;
}

/// The application's handler: one effect row per event (unique per event
/// id), then whatever the event says.
struct Handler<E>(PhantomData<fn() -> E>);

impl<E> Handler<E> {
    fn new() -> Self {
        Self(PhantomData)
    }
}

const EFFECT: &str = "INSERT INTO effect (event_id) VALUES ($1)";

impl<E: ActEvent> InboxHandler for Handler<E> {
    type Event = E;
    const NAME: &'static str = "apply_order";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let id = ctx.incoming().event_id;
            let act = event.act();
            if act == Act::Deadlock {
                sqlx::query(
                    "DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END $$",
                )
                .execute(&mut **ctx)
                .await?;
                return Ok(());
            }
            if act == Act::Release
                && let Err(error) = sqlx::query("RELEASE SAVEPOINT never_made")
                    .execute(&mut **ctx)
                    .await
            {
                tracing::info!(%error, "release failed: carrying on");
            }
            sqlx::query(EFFECT).bind(id).execute(&mut **ctx).await?;
            match act {
                Act::Swallow => {
                    // The same row again: a unique violation, logged and dropped.
                    if let Err(error) = sqlx::query(EFFECT).bind(id).execute(&mut **ctx).await {
                        tracing::info!(%error, "duplicate effect: ignoring");
                    }
                }
                Act::Commit => {
                    sqlx::query("COMMIT").execute(&mut **ctx).await?;
                }
                Act::CommitSwallow => {
                    let _ = sqlx::query("COMMIT").execute(&mut **ctx).await;
                    let _ = sqlx::query("INSERT INTO effect (event_id, note) VALUES ($1, 'after')")
                        .bind(id)
                        .execute(&mut **ctx)
                        .await;
                }
                Act::Rollback => {
                    sqlx::query("ROLLBACK").execute(&mut **ctx).await?;
                    let _ = sqlx::query("INSERT INTO effect (event_id, note) VALUES ($1, 'after')")
                        .bind(id)
                        .execute(&mut **ctx)
                        .await;
                }
                Act::Slow => tokio::time::sleep(Duration::from_secs(3600)).await,
                Act::Good | Act::Release | Act::Deadlock => {}
            }
            Ok(())
        })
    }
}

async fn effect_table(pool: &PgPool) {
    // Unique per event and note: a second plain insert is a unique violation.
    sqlx::query(
        "CREATE TABLE effect (event_id uuid NOT NULL, note text NOT NULL DEFAULT '',
                              UNIQUE (event_id, note))",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Effect rows per event id.
async fn effects(pool: &PgPool) -> HashMap<Uuid, i64> {
    sqlx::query_as("SELECT event_id, count(*) FROM effect GROUP BY event_id")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

fn consumer(pool: &PgPool, group: &str, mode: Mode) -> ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group(group)
        .brokers(brokers())
        .mode(mode)
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(20))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .processor_poll_interval(Duration::from_millis(50))
}

/// `n` events over 8 keys; event `i` acts as `bad(i)` says (`Good` if none).
fn events(n: usize, bad: impl Fn(usize) -> Option<Act>) -> (Vec<TestMessage>, Vec<(Uuid, Act)>) {
    let mut messages = Vec::with_capacity(n);
    let mut ids = Vec::with_capacity(n);
    for seq in 0..n {
        let id = Uuid::now_v7();
        let key = format!("k{}", seq % 8);
        let act = bad(seq).unwrap_or(Act::Good);
        messages.push(TestMessage::event(
            id,
            "OrderPlaced",
            &key,
            serde_json::json!({ "key": key, "seq": seq, "act": act }),
        ));
        ids.push((id, act));
    }
    (messages, ids)
}

/// Runs `events` through a consumer of `mode` until every event is either
/// applied or dead-lettered; checks that each good event was applied once,
/// each bad one not at all and dead-lettered with an error containing the
/// text its act predicts. Returns the consumer's counts.
async fn run_and_check<E: ActEvent>(
    pool: &PgPool,
    topic: &str,
    mode: Mode,
    n: usize,
    bad: impl Fn(usize) -> Option<Act>,
    configure: impl FnOnce(ConsumerBuilder) -> ConsumerBuilder,
) -> outbox_runtime::inbox::ConsumerCounts {
    effect_table(pool).await;
    reset_topic(&brokers(), topic).await;
    let (messages, ids) = events(n, bad);
    produce(&brokers(), topic, &messages).await;
    let group = unique_topic("misbehaving");
    let bad_count = ids.iter().filter(|(_, a)| *a != Act::Good).count();
    let good_count = n - bad_count;
    let handle = configure(consumer(pool, &group, mode))
        .handler(Handler::<E>::new())
        .spawn()
        .unwrap();
    let settled = eventually(Duration::from_secs(60), || async {
        let letters = dead_letter::list(pool, &DeadLetterFilter::new().consumer(&group))
            .await
            .unwrap()
            .len();
        let c = handle.counts();
        letters >= bad_count && c.processed as usize >= good_count
    })
    .await;
    let counts = handle.counts();
    let letters = dead_letter::list(pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap();
    assert!(
        settled,
        "not settled: {counts:?}, {} dead letters: {:?}",
        letters.len(),
        letters.iter().map(|l| &l.error).collect::<Vec<_>>()
    );
    assert!(!handle.is_finished(), "the consumer stopped");
    handle.shutdown().await.unwrap();

    let applied = effects(pool).await;
    let lettered: HashMap<Uuid, &dead_letter::DeadLetter> = letters
        .iter()
        .map(|l| (l.event_id.expect("event id"), l))
        .collect();
    for (id, act) in &ids {
        let times = applied.get(id).copied().unwrap_or(0);
        if *act == Act::Good {
            assert_eq!(times, 1, "good event {id} applied {times} times");
            assert!(!lettered.contains_key(id), "good event {id} dead-lettered");
        } else {
            assert_eq!(times, 0, "{act:?} event {id}: its effect committed");
            let letter = lettered
                .get(id)
                .unwrap_or_else(|| panic!("{act:?} event {id} not dead-lettered"));
            assert_eq!(letter.reason.to_string(), "handler_failed");
            assert_eq!(letter.handler.as_deref(), Some("apply_order"));
            let expected = match act {
                Act::Swallow => "aborted",
                Act::Commit | Act::CommitSwallow | Act::Rollback => "ended",
                Act::Release => "aborted",
                Act::Slow => "timed out",
                Act::Deadlock => "deadlock detected",
                Act::Good => unreachable!(),
            };
            assert!(
                letter.error.contains(expected),
                "{act:?}: the dead letter's error `{}` does not say `{expected}`",
                letter.error
            );
        }
    }
    assert_eq!(letters.len(), bad_count, "one dead letter per bad event");
    assert_eq!(counts.processed as usize, good_count, "{counts:?}");
    counts
}

act_event!(SwallowDedup, "misbehaving-swallow-dedup");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_handler_that_swallows_its_sql_error_fails_only_its_event(pool: PgPool) {
    init_tracing();
    // 2% of the events, spread over the batches.
    run_and_check::<SwallowDedup>(
        &pool,
        SwallowDedup::TOPIC,
        Mode::Dedup,
        500,
        |i| (i % 50 == 7).then_some(Act::Swallow),
        |b| b,
    )
    .await;
}

act_event!(SwallowInbox, "misbehaving-swallow-inbox");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_handler_that_swallows_its_sql_error_fails_only_its_event(pool: PgPool) {
    init_tracing();
    run_and_check::<SwallowInbox>(
        &pool,
        SwallowInbox::TOPIC,
        Mode::Inbox,
        500,
        |i| (i % 50 == 7).then_some(Act::Swallow),
        |b| b,
    )
    .await;
}

/// The acts that end or break the transaction through the connection.
fn transaction_enders(i: usize) -> Option<Act> {
    match i % 40 {
        3 => Some(Act::Commit),
        11 => Some(Act::CommitSwallow),
        19 => Some(Act::Rollback),
        27 => Some(Act::Release),
        _ => None,
    }
}

act_event!(EndersDedup, "misbehaving-enders-dedup");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_handler_cannot_commit_roll_back_or_release_the_consumers_transaction(
    pool: PgPool,
) {
    init_tracing();
    run_and_check::<EndersDedup>(
        &pool,
        EndersDedup::TOPIC,
        Mode::Dedup,
        400,
        transaction_enders,
        |b| b,
    )
    .await;
}

act_event!(EndersInbox, "misbehaving-enders-inbox");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_handler_cannot_commit_roll_back_or_release_the_consumers_transaction(
    pool: PgPool,
) {
    init_tracing();
    run_and_check::<EndersInbox>(
        &pool,
        EndersInbox::TOPIC,
        Mode::Inbox,
        400,
        transaction_enders,
        |b| b,
    )
    .await;
}

act_event!(SlowDedup, "misbehaving-slow-dedup");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_handler_slower_than_its_timeout_fails_its_event(pool: PgPool) {
    init_tracing();
    run_and_check::<SlowDedup>(
        &pool,
        SlowDedup::TOPIC,
        Mode::Dedup,
        100,
        |i| (i == 40).then_some(Act::Slow),
        |b| b.handler_timeout(Duration::from_millis(300)),
    )
    .await;
}

act_event!(SlowInbox, "misbehaving-slow-inbox");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_handler_slower_than_its_timeout_fails_its_event(pool: PgPool) {
    init_tracing();
    run_and_check::<SlowInbox>(
        &pool,
        SlowInbox::TOPIC,
        Mode::Inbox,
        100,
        |i| (i == 40).then_some(Act::Slow),
        |b| b.handler_timeout(Duration::from_millis(300)),
    )
    .await;
}

act_event!(DeadlockDedup, "misbehaving-deadlock-dedup");

/// A deadlock or serialization failure is worth retrying, but one that comes
/// back every time is a failing handler, not an outage: it must end as a
/// dead letter after `max_attempts`, not be retried forever.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_handler_that_keeps_deadlocking_is_dead_lettered(pool: PgPool) {
    init_tracing();
    let counts = run_and_check::<DeadlockDedup>(
        &pool,
        DeadlockDedup::TOPIC,
        Mode::Dedup,
        60,
        |i| (i == 20).then_some(Act::Deadlock),
        |b| b,
    )
    .await;
    assert_eq!(counts.handler_failures, 2, "{counts:?}");
}

act_event!(DeadlockInbox, "misbehaving-deadlock-inbox");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_handler_that_keeps_deadlocking_is_dead_lettered(pool: PgPool) {
    init_tracing();
    run_and_check::<DeadlockInbox>(
        &pool,
        DeadlockInbox::TOPIC,
        Mode::Inbox,
        60,
        |i| (i == 20).then_some(Act::Deadlock),
        |b| b,
    )
    .await;
}
