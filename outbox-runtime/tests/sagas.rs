//! Sagas on a consumer against a real PostgreSQL (fresh database per test)
//! and the real broker: a start message creates its instance once, a
//! redelivered message changes nothing, messages of one instance through
//! two consumers at once are applied one after the other, a stale or
//! cancelled timeout changes nothing, a due timeout fires once (published
//! by the relay), completion ends the instance, and a message in another
//! stage is ignored (counted) or dead-lettered, as the saga says.
//!
//! The test that runs a relay calls `relay_mode`: it runs in the progress
//! mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command), where
//! "published" is "passed by its slot's position" (see
//! `common::unpublished`); a timeout is a scheduled event, sent on the held
//! rows' path in either mode.
//!
//! The sagas are declared with `#[outbox::saga]`, but for the roles test's,
//! whose `Saga` impl is written by hand.
//!
//! Each test has its own saga type on its own fixed topics (a message
//! type's topic is a constant), emptied at its start: do not run this
//! suite twice at the same time against one broker.

mod common;

use std::time::Duration;

use common::*;
use outbox_runtime::{Consumer, ConsumerBuilder, Relay};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

/// A message type of a test saga, on `$topic`.
macro_rules! message {
    ($name:ident, $topic:expr, { $($field:ident: $ty:ty),* }) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        pub struct $name { pub order_id: String, $(pub $field: $ty),* }
        impl DomainEvent for $name {
            const TOPIC: &'static str = $topic;
            const AGGREGATE_TYPE: &'static str = "Order";
            const EVENT_TYPES: &'static [&'static str] = &[stringify!($name)];
            fn event_type(&self) -> &'static str { stringify!($name) }
            fn event_version(&self) -> u32 { 1 }
            fn aggregate_id(&self) -> String { self.order_id.clone() }
        }
    };
}

/// The types of a test saga (`Order`) and its messages, bound to topics
/// named after `$base` (its timeouts: on `$timeouts`).
macro_rules! order_types {
    ($base:literal, $timeouts:literal) => {
        use std::time::Duration;

        use serde::{Deserialize, Serialize};

        pub const ORDERS: &str = concat!($base, "-orders");
        pub const TIMEOUTS: &str = $timeouts;
        pub const SHIPPING: &str = concat!($base, "-shipping");
        pub const NAME: &str = $base;

        message!(Placed, ORDERS, { timeout_ms: u64 });
        message!(Paid, ORDERS, {});
        message!(Hold, ORDERS, {});
        message!(Noted, ORDERS, { n: u64, pause_ms: u64 });
        message!(Ship, SHIPPING, {});

        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        pub enum Stage {
            AwaitingPayment,
            OnHold,
            Shipped,
            Cancelled,
        }

        #[derive(Debug, Serialize, Deserialize)]
        pub struct Order {
            pub order_id: String,
            pub notes: Vec<u64>,
            /// Set by a note, see [`NUL_NOTE`].
            #[serde(default)]
            pub remark: String,
            pub stage: Stage,
        }

        /// Empties the saga's topics.
        pub async fn reset() {
            for topic in [ORDERS, TIMEOUTS, SHIPPING] {
                super::reset_topic(&super::brokers(), topic).await;
            }
        }
    };
}

