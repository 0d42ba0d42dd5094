//! Partition maintenance while the application runs, against a real
//! PostgreSQL (fresh database per test) and the real broker: retention
//! dropping partitions while relays claim, partitions that fell behind
//! created while writers insert into their ranges, and the conversion
//! while writers insert.
//!
//! The tests that call `relay_mode` run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command): "published" is
//! then "passed by its slot's position" (see `common::unpublished`), and the
//! relays' claims read windows and record positions instead of marking rows.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::Relay;
use outbox_runtime::cleanup::{self, Retention};
use outbox_runtime::partition::{self, PartitionKind, PartitionPlan, uuid_at};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinHandle;
use uuid::Uuid;

const DAY_MS: i64 = 86_400_000;

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn now_ms(pool: &PgPool) -> i64 {
    scalar(pool, "SELECT (extract(epoch FROM now()) * 1000)::int8").await
}

/// A UUID whose first 48 bits are `ms` (a UUIDv7 of that millisecond).
fn id_at(ms: i64) -> Uuid {
    Uuid::from_u128(uuid_at(ms).as_u128() | (Uuid::new_v4().as_u128() & ((1 << 80) - 1)))
}

/// A pool of its own (another process, as far as the server can tell).
async fn own_pool(pool: &PgPool, connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap()
}

async fn insert_outbox(pool: &PgPool, event_id: Uuid, topic: &str) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key)
         VALUES ($1, 'Order', 'k', 'OrderPlaced', '{}', $2, 'k')",
    )
    .bind(event_id)
    .bind(topic)
    .execute(pool)
    .await
    .unwrap();
}

