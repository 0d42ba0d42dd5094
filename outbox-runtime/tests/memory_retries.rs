//! Dedup mode with `memory_retries`: a failing event's first retries held
//! in the consumer's memory with the later events of its key, the other
//! keys going on, nothing written to `inbox_event`, and the partition's
//! committed offset held at the waiting event — so that a consumer stopped
//! or crashed meanwhile loses nothing. Out of attempts, the event is
//! dead-lettered and its key goes on; a retry due after the window is set
//! aside in `inbox_event` with its attempts. Real PostgreSQL, real broker;
//! each test has its own fixed topic, emptied at its start.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, ConsumerBuilder};
use sqlx::PgPool;
use uuid::Uuid;

/// The event of `messages` that fails (key k0): the fifth.
const FAILING_SEQ: u64 = 4;

/// Writes each event's effect, then fails the event `FAILING_SEQ` while
/// `failing` is on (having written: its segment is taken back).
struct Recorder<E> {
    failing: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
    /// The events that fail (by `seq`).
    fails: fn(u64) -> bool,
    _event: std::marker::PhantomData<fn() -> E>,
}

impl<E> Recorder<E> {
    fn new() -> Self {
        Self::failing_on(|seq| seq == FAILING_SEQ)
    }

    fn failing_on(fails: fn(u64) -> bool) -> Self {
        Self {
            failing: Arc::new(AtomicBool::new(true)),
            calls: Arc::default(),
            fails,
            _event: std::marker::PhantomData,
        }
    }
}

/// The fields the recorder reads.
trait Keyed: DomainEvent {
    fn parts(&self) -> (&str, u64);
}

macro_rules! event {
    ($name:ident, $topic:literal) => {
        keyed_event!($name, $topic);
        impl Keyed for $name {
            fn parts(&self) -> (&str, u64) {
                (&self.key, self.seq)
            }
        }
    };
}

impl<E: Keyed> InboxHandler for Recorder<E> {
    type Event = E;
    const NAME: &'static str = "record_effect";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let (key, seq) = event.parts();
            let event_id = ctx.incoming().event_id;
            sqlx::query("INSERT INTO effect (event_id, key, seq) VALUES ($1, $2, $3)")
                .bind(event_id)
                .bind(key)
                .bind(seq as i64)
                .execute(&mut **ctx)
                .await?;
            if (self.fails)(seq) && self.failing.load(Ordering::SeqCst) {
                return Err(format!("payment provider refused order {key}").into());
            }
            Ok(())
        })
    }
}

/// Each key's effects in the order they were written: in its events'
/// order, each once.
async fn assert_in_order(pool: &PgPool, keys: usize, per_key: usize) {
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key, seq FROM effect ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap();
    for k in 0..keys {
        let key = format!("k{k}");
        let seqs: Vec<i64> = rows
            .iter()
            .filter(|(r, _)| *r == key)
            .map(|(_, s)| *s)
            .collect();
        assert!(seqs.is_sorted(), "{key} out of order: {seqs:?}");
        assert_eq!(seqs.len(), per_key, "{key}: {seqs:?}");
    }
}

fn consumer(pool: &PgPool, group: &str) -> ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group(group)
        .brokers(brokers())
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(40))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .memory_retries(Duration::from_secs(1))
}

/// 40 events over four keys interleaved on partition 0 (the fifth, key k0,
/// fails); returns the messages, the ids, and k0's ids from the failing one
/// on.
fn messages() -> (Vec<TestMessage>, Vec<Uuid>, Vec<Uuid>) {
    let mut messages = Vec::new();
    let mut ids = Vec::new();
    for seq in 0..40u64 {
        let id = Uuid::now_v7();
        let key = format!("k{}", seq % 4);
        let body = serde_json::json!({ "key": key, "seq": seq });
        messages.push(TestMessage::event(id, "OrderPlaced", &key, body).on_partition(0));
        ids.push(id);
    }
    let behind = ids.iter().skip(4).step_by(4).copied().collect();
    (messages, ids, behind)
}

