//! Batches bounded by bytes as well as rows, against a real PostgreSQL
//! (fresh database per test) and the real broker: the relay's claim stops at
//! its byte budget (and keeps every key in order across the cut), and a
//! consumer's batch stops at its own. The relay's tests run in the
//! progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test
//! command): "published" is then "passed by its slot's position" (see
//! `common::unpublished`).

mod common;

use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler, UnitOfWork};
use outbox_runtime::{Consumer, Mode, Relay};
use sqlx::PgPool;
use uuid::Uuid;

/// Commits one event per `(key, pad)`, one per Unit of Work, with a payload
/// padded by `pad` bytes; returns their event ids in commit order.
async fn commit_padded(pool: &PgPool, topic: &str, events: &[(&str, usize)]) -> Vec<Uuid> {
    let mut ids = Vec::with_capacity(events.len());
    for (seq, (key, pad)) in events.iter().enumerate() {
        let mut m = message(topic, key, seq);
        m.payload =
            serde_json::json!({ "key": key, "seq": seq, "pad": "x".repeat(*pad) }).to_string();
        let mut uow = UnitOfWork::begin(pool).await.expect("begin");
        ids.push(uow.record_message(m));
        uow.commit().await.expect("commit");
    }
    ids
}

/// 60 events of ~100 KB over two keys, a budget of 250 KB: no batch holds
/// more than 3 of them (the bytes before the fourth already reach the
/// budget), a 400 KB event goes alone, and both keys arrive in commit order
/// although every claim stops short of rows it has read ahead.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_relay_claims_at_most_its_byte_budget_and_keeps_keys_in_order(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-bytes");
    create_topic(&brokers(), &topic).await;
    let mut events: Vec<(&str, usize)> = vec![("k0", 400_000)];
    for i in 0..60 {
        events.push((if i % 2 == 0 { "k0" } else { "k1" }, 100_000));
    }
    let committed = commit_padded(&pool, &topic, &events).await;

    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .max_batch_bytes(250_000)
        .spawn()
        .unwrap();
    assert!(
        wait_until_published(&pool, Duration::from_secs(60)).await,
        "relay drained the outbox"
    );
    let counts = relay.counts();
    relay.shutdown().await.unwrap();
    // 1 batch for the large event, then at most 3 events per batch.
    assert!(counts.batches >= 21, "{counts:?}");
    assert_eq!(counts.published, 61, "{counts:?}");
    assert_eq!(counts.order_violations, 0, "{counts:?}");

    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    assert_eq!(
        verify(&committed, &received),
        0,
        "no failure: no duplicates"
    );
}

/// Without a byte budget in reach, the row count alone bounds a batch.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn small_events_fill_batches_by_rows(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("relay-rows");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(&pool, &topic, 1_000, 10, 100).await;
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .batch_size(500)
        .spawn()
        .unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    let counts = relay.counts();
    relay.shutdown().await.unwrap();
    assert_eq!(counts.batches, 2, "two full batches of 500: {counts:?}");
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    assert_eq!(verify(&committed, &received), 0);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_zero_byte_budget_is_refused(pool: PgPool) {
    let error = Relay::builder(pool.clone())
        .max_batch_bytes(0)
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("max batch bytes"), "{error}");
    let error = Consumer::builder(pool)
        .group("g")
        .handler(ByBatch)
        .max_batch_bytes(0)
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("max batch bytes"), "{error}");
}

keyed_event!(Padded, "batch-bytes-consumer");

/// Records, per handled event, the transaction it ran in (dedup mode: one
/// per batch) and the size of its message.
struct ByBatch;

impl InboxHandler for ByBatch {
    type Event = Padded;
    const NAME: &'static str = "by_batch";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: Padded) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            sqlx::query("INSERT INTO handled (seq, tx) VALUES ($1, txid_current())")
                .bind(event.seq as i64)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}

