//! Hostile messages on a subscribed topic, mixed into normal traffic, in
//! both modes, against a real PostgreSQL and the real broker: each one must
//! become a dead letter with its reason (or a counted duplicate), every good
//! event must be applied exactly once, and the consumer must keep running.
//!
//! | message | what happens |
//! |---|---|
//! | a header name that is not UTF-8 | dead letter `invalid_headers` |
//! | `event_id` given twice with different values | dead letter `invalid_headers` |
//! | a custom header given twice | applied (not an identity header) |
//! | a 256 KiB header value | applied (under the size limit) |
//! | a 2 MiB header value | dead letter `oversized` (headers count) |
//! | no key | dead letter `no_key` |
//! | an empty payload | dead letter `not_json` |
//! | a 10 MiB payload | dead letter `oversized`, keeping a 64 KiB prefix |
//! | valid JSON of another shape | dead letter `payload_mismatch` |
//! | random bytes | dead letter `not_json` |
//! | an `event_id` that is not UTF-8 | dead letter `no_event_id` |
//! | an `event_id` reused with another payload | a counted duplicate (the first is applied) |

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, InboxHandler};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox_runtime::{Consumer, Mode};
use sqlx::PgPool;
use uuid::Uuid;

keyed_event!(HostileDedup, "hostile-messages-dedup");
keyed_event!(HostileInbox, "hostile-messages-inbox");

fn good(seq: usize) -> (Uuid, TestMessage) {
    let id = Uuid::now_v7();
    let key = format!("k{}", seq % 8);
    let m = TestMessage::event(
        id,
        "OrderPlaced",
        &key,
        serde_json::json!({ "key": key, "seq": seq }),
    );
    (id, m)
}