async fn scalar(pool: &PgPool, sql: &str, group: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(group)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Rows `group` has set aside in `inbox_event`.
async fn set_aside(pool: &PgPool, group: &str) -> i64 {
    scalar(
        pool,
        "SELECT count(*) FROM inbox_event WHERE consumer = $1",
        group,
    )
    .await
}

/// The attempts `event_id` was set aside in `inbox_event` with.
async fn attempts_set_aside(pool: &PgPool, group: &str, event_id: Uuid) -> i32 {
    sqlx::query_scalar("SELECT attempts FROM inbox_event WHERE consumer = $1 AND event_id = $2")
        .bind(group)
        .bind(event_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The offset `group` has committed on partition 0 of `topic` (-1: none).
async fn committed(group: &str, topic: &str) -> i64 {
    committed_offsets(group, topic, 1).await[0]
}

/// A test's start: its topic emptied, the effect table, `messages()`
/// produced (one record batch per message: the test broker answers a fetch
/// that starts inside a batch wrongly, see `produce_unbatched`); returns
/// the ids, k0's from the failing one on, and a new group.
async fn start(pool: &PgPool, topic: &str) -> (Vec<Uuid>, Vec<Uuid>, String) {
    init_tracing();
    reset_topic(&brokers(), topic).await;
    effect_table(pool).await;
    let (messages, ids, behind) = messages();
    produce_unbatched(&brokers(), topic, &messages).await;
    (ids, behind, unique_topic(topic))
}

event!(WaitEvent, "memory-retries-wait");

/// The failing event and the later events of its key wait in memory while
/// every other key of the partition is applied; nothing is written to
/// `inbox_event`; the committed offset does not pass the failing event.
/// Once the handler is fixed, its key goes on in order. The counts agree
/// with the tables.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_failing_event_waits_in_memory_and_holds_back_only_its_key(pool: PgPool) {
    let topic = WaitEvent::TOPIC;
    let (ids, behind, group) = start(&pool, topic).await;
    let recorder = Recorder::<WaitEvent>::new();
    let (failing, calls) = (recorder.failing.clone(), recorder.calls.clone());
    let handle = consumer(&pool, &group)
        .handler(recorder)
        .max_attempts(1_000)
        .spawn()
        .unwrap();
    let others: Vec<Uuid> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 4 != 0 || *i < 4)
        .map(|(_, id)| *id)
        .collect();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &others).await.iter().all(|n| *n == 1)
                && handle.counts().handler_failures >= 5
        })
        .await,
        "the other keys were not applied while k0 failed: {:?}",
        handle.counts()
    );
    assert_eq!(effects_of(&pool, &behind).await, vec![0; behind.len()]);
    // More events of every key, in later batches: k0's join the wait.
    let (more, more_ids): (Vec<TestMessage>, Vec<Uuid>) = (40..48u64)
        .map(|seq| {
            let id = Uuid::now_v7();
            let key = format!("k{}", seq % 4);
            let body = serde_json::json!({ "key": key, "seq": seq });
            let message = TestMessage::event(id, "OrderPlaced", &key, body).on_partition(0);
            (message, id)
        })
        .unzip();
    produce_unbatched(&brokers(), topic, &more).await;
    let later_k0 = vec![more_ids[0], more_ids[4]];
    let later_others: Vec<Uuid> = more_ids
        .iter()
        .copied()
        .filter(|id| !later_k0.contains(id))
        .collect();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &later_others)
                .await
                .iter()
                .all(|n| *n == 1)
        })
        .await,
        "{:?}",
        handle.counts()
    );
    assert_eq!(effects_of(&pool, &later_k0).await, vec![0, 0]);
    assert_eq!(
        set_aside(&pool, &group).await,
        0,
        "nothing set aside in the database"
    );
    // The offsets after it were applied, and are not committed past it.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let offset = committed(&group, topic).await;
    assert!(
        offset <= 4,
        "committed offset {offset} passes the waiting event"
    );

    failing.store(false, Ordering::SeqCst);
    let all: Vec<Uuid> = ids.iter().chain(&more_ids).copied().collect();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &all).await.iter().all(|n| *n == 1)
        })
        .await,
        "k0 was not applied once fixed: {:?}",
        handle.counts()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            committed(&group, topic).await == 48
        })
        .await,
        "the offset moves on once the key is through"
    );
    let stats = handle.stats();
    handle.shutdown().await.unwrap();
    let counts = stats.snapshot();
    assert_in_order(&pool, 4, 12).await;
    assert_eq!(counts.processed, 48, "{counts:?}");
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM processed_event WHERE consumer = $1",
            &group
        )
        .await,
        48
    );
    assert_eq!(counts.stored, 0, "{counts:?}");
    assert_eq!(counts.dead_lettered, 0, "{counts:?}");
    assert_eq!(counts.received, 48, "nothing read twice: {counts:?}");
    assert!(calls.load(Ordering::SeqCst) >= 48 + 5);
}