/// A saga type (`Order`) declared with `#[saga]`, whose messages in another
/// stage are handled by `$policy` (`ignore` or `dead_letter`).
macro_rules! order_saga {
    ($module:ident, $base:literal, $timeouts:literal, $policy:ident) => {
        mod $module {
            use outbox::{BoxError, DomainEvent, SagaContext, SagaTimeout};

            order_types!($base, $timeouts);

            #[outbox::saga(name = $base, timeouts = $timeouts, stage = Stage, other_stage = $policy)]
            impl Order {
                #[init]
                fn begin(e: &Placed) -> Self {
                    Order {
                        order_id: e.order_id.clone(),
                        notes: Vec::new(),
                        remark: String::new(),
                        stage: Stage::AwaitingPayment,
                    }
                }

                #[step(start, correlate = order_id)]
                async fn placed(ctx: &mut SagaContext<Self>, e: Placed) -> Result<Stage, BoxError> {
                    ctx.schedule_timeout("payment", Duration::from_millis(e.timeout_ms));
                    Ok(Stage::AwaitingPayment)
                }

                #[step(from = AwaitingPayment, correlate = order_id)]
                async fn paid(ctx: &mut SagaContext<Self>, e: Paid) -> Result<Stage, BoxError> {
                    ctx.cancel_timeout("payment");
                    ctx.send(Ship {
                        order_id: e.order_id,
                    });
                    ctx.complete();
                    Ok(Stage::Shipped)
                }

                #[step(from = AwaitingPayment, correlate = order_id)]
                async fn hold(_ctx: &mut SagaContext<Self>, _e: Hold) -> Result<Stage, BoxError> {
                    Ok(Stage::OnHold)
                }

                /// In any stage.
                #[step(correlate = order_id)]
                async fn noted(ctx: &mut SagaContext<Self>, e: Noted) -> Result<Stage, BoxError> {
                    if e.n == super::FAILING_NOTE {
                        return Err("this note always fails".into());
                    }
                    if e.n == super::NUL_NOTE {
                        ctx.remark = "a\0b".into();
                    }
                    let mut notes = ctx.notes.clone();
                    // Read, wait, write: a step not serialized with another
                    // of its instance would lose that one's note.
                    tokio::time::sleep(Duration::from_millis(e.pause_ms)).await;
                    notes.push(e.n);
                    ctx.notes = notes;
                    Ok(ctx.stage.clone())
                }

                #[timeout(name = "payment", from = AwaitingPayment)]
                async fn payment_late(
                    ctx: &mut SagaContext<Self>,
                    _t: SagaTimeout<Self>,
                ) -> Result<Stage, BoxError> {
                    ctx.complete();
                    Ok(Stage::Cancelled)
                }
            }
        }
    };
}

/// The same saga, its `Saga` impl written by hand (the trait works without
/// the macro).
macro_rules! order_saga_by_hand {
    ($module:ident, $base:literal, $timeouts:literal, $policy:expr) => {
        mod $module {
            use outbox_core::saga::StepFuture;
            use outbox_core::{
                DomainEvent, MessageSteps, OtherStage, Saga, SagaContext, SagaRegistrar,
                SagaTimeout,
            };

            order_types!($base, $timeouts);

            fn placed(ctx: &mut SagaContext<Order>, e: Placed) -> StepFuture<'_, Order> {
                Box::pin(async move {
                    ctx.schedule_timeout("payment", Duration::from_millis(e.timeout_ms));
                    Ok(Stage::AwaitingPayment)
                })
            }

            fn paid(ctx: &mut SagaContext<Order>, e: Paid) -> StepFuture<'_, Order> {
                Box::pin(async move {
                    ctx.cancel_timeout("payment");
                    ctx.send(Ship {
                        order_id: e.order_id,
                    });
                    ctx.complete();
                    Ok(Stage::Shipped)
                })
            }

            fn hold(_: &mut SagaContext<Order>, _: Hold) -> StepFuture<'_, Order> {
                Box::pin(async move { Ok(Stage::OnHold) })
            }

            fn noted(ctx: &mut SagaContext<Order>, e: Noted) -> StepFuture<'_, Order> {
                Box::pin(async move {
                    let mut notes = ctx.notes.clone();
                    tokio::time::sleep(Duration::from_millis(e.pause_ms)).await;
                    notes.push(e.n);
                    ctx.notes = notes;
                    Ok(ctx.stage.clone())
                })
            }

            fn payment_late(
                ctx: &mut SagaContext<Order>,
                _: SagaTimeout<Order>,
            ) -> StepFuture<'_, Order> {
                Box::pin(async move {
                    ctx.complete();
                    Ok(Stage::Cancelled)
                })
            }

            impl Saga for Order {
                const NAME: &'static str = NAME;
                const TIMEOUT_TOPIC: &'static str = TIMEOUTS;
                type Stage = Stage;
                fn stage(&self) -> &Stage {
                    &self.stage
                }
                fn set_stage(&mut self, stage: Stage) {
                    self.stage = stage;
                }
                fn other_stage() -> OtherStage {
                    $policy
                }
                fn steps<R: SagaRegistrar<Self>>(r: &mut R) {
                    r.add(MessageSteps::new(|e: &Placed| e.order_id.clone()).start(
                        |e| Order {
                            order_id: e.order_id.clone(),
                            notes: Vec::new(),
                            remark: String::new(),
                            stage: Stage::AwaitingPayment,
                        },
                        placed,
                    ));
                    r.add(
                        MessageSteps::new(|e: &Paid| e.order_id.clone())
                            .handle(Some(Stage::AwaitingPayment), paid),
                    );
                    r.add(
                        MessageSteps::new(|e: &Hold| e.order_id.clone())
                            .handle(Some(Stage::AwaitingPayment), hold),
                    );
                    r.add(MessageSteps::new(|e: &Noted| e.order_id.clone()).handle(None, noted));
                    r.add(MessageSteps::timeouts().on(
                        "payment",
                        Some(Stage::AwaitingPayment),
                        payment_late,
                    ));
                }
            }
        }
    };
}

