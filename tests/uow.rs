//! Unit of Work against a real PostgreSQL (a fresh database per test).

use std::collections::{BTreeMap, HashMap};

use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
    customer: String,
    amount_cents: i64,
    tags: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, DomainEvent)]
#[serde(tag = "type")]
#[event(topic = "payments", aggregate_type = "Payment", version = 2)]
enum PaymentEvent {
    #[event(event_type = "PaymentAuthorized")]
    Authorized {
        #[event(aggregate_id)]
        payment_id: Uuid,
        #[event(partition_key)]
        order_id: Uuid,
        amount_cents: i64,
    },
    #[event(event_type = "PaymentCaptured", version = 3)]
    Captured {
        #[event(aggregate_id)]
        payment_id: Uuid,
        #[event(partition_key)]
        order_id: Uuid,
    },
}

/// An event whose payload cannot be serialized (JSON map keys must be strings).
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(topic = "broken")]
struct Unserializable {
    #[event(aggregate_id)]
    id: u64,
    #[serde(with = "pairs")]
    map: HashMap<(u8, u8), u8>,
}

mod pairs {
    use std::collections::HashMap;
    pub fn serialize<S: serde::Serializer>(
        m: &HashMap<(u8, u8), u8>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        serde::Serialize::serialize(m, s)
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        _: D,
    ) -> Result<HashMap<(u8, u8), u8>, D::Error> {
        Ok(HashMap::new())
    }
}

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", aggregate_type = "Order")]
struct WithOwnId {
    #[event(event_id)]
    id: Uuid,
    #[event(aggregate_id)]
    order_id: Uuid,
}

fn placed(i: usize) -> OrderPlaced {
    OrderPlaced {
        order_id: Uuid::now_v7(),
        customer: format!("customer-{i}"),
        amount_cents: i as i64 * 100 + 1,
        tags: vec!["a".into(), format!("n{i}")],
    }
}

