//! The consumer in dedup mode (the default) against a real PostgreSQL
//! (fresh database per test) and the real broker: effects applied once under
//! duplicate delivery and across a crash between the database commit and the
//! offset commit, dead letters (failing handler, every malformed kind) and
//! their re-drive from the CLI, follow-up events, graceful shutdown.
//!
//! Handlers are bound to their event's topic (`DomainEvent::TOPIC` is a
//! constant), so each test has its own fixed topic, emptied at its start:
//! do not run this suite twice at the same time against one broker.

mod common;

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox_runtime::{Consumer, ConsumerBuilder, Mode};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

/// An event type bound to one test's topic.
macro_rules! test_event {
    ($name:ident, $topic:literal) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name {
            key: String,
            seq: u64,
            #[serde(default)]
            fail: bool,
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

        impl TestEvent for $name {
            fn key(&self) -> &str {
                &self.key
            }
            fn seq(&self) -> u64 {
                self.seq
            }
            fn fail(&self) -> bool {
                self.fail
            }
        }
    };
}

trait TestEvent: DomainEvent {
    fn key(&self) -> &str;
    fn seq(&self) -> u64;
    fn fail(&self) -> bool;
}

/// Records each handled event in the `effect` table; fails events marked
/// `fail` while `failing` is on.
struct Recorder<E> {
    failing: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
    pace: Duration,
    _event: PhantomData<fn() -> E>,
}

impl<E> Recorder<E> {
    fn new() -> Self {
        Self {
            failing: Arc::new(AtomicBool::new(true)),
            calls: Arc::default(),
            pace: Duration::ZERO,
            _event: PhantomData,
        }
    }

    /// Takes `pace` per event (to stop a consumer mid-stream).
    fn paced(mut self, pace: Duration) -> Self {
        self.pace = pace;
        self
    }
}

impl<E: TestEvent> InboxHandler for Recorder<E> {
    type Event = E;
    const NAME: &'static str = "record_effect";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if !self.pace.is_zero() {
                tokio::time::sleep(self.pace).await;
            }
            let event_id = ctx.incoming().event_id;
            sqlx::query("INSERT INTO effect (event_id, key, seq) VALUES ($1, $2, $3)")
                .bind(event_id)
                .bind(event.key())
                .bind(event.seq() as i64)
                .execute(&mut **ctx)
                .await?;
            if event.fail() && self.failing.load(Ordering::SeqCst) {
                return Err(format!("payment provider refused order {}", event.key()).into());
            }
            Ok(())
        })
    }
}

async fn effect_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effect")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn consumer(pool: &PgPool, group: &str) -> ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group(group)
        .brokers(brokers())
        .redrive_interval(Duration::from_millis(100))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

/// `n` well-formed events over `keys` keys; returns the messages and ids.
fn events(n: usize, keys: usize) -> (Vec<TestMessage>, Vec<Uuid>) {
    let mut messages = Vec::with_capacity(n);
    let mut ids = Vec::with_capacity(n);
    for seq in 0..n {
        let id = Uuid::now_v7();
        let key = format!("k{}", seq % keys);
        messages.push(TestMessage::event(
            id,
            "OrderPlaced",
            &key,
            serde_json::json!({ "key": key, "seq": seq }),
        ));
        ids.push(id);
    }
    (messages, ids)
}

/// One well-formed event on each partition of `topic`, produced now; returns
/// their ids. Once a consumer has applied all of them it has read every
/// partition from where it started to past them: whatever it would have read
/// again it has received by then.
async fn markers(topic: &str) -> Vec<Uuid> {
    let mut messages = Vec::new();
    let mut ids = Vec::new();
    for p in 0..PARTITIONS {
        let id = Uuid::now_v7();
        let key = format!("marker-{p}");
        messages.push(
            TestMessage::event(
                id,
                "OrderPlaced",
                &key,
                serde_json::json!({ "key": key, "seq": 0 }),
            )
            .on_partition(p),
        );
        ids.push(id);
    }
    produce(&brokers(), topic, &messages).await;
    ids
}

/// Waits until every id in `ids` has been applied once.
async fn all_applied(pool: &PgPool, ids: &[Uuid]) -> bool {
    eventually(Duration::from_secs(30), || async {
        effects_of(pool, ids).await.iter().all(|n| *n == 1)
    })
    .await
}

test_event!(DupEvent, "consumer-test-duplicates");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_same_event_published_twice_is_applied_once(pool: PgPool) {
    init_tracing();
    let topic = DupEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let (messages, ids) = events(500, 20);
    produce(&brokers(), topic, &messages).await;
    // The relay republishes (at least once): the same messages again, later.
    produce(&brokers(), topic, &messages[..300]).await;

    let group = unique_topic("dup");
    let handle = consumer(&pool, &group)
        .handler(Recorder::<DupEvent>::new())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed + c.duplicates == 800
        })
        .await,
        "all 800 messages applied or skipped: {:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.processed, 500);
    assert_eq!(counts.duplicates, 300);
    assert_eq!(counts.dead_lettered, 0);
    assert!(effects_of(&pool, &ids).await.iter().all(|n| *n == 1));
    assert_eq!(effect_count(&pool).await, 500);
    let recorded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_event WHERE consumer = $1")
            .bind(&group)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(recorded, 500);
    eprintln!("duplicates: {counts:?}");
}

