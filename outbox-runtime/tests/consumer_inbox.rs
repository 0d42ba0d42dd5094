//! The consumer in inbox mode against a real PostgreSQL and the real broker:
//! a burst is stored quickly and then processed in per-key order; a failing
//! handler holds back only its key, is retried, dead-lettered, and re-driven
//! back into the inbox.
//!
//! Like `consumer.rs`, each test owns a fixed topic (handlers are bound to
//! `DomainEvent::TOPIC`), emptied at its start.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox_runtime::{Consumer, Mode};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Burst {
    key: String,
    seq: u64,
}

impl DomainEvent for Burst {
    const TOPIC: &'static str = "consumer-test-inbox-burst";
    const AGGREGATE_TYPE: &'static str = "Account";
    const EVENT_TYPES: &'static [&'static str] = &["Deposited"];
    fn event_type(&self) -> &'static str {
        "Deposited"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.key.clone()
    }
}

/// Records (key, per-key sequence) in handling order.
struct Sequence(Arc<Mutex<Vec<(String, u64)>>>);

impl InboxHandler for Sequence {
    type Event = Burst;
    const NAME: &'static str = "record_sequence";

    fn handle<'a, 'c>(&'a self, _ctx: &'a mut HandlerContext<'c>, event: Burst) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.0.lock().unwrap().push((event.key.clone(), event.seq));
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn an_inbox_burst_is_stored_quickly_then_processed_in_per_key_order(pool: PgPool) {
    init_tracing();
    const N: usize = 50_000;
    const KEYS: usize = 200;
    let topic = Burst::TOPIC;
    reset_topic(&brokers(), topic).await;
    let mut next_seq = vec![0_u64; KEYS];
    let messages: Vec<TestMessage> = (0..N)
        .map(|i| {
            let k = (i * 7919) % KEYS; // keys interleaved
            let seq = next_seq[k];
            next_seq[k] += 1;
            let key = format!("account-{k}");
            TestMessage::event(
                Uuid::now_v7(),
                "Deposited",
                &key,
                serde_json::json!({ "key": key, "seq": seq, "note": "x".repeat(120) }),
            )
        })
        .collect();
    produce(&brokers(), topic, &messages).await;

    let seen = Arc::new(Mutex::new(Vec::with_capacity(N)));
    let started = Instant::now();
    let handle = Consumer::builder(pool.clone())
        .group(unique_topic("inbox-burst"))
        .brokers(brokers())
        .mode(Mode::Inbox)
        .batch_size(5_000)
        .processors(2)
        .processor_batch_size(1_000)
        .handler(Sequence(seen.clone()))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(60), || async {
            handle.counts().stored == N as u64
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let stored_in = started.elapsed();
    assert!(
        eventually(Duration::from_secs(120), || async {
            handle.counts().processed == N as u64
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let processed_in = started.elapsed();
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    eprintln!(
        "inbox burst of {N}: stored in {:.2} s ({:.0} events/s), all processed after {:.2} s ({:.0} events/s end to end); {counts:?}",
        stored_in.as_secs_f64(),
        N as f64 / stored_in.as_secs_f64(),
        processed_in.as_secs_f64(),
        N as f64 / processed_in.as_secs_f64(),
    );
    assert_eq!(counts.duplicates, 0);

    // Every event once, each key's events in their order.
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(seen.len(), N);
    let mut last: HashMap<&str, u64> = HashMap::new();
    for (key, seq) in seen.iter() {
        let expected = last.get(key.as_str()).map_or(0, |s| s + 1);
        assert_eq!(*seq, expected, "key {key} out of order");
        last.insert(key, *seq);
    }
    assert_eq!(last.len(), KEYS);
    let (processed, in_seq_order): (i64, bool) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE processed),
                bool_and(ok)
         FROM (SELECT processed,
                      (payload->>'seq')::bigint
                        = row_number() OVER (PARTITION BY partition_key ORDER BY seq) - 1 AS ok
               FROM inbox_event) t",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(processed, N as i64);
    assert!(in_seq_order, "inbox seq follows each key's order");
}

// ---- Failures ------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Transfer {
    key: String,
    seq: u64,
}

impl DomainEvent for Transfer {
    const TOPIC: &'static str = "consumer-test-inbox-failures";
    const AGGREGATE_TYPE: &'static str = "Account";
    const EVENT_TYPES: &'static [&'static str] = &["Transferred"];
    fn event_type(&self) -> &'static str {
        "Transferred"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.key.clone()
    }
}

/// Writes each transfer to the `effect` table (committed order = id order).
/// Key `flaky` seq 0 fails its first two attempts; key `broken` seq 0 fails
/// while `broken` is on.
struct Book {
    attempts: Mutex<HashMap<(String, u64), u32>>,
    broken: Arc<AtomicBool>,
}

impl InboxHandler for Book {
    type Event = Transfer;
    const NAME: &'static str = "book_transfer";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: Transfer,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let attempt = {
                let mut a = self.attempts.lock().unwrap();
                let n = a.entry((event.key.clone(), event.seq)).or_insert(0);
                *n += 1;
                *n
            };
            sqlx::query("INSERT INTO effect (event_id, key, seq) VALUES ($1, $2, $3)")
                .bind(ctx.incoming().event_id)
                .bind(&event.key)
                .bind(event.seq as i64)
                .execute(&mut **ctx)
                .await?;
            if event.key == "flaky" && event.seq == 0 && attempt <= 2 {
                return Err(format!("ledger locked (attempt {attempt})").into());
            }
            if event.key == "broken" && event.seq == 0 && self.broken.load(Ordering::SeqCst) {
                return Err("account frozen".into());
            }
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_failing_row_holds_back_only_its_key_then_is_dead_lettered_and_requeued(pool: PgPool) {
    init_tracing();
    let topic = Transfer::TOPIC;
    reset_topic(&brokers(), topic).await;
    sqlx::query(
        "CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text, seq bigint)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let event = |key: &str, seq: u64| {
        TestMessage::event(
            Uuid::now_v7(),
            "Transferred",
            key,
            serde_json::json!({ "key": key, "seq": seq }),
        )
    };
    let mut messages = vec![event("flaky", 0), event("broken", 0)];
    for i in 0..20 {
        messages.push(event(&format!("other-{i}"), 0));
        if i == 5 {
            messages.push(event("flaky", 1));
            messages.push(event("broken", 1));
        }
        if i == 10 {
            messages.push(event("flaky", 2));
        }
    }
    // Malformed input never enters the inbox.
    messages.push(event("other-x", 0).payload("{ not json"));
    messages.push(event("other-y", 0).header("event_type", "Audited"));
    let broken_id: Uuid = messages[1].headers[0].1.parse().unwrap();
    produce(&brokers(), topic, &messages).await;

    let broken = Arc::new(AtomicBool::new(true));
    let group = unique_topic("inbox-failures");
    let handle = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(brokers())
        .mode(Mode::Inbox)
        .max_attempts(3)
        .retry_backoff(Duration::from_millis(300), Duration::from_millis(600))
        .processor_poll_interval(Duration::from_millis(50))
        .redrive_interval(Duration::from_millis(100))
        .ignore_event_type(topic, "Audited")
        .handler(Book {
            attempts: Mutex::default(),
            broken: broken.clone(),
        })
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed == 24 && c.dead_lettered == 2
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    assert_eq!(counts.stored, 25);
    assert_eq!(counts.ignored, 1);
    assert_eq!(counts.handler_failures, 2 + 3);

    // Committed effects, in commit order.
    let effects: Vec<(String, i64)> = sqlx::query_as("SELECT key, seq FROM effect ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let position = |key: &str, seq: i64| {
        effects
            .iter()
            .position(|(k, s)| k == key && *s == seq)
            .unwrap_or_else(|| panic!("{key}/{seq} not applied: {effects:?}"))
    };
    // The flaky key kept its order...
    assert!(position("flaky", 0) < position("flaky", 1));
    assert!(position("flaky", 1) < position("flaky", 2));
    // ...while the other keys did not wait for its retries.
    let others_before = (0..20)
        .filter(|i| position(&format!("other-{i}"), 0) < position("flaky", 0))
        .count();
    assert_eq!(others_before, 20, "other keys went first: {effects:?}");
    // The broken key's first event is out; the key moved on after it.
    assert!(!effects.iter().any(|(k, s)| k == "broken" && *s == 0));
    assert!(position("broken", 1) > position("other-19", 0));
    assert_eq!(effects.len(), 24);

    let (attempts, last_error, processed): (i32, Option<String>, bool) = sqlx::query_as(
        "SELECT attempts, last_error, processed FROM inbox_event
         WHERE partition_key = 'flaky' AND (payload->>'seq')::int = 0",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, processed), (3, true));
    assert_eq!(last_error.as_deref(), Some("ledger locked (attempt 2)"));
    let (attempts, last_error, dead): (i32, Option<String>, bool) = sqlx::query_as(
        "SELECT attempts, last_error, dead_lettered_at IS NOT NULL FROM inbox_event
         WHERE event_id = $1",
    )
    .bind(broken_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, dead), (3, true));
    assert_eq!(last_error.as_deref(), Some("account frozen"));

    let letters = dead_letter::list(&pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap();
    let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    assert_eq!(reasons.len(), 2);
    assert!(reasons.contains(&"not_json"), "{reasons:?}");
    let letter = letters
        .iter()
        .find(|l| l.reason == "handler_failed")
        .unwrap();
    assert_eq!(letter.event_id, Some(broken_id));
    assert_eq!(letter.attempts, 3);
    assert_eq!(letter.error, "account frozen");

    // Fixed, re-driven: back into the inbox, processed once.
    broken.store(false, Ordering::SeqCst);
    assert_eq!(
        dead_letter::retry(&pool, Some(&group), Some(&[letter.id]))
            .await
            .unwrap(),
        1
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            handle.counts().processed == 25
        })
        .await,
        "{:?}",
        handle.counts()
    );
    assert_eq!(handle.counts().redriven, 1);
    handle.shutdown().await.unwrap();
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM effect WHERE event_id = $1")
        .bind(broken_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(applied, 1);
    let status: String = sqlx::query_scalar("SELECT status FROM dead_letter WHERE id = $1")
        .bind(letter.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(status, "resolved");
}

// ---- Duplicates and refused payloads ---------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Credit {
    key: String,
    seq: u64,
    #[serde(default)]
    note: String,
}

impl DomainEvent for Credit {
    const TOPIC: &'static str = "consumer-test-inbox-duplicates";
    const AGGREGATE_TYPE: &'static str = "Account";
    const EVENT_TYPES: &'static [&'static str] = &["Credited"];
    fn event_type(&self) -> &'static str {
        "Credited"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.key.clone()
    }
}