event!(StopEvent, "memory-retries-stop");

/// A consumer stopped while a key waits in memory, then one started after
/// the handler is fixed: every event applied once, k0's in order. The
/// waiting events were in no table: only the committed offset, held at the
/// failing event, brings them back (the events after it that were applied
/// come back as duplicates).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_consumer_stopped_while_a_key_waits_in_memory_loses_nothing(pool: PgPool) {
    let topic = StopEvent::TOPIC;
    let (ids, behind, group) = start(&pool, topic).await;
    let first = consumer(&pool, &group)
        .handler(Recorder::<StopEvent>::new())
        .max_attempts(1_000)
        .spawn()
        .unwrap();
    let others: Vec<Uuid> = ids
        .iter()
        .copied()
        .filter(|id| !behind.contains(id))
        .collect();
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &others).await.iter().all(|n| *n == 1)
                && first.counts().handler_failures >= 3
        })
        .await,
        "{:?}",
        first.counts()
    );
    first.shutdown().await.unwrap();
    assert_eq!(effects_of(&pool, &behind).await, vec![0; behind.len()]);
    let offset = committed(&group, topic).await;
    // Control: a plain client reads the partition from that offset on (if
    // the consumer below reads nothing, the broker is not at fault).
    let from = offset.max(0);
    let readable = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer as _};
        let client: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", unique_topic("memory-stop-control"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("client");
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset(StopEvent::TOPIC, 0, rdkafka::Offset::Offset(from))
            .expect("offset");
        client.assign(&tpl).expect("assign");
        let mut n = 0;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline && n < 40 - from {
            if let Some(Ok(_)) = client.poll(Duration::from_millis(200)) {
                n += 1;
            }
        }
        n
    })
    .await
    .unwrap();
    assert_eq!(
        readable,
        40 - from,
        "the broker serves the partition from {from}"
    );
    assert!(
        offset <= 4,
        "committed offset {offset} passes the waiting event"
    );

    let fixed = Recorder::<StopEvent>::new();
    fixed.failing.store(false, Ordering::SeqCst);
    let second = consumer(&pool, &group).handler(fixed).spawn().unwrap();
    // The counts are taken once they cover every message read again: a
    // transaction's effects are visible a moment before its counts are.
    let read_again = 40 - offset.max(0) as u64;
    assert!(
        eventually(Duration::from_secs(30), || async {
            let counts = second.counts();
            effects_of(&pool, &ids).await.iter().all(|n| *n == 1)
                && counts.processed + counts.duplicates >= read_again
        })
        .await,
        "{:?}",
        second.counts()
    );
    let counts = second.counts();
    second.shutdown().await.unwrap();
    assert_in_order(&pool, 4, 10).await;
    assert_eq!(counts.processed, behind.len() as u64, "{counts:?}");
    assert_eq!(
        counts.duplicates,
        read_again - behind.len() as u64,
        "{counts:?}"
    );
}

event!(DeadEvent, "memory-retries-dead");