test_event!(CrashEvent, "consumer-test-crash-window");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_consumer_dying_between_database_commit_and_offset_commit_applies_nothing_twice(
    pool: PgPool,
) {
    init_tracing();
    let topic = CrashEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let (messages, ids) = events(2_000, 50);
    produce(&brokers(), topic, &messages).await;
    let group = unique_topic("crash");

    // First consumer: every batch commits in the database, no offset is
    // ever committed — the crash window, held open for the whole run.
    let first = consumer(&pool, &group)
        .handler(Recorder::<CrashEvent>::new())
        .skip_offset_commits(true)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            first.counts().processed == 2_000
        })
        .await,
        "{:?}",
        first.counts()
    );
    first.shutdown().await.unwrap();
    assert_eq!(effect_count(&pool).await, 2_000);

    // "Restarted": the same group reads everything again.
    let second = consumer(&pool, &group)
        .handler(Recorder::<CrashEvent>::new())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            second.counts().duplicates == 2_000
        })
        .await,
        "{:?}",
        second.counts()
    );
    let counts = second.counts();
    second.shutdown().await.unwrap();
    assert_eq!(counts.received, 2_000, "everything was redelivered");
    assert_eq!(counts.processed, 0, "nothing applied a second time");
    assert!(effects_of(&pool, &ids).await.iter().all(|n| *n == 1));
    assert_eq!(effect_count(&pool).await, 2_000);
}

test_event!(ShutdownEvent, "consumer-test-shutdown");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn graceful_shutdown_commits_offsets_and_the_next_consumer_continues(pool: PgPool) {
    init_tracing();
    let topic = ShutdownEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    const N: u64 = 2_000;
    let (messages, ids) = events(N as usize, 40);
    // One record per batch: the next consumer resumes mid-stream (see
    // `produce_unbatched` about the test broker).
    produce_unbatched(&brokers(), topic, &messages).await;
    let group = unique_topic("shutdown");

    // Stopped in the middle of the stream.
    let first = consumer(&pool, &group)
        .handler(Recorder::<ShutdownEvent>::new().paced(Duration::from_millis(1)))
        .batch_size(100)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            first.counts().processed >= 300
        })
        .await
    );
    first.shutdown().await.unwrap();
    let applied = effect_count(&pool).await as u64;
    assert!((300..N).contains(&applied), "stopped mid-stream: {applied}");

    let second = consumer(&pool, &group)
        .handler(Recorder::<ShutdownEvent>::new())
        .spawn()
        .unwrap();
    let rest = N - applied;
    assert!(
        eventually(Duration::from_secs(30), || async {
            second.counts().processed == rest
        })
        .await,
        "{:?}",
        second.counts()
    );
    // Nothing beyond the rest arrives late.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let counts = second.counts();
    second.shutdown().await.unwrap();
    assert_eq!(
        counts.duplicates, 0,
        "no processed message was read again: {counts:?}"
    );
    assert_eq!(counts.received, rest);
    assert!(effects_of(&pool, &ids).await.iter().all(|n| *n == 1));

    // A third consumer of the group reads nothing old: markers produced
    // after it started are all it receives.
    let third = consumer(&pool, &group)
        .handler(Recorder::<ShutdownEvent>::new())
        .spawn()
        .unwrap();
    let marks = markers(topic).await;
    assert!(all_applied(&pool, &marks).await, "{:?}", third.counts());
    let counts = third.counts();
    third.shutdown().await.unwrap();
    assert_eq!(
        counts.received, PARTITIONS as u64,
        "only the markers: {counts:?}"
    );
}

test_event!(HeldKeyEvent, "consumer-test-failing-key");
test_event!(HeldKeyInboxEvent, "consumer-test-failing-key-inbox");
test_event!(HeldKeyProgressEvent, "consumer-test-failing-key-progress");