/// 40 messages of ~50 KB, produced before the consumer starts, with a
/// linger long enough for all of them to fit one batch by rows: a budget of
/// 120 KB cuts them into batches of at most 3 (the message that reaches
/// the budget ends its batch).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_consumer_batch_stops_at_its_byte_budget(pool: PgPool) {
    sqlx::query("CREATE TABLE handled (seq bigint PRIMARY KEY, tx bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let topic = Padded::TOPIC;
    reset_topic(&brokers(), topic).await;
    let messages: Vec<TestMessage> = (0..40)
        .map(|seq| {
            TestMessage::event(
                Uuid::now_v7(),
                "OrderPlaced",
                &format!("k{}", seq % 4),
                serde_json::json!({ "key": format!("k{}", seq % 4), "seq": seq, "pad": "x".repeat(50_000) }),
            )
        })
        .collect();
    produce(&brokers(), topic, &messages).await;

    let consumer = Consumer::builder(pool.clone())
        .group(unique_topic("batch-bytes"))
        .brokers(brokers())
        .handler(ByBatch)
        .batch_linger(Duration::from_secs(3))
        .max_batch_bytes(120_000)
        .spawn()
        .unwrap();
    let done = eventually(Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM handled")
            .fetch_one(&pool)
            .await
            .unwrap()
            == 40
    })
    .await;
    // The counts once every task has ended: a batch is counted after its
    // commit, which the handled rows can show first.
    let stats = consumer.stats();
    consumer.shutdown().await.unwrap();
    let counts = stats.snapshot();
    assert!(done, "all 40 handled: {counts:?}");
    let largest: i64 =
        sqlx::query_scalar("SELECT max(n) FROM (SELECT count(*) AS n FROM handled GROUP BY tx) t")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        (1..=3).contains(&largest),
        "at most 3 messages of ~50 KB per batch with a budget of 120 KB, got {largest}"
    );
    assert!(counts.batches >= 14, "{counts:?}");
}

keyed_event!(PaddedInbox, "batch-bytes-inbox");

/// [`ByBatch`] for the inbox processor's transactions.
struct ByProcessorBatch;

impl InboxHandler for ByProcessorBatch {
    type Event = PaddedInbox;
    const NAME: &'static str = "by_processor_batch";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: PaddedInbox,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            sqlx::query("INSERT INTO handled (seq, tx) VALUES ($1, txid_current())")
                .bind(event.seq as i64)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}

/// Inbox mode: 40 messages of ~50 KB are stored first (no processor), then
/// a processor claims them from the table, where all 40 fit one claim by
/// rows (500): a budget of 120 KB cuts its transactions to at most 3 events,
/// and every event is applied once, in per-key order.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn an_inbox_processor_batch_stops_at_its_byte_budget(pool: PgPool) {
    sqlx::query("CREATE TABLE handled (seq bigint PRIMARY KEY, tx bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let topic = PaddedInbox::TOPIC;
    reset_topic(&brokers(), topic).await;
    let messages: Vec<TestMessage> = (0..40)
        .map(|seq| {
            TestMessage::event(
                Uuid::now_v7(),
                "OrderPlaced",
                &format!("k{}", seq % 4),
                serde_json::json!({ "key": format!("k{}", seq % 4), "seq": seq, "pad": "x".repeat(50_000) }),
            )
        })
        .collect();
    produce(&brokers(), topic, &messages).await;
    let group = unique_topic("batch-bytes-inbox");
    let consumer = |processors| {
        Consumer::builder(pool.clone())
            .group(&group)
            .brokers(brokers())
            .mode(Mode::Inbox)
            .processors(processors)
            .processor_poll_interval(Duration::from_millis(50))
            .max_batch_bytes(120_000)
            .handler(ByProcessorBatch)
            .spawn()
            .unwrap()
    };
    let store = consumer(0);
    assert!(
        eventually(Duration::from_secs(60), || async {
            store.counts().stored == 40
        })
        .await,
        "{:?}",
        store.counts()
    );
    store.shutdown().await.unwrap();

    let process = consumer(1);
    let done = eventually(Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM handled")
            .fetch_one(&pool)
            .await
            .unwrap()
            == 40
    })
    .await;
    let counts = process.counts();
    process.shutdown().await.unwrap();
    assert!(done, "all 40 handled: {counts:?}");
    let largest: i64 =
        sqlx::query_scalar("SELECT max(n) FROM (SELECT count(*) AS n FROM handled GROUP BY tx) t")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        (1..=3).contains(&largest),
        "at most 3 events of ~50 KB per processor transaction with a budget of 120 KB, got {largest}"
    );
    // Per key, in order: a key's events are handled in increasing seq order.
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY seq % 4 ORDER BY tx, seq) AS prev
             FROM handled) t
         WHERE prev > seq",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(out_of_order, 0);
}