/// A note whose step always fails (in the sagas declared with `#[saga]`).
const FAILING_NOTE: u64 = 666;
/// A note whose step puts the character NUL in the state, which `jsonb`
/// cannot store (in the sagas declared with `#[saga]`).
const NUL_NOTE: u64 = 667;

fn consumer(pool: &PgPool, group: &str) -> ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group(group)
        .brokers(brokers())
        .redrive_interval(Duration::from_millis(100))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

/// A message of the saga's topics, as the relay writes it.
fn msg(id: Uuid, event_type: &str, order: &str, payload: serde_json::Value) -> TestMessage {
    let mut payload = payload;
    payload["order_id"] = json!(order);
    TestMessage::event(id, event_type, order, payload)
}

/// A timeout message of saga `saga` for `order`.
fn timeout_msg(saga: &str, order: &str, timeout_id: Uuid) -> TestMessage {
    TestMessage::event(
        timeout_id,
        "saga.timeout",
        order,
        json!({ "saga_type": saga, "saga_id": order, "name": "payment", "timeout_id": timeout_id }),
    )
}

/// (stage, version, completed, timeouts) of an instance.
async fn instance(
    pool: &PgPool,
    saga: &str,
    id: &str,
) -> Option<(String, i64, bool, serde_json::Value)> {
    sqlx::query_as(
        "SELECT stage, version, completed_at IS NOT NULL, timeouts FROM outbox_saga
         WHERE saga_type = $1 AND saga_id = $2",
    )
    .bind(saga)
    .bind(id)
    .fetch_optional(pool)
    .await
    .unwrap()
}

async fn state(pool: &PgPool, saga: &str, id: &str) -> serde_json::Value {
    sqlx::query_scalar("SELECT state FROM outbox_saga WHERE saga_type = $1 AND saga_id = $2")
        .bind(saga)
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Waits until `n` messages were processed or skipped as duplicates.
async fn settled(handle: &outbox_runtime::ConsumerHandle, n: u64) -> bool {
    eventually(Duration::from_secs(30), || async {
        let c = handle.counts();
        c.processed + c.duplicates + c.dead_lettered >= n
    })
    .await
}

order_saga!(
    created,
    "saga-test-created",
    "saga-test-created-timeouts",
    ignore
);

/// A start message creates its instance once: redelivered (same event id)
/// it is a duplicate, and a second start of the same instance (another
/// event id) changes nothing. A payment then completes it: the command is
/// in the outbox once, the pending timeout's row cancelled, and the
/// payment redelivered changes nothing.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_start_creates_once_and_redelivery_changes_nothing(pool: PgPool) {
    init_tracing();
    created::reset().await;
    let placed = msg(
        Uuid::now_v7(),
        "Placed",
        "o1",
        json!({ "timeout_ms": 3_600_000 }),
    );
    let again = msg(
        Uuid::now_v7(),
        "Placed",
        "o1",
        json!({ "timeout_ms": 3_600_000 }),
    );
    produce(
        &brokers(),
        created::ORDERS,
        &[placed.clone(), placed, again],
    )
    .await;
    let handle = consumer(&pool, &unique_topic("created"))
        .saga::<created::Order>()
        .spawn()
        .unwrap();
    assert!(settled(&handle, 3).await, "{:?}", handle.counts());
    let (stage, version, completed, timeouts) = instance(&pool, created::NAME, "o1").await.unwrap();
    assert_eq!(
        (stage.as_str(), version, completed),
        ("AwaitingPayment", 1, false)
    );
    let pending: Uuid = serde_json::from_value(timeouts["payment"].clone()).unwrap();
    let scheduled = scalar(
        &pool,
        &format!(
            "SELECT count(*) FROM outbox_event WHERE event_id = '{pending}'
             AND due_at > now() + interval '50 minutes'"
        ),
    )
    .await;
    assert_eq!(scheduled, 1, "the timeout is a scheduled row");

    let paid = msg(Uuid::now_v7(), "Paid", "o1", json!({}));
    produce(&brokers(), created::ORDERS, &[paid.clone(), paid]).await;
    assert!(settled(&handle, 5).await, "{:?}", handle.counts());
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.duplicates, 2, "{counts:?}");
    let (stage, version, completed, timeouts) = instance(&pool, created::NAME, "o1").await.unwrap();
    assert_eq!((stage.as_str(), version, completed), ("Shipped", 2, true));
    assert_eq!(timeouts, json!({}));
    let ships = scalar(
        &pool,
        &format!(
            "SELECT count(*) FROM outbox_event WHERE topic = '{}'",
            created::SHIPPING
        ),
    )
    .await;
    assert_eq!(ships, 1, "the command is sent once");
    let cancelled = scalar(
        &pool,
        &format!(
            "SELECT count(*) FROM outbox_event WHERE event_id = '{pending}'
             AND discard_reason = 'cancelled'"
        ),
    )
    .await;
    assert_eq!(cancelled, 1, "the pending timeout's row is cancelled");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox_saga").await, 1);
}