/// A failing event holds back its key alone, in both modes: on one
/// partition, four keys interleaved, the fifth message (key k0) fails until
/// the handler is fixed. Meanwhile every event of the other three keys is
/// applied, and none of k0's after the failing one; then k0's are applied
/// after it, in order. The counts agree with the tables. In the progress
/// mode (`progress`), only the rows that waited are marked processed: the
/// others are passed by positions.
async fn a_failing_event_holds_back_only_its_key<E: TestEvent>(
    pool: PgPool,
    mode: Mode,
    progress: bool,
) {
    init_tracing();
    let topic = E::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let (messages, ids) = events(40, 4);
    let mut messages: Vec<TestMessage> = messages.into_iter().map(|m| m.on_partition(0)).collect();
    let poison = ids[4];
    messages[4] = TestMessage::event(
        poison,
        "OrderPlaced",
        "k0",
        serde_json::json!({ "key": "k0", "seq": 4, "fail": true }),
    )
    .on_partition(0);
    produce(&brokers(), topic, &messages).await;

    let group = unique_topic("held-key");
    if progress {
        outbox_runtime::inbox::progress::enable(&pool, &group)
            .await
            .unwrap();
    }
    let recorder = Recorder::<E>::new();
    let failing = recorder.failing.clone();
    let handle = consumer(&pool, &group)
        .mode(mode)
        .handler(recorder)
        .max_attempts(10_000)
        .spawn()
        .unwrap();
    // Every event of k1, k2, k3 (30), and k0's before the failing one.
    let others: Vec<Uuid> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 4 != 0 || *i < 4)
        .map(|(_, id)| *id)
        .collect();
    let behind: Vec<Uuid> = ids.iter().skip(4).step_by(4).copied().collect();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &others).await.iter().all(|n| *n == 1)
                && handle.counts().handler_failures >= 3
        })
        .await,
        "the other keys were not applied while k0 failed: {:?}",
        handle.counts()
    );
    assert_eq!(
        effects_of(&pool, &behind).await,
        vec![0; behind.len()],
        "k0's failing event and those behind it wait"
    );
    assert_eq!(handle.counts().dead_lettered, 0);

    failing.store(false, Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &ids).await.iter().all(|n| *n == 1)
        })
        .await,
        "k0 was not applied once fixed: {:?}",
        handle.counts()
    );
    // The counts once every task has ended (a round's counts follow its
    // commit).
    let stats = handle.stats();
    handle.shutdown().await.unwrap();
    let counts = stats.snapshot();
    // Per-key order: each key's effects in the order of its events.
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key, seq FROM effect ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    for key in ["k0", "k1", "k2", "k3"] {
        let seqs: Vec<i64> = rows
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, s)| *s)
            .collect();
        assert!(seqs.is_sorted(), "{key} out of order: {seqs:?}");
        assert_eq!(seqs.len(), 10);
    }
    // The counts agree with the tables.
    let scalar = |sql: &'static str| {
        let (pool, group) = (pool.clone(), group.clone());
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .bind(group)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let processed = scalar("SELECT count(*) FROM processed_event WHERE consumer = $1").await;
    let stored = scalar("SELECT count(*) FROM inbox_event WHERE consumer = $1").await;
    let letters = scalar("SELECT count(*) FROM dead_letter WHERE consumer = $1").await;
    assert_eq!(counts.processed, 40, "{counts:?}");
    assert_eq!(processed, 40);
    assert_eq!(counts.duplicates, 0, "{counts:?}");
    assert_eq!(counts.stored as i64, stored, "{counts:?}");
    let expected_stored = if mode == Mode::Dedup {
        behind.len()
    } else {
        40
    };
    assert_eq!(
        stored, expected_stored as i64,
        "set aside: the failing event and k0's behind it"
    );
    assert_eq!(counts.dead_lettered as i64, letters);
    assert_eq!(letters, 0);
    assert_eq!(counts.received, 40, "nothing read twice: {counts:?}");
    if progress {
        let marked = scalar(
            "SELECT count(*) FROM inbox_event WHERE consumer = $1 AND processed_at IS NOT NULL",
        )
        .await;
        assert_eq!(
            marked,
            behind.len() as i64,
            "only the failing event and k0's behind it are marked"
        );
        let positions = scalar("SELECT count(*) FROM inbox_progress WHERE consumer = $1").await;
        assert!(positions > 0, "no position recorded");
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_failing_event_holds_back_only_its_key_in_dedup_mode(pool: PgPool) {
    a_failing_event_holds_back_only_its_key::<HeldKeyEvent>(pool, Mode::Dedup, false).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_failing_event_holds_back_only_its_key_in_inbox_mode(pool: PgPool) {
    a_failing_event_holds_back_only_its_key::<HeldKeyInboxEvent>(pool, Mode::Inbox, false).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_failing_event_holds_back_only_its_key_in_the_inbox_progress_mode(pool: PgPool) {
    a_failing_event_holds_back_only_its_key::<HeldKeyProgressEvent>(pool, Mode::Inbox, true).await;
}

test_event!(ProgressEvent, "consumer-test-inbox-progress");

/// The inbox processor in the progress mode, switched to with stored
/// events pending: 120 events stored by a store-only consumer (the default
/// mode's way), the mode enabled, 120 more produced, the consumer stopped
/// mid-stream and started again. Every event is applied once, each key in
/// order, and no row is marked processed: the positions pass them.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_inbox_progress_mode_applies_each_event_once_across_a_switch_and_a_restart(
    pool: PgPool,
) {
    init_tracing();
    let topic = ProgressEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let (messages, ids) = events(240, 8);
    let on = |m: Vec<TestMessage>| -> Vec<TestMessage> {
        m.into_iter()
            .enumerate()
            .map(|(i, m)| m.on_partition((i % 8 % PARTITIONS as usize) as i32))
            .collect()
    };
    let (first, second) = messages.split_at(120);
    produce(&brokers(), topic, &on(first.to_vec())).await;
    let group = unique_topic("inbox-progress");
    let store_only = consumer(&pool, &group)
        .mode(Mode::Inbox)
        .processors(0)
        .handler(Recorder::<ProgressEvent>::new())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            store_only.counts().stored >= 120
        })
        .await,
        "{:?}",
        store_only.counts()
    );
    store_only.shutdown().await.unwrap();
    assert_eq!(effect_count(&pool).await, 0);

    outbox_runtime::inbox::progress::enable(&pool, &group)
        .await
        .unwrap();
    assert_eq!(pending(&pool, &group).await, 120, "the stored rows wait");
    produce(&brokers(), topic, &on(second.to_vec())).await;
    let paced = consumer(&pool, &group)
        .mode(Mode::Inbox)
        .processor_batch_size(10)
        .handler(Recorder::<ProgressEvent>::new().paced(Duration::from_millis(5)))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effect_count(&pool).await >= 60
        })
        .await,
        "{:?}",
        paced.counts()
    );
    paced.shutdown().await.unwrap();
    let halfway = effect_count(&pool).await;
    assert!(halfway < 240, "stopped mid-stream: {halfway}");

    let again = consumer(&pool, &group)
        .mode(Mode::Inbox)
        .handler(Recorder::<ProgressEvent>::new())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &ids).await.iter().all(|n| *n >= 1)
        })
        .await,
        "{:?}",
        again.counts()
    );
    again.shutdown().await.unwrap();
    assert_eq!(
        effects_of(&pool, &ids).await,
        vec![1; ids.len()],
        "each event applied once"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key, seq FROM effect ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    for k in 0..8 {
        let key = format!("k{k}");
        let seqs: Vec<i64> = rows
            .iter()
            .filter(|(r, _)| *r == key)
            .map(|(_, s)| *s)
            .collect();
        assert!(seqs.is_sorted(), "{key} out of order: {seqs:?}");
    }
    let (marked, queued): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE processed_at IS NOT NULL),
                count(*) FILTER (WHERE NOT processed)
         FROM inbox_event WHERE consumer = $1",
    )
    .bind(&group)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(marked, 0, "no row marked processed");
    assert_eq!(queued, 0, "no row in the default mode's queue");
    assert_eq!(pending(&pool, &group).await, 0, "none waits");

    // The cleanup deletes the old rows the positions passed, and not a row
    // stored since.
    let mut conn = pool.acquire().await.unwrap();
    let since = store_row(&mut conn, &group, topic, "k0", 10_000).await;
    sqlx::query(
        "UPDATE inbox_event SET received_at = now() - interval '30 days' WHERE consumer = $1",
    )
    .bind(&group)
    .execute(&pool)
    .await
    .unwrap();
    let report = outbox_runtime::cleanup::cleanup(
        &pool,
        &outbox_runtime::cleanup::Retention::new(Duration::from_secs(8 * 86_400)),
    )
    .await
    .unwrap();
    assert_eq!(report.inbox_events, 240, "{report:?}");
    let left: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM inbox_event WHERE consumer = $1")
            .bind(&group)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(left, vec![since]);
    assert_eq!(
        pending(&pool, &group).await,
        1,
        "the row stored since waits"
    );
}