struct CountCredits(Arc<Mutex<HashMap<Uuid, u32>>>);

impl InboxHandler for CountCredits {
    type Event = Credit;
    const NAME: &'static str = "count_credits";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        _event: Credit,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            *self
                .0
                .lock()
                .unwrap()
                .entry(ctx.incoming().event_id)
                .or_default() += 1;
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_mode_stores_each_event_once_and_dead_letters_payloads_the_database_refuses(
    pool: PgPool,
) {
    init_tracing();
    let topic = Credit::TOPIC;
    reset_topic(&brokers(), topic).await;
    let mut messages = Vec::new();
    let mut ids = Vec::new();
    for seq in 0..300_u64 {
        let id = Uuid::now_v7();
        let key = format!("acct-{}", seq % 7);
        ids.push(id);
        messages.push(TestMessage::event(
            id,
            "Credited",
            &key,
            serde_json::json!({ "key": key, "seq": seq }),
        ));
    }
    // Valid JSON that jsonb cannot hold.
    let refused = Uuid::now_v7();
    messages.push(
        TestMessage::event(refused, "Credited", "acct-0", serde_json::json!({}))
            .payload(r#"{"key": "acct-0", "seq": 300, "note": "nul \u0000 inside"}"#),
    );
    produce(&brokers(), topic, &messages).await;
    // Redelivered: some in the same batch as their first copy, some later.
    produce(&brokers(), topic, &messages[100..300]).await;

    let counted = Arc::new(Mutex::new(HashMap::new()));
    let group = unique_topic("inbox-dup");
    let handle = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(brokers())
        .mode(Mode::Inbox)
        .handler(CountCredits(counted.clone()))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let c = handle.counts();
            c.processed == 300 && c.duplicates == 200 && c.dead_lettered == 1
        })
        .await,
        "{:?}",
        handle.counts()
    );
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.stored, 300, "{counts:?}");
    let counted = std::mem::take(&mut *counted.lock().unwrap());
    assert_eq!(counted.len(), 300);
    assert!(ids.iter().all(|id| counted.get(id) == Some(&1)));
    let letters = dead_letter::list(&pool, &DeadLetterFilter::new().consumer(&group))
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].event_id, Some(refused));
    assert_eq!(letters[0].reason, "not_json");
    assert!(
        letters[0].error.contains("refused the payload"),
        "{}",
        letters[0].error
    );
}