order_saga!(
    taken_back,
    "saga-test-taken-back",
    "saga-test-taken-back-timeouts",
    ignore
);

/// In a dedup batch, a step's instance comes from what the batch read
/// ahead and the batch's earlier steps wrote, not from a read of its own.
/// When a step fails, its segment is taken back (the writes of the steps
/// before it too) and run again without it: those steps must start again
/// from the rolled-back rows, not from the states they wrote. Here o1 and
/// o2 are created and noted in one batch, then o2's failing note takes the
/// segment back: o1's notes must each be applied once, o2's failing note
/// dead-lettered after its attempts and the note behind it applied.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_segment_taken_back_runs_its_steps_again_from_the_rolled_back_rows(pool: PgPool) {
    init_tracing();
    taken_back::reset().await;
    let placed = |order: &str| {
        msg(
            Uuid::now_v7(),
            "Placed",
            order,
            json!({ "timeout_ms": 3_600_000 }),
        )
        .on_partition(0)
    };
    let noted = |order: &str, n: u64| {
        msg(
            Uuid::now_v7(),
            "Noted",
            order,
            json!({ "n": n, "pause_ms": 0 }),
        )
        .on_partition(0)
    };
    // In the topic before the consumer starts: one batch.
    produce(
        &brokers(),
        taken_back::ORDERS,
        &[
            placed("o1"),
            placed("o2"),
            noted("o1", 1),
            noted("o2", 2),
            noted("o2", FAILING_NOTE),
            noted("o1", 3),
            noted("o2", 4),
        ],
    )
    .await;
    let handle = consumer(&pool, &unique_topic("taken-back"))
        .saga::<taken_back::Order>()
        .max_attempts(2)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            handle.counts().dead_lettered >= 1
                && state(&pool, taken_back::NAME, "o2").await["notes"] == json!([2, 4])
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(
        state(&pool, taken_back::NAME, "o1").await["notes"],
        json!([1, 3])
    );
    assert_eq!(
        state(&pool, taken_back::NAME, "o2").await["notes"],
        json!([2, 4])
    );
    assert_eq!(counts.dead_lettered, 1, "{counts:?}");
    assert!(counts.handler_failures >= 1, "{counts:?}");
    let (_, o1_version, _, _) = instance(&pool, taken_back::NAME, "o1").await.unwrap();
    assert_eq!(
        o1_version, 3,
        "o1 was written once per step: placed, two notes"
    );
}

order_saga!(
    nul_state,
    "saga-test-nul-state",
    "saga-test-nul-state-timeouts",
    ignore
);