/// The hostile messages, each with the dead-letter reason it must get
/// (`None`: it must be applied).
fn hostile() -> Vec<(&'static str, TestMessage, Option<&'static str>)> {
    let mut out = Vec::new();
    let mut add = |what: &'static str, m: TestMessage, reason: Option<&'static str>| {
        out.push((what, m, reason))
    };
    add(
        "header name not UTF-8",
        good(1).1.raw_header(b"tenant\xff\xfe", Some(b"acme")),
        Some("invalid_headers"),
    );
    add(
        "event_id given twice, differently",
        good(2)
            .1
            .raw_header(b"event_id", Some(Uuid::now_v7().to_string().as_bytes())),
        Some("invalid_headers"),
    );
    add(
        "a custom header given twice",
        good(3)
            .1
            .raw_header(b"tenant", Some(b"a"))
            .raw_header(b"tenant", Some(b"b")),
        None,
    );
    add(
        "a 256 KiB header value",
        good(4).1.header("blob", &"h".repeat(256 * 1024)),
        None,
    );
    add(
        "a 2 MiB header value",
        good(5).1.header("blob", &"h".repeat(2 * 1024 * 1024)),
        Some("oversized"),
    );
    let mut no_key = good(6).1;
    no_key.key = None;
    add("no key", no_key, Some("no_key"));
    add(
        "an empty payload",
        good(7).1.payload(Vec::new()),
        Some("not_json"),
    );
    add(
        "a 10 MiB payload",
        good(8).1.payload(format!(
            "{{\"key\":\"k0\",\"seq\":8,\"pad\":\"{}\"}}",
            "p".repeat(10 * 1024 * 1024)
        )),
        Some("oversized"),
    );
    add(
        "JSON of another shape",
        good(9)
            .1
            .payload(br#"{"amount_cents": 500, "currency": "EUR"}"#.to_vec()),
        Some("payload_mismatch"),
    );
    let random: Vec<u8> = (0..512u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    add("random bytes", good(10).1.payload(random), Some("not_json"));
    add(
        "event_id not UTF-8",
        good(11)
            .1
            .without_header("event_id")
            .raw_header(b"event_id", Some(b"\xff\xfe\xfd")),
        Some("no_event_id"),
    );
    out
}

async fn run(pool: &PgPool, topic: &str, mode: Mode, handler: impl InboxHandler) {
    sqlx::query("CREATE TABLE effect (event_id uuid NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    reset_topic(&brokers(), topic).await;
    // Good events around and between the hostile ones, one partition key
    // each time (the hostile ones land on every partition).
    let hostile = hostile();
    let mut messages = Vec::new();
    let mut good_ids = Vec::new();
    let mut seq = 100;
    for _ in 0..50 {
        let (id, m) = good(seq);
        seq += 1;
        good_ids.push(id);
        messages.push(m);
    }
    let mut expected: HashMap<Uuid, &str> = HashMap::new();
    for (what, m, reason) in &hostile {
        let id: Uuid = m
            .headers
            .iter()
            .find(|(k, _)| k == "event_id")
            .map(|(_, v)| v.parse().unwrap())
            .unwrap_or_else(Uuid::nil);
        match reason {
            Some(reason) => {
                expected.insert(id, reason);
            }
            None => good_ids.push(id),
        }
        messages.push(m.clone());
        for _ in 0..20 {
            let (id, m) = good(seq);
            seq += 1;
            good_ids.push(id);
            messages.push(m);
        }
        let _ = what;
    }
    // An event id reused with another payload: the first copy is applied,
    // the second is a duplicate.
    let (reused, first) = good(seq);
    let second = first.clone().payload(
        serde_json::json!({ "key": "k0", "seq": 999_999 })
            .to_string()
            .into_bytes(),
    );
    good_ids.push(reused);
    messages.push(first);
    messages.push(second);
    produce(&brokers(), topic, &messages).await;

    let group = unique_topic("hostile");
    let handle = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(brokers())
        .mode(mode)
        .processor_poll_interval(Duration::from_millis(50))
        .handler(handler)
        .spawn()
        .unwrap();
    let letters_of = || async {
        dead_letter::list(pool, &DeadLetterFilter::new().consumer(&group).limit(1000))
            .await
            .unwrap()
    };
    let applied = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT event_id) FROM effect")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let settled = eventually(Duration::from_secs(60), || async {
        letters_of().await.len() >= expected.len() && applied().await >= good_ids.len() as i64
    })
    .await;
    let counts = handle.counts();
    assert!(!handle.is_finished(), "the consumer stopped: {counts:?}");
    let letters = letters_of().await;
    assert!(
        settled,
        "{counts:?}; {} letters: {:?}",
        letters.len(),
        letters
            .iter()
            .map(|l| (&l.reason, &l.error))
            .collect::<Vec<_>>()
    );
    handle.shutdown().await.unwrap();

    // Each hostile message: its own dead letter, with the expected reason.
    assert_eq!(letters.len(), expected.len(), "{letters:?}");
    let mut reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    reasons.sort();
    let mut want: Vec<&str> = expected.values().copied().collect();
    want.sort();
    assert_eq!(reasons, want);
    for letter in &letters {
        if let Some(id) = letter.event_id
            && let Some(reason) = expected.get(&id)
        {
            assert_eq!(letter.reason, *reason, "{letter:?}");
        }
        if letter.reason == "oversized" {
            assert!(letter.error.contains("sha256"), "{}", letter.error);
        }
    }
    // A 10 MiB payload is not stored whole.
    let largest: i64 = sqlx::query_scalar(
        "SELECT max(octet_length(payload))::bigint FROM dead_letter WHERE reason = 'oversized'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(largest <= 64 * 1024, "{largest} bytes kept");
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dead_letter WHERE payload_bytes > 10 * 1024 * 1024",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(cut, 1, "the cut payload's full size is kept");

    // Every good event applied exactly once, nothing else applied.
    let rows: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM effect GROUP BY event_id")
            .fetch_all(pool)
            .await
            .unwrap();
    let applied: HashMap<Uuid, i64> = rows.into_iter().collect();
    for id in &good_ids {
        assert_eq!(applied.get(id), Some(&1), "good event {id}");
    }
    assert_eq!(applied.len(), good_ids.len(), "only good events applied");
    assert!(counts.duplicates >= 1, "the reused event id: {counts:?}");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_hostile_messages_are_dead_lettered_and_the_consumer_goes_on(pool: PgPool) {
    init_tracing();
    run(
        &pool,
        HostileDedup::TOPIC,
        Mode::Dedup,
        RecordEffect::<HostileDedup>::new(),
    )
    .await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_hostile_messages_are_dead_lettered_and_the_consumer_goes_on(pool: PgPool) {
    init_tracing();
    run(
        &pool,
        HostileInbox::TOPIC,
        Mode::Inbox,
        RecordEffect::<HostileInbox>::new(),
    )
    .await;
}