/// The group's pending inbox rows, as `outbox status` and the console
/// count them.
async fn pending(pool: &PgPool, group: &str) -> i64 {
    outbox_runtime::inbox::groups::groups(pool)
        .await
        .unwrap()
        .into_iter()
        .find(|g| g.group == group)
        .map_or(0, |g| g.inbox_pending)
}

test_event!(LateEvent, "consumer-test-inbox-progress-late");

/// Stores an event of `key` for `group` on partition 0 as the progress
/// mode's ingest does, on `conn`.
async fn store_row(
    conn: &mut sqlx::PgConnection,
    group: &str,
    topic: &str,
    key: &str,
    offset: i64,
) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO inbox_event (event_id, payload, consumer, topic, "partition",
               "offset", partition_key, event_type, event_version, headers, processed)
           VALUES ($1, $2, $3, $4, 0, $5, $6, 'OrderPlaced', 1, '{}', true)"#,
    )
    .bind(id)
    .bind(serde_json::json!({ "key": key, "seq": offset }))
    .bind(group)
    .bind(topic)
    .bind(offset)
    .bind(key)
    .execute(conn)
    .await
    .unwrap();
    id
}

/// The progress mode's windows do not pass over a row whose transaction
/// commits after later rows of its partition: a row stored by a
/// transaction left open (its `seq` drawn first) waits for its commit while
/// a row stored after it is applied, and is then applied too, once.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_inbox_progress_mode_applies_a_row_committed_late_once(pool: PgPool) {
    init_tracing();
    let topic = LateEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let group = unique_topic("inbox-progress-late");
    outbox_runtime::inbox::progress::enable(&pool, &group)
        .await
        .unwrap();
    let mut late = pool.begin().await.unwrap();
    let first = store_row(&mut late, &group, topic, "a", 0).await;
    let mut conn = pool.acquire().await.unwrap();
    let second = store_row(&mut conn, &group, topic, "b", 1).await;
    let handle = consumer(&pool, &group)
        .mode(Mode::Inbox)
        .processor_poll_interval(Duration::from_millis(20))
        .handler(Recorder::<LateEvent>::new())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(20), || async {
            effects_of(&pool, &[second]).await == vec![1]
        })
        .await,
        "{:?}",
        handle.counts()
    );
    // Rounds pass while the first row's transaction is open.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(effects_of(&pool, &[first]).await, vec![0]);
    late.commit().await.unwrap();
    assert!(
        eventually(Duration::from_secs(20), || async {
            effects_of(&pool, &[first]).await == vec![1]
        })
        .await,
        "the row committed late was passed over: {:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();
    assert_eq!(effects_of(&pool, &[first, second]).await, vec![1, 1]);
}

test_event!(BatchFailEvent, "consumer-test-failures-in-a-batch");

/// Inbox mode: the failures of a claimed batch are settled in its
/// transaction, so each good event's handlers run at most twice however many
/// events of the batch fail. (Each failure used to roll the whole batch back,
/// and the next round ran it all again: here 6 runs of each of the first ten
/// events.)
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn failures_in_a_claimed_batch_rerun_each_good_event_at_most_once(pool: PgPool) {
    init_tracing();
    let topic = BatchFailEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let mut messages = Vec::new();
    let mut good = Vec::new();
    let mut event = |key: &str, seq: usize, fail: bool| {
        let id = Uuid::now_v7();
        messages.push(
            TestMessage::event(
                id,
                "OrderPlaced",
                key,
                serde_json::json!({ "key": key, "seq": seq, "fail": fail }),
            )
            .on_partition(0),
        );
        id
    };
    // Ten good events of k0, the failing first event of k1..k5, ten more of k0.
    for seq in 0..10 {
        good.push(event("k0", seq, false));
    }
    for k in 1..=5 {
        event(&format!("k{k}"), 0, true);
    }
    for seq in 10..20 {
        good.push(event("k0", seq, false));
    }
    produce(&brokers(), topic, &messages).await;

    let group = unique_topic("batch-failures");
    let recorder = Recorder::<BatchFailEvent>::new();
    let calls = recorder.calls.clone();
    let handle = consumer(&pool, &group)
        .mode(Mode::Inbox)
        .handler(recorder)
        .max_attempts(100)
        // One attempt each within the test.
        .retry_backoff(Duration::from_secs(120), Duration::from_secs(120))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &good).await.iter().all(|n| *n == 1)
                && handle.counts().handler_failures >= 5
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.handler_failures, 5, "{counts:?}");
    assert_eq!(counts.processed, 20, "{counts:?}");
    let calls = calls.load(Ordering::SeqCst);
    assert!(
        calls <= 5 + 2 * good.len(),
        "{calls} handler calls for 5 failing and {} good events",
        good.len()
    );
    // Each failure is recorded on its row: one attempt, retried later.
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inbox_event
         WHERE consumer = $1 AND attempts = 1 AND NOT processed AND next_attempt_at > now()
           AND last_error LIKE '%payment provider refused%'",
    )
    .bind(&group)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(waiting, 5);
}

/// Refuses events marked `fail` (while `failing` is on) before it touches
/// the transaction, as a validation error does; records the others in
/// `effect`. Counts its calls per event.
struct Refuser<E> {
    failing: Arc<AtomicBool>,
    calls: Arc<std::sync::Mutex<std::collections::HashMap<Uuid, usize>>>,
    _event: PhantomData<fn() -> E>,
}