/// A step that leaves in its state a string PostgreSQL's `jsonb` cannot
/// store (the character NUL) fails like a failing step, with the reason:
/// retried, then dead-lettered, its instance unchanged, while the other
/// steps of the batch (written together at the segment's end) are applied
/// and the consumer goes on.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_step_whose_state_jsonb_cannot_store_is_dead_lettered_and_the_batch_goes_on(
    pool: PgPool,
) {
    init_tracing();
    nul_state::reset().await;
    let on_0 = |m: TestMessage| m.on_partition(0);
    let placed = |order: &str| {
        on_0(msg(
            Uuid::now_v7(),
            "Placed",
            order,
            json!({ "timeout_ms": 3_600_000 }),
        ))
    };
    let noted = |order: &str, n: u64| {
        on_0(msg(
            Uuid::now_v7(),
            "Noted",
            order,
            json!({ "n": n, "pause_ms": 0 }),
        ))
    };
    produce(
        &brokers(),
        nul_state::ORDERS,
        &[
            placed("o1"),
            placed("o2"),
            noted("o2", 7),
            noted("o1", NUL_NOTE),
            noted("o1", 5),
            noted("o2", 8),
        ],
    )
    .await;
    let handle = consumer(&pool, &unique_topic("nul-state"))
        .saga::<nul_state::Order>()
        .max_attempts(2)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            handle.counts().dead_lettered >= 1
                && state(&pool, nul_state::NAME, "o1").await["notes"] == json!([5])
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.dead_lettered, 1, "{counts:?}");
    assert_eq!(
        state(&pool, nul_state::NAME, "o2").await["notes"],
        json!([7, 8])
    );
    assert_eq!(
        state(&pool, nul_state::NAME, "o1").await["remark"],
        json!("")
    );
    let error: String = sqlx::query_scalar("SELECT error FROM dead_letter")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(error.contains("NUL"), "{error}");
}

order_saga!(
    concurrent,
    "saga-test-concurrent",
    "saga-test-concurrent-timeouts",
    ignore
);

/// Messages of one instance on every partition, through two consumers of
/// one group at once, each step reading the state, pausing, then writing
/// it: every step is applied, one after the other (none lost).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn messages_of_one_instance_through_two_consumers_apply_one_after_another(pool: PgPool) {
    init_tracing();
    concurrent::reset().await;
    let group = unique_topic("concurrent");
    let first = consumer(&pool, &group)
        .saga::<concurrent::Order>()
        .batch_size(1)
        .spawn()
        .unwrap();
    let second = consumer(&pool, &group)
        .saga::<concurrent::Order>()
        .batch_size(1)
        .spawn()
        .unwrap();
    let placed = msg(
        Uuid::now_v7(),
        "Placed",
        "o1",
        json!({ "timeout_ms": 3_600_000 }),
    );
    produce(&brokers(), concurrent::ORDERS, &[placed]).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            instance(&pool, concurrent::NAME, "o1").await.is_some()
        })
        .await
    );
    // Until both consumers hold partitions: messages for no instance on
    // every partition, until each consumer has handled one.
    assert!(
        eventually(Duration::from_secs(60), || async {
            let markers: Vec<TestMessage> = (0..PARTITIONS)
                .map(|p| msg(Uuid::now_v7(), "Paid", "nobody", json!({})).on_partition(p))
                .collect();
            produce(&brokers(), concurrent::ORDERS, &markers).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            first.counts().processed > 1 && second.counts().processed > 0
                || first.counts().processed > 0 && second.counts().processed > 1
        })
        .await,
        "both consumers hold partitions"
    );
    let (first_before, second_before) = (first.counts().processed, second.counts().processed);
    let before = first_before + second_before;
    // Each on a key of its own (a consumer serializes one key's
    // messages), over every partition.
    let notes: Vec<TestMessage> = (0..8u64)
        .map(|n| {
            let id = Uuid::now_v7();
            let payload = json!({ "order_id": "o1", "n": n, "pause_ms": 300 });
            TestMessage::event(id, "Noted", &format!("note-{n}"), payload)
                .on_partition((n % PARTITIONS as u64) as i32)
        })
        .collect();
    produce(&brokers(), concurrent::ORDERS, &notes).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            let (a, b) = (first.counts(), second.counts());
            a.processed + b.processed >= before + 8
        })
        .await
    );
    let (a, b) = (first.counts(), second.counts());
    first.shutdown().await.unwrap();
    second.shutdown().await.unwrap();
    eprintln!("first: {a:?}\nsecond: {b:?}");
    assert!(
        a.processed > first_before && b.processed > second_before,
        "both consumers applied steps of the instance"
    );
    let (_, version, _, _) = instance(&pool, concurrent::NAME, "o1").await.unwrap();
    assert_eq!(version, 9);
    let mut notes: Vec<u64> =
        serde_json::from_value(state(&pool, concurrent::NAME, "o1").await["notes"].clone())
            .unwrap();
    notes.sort_unstable();
    assert_eq!(notes, (0..8).collect::<Vec<_>>(), "no step lost");
}