async fn create_orders_table(pool: &PgPool) {
    sqlx::query("CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL CHECK (amount_cents > 0))")
        .execute(pool)
        .await
        .unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn insert_order(uow: &mut UnitOfWork, id: Uuid, amount: i64) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2)")
        .bind(id)
        .bind(amount)
        .execute(&mut **uow)
        .await
        .map(|_| ())
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn commit_writes_domain_row_and_every_outbox_row(pool: PgPool) {
    create_orders_table(&pool).await;
    let event = placed(1);
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    insert_order(&mut uow, event.order_id, event.amount_cents)
        .await
        .unwrap();
    let id1 = uow.record(event.clone());
    let payment_id = Uuid::now_v7();
    let id2 = uow.record(PaymentEvent::Authorized {
        payment_id,
        order_id: event.order_id,
        amount_cents: 101,
    });
    let id3 = uow.record(PaymentEvent::Captured {
        payment_id,
        order_id: event.order_id,
    });
    assert_eq!(uow.pending_events(), 3);
    let committed = uow.commit().await.unwrap();
    assert_eq!(committed.event_ids, vec![id1, id2, id3]);

    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    type Row = (Uuid, String, String, String, i32, String, String, bool);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT event_id, aggregate_type, aggregate_id, event_type, event_version, topic,
                partition_key, published_at IS NULL
         FROM outbox_event ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let oid = event.order_id.to_string();
    let pid = payment_id.to_string();
    assert_eq!(
        rows,
        vec![
            (
                id1,
                "Order".into(),
                oid.clone(),
                "OrderPlaced".into(),
                1,
                "orders".into(),
                oid.clone(),
                true
            ),
            (
                id2,
                "Payment".into(),
                pid.clone(),
                "PaymentAuthorized".into(),
                2,
                "payments".into(),
                oid.clone(),
                true
            ),
            (
                id3,
                "Payment".into(),
                pid,
                "PaymentCaptured".into(),
                3,
                "payments".into(),
                oid,
                true
            ),
        ]
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn error_after_recording_writes_nothing(pool: PgPool) {
    create_orders_table(&pool).await;

    async fn place(pool: &PgPool, amount: i64) -> Result<(), Box<dyn std::error::Error>> {
        let mut uow = UnitOfWork::begin(pool).await?;
        let id = Uuid::now_v7();
        uow.record(OrderPlaced {
            amount_cents: amount,
            ..placed(0)
        });
        // Fails the CHECK constraint for amount <= 0: `?` returns, the Unit
        // of Work is dropped, the transaction rolls back.
        insert_order(&mut uow, id, amount).await?;
        uow.commit().await?;
        Ok(())
    }

    assert!(place(&pool, -5).await.is_err());
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
    // The same code path commits both when nothing fails.
    place(&pool, 5).await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn drop_and_rollback_write_nothing(pool: PgPool) {
    create_orders_table(&pool).await;
    {
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        let e = placed(1);
        insert_order(&mut uow, e.order_id, 10).await.unwrap();
        uow.record(e);
        // dropped here without commit
    }
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let e = placed(2);
    insert_order(&mut uow, e.order_id, 10).await.unwrap();
    uow.record(e);
    uow.rollback().await.unwrap();

    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn serialization_failure_fails_the_commit_and_writes_nothing(pool: PgPool) {
    create_orders_table(&pool).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    insert_order(&mut uow, Uuid::now_v7(), 10).await.unwrap();
    uow.record(placed(1));
    uow.record(Unserializable {
        id: 7,
        map: HashMap::from([((1, 2), 3)]),
    });
    let err = uow.commit().await.unwrap_err();
    assert!(
        matches!(&err, outbox::Error::Serialize { event_type, .. } if event_type == "Unserializable"),
        "{err}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 0);
}

async fn commit_n_and_check_round_trip(pool: &PgPool, n: usize) {
    let events: Vec<OrderPlaced> = (0..n).map(placed).collect();
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    for e in &events {
        uow.record(e.clone());
    }
    let committed = uow.commit().await.unwrap();
    assert_eq!(committed.event_ids.len(), n);

    let rows: Vec<(Uuid, String, String)> = sqlx::query_as(
        "SELECT event_id, event_type, payload::text FROM outbox_event
         WHERE event_id = ANY($1) ORDER BY id",
    )
    .bind(&committed.event_ids)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), n);
    for ((row, expected), id) in rows.iter().zip(&events).zip(&committed.event_ids) {
        assert_eq!(&row.0, id, "outbox ids follow record order");
        let decoded = OrderPlaced::from_payload(&row.1, row.2.as_bytes()).unwrap();
        assert_eq!(&decoded, expected);
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn one_ten_and_a_thousand_events_per_commit_round_trip(pool: PgPool) {
    for n in [1, 10, 1000] {
        commit_n_and_check_round_trip(&pool, n).await;
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_event").await,
        1011
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT event_id) FROM outbox_event").await,
        1011
    );
}

/// Events sharing their type, version, topic and aggregate type are written
/// with those sent once (a statement of its own); each row still gets its
/// own aggregate id, key, payload and headers.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_commit_of_events_of_one_type_writes_every_column(pool: PgPool) {
    let events: Vec<OrderPlaced> = (0..4).map(placed).collect();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let mut ids: Vec<Uuid> = events[..3].iter().map(|e| uow.record(e.clone())).collect();
    // The last one with a header of its own.
    ids.push(uow.record_message(outbox::OutboxMessage {
        headers: Headers {
            causation_id: Some(ids[0]),
            ..Headers::default()
        },
        ..outbox::OutboxMessage::from_event(&events[3]).unwrap()
    }));
    uow.commit().await.unwrap();
    type Row = (
        Uuid,
        String,
        String,
        String,
        i32,
        String,
        String,
        String,
        Option<String>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT event_id, aggregate_type, aggregate_id, event_type, event_version, topic,
                partition_key, payload->>'customer', headers->>'causation_id'
         FROM outbox_event ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected: Vec<Row> = events
        .iter()
        .enumerate()
        .map(|(i, e)| {
            (
                ids[i],
                "Order".into(),
                e.order_id.to_string(),
                "OrderPlaced".into(),
                1,
                "orders".into(),
                e.order_id.to_string(),
                e.customer.clone(),
                (i == 3).then(|| ids[0].to_string()),
            )
        })
        .collect();
    assert_eq!(rows, expected);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn enum_payload_round_trips_by_event_type(pool: PgPool) {
    let (payment_id, order_id) = (Uuid::now_v7(), Uuid::now_v7());
    let sent = vec![
        PaymentEvent::Authorized {
            payment_id,
            order_id,
            amount_cents: 5,
        },
        PaymentEvent::Captured {
            payment_id,
            order_id,
        },
    ];
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    for e in &sent {
        uow.record(e.clone());
    }
    uow.commit().await.unwrap();
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT event_type, payload::text FROM outbox_event ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let got: Vec<PaymentEvent> = rows
        .iter()
        .map(|(t, p)| PaymentEvent::from_payload(t, p.as_bytes()).unwrap())
        .collect();
    assert_eq!(got, sent);
    // A payload read under the wrong event type is refused, not misread.
    let err = PaymentEvent::from_payload("PaymentCaptured", rows[0].1.as_bytes()).unwrap_err();
    assert!(
        matches!(err, outbox::Error::EventTypeMismatch { .. }),
        "{err}"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn event_id_is_unique_across_commits(pool: PgPool) {
    create_orders_table(&pool).await;
    let fixed = Uuid::now_v7();
    let order_id = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert_eq!(
        uow.record(WithOwnId {
            id: fixed,
            order_id
        }),
        fixed
    );
    uow.commit().await.unwrap();

    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    insert_order(&mut uow, order_id, 10).await.unwrap();
    uow.record(WithOwnId {
        id: fixed,
        order_id,
    });
    let err = uow.commit().await.unwrap_err();
    let outbox::Error::Database(sqlx::Error::Database(db)) = &err else {
        panic!("expected a unique violation, got {err}");
    };
    assert!(db.is_unique_violation(), "{db}");
    // The failed commit took its domain row with it.
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_event").await, 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn sixteen_concurrent_writers_each_event_present_exactly_once(pool: PgPool) {
    create_orders_table(&pool).await;
    const TASKS: usize = 16;
    const COMMITS: usize = 20;
    const EVENTS: usize = 5;
    let mut handles = Vec::new();
    for t in 0..TASKS {
        let pool = pool.clone();
        handles.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for c in 0..COMMITS {
                let mut uow = UnitOfWork::begin(&pool).await.unwrap();
                let e = placed(t * 1000 + c);
                insert_order(&mut uow, e.order_id, 10).await.unwrap();
                for _ in 0..EVENTS {
                    uow.record(OrderPlaced {
                        order_id: e.order_id,
                        ..placed(c)
                    });
                }
                ids.extend(uow.commit().await.unwrap().event_ids);
            }
            ids
        }));
    }
    let mut committed = Vec::new();
    for h in handles {
        committed.extend(h.await.unwrap());
    }
    assert_eq!(committed.len(), TASKS * COMMITS * EVENTS);
    let stored: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM outbox_event GROUP BY event_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let stored: BTreeMap<Uuid, i64> = stored.into_iter().collect();
    assert_eq!(stored.len(), committed.len());
    for id in &committed {
        assert_eq!(stored.get(id), Some(&1), "event {id} present exactly once");
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders").await,
        (TASKS * COMMITS) as i64
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn headers_carry_correlation_and_causation(pool: PgPool) {
    let correlation = Uuid::now_v7();
    let causation = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.set_correlation_id(correlation);
    uow.set_causation_id(causation);
    uow.headers_mut().traceparent =
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    uow.headers_mut()
        .extra
        .insert("tenant".into(), "acme".into());
    uow.record(placed(1));
    uow.commit().await.unwrap();

    let headers: sqlx::types::Json<Headers> =
        sqlx::query_scalar("SELECT headers FROM outbox_event")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(headers.correlation_id, Some(correlation));
    assert_eq!(headers.causation_id, Some(causation));
    assert_eq!(
        headers.traceparent.as_deref(),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert_eq!(
        headers.extra.get("tenant").map(String::as_str),
        Some("acme")
    );

    // Without an explicit one, every Unit of Work gets its own correlation id.
    let mut a = UnitOfWork::begin(&pool).await.unwrap();
    let b = UnitOfWork::begin(&pool).await.unwrap();
    assert!(a.headers().correlation_id.is_some());
    assert_ne!(a.headers().correlation_id, b.headers().correlation_id);
    a.record(placed(2));
    let expected = a.headers().correlation_id;
    a.commit().await.unwrap();
    let stored: Option<String> = sqlx::query_scalar(
        "SELECT headers->>'correlation_id' FROM outbox_event ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stored, expected.map(|u| u.to_string()));
}

#[sqlx::test(migrations = false)]
async fn migrate_is_idempotent_and_tolerates_concurrent_callers(pool: PgPool) {
    let (a, b) = tokio::join!(outbox::migrate(&pool), outbox::migrate(&pool));
    a.unwrap();
    b.unwrap();
    outbox::migrate(&pool).await.unwrap();
    for table in ["outbox_event", "inbox_event", "processed_event"] {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(table)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(exists, "{table} exists");
    }
    let predicate: String = sqlx::query_scalar(
        "SELECT pg_get_expr(i.indpred, i.indrelid) FROM pg_index i
         JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'ix_outbox_event_unpublished'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        predicate,
        "((published_at IS NULL) AND (parked_at IS NULL) AND (held_until IS NULL))"
    );
}

#[sqlx::test(migrations = false)]
async fn migrate_coexists_with_the_applications_own_sqlx_migrations(pool: PgPool) {
    // The application's migrator ran first, with a version of its own.
    sqlx::query(
        "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL,
            installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL,
            checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (1, 'app tables', true, '\\x00', 1)",
    )
    .execute(&pool)
    .await
    .unwrap();
    outbox::migrate(&pool).await.unwrap();
    outbox::migrate(&pool).await.unwrap();
    let ours = outbox::MIGRATOR.iter().count() as i64;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        1 + ours
    );
}

/// Writers of one key are serialized by an advisory lock per key bucket
/// (256 buckets), so a commit holds at most 256 of those locks however many
/// keys it writes: eight concurrent commits of 20,000 keys each fit in the
/// server's lock table (one lock per key would need 160,000 entries and fail
/// with "out of shared memory").
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn eight_concurrent_commits_of_twenty_thousand_keys_each(pool: PgPool) {
    let writers: Vec<_> = (0..8)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut uow = UnitOfWork::begin(&pool).await.unwrap();
                for i in 0..20_000 {
                    uow.record(placed(i));
                }
                uow.commit().await.unwrap().event_ids.len()
            })
        })
        .collect();
    for w in writers {
        assert_eq!(w.await.unwrap(), 20_000);
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(DISTINCT partition_key) FROM outbox_event"
        )
        .await,
        160_000
    );
}

/// An outbox row of partition key `key`.
fn keyed(key: &str) -> outbox::OutboxMessage {
    outbox::OutboxMessage {
        event_id: Uuid::now_v7(),
        aggregate_type: "Order".into(),
        aggregate_id: key.into(),
        event_type: "OrderPlaced".into(),
        event_version: 1,
        topic: "orders".into(),
        partition_key: key.into(),
        payload: "{}".into(),
        headers: Headers::default(),
    }
}

/// Opens a transaction and writes one row per key in it (the key locks are
/// then held until it ends); gives up after `wait` if the locks are taken.
async fn hold_keys(
    pool: &PgPool,
    keys: &[&str],
    wait: &str,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, outbox::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(&format!("SET LOCAL lock_timeout = '{wait}'"))
        .execute(&mut *tx)
        .await?;
    let messages: Vec<outbox::OutboxMessage> = keys.iter().map(|k| keyed(k)).collect();
    outbox_core::insert_messages(&mut tx, &messages, &Headers::default()).await?;
    Ok(tx)
}

fn is_lock_timeout(
    result: &Result<sqlx::Transaction<'static, sqlx::Postgres>, outbox::Error>,
) -> bool {
    matches!(result, Err(outbox::Error::Database(sqlx::Error::Database(e))) if e.code().as_deref() == Some("55P03"))
}

/// The key locks of the outbox insert: a writer waits, from its insert to
/// the other's commit, for writers of its keys' buckets (the same key, or
/// another key of the same bucket: the documented price of a bounded lock
/// count), and never for writers of other buckets.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn key_locks_serialize_writers_of_a_bucket_and_only_them(pool: PgPool) {
    // Two keys of one bucket, and one of another bucket.
    let mut by_bucket: HashMap<i32, String> = HashMap::new();
    let mut same = None;
    for i in 0.. {
        let key = format!("key-{i}");
        let bucket: i32 = sqlx::query_scalar("SELECT hashtext($1) & 255")
            .bind(&key)
            .fetch_one(&pool)
            .await
            .unwrap();
        if let Some(other) = by_bucket.get(&bucket) {
            same = Some((other.clone(), key, bucket));
            break;
        }
        by_bucket.insert(bucket, key);
    }
    let (a, b, bucket) = same.unwrap();
    let elsewhere = by_bucket
        .iter()
        .find(|(other, _)| **other != bucket)
        .map(|(_, key)| key.clone())
        .unwrap();

    let first = hold_keys(&pool, &[&a], "2s").await.unwrap();
    assert!(is_lock_timeout(&hold_keys(&pool, &[&a], "300ms").await));
    assert!(is_lock_timeout(&hold_keys(&pool, &[&b], "300ms").await));
    let other = hold_keys(&pool, &[&elsewhere], "2s").await;
    assert!(other.is_ok(), "{:?}", other.err());
    first.commit().await.unwrap();
    assert!(hold_keys(&pool, &[&b], "2s").await.is_ok());
}

/// Scheduled events are written at commit with the other events (their
/// ids last), with the Unit of Work's headers, `due_at` the time asked for
/// (`record_after`: from the commit, by the database's clock) and held
/// until then.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn scheduled_events_carry_the_headers_and_their_due_time(pool: PgPool) {
    use std::time::{Duration, SystemTime};
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let correlation = uow.headers().correlation_id.unwrap();
    let after = uow.record_after(Duration::from_secs(90), placed(0));
    let at = uow.record_at(SystemTime::now() + Duration::from_secs(3600), placed(1));
    let now = uow.record(placed(2));
    assert_eq!(uow.pending_events(), 3);
    let committed = uow.commit().await.unwrap();
    assert_eq!(committed.event_ids, [now, after, at]);

    let rows: Vec<(Uuid, Option<String>, Option<f64>, bool)> = sqlx::query_as(
        "SELECT event_id, headers->>'correlation_id',
                EXTRACT(EPOCH FROM due_at - created_at)::float8,
                held_until IS NOT DISTINCT FROM due_at
         FROM outbox_event ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 3);
    for (event_id, corr, due_in, held) in rows {
        assert_eq!(corr, Some(correlation.to_string()), "{event_id}");
        assert!(held, "{event_id}");
        match due_in {
            None => assert_eq!(event_id, now),
            Some(secs) if event_id == after => assert!((secs - 90.0).abs() < 1.0, "{secs}"),
            Some(secs) => {
                assert_eq!(event_id, at);
                assert!((secs - 3600.0).abs() < 5.0, "{secs}");
            }
        }
    }
}