/// Out of attempts, an event retried from memory is dead-lettered with its
/// attempts, and the later events of its key follow it, in order; nothing
/// was set aside in the database.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn out_of_attempts_in_memory_the_event_is_dead_lettered_and_its_key_goes_on(pool: PgPool) {
    let topic = DeadEvent::TOPIC;
    let (ids, behind, group) = start(&pool, topic).await;
    let handle = consumer(&pool, &group)
        .handler(Recorder::<DeadEvent>::new())
        .max_attempts(3)
        .spawn()
        .unwrap();
    let applied: Vec<Uuid> = ids.iter().copied().filter(|id| *id != behind[0]).collect();
    assert!(
        eventually(Duration::from_secs(30), || async {
            // Effects are visible a moment before their counts are.
            effects_of(&pool, &applied).await.iter().all(|n| *n == 1)
                && handle.counts().dead_lettered == 1
                && handle.counts().processed >= 39
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(effects_of(&pool, &behind[..1]).await, vec![0]);
    let (attempts, handler): (i32, Option<String>) = sqlx::query_as(
        "SELECT attempts, handler FROM dead_letter WHERE consumer = $1 AND event_id = $2",
    )
    .bind(&group)
    .bind(behind[0])
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, handler.as_deref()), (3, Some("record_effect")));
    assert_eq!(counts.handler_failures, 3, "{counts:?}");
    assert_eq!(counts.processed, 39, "{counts:?}");
    assert_eq!(counts.stored, 0, "{counts:?}");
    assert_eq!(set_aside(&pool, &group).await, 0);
    let rows: Vec<i64> = sqlx::query_scalar("SELECT seq FROM effect WHERE key = 'k0' ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![0, 8, 12, 16, 20, 24, 28, 32, 36]);
}

event!(AgainEvent, "memory-retries-again");

/// A key that fails again soon after its failed event is through stays in
/// memory: 200 events over four keys, k0's 50 of them failing at seq 4, 40
/// and 100 until dead-lettered. Behind seq 4, k0's next 48 events wait; they
/// then run in chunks (16, then 32), and seq 40 fails inside the first chunk
/// while the second still waits: it and the chunk's later events of k0 go
/// back before the rest. Every other event is applied once, k0's in order,
/// nothing goes to `inbox_event`, and the counts agree with the tables.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_key_failing_again_soon_stays_in_memory_and_in_order(pool: PgPool) {
    const FAILING: [u64; 3] = [4, 40, 100];
    let topic = AgainEvent::TOPIC;
    init_tracing();
    reset_topic(&brokers(), topic).await;
    effect_table(&pool).await;
    let (messages, ids): (Vec<TestMessage>, Vec<Uuid>) = (0..200u64)
        .map(|seq| {
            let id = Uuid::now_v7();
            let key = format!("k{}", seq % 4);
            let body = serde_json::json!({ "key": key, "seq": seq });
            let message = TestMessage::event(id, "OrderPlaced", &key, body).on_partition(0);
            (message, id)
        })
        .unzip();
    produce_unbatched(&brokers(), topic, &messages).await;
    let group = unique_topic(topic);
    let handle = consumer(&pool, &group)
        .handler(Recorder::<AgainEvent>::failing_on(|seq| {
            FAILING.contains(&seq)
        }))
        .max_attempts(3)
        .spawn()
        .unwrap();
    let applied: Vec<Uuid> = ids
        .iter()
        .enumerate()
        .filter(|(seq, _)| !FAILING.contains(&(*seq as u64)))
        .map(|(_, id)| *id)
        .collect();
    assert!(
        eventually(Duration::from_secs(60), || async {
            // Effects are visible a moment before their counts are.
            effects_of(&pool, &applied).await.iter().all(|n| *n == 1)
                && handle.counts().dead_lettered == 3
                && handle.counts().processed >= 197
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let stats = handle.stats();
    handle.shutdown().await.unwrap();
    let counts = stats.snapshot();
    let failed: Vec<Uuid> = FAILING.iter().map(|seq| ids[*seq as usize]).collect();
    assert_eq!(effects_of(&pool, &failed).await, vec![0, 0, 0]);
    assert_eq!(counts.processed, 197, "{counts:?}");
    assert_eq!(
        counts.handler_failures, 9,
        "three attempts each: {counts:?}"
    );
    assert_eq!(counts.stored, 0, "nothing set aside: {counts:?}");
    assert_eq!(set_aside(&pool, &group).await, 0);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM dead_letter WHERE consumer = $1 AND attempts = 3",
            &group
        )
        .await,
        3
    );
    let k0: Vec<i64> = sqlx::query_scalar("SELECT seq FROM effect WHERE key = 'k0' ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let expected: Vec<i64> = (0..200)
        .step_by(4)
        .filter(|seq| !FAILING.contains(&(*seq as u64)))
        .collect();
    assert_eq!(k0, expected, "k0 applied once each, in order");
    for k in 1..4 {
        let seqs: Vec<i64> =
            sqlx::query_scalar("SELECT seq FROM effect WHERE key = $1 ORDER BY id")
                .bind(format!("k{k}"))
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(seqs, (k..200).step_by(4).collect::<Vec<i64>>());
    }
}

event!(SpillEvent, "memory-retries-spill");

/// A retry due after the window is not held in memory: the event is set
/// aside in `inbox_event` with its attempts so far, the later events of its
/// key behind it, and the inbox processor takes over from there.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_retry_due_after_the_window_is_set_aside_with_its_attempts(pool: PgPool) {
    let topic = SpillEvent::TOPIC;
    let (ids, behind, group) = start(&pool, topic).await;
    let recorder = Recorder::<SpillEvent>::new();
    let failing = recorder.failing.clone();
    // Back-offs 100 ms, 200 ms, …: the second retry is due after the window.
    let handle = consumer(&pool, &group)
        .retry_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .memory_retries(Duration::from_millis(150))
        .handler(recorder)
        .max_attempts(1_000)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            scalar(
                &pool,
                "SELECT coalesce(max(attempts), 0)::int8 FROM inbox_event WHERE consumer = $1",
                &group,
            )
            .await
                >= 2
        })
        .await,
        "{:?}",
        handle.counts()
    );
    // The failing event keeps the attempts it had in memory; its key's
    // later events follow it into the table, behind it.
    let first_attempts = attempts_set_aside(&pool, &group, behind[0]).await;
    assert!(
        first_attempts >= 2,
        "set aside with its attempts: {first_attempts}"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            set_aside(&pool, &group).await == behind.len() as i64
        })
        .await,
        "the failing event and its key's later ones are set aside"
    );
    assert_eq!(effects_of(&pool, &behind).await, vec![0; behind.len()]);
    failing.store(false, Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &ids).await.iter().all(|n| *n == 1)
        })
        .await,
        "{:?}",
        handle.counts()
    );
    handle.shutdown().await.unwrap();
    assert_in_order(&pool, 4, 10).await;
}