order_saga!(
    timeouts,
    "saga-test-timeouts",
    "saga-test-timeouts-timeouts",
    ignore
);

/// A due timeout, published by the relay, fires once and completes the
/// saga (Cancelled). A timeout whose id is not pending (a stale one, or one
/// arriving after completion or after its cancel) changes nothing.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn timeouts_fire_once_and_stale_or_cancelled_ones_change_nothing(pool: PgPool) {
    init_tracing();
    relay_mode(&pool).await;
    timeouts::reset().await;
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
        .spawn()
        .unwrap();
    let handle = consumer(&pool, &unique_topic("timeouts"))
        .saga::<timeouts::Order>()
        .spawn()
        .unwrap();
    let stale_before = outbox_core::saga::saga_counts(timeouts::NAME).stale_timeouts;
    // o1 times out after a second; o2 waits an hour, and is paid.
    produce(
        &brokers(),
        timeouts::ORDERS,
        &[
            msg(
                Uuid::now_v7(),
                "Placed",
                "o1",
                json!({ "timeout_ms": 1_000 }),
            ),
            msg(
                Uuid::now_v7(),
                "Placed",
                "o2",
                json!({ "timeout_ms": 3_600_000 }),
            ),
        ],
    )
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            matches!(instance(&pool, timeouts::NAME, "o1").await, Some((s, 2, true, _)) if s == "Cancelled")
        })
        .await,
        "o1 timed out: {:?}",
        instance(&pool, timeouts::NAME, "o1").await
    );
    let (_, _, _, pending) = instance(&pool, timeouts::NAME, "o2").await.unwrap();
    let o2_timeout: Uuid = serde_json::from_value(pending["payment"].clone()).unwrap();

    // A timeout not pending for o2 (a stale id), and o1's again (fired):
    // nothing changes.
    produce(
        &brokers(),
        timeouts::TIMEOUTS,
        &[
            timeout_msg(timeouts::NAME, "o2", Uuid::now_v7()),
            timeout_msg(timeouts::NAME, "o1", Uuid::now_v7()),
        ],
    )
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            outbox_core::saga::saga_counts(timeouts::NAME).stale_timeouts > stale_before
        })
        .await
    );
    let (stage, version, completed, _) = instance(&pool, timeouts::NAME, "o2").await.unwrap();
    assert_eq!(
        (stage.as_str(), version, completed),
        ("AwaitingPayment", 1, false)
    );
    assert_eq!(instance(&pool, timeouts::NAME, "o1").await.unwrap().1, 2);

    // o2 is paid (its timeout cancelled); its timeout arriving anyway
    // (the outbox's cancel is best effort) changes nothing.
    produce(
        &brokers(),
        timeouts::ORDERS,
        &[msg(Uuid::now_v7(), "Paid", "o2", json!({}))],
    )
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            matches!(
                instance(&pool, timeouts::NAME, "o2").await,
                Some((_, 2, true, _))
            )
        })
        .await
    );
    let processed = handle.counts().processed;
    produce(
        &brokers(),
        timeouts::TIMEOUTS,
        &[timeout_msg(timeouts::NAME, "o2", o2_timeout)],
    )
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            handle.counts().processed > processed
        })
        .await
    );
    handle.shutdown().await.unwrap();
    relay.shutdown().await.unwrap();
    let (stage, version, _, _) = instance(&pool, timeouts::NAME, "o2").await.unwrap();
    assert_eq!((stage.as_str(), version), ("Shipped", 2));
    let published = outbox_runtime::relay::progress::Published::of(&pool)
        .await
        .unwrap();
    let published_timeouts = scalar(
        &pool,
        &format!(
            "{}SELECT count(*) FROM outbox_event WHERE topic = '{}' AND {}",
            published.with,
            timeouts::TIMEOUTS,
            published.condition
        ),
    )
    .await;
    assert_eq!(published_timeouts, 1, "only o1's timeout went out");
}

order_saga!(
    ignored,
    "saga-test-ignored",
    "saga-test-ignored-timeouts",
    ignore
);