/// Creates the partition of `table` for the day `days` days before today
/// (a day this test treats as long past) and returns its name. Each
/// attempt waits 1 s at most for the table's lock: a relay may keep its
/// claim open while its next statement waits behind the lock request.
async fn past_day(pool: &PgPool, table: &str, days: i64) -> (i64, String) {
    let today = now_ms(pool).await.div_euclid(DAY_MS) * DAY_MS;
    let from = today - days * DAY_MS;
    let name = format!("{table}_past{days}");
    for attempt in 1.. {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '1s'")
            .execute(&mut *tx)
            .await
            .unwrap();
        let created = sqlx::query(&format!(
            "CREATE TABLE {name} PARTITION OF {table} FOR VALUES FROM ('{}') TO ('{}')",
            uuid_at(from),
            uuid_at(from + DAY_MS)
        ))
        .execute(&mut *tx)
        .await;
        match created {
            Ok(_) => {
                tx.commit().await.unwrap();
                break;
            }
            Err(e)
                if attempt < 30
                    && e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55P03") =>
            {
                tx.rollback().await.unwrap();
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    (from, name)
}

/// Rows a consumer no longer needs, in the default partitions (ids far
/// ahead) and the dead letters: what the row-by-row half of a pass deletes.
async fn expired_rows(pool: &PgPool, round: i64, n: i64) {
    sqlx::query(
        "INSERT INTO processed_event (consumer, event_id, processed_at)
         SELECT 'c', $1::uuid, now() - interval '40 days'
         UNION ALL SELECT 'c', gen_random_uuid(), now() - interval '40 days'
                   FROM generate_series(2, $2)",
    )
    .bind(id_at(now_ms(pool).await + 1000 * DAY_MS + round))
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inbox_event (consumer, event_id, payload, processed, processed_at)
         SELECT 'c', gen_random_uuid(), '{}', true, now() - interval '40 days'
         FROM generate_series(1, $1)",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO dead_letter (consumer, topic, \"partition\", \"offset\", reason, error,
                                  last_failed_at)
         SELECT 'c', 't', $1::int, o, 'not_json', 'x', now() - interval '40 days'
         FROM generate_series(1, $2) AS o",
    )
    .bind(round as i32)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// Commits messages to `topic` until `stop`, 5 per Unit of Work; returns
/// their ids.
fn writer(pool: PgPool, topic: String, stop: Arc<AtomicBool>) -> JoinHandle<Vec<Uuid>> {
    tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut seq = 0;
        while !stop.load(Ordering::Relaxed) {
            let mut uow = UnitOfWork::begin(&pool).await.unwrap();
            for _ in 0..5 {
                ids.push(uow.record_message(message(&topic, &format!("k{}", seq % 8), seq)));
                seq += 1;
            }
            uow.commit().await.unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        ids
    })
}

/// Two relays publish what a writer commits while cleanup passes drop
/// expired partitions of the outbox, one new expired partition per pass:
/// each drop locks the parent exclusively while the relays' claims, marks
/// and holds lock the parent and then every partition. Every pass
/// completes (no deadlock fails it), every expired partition is dropped
/// (a busy one at a later pass), and the row-by-row half of each pass
/// (dedup rows, inbox rows, dead letters) runs every time.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn every_cleanup_pass_completes_while_relays_claim(pool: PgPool) {
    init_tracing();
    relay_mode(&pool).await;
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    // Room for past days: the legacy partition is empty.
    sqlx::query("DROP TABLE outbox_event_legacy")
        .execute(&pool)
        .await
        .unwrap();
    let topic = unique_topic("part-retention-load");
    create_warm_topic(&brokers(), &topic).await;
    let stop = Arc::new(AtomicBool::new(false));
    let write = writer(pool.clone(), topic.clone(), stop.clone());
    let mut relays = Vec::new();
    for _ in 0..2 {
        relays.push(
            Relay::builder(own_pool(&pool, 4).await)
                .brokers(brokers())
                .batch_size(20)
                .delivery_timeout(Duration::from_secs(10))
                .spawn()
                .unwrap(),
        );
    }
    // The relays are at work.
    assert!(
        eventually(Duration::from_secs(30), || async {
            scalar(&pool, "SELECT count(*) FROM outbox_event").await - unpublished(&pool).await > 50
        })
        .await,
        "the relays publish"
    );

    let retention = Retention::new(Duration::from_secs(30 * 86_400))
        .dead_letters(Duration::from_secs(30 * 86_400));
    let rounds = 12;
    let per_round = 20;
    let mut expired = Vec::new();
    let mut failures = Vec::new();
    let mut reports = Vec::new();
    let mut cleaned = (0, 0, 0);
    let mut pending = 0;
    for round in 0..rounds {
        let (from, name) = past_day(&pool, "outbox_event", 40 + round).await;
        let id = id_at(from + 1000);
        insert_outbox(&pool, id, &topic).await;
        // Created at its id's time, published long ago.
        sqlx::query(
            "UPDATE outbox_event SET created_at = to_timestamp($2 / 1000.0),
                                     published_at = now() - interval '35 days'
             WHERE event_id = $1",
        )
        .bind(id)
        .bind((from + 1000) as f64)
        .execute(&pool)
        .await
        .unwrap();
        expired.push(name);
        expired_rows(&pool, round, per_round).await;
        pending += per_round as u64;
        match cleanup::cleanup(&pool, &retention).await {
            Ok(r) => {
                reports.push(r);
                cleaned.0 += r.processed_events;
                cleaned.1 += r.inbox_events;
                cleaned.2 += r.dead_letters;
                if (r.processed_events, r.inbox_events, r.dead_letters)
                    != (pending, pending, pending)
                {
                    // Where the rows the pass left are, and the partitions.
                    let left: Vec<String> = sqlx::query_scalar(
                        "SELECT t.tableoid::regclass::text || ' ' || t.event_id || ' ' || t.ctid
                         FROM processed_event t WHERE processed_at < now() - interval '30 days'
                         UNION ALL
                         SELECT 'inbox ' || t.tableoid::regclass::text || ' ' || t.ctid
                         FROM inbox_event t WHERE processed_at < now() - interval '30 days'",
                    )
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_default();
                    let parts: Vec<String> = partition::list(&pool)
                        .await
                        .unwrap_or_default()
                        .into_iter()
                        .filter(|p| p.table != "outbox_event")
                        .map(|p| format!("{} {:?}..{:?}", p.name, p.from, p.to))
                        .collect();
                    panic!(
                        "round {round}: the rows expired since the last pass not all cleaned \
                         ({pending} each): {r:?}; left: {left:?}; partitions: {parts:?}"
                    );
                }
                pending = 0;
            }
            Err(e) => failures.push(format!("round {round}: {e}")),
        }
    }
    // A partition busy at its pass goes at a later one.
    let mut left = Vec::new();
    for _ in 0..30 {
        let names: HashSet<String> = partition::list(&pool)
            .await
            .unwrap()
            .into_iter()
            .map(|p| p.name)
            .collect();
        left = expired
            .iter()
            .filter(|n| names.contains(*n))
            .cloned()
            .collect();
        if left.is_empty() {
            break;
        }
        match cleanup::cleanup(&pool, &retention).await {
            Ok(r) => reports.push(r),
            Err(e) => failures.push(format!("late pass: {e}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let written = write.await.unwrap();
    assert!(
        wait_until_published(&pool, Duration::from_secs(60)).await,
        "the relays published everything"
    );
    for relay in relays {
        relay.shutdown().await.unwrap();
    }
    assert!(failures.is_empty(), "every pass completes: {failures:?}");
    assert!(
        left.is_empty(),
        "expired partitions dropped: {left:?} left; passes: {reports:?}"
    );
    assert!(written.len() > 100, "the writer kept writing");
    let total = rounds as u64 * per_round as u64;
    assert_eq!(cleaned, (total, total, total));
}

/// Partitions that fell behind, created while writers keep inserting rows
/// into their ranges (into the default partition until the partition
/// exists): `maintain` succeeds, every row is kept exactly once, each in
/// its range's partition.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn partitions_that_fell_behind_catch_up_while_writers_insert(pool: PgPool) {
    let period = 60_000;
    let plan = PartitionPlan {
        period: Duration::from_millis(period as u64),
        ahead: 1,
        ..PartitionPlan::default()
    };
    partition::enable(&pool, &plan).await.unwrap();
    // The ranges past the legacy one: none created yet (a maintainer that
    // stopped), so their rows go to the default partitions.
    let first = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .find(|p| p.table == "outbox_event" && p.kind == PartitionKind::Legacy)
        .and_then(|p| p.to_ms())
        .unwrap();
    for p in partition::list(&pool).await.unwrap() {
        if p.kind == PartitionKind::Range {
            sqlx::query(&format!("DROP TABLE {}", p.name))
                .execute(&pool)
                .await
                .unwrap();
        }
    }
    let ranges = 12;
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4_i64 {
        let pool = own_pool(&pool, 1).await;
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut n = 0_i64;
            while !stop.load(Ordering::Relaxed) {
                let range = (n * 4 + w) % ranges;
                let id = id_at(first + range * period + 1 + (n % 50_000));
                insert_outbox(&pool, id, "t").await;
                sqlx::query("INSERT INTO processed_event (consumer, event_id) VALUES ('c', $1)")
                    .bind(id)
                    .execute(&pool)
                    .await
                    .unwrap();
                ids.push(id);
                n += 1;
            }
            ids
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let catch_up = PartitionPlan {
        ahead: ranges as u32 + 2,
        ..plan.clone()
    };
    let report = partition::maintain(&pool, &catch_up).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let mut written = Vec::new();
    for w in writers {
        written.extend(w.await.unwrap());
    }
    let report = report.unwrap().expect("the only maintainer");
    assert!(report.created >= 3 * ranges as u64, "{report:?}");
    assert!(report.moved_rows > 0, "{report:?}");
    for table in ["outbox_event", "processed_event"] {
        let (rows, distinct, in_default): (i64, i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*), count(DISTINCT event_id),
                    count(*) FILTER (WHERE tableoid = '{table}_default'::regclass)
             FROM {table}"
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(rows, written.len() as i64, "{table}: every row kept");
        assert_eq!(distinct, rows, "{table}: each once");
        assert_eq!(in_default, 0, "{table}: each in its range's partition");
    }
    let found: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM outbox_event")
        .fetch_all(&pool)
        .await
        .unwrap();
    let found: HashSet<Uuid> = found.into_iter().collect();
    assert!(written.iter().all(|id| found.contains(id)));
}

/// The conversion of tables holding rows (UUIDv7 ids and others) while
/// writers insert into all three: it goes through (writers in the middle of
/// a transaction are no relay), every row is kept exactly once, and no
/// writer waits long.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn converting_while_writers_insert_keeps_every_row(pool: PgPool) {
    // 20,000 rows per table, one in ten with an id that is not a UUIDv7.
    for table in ["outbox_event", "processed_event", "inbox_event"] {
        let (columns, values) = match table {
            "outbox_event" => (
                "event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key",
                "'Order', 'k', 'OrderPlaced', '{}', 't', 'k'",
            ),
            "processed_event" => ("event_id, consumer", "'c'"),
            _ => ("event_id, consumer, payload", "'c', '{}'"),
        };
        sqlx::query(&format!(
            "INSERT INTO {table} ({columns})
             SELECT CASE WHEN g % 10 = 0 THEN gen_random_uuid()
                         ELSE ('0' || lpad(to_hex(g), 11, '0') || '-7000-8000-000000000000')::uuid
                         END, {values}
             FROM generate_series(1, 20000) AS g"
        ))
        .execute(&pool)
        .await
        .unwrap();
    }
    let before: i64 = scalar(&pool, "SELECT count(*) FROM outbox_event").await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..3 {
        let pool = own_pool(&pool, 1).await;
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut slowest = Duration::ZERO;
            let mut n = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                let id = if n.is_multiple_of(4) {
                    Uuid::new_v4()
                } else {
                    Uuid::now_v7()
                };
                let started = Instant::now();
                // One transaction per write, held open a moment: the
                // conversion meets writers in the middle of theirs.
                let mut tx = pool.begin().await.unwrap();
                let sql = match w {
                    0 => {
                        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id,
                                                   event_type, payload, topic, partition_key)
                         VALUES ($1, 'Order', 'k', 'OrderPlaced', '{}', 't', 'k')"
                    }
                    1 => "INSERT INTO processed_event (consumer, event_id) VALUES ('c', $1)",
                    _ => {
                        "INSERT INTO inbox_event (consumer, event_id, payload)
                         VALUES ('c', $1, '{}')"
                    }
                };
                sqlx::query(sql).bind(id).execute(&mut *tx).await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                tx.commit().await.unwrap();
                slowest = slowest.max(started.elapsed());
                ids.push(id);
                n += 1;
            }
            (ids, slowest)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let report = partition::enable(&pool, &PartitionPlan::default()).await;
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut written = Vec::new();
    let mut slowest = Duration::ZERO;
    for w in writers {
        let (ids, s) = w.await.unwrap();
        written.push(ids);
        slowest = slowest.max(s);
    }
    let report = report.unwrap();
    eprintln!("conversion: {took:?}, {report:?}; slowest write: {slowest:?}");
    assert_eq!(report.converted.len(), 3, "{report:?}");
    for (table, ids) in ["outbox_event", "processed_event", "inbox_event"]
        .into_iter()
        .zip(&written)
    {
        assert!(ids.len() > 10, "{table}: writers kept writing");
        let (rows, distinct): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*), count(DISTINCT event_id) FROM {table}"
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(rows, before + ids.len() as i64, "{table}: every row kept");
        assert_eq!(distinct, rows, "{table}: each once");
        let found: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE event_id = ANY($1)"
        ))
        .bind(ids)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(found, ids.len() as i64, "{table}: the writers' rows");
    }
    // Far from the time it takes (milliseconds here): only a hang or a
    // walk over the tables under their exclusive locks gets near it.
    assert!(
        slowest < Duration::from_secs(10),
        "a writer waited {slowest:?}"
    );
}