impl<E: TestEvent> InboxHandler for Refuser<E> {
    type Event = E;
    const NAME: &'static str = "refuse_or_record";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let event_id = ctx.incoming().event_id;
            *self.calls.lock().unwrap().entry(event_id).or_default() += 1;
            if event.fail() && self.failing.load(Ordering::SeqCst) {
                return Err(format!("order {} refused", event.key()).into());
            }
            sqlx::query("INSERT INTO effect (event_id, key, seq) VALUES ($1, $2, $3)")
                .bind(event_id)
                .bind(event.key())
                .bind(event.seq() as i64)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}

test_event!(RefusedDedupEvent, "consumer-test-refused-dedup");
test_event!(RefusedInboxEvent, "consumer-test-refused-inbox");

/// A handler that fails before it touches the transaction (a refusal)
/// costs no rollback, in either mode: every other event of the batch runs
/// once, not again after a savepoint; the refused events and the later
/// events of their keys wait (their dedup rows taken out again), and are
/// applied once, in key order, when the handler accepts them.
async fn a_refusal_costs_the_other_events_nothing<E: TestEvent>(pool: PgPool, mode: Mode) {
    init_tracing();
    let topic = E::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let mut messages = Vec::new();
    let (mut good, mut waiting) = (Vec::new(), Vec::new());
    let mut event = |key: &str, seq: usize, fail: bool| {
        let id = Uuid::now_v7();
        messages.push(
            TestMessage::event(
                id,
                "OrderPlaced",
                key,
                serde_json::json!({ "key": key, "seq": seq, "fail": fail }),
            )
            .on_partition(0),
        );
        id
    };
    for seq in 0..10 {
        good.push(event("k0", seq, false));
    }
    for k in 1..=5 {
        waiting.push(event(&format!("k{k}"), 0, true));
    }
    for seq in 10..20 {
        good.push(event("k0", seq, false));
        // Behind the refused first event of k1: waits with it.
        waiting.push(event("k1", seq, false));
    }
    produce(&brokers(), topic, &messages).await;

    let group = unique_topic("refusals");
    let refuser = Refuser::<E> {
        failing: Arc::new(AtomicBool::new(true)),
        calls: Arc::default(),
        _event: PhantomData,
    };
    let (failing, calls) = (refuser.failing.clone(), refuser.calls.clone());
    let handle = consumer(&pool, &group)
        .mode(mode)
        .handler(refuser)
        .max_attempts(100)
        .retry_backoff(Duration::from_secs(120), Duration::from_secs(120))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &good).await.iter().all(|n| *n == 1)
                && handle.counts().handler_failures >= 5
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    assert_eq!(counts.handler_failures, 5, "{counts:?}");
    {
        let calls = calls.lock().unwrap();
        let twice: Vec<usize> = good
            .iter()
            .filter_map(|id| calls.get(id).copied())
            .filter(|n| *n != 1)
            .collect();
        assert!(
            twice.is_empty(),
            "each good event's handler ran once: {twice:?}"
        );
        for id in &waiting[5..] {
            assert!(!calls.contains_key(id), "an event behind a refusal waits");
        }
    }
    let dedup_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_event WHERE event_id = ANY($1)")
            .bind(&waiting)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(dedup_rows, 0, "no dedup row for an event not applied");

    // Accepted now: the waiting events are applied once, each key in order.
    failing.store(false, Ordering::SeqCst);
    let retry_now =
        "UPDATE inbox_event SET next_attempt_at = now() WHERE consumer = $1 AND NOT processed";
    sqlx::query(retry_now)
        .bind(&group)
        .execute(&pool)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &waiting).await.iter().all(|n| *n == 1)
        })
        .await,
        "the waiting events applied: {:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();
    assert!(effects_of(&pool, &good).await.iter().all(|n| *n == 1));
    let k1: Vec<i64> = sqlx::query_scalar("SELECT seq FROM effect WHERE key = 'k1' ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut sorted = k1.clone();
    sorted.sort();
    assert_eq!(k1, sorted, "k1 in order");
    assert_eq!(k1.len(), 11);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_refusal_costs_the_other_events_nothing_in_dedup_mode(pool: PgPool) {
    a_refusal_costs_the_other_events_nothing::<RefusedDedupEvent>(pool, Mode::Dedup).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_refusal_costs_the_other_events_nothing_in_inbox_mode(pool: PgPool) {
    a_refusal_costs_the_other_events_nothing::<RefusedInboxEvent>(pool, Mode::Inbox).await;
}

test_event!(FailEvent, "consumer-test-failing-handler");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_failing_handler_is_dead_lettered_after_max_attempts_and_retry_redrives_it(pool: PgPool) {
    init_tracing();
    let topic = FailEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let (mut messages, ids) = events(50, 1); // one key: one partition
    let poison = ids[10];
    messages[10] = TestMessage::event(
        poison,
        "OrderPlaced",
        "k0",
        serde_json::json!({ "key": "k0", "seq": 10, "fail": true }),
    );
    produce(&brokers(), topic, &messages).await;

    let group = unique_topic("failing");
    let recorder = Recorder::<FailEvent>::new();
    let (failing, calls) = (recorder.failing.clone(), recorder.calls.clone());
    let handle = consumer(&pool, &group)
        .handler(recorder)
        .max_attempts(3)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed == 49 && c.dead_lettered == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    assert_eq!(counts.handler_failures, 3);
    // Its effects were rolled back with each attempt; the others applied once.
    let effects = effects_of(&pool, &ids).await;
    assert_eq!(effects[10], 0);
    assert!(effects.iter().enumerate().all(|(i, n)| i == 10 || *n == 1));
    let letters = dead_letter::list(&pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.reason, "handler_failed");
    assert_eq!(letter.event_id, Some(poison));
    assert_eq!(letter.handler.as_deref(), Some("record_effect"));
    assert_eq!(letter.attempts, 3);
    assert_eq!(letter.status, "dead");
    assert!(
        letter.error.contains("payment provider refused order k0"),
        "{}",
        letter.error
    );
    assert_eq!(letter.headers["event_id"], poison.to_string());
    // The payload as the inbox stored it (the failing event was set aside
    // there, behind nothing; k0's later events behind it).
    let payload: serde_json::Value =
        serde_json::from_str(letter.payload.as_deref().unwrap_or_default()).unwrap();
    assert_eq!(payload["fail"], true);

    // Re-driven (what `outbox dead-letters retry` does) once the handler is
    // fixed.
    failing.store(false, Ordering::SeqCst);
    let listed = dead_letter::list(&pool, &DeadLetterFilter::new())
        .await
        .unwrap();
    assert_eq!(listed[0].reason, "handler_failed");
    let marked = dead_letter::retry(&pool, None, Some(&[letter.id]))
        .await
        .unwrap();
    assert_eq!(marked, 1);
    assert!(
        eventually(Duration::from_secs(10), || async {
            handle.counts().redriven == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    assert_eq!(effects_of(&pool, &[poison]).await, vec![1]);
    let calls_before = calls.load(Ordering::SeqCst);
    // Retrying a resolved dead letter does nothing.
    assert_eq!(dead_letter::retry(&pool, None, None).await.unwrap(), 0);
    let resolved = dead_letter::list(&pool, &DeadLetterFilter::new().statuses(["resolved"]))
        .await
        .unwrap();
    assert_eq!(resolved.len(), 1);
    // Proof that a re-drive pass ran after that: another dead letter of the
    // group, marked for retry, is re-driven; the pass that takes it would
    // have taken the resolved one too had it been marked.
    let other = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO dead_letter (consumer, topic, "partition", "offset", key, event_id,
               event_type, headers, payload, reason, error, handler, attempts, status,
               retry_requested_at)
           SELECT consumer, topic, "partition", "offset" + 1000000, key, $2, event_type,
                  headers || jsonb_build_object('event_id', $2::text), payload, reason, error,
                  handler, attempts, 'retry', now()
           FROM dead_letter WHERE id = $1"#,
    )
    .bind(letter.id)
    .bind(other)
    .execute(&pool)
    .await
    .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            handle.counts().redriven == 2
        })
        .await,
        "the other dead letter is re-driven: {:?}",
        handle.counts()
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        calls_before + 1,
        "only the other one ran: the resolved one was not run again"
    );
    assert_eq!(effects_of(&pool, &[other]).await, vec![1]);
    handle.shutdown().await.unwrap();
    assert_eq!(effects_of(&pool, &[poison]).await, vec![1]);
    assert_eq!(dead_letter::discard(&pool, None, None).await.unwrap(), 2);
}

test_event!(BadEvent, "consumer-test-malformed");

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn malformed_messages_are_dead_lettered_with_their_reason_and_block_nothing(pool: PgPool) {
    init_tracing();
    let topic = BadEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let good = |seq: u64| {
        TestMessage::event(
            Uuid::now_v7(),
            "OrderPlaced",
            "k",
            serde_json::json!({ "key": "k", "seq": seq }),
        )
    };
    let first = good(0);
    let last = good(9);
    // Everything on one key, so on one partition: nothing may block it.
    let messages = vec![
        first.clone(),
        good(1).payload("{\"key\": \"k\", \"seq\": "),
        good(2).without_header("event_id"),
        good(3).header("event_id", "not-a-uuid"),
        good(4).header("event_type", "OrderExploded"),
        good(5).payload(r#"{"order": "k", "amount": 12}"#),
        good(6).payload(format!(
            r#"{{"key": "k", "seq": 6, "pad": "{}"}}"#,
            "x".repeat(2_000)
        )),
        good(7).header("event_type", "OrderViewed"),
        good(8).payload(vec![0xff, 0xfe, 0x00]),
        last.clone(),
    ];
    produce(&brokers(), topic, &messages).await;
    let group = unique_topic("malformed");
    let handle = consumer(&pool, &group)
        .handler(Recorder::<BadEvent>::new())
        .ignore_event_type(topic, "OrderViewed")
        .max_payload_bytes(1_000)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed == 2 && c.dead_lettered == 7 && c.ignored == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    assert!(!handle.is_finished(), "the consumer is alive");
    // Later good events still flow.
    let after = good(10);
    produce(&brokers(), topic, std::slice::from_ref(&after)).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            handle.counts().processed == 3
        })
        .await
    );
    handle.shutdown().await.unwrap();

    let letters = dead_letter::list(&pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap();
    let reasons: Vec<(i64, &str)> = letters
        .iter()
        .map(|l| (l.offset, l.reason.as_str()))
        .collect();
    // Offsets are per partition: all on one, 0..=9 in produce order.
    assert_eq!(
        reasons,
        vec![
            (1, "not_json"),
            (2, "no_event_id"),
            (3, "no_event_id"),
            (4, "unknown_event_type"),
            (5, "payload_mismatch"),
            (6, "oversized"),
            (8, "not_json"),
        ]
    );
    let by_offset = |o: i64| letters.iter().find(|l| l.offset == o).unwrap();
    assert!(by_offset(3).error.contains("not-a-uuid"));
    assert!(by_offset(4).error.contains("OrderExploded"));
    assert!(by_offset(6).error.contains("1000 bytes"));
    assert_eq!(by_offset(2).event_id, None);
    assert_eq!(by_offset(4).key.as_deref(), Some("k"));
    assert_eq!(effect_count(&pool).await, 3);

    // Offsets were committed past the malformed messages: nothing is read
    // again, only markers produced after the next consumer started.
    let again = consumer(&pool, &group)
        .handler(Recorder::<BadEvent>::new())
        .ignore_event_type(topic, "OrderViewed")
        .spawn()
        .unwrap();
    let marks = markers(topic).await;
    assert!(all_applied(&pool, &marks).await, "{:?}", again.counts());
    let counts = again.counts();
    again.shutdown().await.unwrap();
    assert_eq!(
        counts.received, PARTITIONS as u64,
        "only the markers: {counts:?}"
    );
}