/// A message in a stage no step of it accepts changes nothing under the
/// `Ignore` policy (counted), as does a message for no instance.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_message_in_another_stage_is_ignored_and_counted(pool: PgPool) {
    init_tracing();
    ignored::reset().await;
    let before = outbox_core::saga::saga_counts(ignored::NAME);
    produce(
        &brokers(),
        ignored::ORDERS,
        &[
            msg(
                Uuid::now_v7(),
                "Placed",
                "o1",
                json!({ "timeout_ms": 3_600_000 }),
            ),
            msg(Uuid::now_v7(), "Hold", "o1", json!({})),
            msg(Uuid::now_v7(), "Paid", "o1", json!({})),
            msg(Uuid::now_v7(), "Paid", "nobody", json!({})),
        ],
    )
    .await;
    let handle = consumer(&pool, &unique_topic("ignored"))
        .saga::<ignored::Order>()
        .spawn()
        .unwrap();
    assert!(settled(&handle, 4).await, "{:?}", handle.counts());
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.dead_lettered, 0);
    let (stage, version, completed, _) = instance(&pool, ignored::NAME, "o1").await.unwrap();
    assert_eq!((stage.as_str(), version, completed), ("OnHold", 2, false));
    assert!(instance(&pool, ignored::NAME, "nobody").await.is_none());
    let after = outbox_core::saga::saga_counts(ignored::NAME);
    assert_eq!(after.other_stage - before.other_stage, 1);
    assert_eq!(after.missing - before.missing, 1);
}

order_saga!(
    lettered,
    "saga-test-lettered",
    "saga-test-lettered-timeouts",
    dead_letter
);

/// Under the `DeadLetter` policy a message in another stage fails: it is
/// dead-lettered, and the instance is unchanged.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn under_the_dead_letter_policy_a_message_in_another_stage_is_dead_lettered(pool: PgPool) {
    init_tracing();
    lettered::reset().await;
    let paid = Uuid::now_v7();
    produce(
        &brokers(),
        lettered::ORDERS,
        &[
            msg(
                Uuid::now_v7(),
                "Placed",
                "o1",
                json!({ "timeout_ms": 3_600_000 }),
            ),
            msg(Uuid::now_v7(), "Hold", "o1", json!({})),
            msg(paid, "Paid", "o1", json!({})),
        ],
    )
    .await;
    let handle = consumer(&pool, &unique_topic("lettered"))
        .saga::<lettered::Order>()
        .max_attempts(2)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            handle.counts().dead_lettered == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();
    let (stage, version, completed, _) = instance(&pool, lettered::NAME, "o1").await.unwrap();
    assert_eq!((stage.as_str(), version, completed), ("OnHold", 2, false));
    let letter = scalar(
        &pool,
        &format!("SELECT count(*) FROM dead_letter WHERE event_id = '{paid}'"),
    )
    .await;
    assert_eq!(letter, 1);
}

order_saga_by_hand!(
    roles,
    "saga-test-roles",
    "saga-test-roles-timeouts",
    outbox_core::OtherStage::Ignore
);

/// The consumer role with the guide's grants (docs/src/production.md) runs
/// a saga: creates the instance, schedules its timeout, cancels it, sends
/// a command and completes. Without its grant on `outbox_saga` it applies
/// nothing: the message fails (dead-lettered), no instance.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_consumer_role_runs_a_saga_with_the_guides_grants(pool: PgPool) {
    use common::roles::Roles;
    init_tracing();
    roles::reset().await;
    let roles_ = Roles::create(&pool).await;
    let as_consumer = roles_.pool("outbox_consumer", 4);
    produce(
        &brokers(),
        roles::ORDERS,
        &[
            msg(
                Uuid::now_v7(),
                "Placed",
                "o1",
                json!({ "timeout_ms": 3_600_000 }),
            ),
            msg(Uuid::now_v7(), "Paid", "o1", json!({})),
        ],
    )
    .await;
    let handle = consumer(&as_consumer, &unique_topic("roles"))
        .saga::<roles::Order>()
        .max_attempts(2)
        .spawn()
        .unwrap();
    assert!(settled(&handle, 2).await, "{:?}", handle.counts());
    assert_eq!(handle.counts().dead_lettered, 0, "{:?}", handle.counts());
    let (stage, version, completed, _) = instance(&pool, roles::NAME, "o1").await.unwrap();
    assert_eq!((stage.as_str(), version, completed), ("Shipped", 2, true));
    let cancelled = scalar(
        &pool,
        &format!(
            "SELECT count(*) FROM outbox_event WHERE topic = '{}' AND discard_reason = 'cancelled'",
            roles::TIMEOUTS
        ),
    )
    .await;
    assert_eq!(cancelled, 1);

    roles_
        .sql("REVOKE SELECT, INSERT, UPDATE ON outbox_saga FROM outbox_consumer")
        .await;
    produce(
        &brokers(),
        roles::ORDERS,
        &[msg(
            Uuid::now_v7(),
            "Placed",
            "o2",
            json!({ "timeout_ms": 3_600_000 }),
        )],
    )
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            handle.counts().dead_lettered == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();
    assert!(instance(&pool, roles::NAME, "o2").await.is_none());
    as_consumer.close().await;
    roles_.drop_all().await;
}