event!(FullEvent, "memory-retries-full");

/// With room for fewer events than a failing key holds back, nothing waits
/// in memory: the failing event (first attempt) and its key's 9 later
/// events are set aside in `inbox_event`, the other keys go on, and once
/// fixed every event is applied once, in order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn past_the_memorys_bound_a_failing_key_is_set_aside(pool: PgPool) {
    let topic = FullEvent::TOPIC;
    let (ids, behind, group) = start(&pool, topic).await;
    let recorder = Recorder::<FullEvent>::new();
    let failing = recorder.failing.clone();
    // One batch of all 40 (they were produced before the start): the
    // failing event meets its key's 9 later events in it, 10 > 5.
    let handle = consumer(&pool, &group)
        .batch_linger(Duration::from_millis(500))
        .memory_retries_max_events(5)
        .handler(recorder)
        .max_attempts(1_000)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            set_aside(&pool, &group).await == behind.len() as i64
        })
        .await,
        "the failing event and its key's later ones are set aside: {:?}",
        handle.counts()
    );
    let first_attempts = attempts_set_aside(&pool, &group, behind[0]).await;
    assert!(first_attempts >= 1, "{first_attempts}");
    failing.store(false, Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(30), || async {
            effects_of(&pool, &ids).await.iter().all(|n| *n == 1)
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.stored, behind.len() as u64, "{counts:?}");
    assert_in_order(&pool, 4, 10).await;
}

/// The bound must be positive.
#[tokio::test]
async fn memory_retries_max_events_must_be_positive() {
    let pool = PgPool::connect_lazy("postgres://localhost/unused").unwrap();
    let Err(error) = Consumer::builder(pool)
        .group("g")
        .memory_retries(Duration::from_secs(1))
        .memory_retries_max_events(0)
        .handler(Recorder::<FullEvent>::new())
        .build()
    else {
        panic!("a bound of 0 events was accepted");
    };
    assert!(error.to_string().contains("max events"), "{error}");
}