// ---- Follow-up events --------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PaymentRequested {
    order: String,
}

impl DomainEvent for PaymentRequested {
    const TOPIC: &'static str = "consumer-test-payments";
    const AGGREGATE_TYPE: &'static str = "Payment";
    const EVENT_TYPES: &'static [&'static str] = &["PaymentRequested"];
    fn event_type(&self) -> &'static str {
        "PaymentRequested"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.order.clone()
    }
}

test_event!(FollowEvent, "consumer-test-follow-up");

/// Requests a payment for each order; fails (after recording it) for
/// orders marked `fail`.
struct RequestPayment;

impl InboxHandler for RequestPayment {
    type Event = FollowEvent;
    const NAME: &'static str = "request_payment";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: FollowEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            ctx.record(PaymentRequested {
                order: event.key.clone(),
            });
            if event.fail {
                return Err("card declined".into());
            }
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_follow_up_event_commits_with_the_handling_and_not_without_it(pool: PgPool) {
    init_tracing();
    let topic = FollowEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    let (ok_id, failing_id) = (Uuid::now_v7(), Uuid::now_v7());
    let correlation = Uuid::now_v7();
    let messages = vec![
        TestMessage::event(
            ok_id,
            "OrderPlaced",
            "order-1",
            serde_json::json!({ "key": "order-1", "seq": 1 }),
        )
        .header("correlation_id", &correlation.to_string())
        .header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
        TestMessage::event(
            failing_id,
            "OrderPlaced",
            "order-2",
            serde_json::json!({ "key": "order-2", "seq": 2, "fail": true }),
        ),
    ];
    produce(&brokers(), topic, &messages).await;
    let group = unique_topic("follow");
    let handle = consumer(&pool, &group)
        .handler(RequestPayment)
        .max_attempts(2)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed == 1 && c.dead_lettered == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();

    let rows: Vec<(String, String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT topic, event_type, partition_key, headers FROM outbox_event ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows.len(),
        1,
        "only the successful handling wrote its event"
    );
    let (topic, event_type, key, headers) = &rows[0];
    assert_eq!(topic, "consumer-test-payments");
    assert_eq!(event_type, "PaymentRequested");
    assert_eq!(key, "order-1");
    assert_eq!(headers["causation_id"], ok_id.to_string());
    assert_eq!(headers["correlation_id"], correlation.to_string());
    // The same trace, continued by the handling: same trace id, new span.
    let follow: outbox_core::TraceParent =
        headers["traceparent"].as_str().unwrap().parse().unwrap();
    assert_eq!(follow.trace_id(), "0af7651916cd43dd8448eb211c80319c");
    assert_ne!(follow.parent_id(), "b7ad6b7169203331");
    // The handled event and its follow-up committed together.
    let processed: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM processed_event WHERE consumer = $1")
            .bind(&group)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(processed, vec![ok_id]);
    let letter = &dead_letter::list(&pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap()[0];
    assert_eq!(letter.event_id, Some(failing_id));
    assert_eq!(letter.error, "card declined");
}

test_event!(KeyedEvent, "consumer-test-follow-up-keys");

/// Records a follow-up event keyed by the handled event's `key`; on the
/// event with `seq` 2 it first signals `started` and waits a second (so the
/// test can commit a writer in between).
struct FollowUpByKey {
    started: Arc<AtomicBool>,
}

impl InboxHandler for FollowUpByKey {
    type Event = KeyedEvent;
    const NAME: &'static str = "follow_up_by_key";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: KeyedEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            ctx.record(PaymentRequested {
                order: event.key.clone(),
            });
            if event.seq == 2 {
                self.started.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok(())
        })
    }
}