order_saga!(
    conflicted,
    "saga-test-conflict",
    "saga-test-conflict-timeouts",
    ignore
);

/// A step that deadlocks with another transaction fails like any failure,
/// is counted as a conflict (and in `outbox_saga_conflicts_total`), and is
/// retried in a new transaction: applied once, after the other transaction
/// ends. The other transaction holds the instance's row and then inserts
/// the dedup row the consumer's transaction holds: a cycle the consumer's
/// side detects first (its `deadlock_timeout` is the server's 1 s, the
/// holder's 20 s), so the consumer's step is the one that fails.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_deadlocked_step_is_counted_and_retried_in_a_new_transaction(pool: PgPool) {
    init_tracing();
    conflicted::reset().await;
    let group = unique_topic("conflict");
    let placed = msg(
        Uuid::now_v7(),
        "Placed",
        "o1",
        json!({ "timeout_ms": 3_600_000 }),
    );
    produce(&brokers(), conflicted::ORDERS, &[placed]).await;
    let handle = consumer(&pool, &group)
        .saga::<conflicted::Order>()
        .spawn()
        .unwrap();
    assert!(settled(&handle, 1).await, "{:?}", handle.counts());
    let before = outbox_core::saga::saga_counts(conflicted::NAME);

    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL deadlock_timeout = '20s'")
        .execute(&mut *holder)
        .await
        .unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM outbox_saga WHERE saga_type = $1 AND saga_id = 'o1' FOR UPDATE")
        .bind(conflicted::NAME)
        .execute(&mut *holder)
        .await
        .unwrap();
    let hold = Uuid::now_v7();
    produce(
        &brokers(),
        conflicted::ORDERS,
        &[msg(hold, "Hold", "o1", json!({}))],
    )
    .await;
    // The consumer's step waits for the instance's row, its dedup row of
    // the message inserted.
    let waiting = eventually(Duration::from_secs(30), || async {
        scalar(
            &pool,
            &format!(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> {holder_pid}
                   AND wait_event_type = 'Lock' AND query ILIKE '%outbox_saga%'"
            ),
        )
        .await
            == 1
    })
    .await;
    assert!(waiting, "the step waits for the instance's lock");
    // The holder now waits for that dedup row: a deadlock.
    sqlx::query("INSERT INTO processed_event (consumer, event_id) VALUES ($1, $2)")
        .bind(&group)
        .bind(hold)
        .execute(&mut *holder)
        .await
        .expect("the consumer's side of the deadlock was aborted");
    // PostgreSQL releases the failed statement's locks before the consumer
    // hears of the error: the count follows.
    let counted = eventually(Duration::from_secs(10), || async {
        outbox_core::saga::saga_counts(conflicted::NAME).conflicts > before.conflicts
    })
    .await;
    let after = outbox_core::saga::saga_counts(conflicted::NAME);
    assert!(counted, "{after:?}");
    assert_eq!(after.conflicts, before.conflicts + 1, "{after:?}");
    assert_eq!(after.steps, before.steps, "nothing applied yet");
    holder.rollback().await.unwrap();

    // Retried in a new transaction, once the holder is gone: applied once.
    assert!(settled(&handle, 2).await, "{:?}", handle.counts());
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    let (stage, version, completed, _) = instance(&pool, conflicted::NAME, "o1").await.unwrap();
    assert_eq!((stage.as_str(), version, completed), ("OnHold", 2, false));
    assert!(counts.handler_failures >= 1, "{counts:?}");
    assert_eq!(counts.dead_lettered, 0, "{counts:?}");
    let final_counts = outbox_core::saga::saga_counts(conflicted::NAME);
    assert_eq!(final_counts.steps, before.steps + 1, "{final_counts:?}");
    assert_eq!(
        final_counts.conflicts,
        before.conflicts + 1,
        "{final_counts:?}"
    );
}