/// The follow-ups of a consumer transaction and an application's commit
/// write to the same keys: they must not deadlock on the outbox's per-key
/// locks. Here the transaction handles e1 (follow-up of key B) then e2
/// (follow-up of key A, bucket A < bucket B); while e2's handler runs, a
/// Unit of Work writes A and B. Writing each handler's follow-ups as it
/// returned took B, then (after the writer took A and queued for B) A: a
/// deadlock, and PostgreSQL aborted the writer after `deadlock_timeout`.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn follow_ups_and_application_commits_do_not_deadlock_on_key_locks(pool: PgPool) {
    init_tracing();
    let topic = KeyedEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    // Two keys in different lock buckets, `low` in the lower one.
    let mut by_bucket: Vec<(i32, String)> = Vec::new();
    for i in 0.. {
        let key = format!("key-{i}");
        let bucket: i32 = sqlx::query_scalar("SELECT hashtext($1) & 255")
            .bind(&key)
            .fetch_one(&pool)
            .await
            .unwrap();
        if by_bucket.iter().all(|(b, _)| *b != bucket) {
            by_bucket.push((bucket, key));
        }
        if by_bucket.len() == 2 {
            break;
        }
    }
    by_bucket.sort();
    let (low, high) = (by_bucket[0].1.clone(), by_bucket[1].1.clone());

    let (e1, e2) = (Uuid::now_v7(), Uuid::now_v7());
    let messages = vec![
        TestMessage::event(
            e1,
            "OrderPlaced",
            "order-x",
            serde_json::json!({ "key": high, "seq": 1 }),
        ),
        TestMessage::event(
            e2,
            "OrderPlaced",
            "order-x",
            serde_json::json!({ "key": low, "seq": 2 }),
        ),
    ];
    produce(&brokers(), topic, &messages).await;
    let started = Arc::new(AtomicBool::new(false));
    let group = unique_topic("follow-keys");
    let handle = consumer(&pool, &group)
        .handler(FollowUpByKey {
            started: started.clone(),
        })
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            started.load(Ordering::SeqCst)
        })
        .await,
        "e2's handler started"
    );
    // e1's handler has returned and e2's is running: the writer commits
    // events of both keys now.
    let mut uow = outbox_core::UnitOfWork::begin(&pool).await.unwrap();
    for key in [&low, &high] {
        uow.record(PaymentRequested { order: key.clone() });
    }
    let committed = uow.commit().await;
    assert!(
        committed.is_ok(),
        "the writer's commit failed: {:?}",
        committed.err()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            handle.counts().processed == 2
        })
        .await,
        "{:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT partition_key FROM outbox_event ORDER BY partition_key, id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut expected = vec![low.clone(), low, high.clone(), high];
    expected.sort();
    assert_eq!(keys, expected, "both follow-ups and both writes committed");
}

test_event!(ReceiptEvent, "consumer-test-follow-up-dup");

/// A follow-up event whose id is chosen by the handler.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Receipt {
    order: String,
    id: Uuid,
}

impl DomainEvent for Receipt {
    const TOPIC: &'static str = "consumer-test-receipts";
    const AGGREGATE_TYPE: &'static str = "Receipt";
    const EVENT_TYPES: &'static [&'static str] = &["ReceiptIssued"];
    fn event_type(&self) -> &'static str {
        "ReceiptIssued"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.order.clone()
    }
    fn event_id(&self) -> Option<Uuid> {
        Some(self.id)
    }
}

/// Issues a receipt for every order, always with the same event id (a bug
/// a handler can have): only the first can be written.
struct IssueReceipt;

const RECEIPT_ID: Uuid = Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_0001);

impl InboxHandler for IssueReceipt {
    type Event = ReceiptEvent;
    const NAME: &'static str = "issue_receipt";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: ReceiptEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            ctx.record(Receipt {
                order: event.key.clone(),
                id: RECEIPT_ID,
            });
            Ok(())
        })
    }
}

/// The follow-ups of a batch are written with one statement at its end; when
/// it fails, the event whose follow-ups broke it is found and fails alone
/// (retried, then dead-lettered with the database's error); the events
/// before it commit.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_follow_up_that_cannot_be_written_fails_only_its_event(pool: PgPool) {
    init_tracing();
    let topic = ReceiptEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    let messages: Vec<TestMessage> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            TestMessage::event(
                *id,
                "OrderPlaced",
                "order-r",
                serde_json::json!({ "key": format!("order-{i}"), "seq": i }),
            )
        })
        .collect();
    produce(&brokers(), topic, &messages).await;
    let group = unique_topic("follow-dup");
    let handle = consumer(&pool, &group)
        .handler(IssueReceipt)
        .max_attempts(2)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed == 1 && c.dead_lettered == 2
        })
        .await,
        "{:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();

    let receipts: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT event_id, partition_key FROM outbox_event")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(receipts, vec![(RECEIPT_ID, "order-0".to_owned())]);
    let processed: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM processed_event WHERE consumer = $1")
            .bind(&group)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(processed, vec![ids[0]]);
    let letters = dead_letter::list(&pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap();
    let mut lettered: Vec<Uuid> = letters.iter().filter_map(|l| l.event_id).collect();
    lettered.sort();
    assert_eq!(lettered, ids[1..].to_vec());
    for letter in &letters {
        assert_eq!(letter.handler.as_deref(), Some("issue_receipt"));
        assert!(
            letter
                .error
                .contains("writing the handler's follow-up events failed")
                && letter.error.contains("duplicate key"),
            "{}",
            letter.error
        );
    }
}

// ---- Configuration -----------------------------------------------------------

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn invalid_configuration_is_a_clear_error(pool: PgPool) {
    let err = Consumer::builder(pool.clone())
        .handler(RequestPayment)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("group"), "{err}");
    let err = Consumer::builder(pool.clone())
        .group("g")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("no handler"), "{err}");
    let err = Consumer::builder(pool.clone())
        .group("g")
        .handler(RequestPayment)
        .kafka_setting("enable.auto.commit", "true")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("enable.auto.commit"), "{err}");
    let err = Consumer::builder(pool.clone())
        .group("g")
        .handler(RequestPayment)
        .ignore_event_type("elsewhere", "X")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("elsewhere"), "{err}");
    let consumer = Consumer::builder(pool)
        .group("g")
        .handler(RequestPayment)
        .mode(Mode::Inbox)
        .kafka_setting("no.such.setting", "1")
        .build()
        .unwrap();
    assert_eq!(consumer.config().mode, Mode::Inbox);
    let err = consumer
        .run(outbox_runtime::CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no.such.setting"), "{err}");
}

// ---- A panicking handler ---------------------------------------------------------

test_event!(PanicEvent, "consumer-test-panic");

/// Panics on events marked `fail`.
struct Panicky;

impl InboxHandler for Panicky {
    type Event = PanicEvent;
    const NAME: &'static str = "panicky";

    fn handle<'a, 'c>(
        &'a self,
        _ctx: &'a mut HandlerContext<'c>,
        event: PanicEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            if event.fail {
                panic!("unexpected state for {}", event.key);
            }
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_panicking_handler_is_a_failing_handler_and_the_consumer_goes_on(pool: PgPool) {
    init_tracing();
    let topic = PanicEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    let (mut messages, ids) = events(20, 1);
    messages[3] = TestMessage::event(
        ids[3],
        "OrderPlaced",
        "k0",
        serde_json::json!({ "key": "k0", "seq": 3, "fail": true }),
    );
    produce(&brokers(), topic, &messages).await;
    let group = unique_topic("panic");
    let handle = consumer(&pool, &group)
        .handler(Panicky)
        .max_attempts(2)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed == 19 && c.dead_lettered == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    assert!(!handle.is_finished());
    handle.shutdown().await.unwrap();
    let letter = &dead_letter::list(&pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap()[0];
    assert_eq!(letter.event_id, Some(ids[3]));
    assert_eq!(letter.error, "handler panicked: unexpected state for k0");
}
