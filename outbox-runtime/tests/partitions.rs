//! The partitioned layout against a real PostgreSQL (fresh database per
//! test) and the real broker: the conversion of an installation holding
//! rows (rows, ids, dedup and publishing carried over), inserts outside
//! every dated range, partitions created ahead by one maintainer, and
//! retention by partition (old published partitions dropped, partitions
//! with rows still needed kept).
//!
//! The tests that call `relay_mode` run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command): "published" is
//! then "passed by its slot's position" (see `common::unpublished`), and
//! retention keeps a partition until every lane's position is past its
//! rows. The tests of that mode's own rules enable it themselves.

mod common;

use std::time::Duration;

use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::cleanup::{self, Retention};
use outbox_runtime::partition::{self, PartitionKind, PartitionPlan, uuid_at};
use outbox_runtime::{Error, Relay};
use sqlx::PgPool;
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

/// The partition holding `event_id` in `table`.
async fn home(pool: &PgPool, table: &str, event_id: Uuid) -> String {
    sqlx::query_scalar(&format!(
        "SELECT tableoid::regclass::text FROM {table} WHERE event_id = $1"
    ))
    .bind(event_id)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn insert_outbox(pool: &PgPool, event_id: Uuid, topic: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key)
         VALUES ($1, 'Order', 'k', 'OrderPlaced', '{}', $2, 'k') RETURNING id",
    )
    .bind(event_id)
    .bind(topic)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn dedup(pool: &PgPool, consumer: &str, event_id: Uuid) -> u64 {
    sqlx::query(
        "INSERT INTO processed_event (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(event_id)
    .execute(pool)
    .await
    .unwrap()
    .rows_affected()
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn enabling_on_an_installation_with_rows_keeps_rows_ids_dedup_and_publishing(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("part-enable");
    create_topic(&brokers(), &topic).await;
    let before = commit_messages(&pool, &topic, 30, 5, 10).await;
    // An id that is not a UUIDv7 and lies past the first boundary: it
    // cannot stay in the legacy range and is moved.
    let v4 = Uuid::from_u128(0xf000_0000_0000_4000_8000_0000_0000_0001);
    insert_outbox(&pool, v4, &topic).await;
    let max_before = scalar(&pool, "SELECT max(id) FROM outbox_event").await;
    for id in &before[..3] {
        assert_eq!(dedup(&pool, "billing", *id).await, 1);
    }
    sqlx::query(
        "INSERT INTO inbox_event (consumer, event_id, payload) VALUES ('billing', $1, '{}')",
    )
    .bind(before[0])
    .execute(&pool)
    .await
    .unwrap();
    let inbox_seq_before = scalar(&pool, "SELECT max(seq) FROM inbox_event").await;
    // Privileges, table-wide and per column, carry over.
    sqlx::query("GRANT SELECT, INSERT ON outbox_event TO PUBLIC")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("GRANT UPDATE (published_at) ON outbox_event TO PUBLIC")
        .execute(&pool)
        .await
        .unwrap();

    assert!(
        !partition::is_partitioned(&pool, "outbox_event")
            .await
            .unwrap()
    );
    let report = partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    assert_eq!(
        report.converted,
        ["outbox_event", "processed_event", "inbox_event"]
    );
    assert_eq!(report.moved_rows, 1, "the one id past the boundary");
    for table in partition::TABLES {
        assert!(partition::is_partitioned(&pool, table).await.unwrap());
    }
    // A second call changes nothing.
    let again = partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    assert!(again.converted.is_empty());
    assert_eq!(again.already.len(), 3);

    // Every table: legacy, three days ahead, default.
    let parts = partition::list(&pool).await.unwrap();
    for table in partition::TABLES {
        let kinds: Vec<PartitionKind> = parts
            .iter()
            .filter(|p| p.table == table)
            .map(|p| p.kind)
            .collect();
        assert_eq!(
            kinds,
            [
                PartitionKind::Legacy,
                PartitionKind::Range,
                PartitionKind::Range,
                PartitionKind::Range,
                PartitionKind::Default
            ],
            "{table}"
        );
    }
    // The rows stayed where they were: in the legacy partition, not copied.
    assert_eq!(
        home(&pool, "outbox_event", before[0]).await,
        "outbox_event_legacy"
    );
    assert_eq!(
        home(&pool, "outbox_event", v4).await,
        "outbox_event_default"
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox_event").await, 31);

    let public = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Vec<String>>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        public(
            "SELECT array_agg(a.privilege_type ORDER BY a.privilege_type) FROM pg_class c, aclexplode(c.relacl) a
             WHERE c.oid = 'outbox_event'::regclass AND a.grantee = 0"
        )
        .await,
        ["INSERT", "SELECT"]
    );
    assert_eq!(
        public(
            "SELECT array_agg(t.attname::text || ':' || a.privilege_type)
             FROM pg_attribute t, aclexplode(t.attacl) a
             WHERE t.attrelid = 'outbox_event'::regclass AND a.grantee = 0"
        )
        .await,
        ["published_at:UPDATE"]
    );
    assert_eq!(
        public(
            "SELECT array_agg(a.privilege_type) FROM pg_class c, aclexplode(c.relacl) a
             WHERE c.oid = 'outbox_event_id_seq'::regclass AND a.grantee = 0"
        )
        .await,
        ["USAGE"],
        "who may insert may draw ids"
    );

    // Ids go on past the old ones; the inbox's sequence too.
    let after = commit_messages(&pool, &topic, 10, 5, 5).await;
    let min_after: i64 =
        sqlx::query_scalar("SELECT min(id) FROM outbox_event WHERE event_id = ANY($1)")
            .bind(&after)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(min_after > max_before, "{min_after} > {max_before}");
    sqlx::query(
        "INSERT INTO inbox_event (consumer, event_id, payload) VALUES ('billing', $1, '{}')",
    )
    .bind(after[0])
    .execute(&pool)
    .await
    .unwrap();
    assert!(scalar(&pool, "SELECT max(seq) FROM inbox_event").await > inbox_seq_before);

    // Dedup across the conversion: an event recorded before is still a
    // duplicate, in the processed events and in the outbox.
    assert_eq!(dedup(&pool, "billing", before[1]).await, 0);
    assert_eq!(dedup(&pool, "shipping", before[1]).await, 1);
    assert_eq!(dedup(&pool, "billing", after[1]).await, 1);
    assert_eq!(dedup(&pool, "billing", after[1]).await, 0);
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let mut m = message(&topic, "k0", 0);
    m.event_id = before[2];
    uow.record_message(m);
    let err = uow.commit().await.unwrap_err();
    assert!(
        matches!(&err, outbox_core::Error::Database(sqlx::Error::Database(db)) if db.is_unique_violation()),
        "{err}"
    );
    let inbox_dup = sqlx::query(
        "INSERT INTO inbox_event (consumer, event_id, payload) VALUES ('billing', $1, '{}')",
    )
    .bind(before[0])
    .execute(&pool)
    .await
    .unwrap_err();
    assert!(
        inbox_dup
            .as_database_error()
            .is_some_and(|e| e.is_unique_violation())
    );

    // The relay publishes all of them, old and new, from every partition.
    let handle = Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
        .spawn()
        .unwrap();
    assert!(
        wait_until_published(&pool, Duration::from_secs(60)).await,
        "relay drained the partitioned outbox"
    );
    handle.shutdown().await.unwrap();
    let mut all = before.clone();
    all.push(v4);
    all.extend(&after);
    let received = read_topic(&brokers(), &topic, all.len(), Duration::from_secs(60)).await;
    // The v4 row went in with another key order: checked by id only.
    let ids: std::collections::HashSet<Uuid> = received.iter().map(|r| r.event_id()).collect();
    assert_eq!(ids, all.iter().copied().collect());
    assert_eq!(received.len(), all.len(), "each row published once");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn enabling_is_refused_while_a_relay_runs(pool: PgPool) {
    relay_mode(&pool).await;
    // The relay on a pool of its own: a relay stopped while it samples its
    // backlog gauges can hand its pool a connection still inside the
    // sample's read-only transaction.
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let handle = Relay::builder(relay_pool)
        .brokers(brokers())
        .spawn()
        .unwrap();
    let registered = eventually(Duration::from_secs(30), || async {
        scalar(
            &pool,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
               AND classid::int8 = 'outbox_event'::regclass::oid::int8",
        )
        .await
            > 0
    })
    .await;
    assert!(registered, "the relay registered");
    let err = partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("stop them")),
        "{err}"
    );
    handle.shutdown().await.unwrap();
    assert!(
        !partition::is_partitioned(&pool, "outbox_event")
            .await
            .unwrap()
    );
    // Once it is stopped, the conversion goes through.
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    assert!(
        partition::is_partitioned(&pool, "outbox_event")
            .await
            .unwrap()
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn rows_outside_every_dated_range_land_in_the_legacy_or_default_partition(pool: PgPool) {
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let now = now_ms(&pool).await;
    let far_future = id_at(now + 10 * DAY_MS);
    let far_past = id_at(now - 400 * DAY_MS);
    let tomorrow = id_at(now + DAY_MS + 1);
    let max = Uuid::max();
    for id in [far_future, far_past, tomorrow, max] {
        insert_outbox(&pool, id, "t").await;
        assert_eq!(dedup(&pool, "c", id).await, 1);
    }
    assert_eq!(
        home(&pool, "outbox_event", far_future).await,
        "outbox_event_default"
    );
    assert_eq!(
        home(&pool, "outbox_event", max).await,
        "outbox_event_default"
    );
    assert_eq!(
        home(&pool, "outbox_event", far_past).await,
        "outbox_event_legacy"
    );
    assert!(
        home(&pool, "outbox_event", tomorrow)
            .await
            .starts_with("outbox_event_p"),
        "a dated partition"
    );
    assert_eq!(
        home(&pool, "processed_event", far_future).await,
        "processed_event_default"
    );

    // Creating the partition of a range that has rows in the default
    // partition moves them into it.
    let plan = PartitionPlan {
        ahead: 12,
        ..PartitionPlan::default()
    };
    let report = partition::maintain(&pool, &plan).await.unwrap().unwrap();
    assert_eq!(report.moved_rows, 2, "the far future id of each table");
    assert!(
        home(&pool, "outbox_event", far_future)
            .await
            .starts_with("outbox_event_p")
    );
    assert!(
        home(&pool, "processed_event", far_future)
            .await
            .starts_with("processed_event_p")
    );
    assert_eq!(dedup(&pool, "c", far_future).await, 0);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn partitions_ahead_are_created_once_by_one_maintainer(pool: PgPool) {
    partition::enable(
        &pool,
        &PartitionPlan {
            ahead: 1,
            ..PartitionPlan::default()
        },
    )
    .await
    .unwrap();
    let ranges = |parts: &[partition::PartitionInfo]| {
        parts
            .iter()
            .filter(|p| p.kind == PartitionKind::Range)
            .count()
    };
    assert_eq!(ranges(&partition::list(&pool).await.unwrap()), 3);
    let plan = PartitionPlan {
        ahead: 5,
        ..PartitionPlan::default()
    };
    let (a, b) = tokio::join!(
        partition::maintain(&pool, &plan),
        partition::maintain(&pool, &plan)
    );
    let created: u64 = [a.unwrap(), b.unwrap()]
        .iter()
        .flatten()
        .map(|r| r.created)
        .sum();
    assert_eq!(created, 3 * 4, "four more per table, each created once");
    let parts = partition::list(&pool).await.unwrap();
    assert_eq!(ranges(&parts), 3 * 5);
    // Contiguous ranges, no gap, no overlap.
    for table in partition::TABLES {
        let mut last = None;
        for p in parts
            .iter()
            .filter(|p| p.table == table && p.kind != PartitionKind::Default)
        {
            if let Some(last) = last {
                assert_eq!(p.from, Some(last), "{}", p.name);
            }
            last = p.to;
        }
    }
    // Nothing left to create.
    let report = partition::maintain(&pool, &plan).await.unwrap().unwrap();
    assert_eq!(report.created, 0);
}

/// Replaces the (empty) legacy partition of `table` by one-day partitions
/// of the `days` days before today: what a partitioned installation holds
/// after some weeks.
async fn past_partitions(pool: &PgPool, table: &str, days: i64) -> Vec<(i64, String)> {
    let today = now_ms(pool).await.div_euclid(DAY_MS) * DAY_MS;
    sqlx::query(&format!("DROP TABLE {table}_legacy"))
        .execute(pool)
        .await
        .unwrap();
    let mut made = Vec::new();
    for d in (1..=days).rev() {
        let from = today - d * DAY_MS;
        let name = format!("{table}_past{d}");
        sqlx::query(&format!(
            "CREATE TABLE {name} PARTITION OF {table} FOR VALUES FROM ('{}') TO ('{}')",
            uuid_at(from),
            uuid_at(from + DAY_MS)
        ))
        .execute(pool)
        .await
        .unwrap();
        made.push((from, name));
    }
    // The current day, up to the first dated partition (tomorrow).
    sqlx::query(&format!(
        "CREATE TABLE {table}_today PARTITION OF {table} FOR VALUES FROM ('{}') TO ('{}')",
        uuid_at(today),
        uuid_at(today + DAY_MS)
    ))
    .execute(pool)
    .await
    .unwrap();
    made
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn retention_drops_old_partitions_and_keeps_those_with_rows_still_needed(pool: PgPool) {
    relay_mode(&pool).await;
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let outbox = past_partitions(&pool, "outbox_event", 40).await;
    let processed = past_partitions(&pool, "processed_event", 40).await;
    let inbox = past_partitions(&pool, "inbox_event", 40).await;
    let at = |parts: &[(i64, String)], days_ago: usize| parts[parts.len() - days_ago].clone();

    // Outbox: 40 days ago published (dropped), 39 days ago one row still
    // unpublished (kept), 38 days ago a parked row (kept), 37 days ago a
    // row published yesterday (kept: younger than the window), 2 days ago
    // published (inside the window: kept, not even looked at).
    let mut expect_kept = Vec::new();
    for (days_ago, published, parked) in [
        (40, Some(35), false),
        (39, None, false),
        (38, None, true),
        (37, Some(1), false),
        (2, Some(1), false),
    ] {
        let (from, name) = at(&outbox, days_ago);
        let id = id_at(from + 1000);
        insert_outbox(&pool, id, "t").await;
        // Created at its id's time, as a UUIDv7 says.
        sqlx::query(
            "UPDATE outbox_event SET published_at = now() - make_interval(days => $2),
                                     parked_at = CASE WHEN $3 THEN now() END,
                                     created_at = to_timestamp($4 / 1000.0)
             WHERE event_id = $1",
        )
        .bind(id)
        .bind(published.unwrap_or(0))
        .bind(parked)
        .bind((from + 1000) as f64)
        .execute(&pool)
        .await
        .unwrap();
        if published.is_none() {
            sqlx::query("UPDATE outbox_event SET published_at = NULL WHERE event_id = $1")
                .bind(id)
                .execute(&pool)
                .await
                .unwrap();
        }
        if days_ago != 40 {
            expect_kept.push(name);
        }
    }
    // Processed events: 40 days ago processed 35 days ago (dropped); 39
    // days ago processed yesterday (kept: the dedup window counts from
    // processing).
    for (days_ago, processed_days_ago) in [(40, 35), (39, 1)] {
        let (from, name) = at(&processed, days_ago);
        sqlx::query(
            "INSERT INTO processed_event (consumer, event_id, processed_at)
             VALUES ('c', $1, now() - make_interval(days => $2))",
        )
        .bind(id_at(from + 1000))
        .bind(processed_days_ago)
        .execute(&pool)
        .await
        .unwrap();
        if days_ago == 39 {
            expect_kept.push(name);
        }
    }
    // Inbox: 40 days ago processed long ago (dropped), 39 days ago not
    // processed (kept).
    for (days_ago, processed) in [(40, true), (39, false)] {
        let (from, name) = at(&inbox, days_ago);
        sqlx::query(
            "INSERT INTO inbox_event (consumer, event_id, payload, processed, processed_at,
                                      received_at)
             VALUES ('c', $1, '{}', $2, CASE WHEN $2 THEN now() - interval '35 days' END,
                     now() - interval '36 days')",
        )
        .bind(id_at(from + 1000))
        .bind(processed)
        .execute(&pool)
        .await
        .unwrap();
        if !processed {
            expect_kept.push(name);
        }
    }

    // A partition detached by a pass that stopped before dropping it, and a
    // table of the application's that merely looks alike.
    for name in [
        "outbox_event_p20250101_0000_retired",
        "outbox_event_notes_retired",
    ] {
        sqlx::query(&format!("CREATE TABLE {name} (n int)"))
            .execute(&pool)
            .await
            .unwrap();
    }

    let retention = Retention::new(Duration::from_secs(30 * 86_400));
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    let retired: Vec<String> = sqlx::query_scalar(
        "SELECT relname::text FROM pg_class WHERE relname LIKE '%retired' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        retired,
        ["outbox_event_notes_retired"],
        "detached partitions dropped"
    );
    // Partitions ending 30 days ago or earlier: days 40..=31 of each table
    // (the empty ones go too); kept: the five above past the window.
    let left: Vec<String> = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    for name in &expect_kept {
        assert!(left.contains(name), "{name} kept");
    }
    for parts in [&outbox, &processed, &inbox] {
        assert!(!left.contains(&at(parts, 40).1), "40 days ago dropped");
        assert!(left.contains(&at(parts, 30).1), "inside the window");
    }
    assert_eq!(report.partitions_kept, 5, "{report:?}");
    assert_eq!(report.partitions_dropped, 3 * 10 - 5, "{report:?}");
    assert_eq!(report.outbox_events, 0, "no row deleted one by one");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox_event").await, 4);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_event").await,
        1
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM inbox_event").await, 1);

    // Once published and old enough, the kept partition goes too.
    sqlx::query(
        "UPDATE outbox_event SET published_at = now() - interval '35 days', parked_at = NULL
         WHERE published_at IS NULL OR published_at > now() - interval '30 days'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    assert_eq!(report.partitions_dropped, 3, "{report:?}");
    assert_eq!(report.partitions_kept, 2, "{report:?}");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_busy_table_is_left_as_it_was_and_the_command_can_be_run_again(pool: PgPool) {
    // A consumer's transaction holding processed_event.
    let mut consumer = pool.begin().await.unwrap();
    dedup_in(&mut consumer, Uuid::now_v7()).await;
    let plan = PartitionPlan {
        lock_timeout: Duration::from_millis(200),
        ..PartitionPlan::default()
    };
    let err = partition::enable(&pool, &plan).await.unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("processed_event stayed busy")),
        "{err}"
    );
    assert!(
        partition::is_partitioned(&pool, "outbox_event")
            .await
            .unwrap()
    );
    assert!(
        !partition::is_partitioned(&pool, "processed_event")
            .await
            .unwrap()
    );
    consumer.commit().await.unwrap();
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_event").await,
        1
    );

    let report = partition::enable(&pool, &plan).await.unwrap();
    assert_eq!(report.already, ["outbox_event"]);
    assert_eq!(report.converted, ["processed_event", "inbox_event"]);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_event").await,
        1
    );
}

async fn dedup_in(tx: &mut sqlx::PgConnection, event_id: Uuid) {
    sqlx::query("INSERT INTO processed_event (consumer, event_id) VALUES ('c', $1)")
        .bind(event_id)
        .execute(tx)
        .await
        .unwrap();
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Deposit {
    key: String,
    seq: u64,
}

impl outbox_core::DomainEvent for Deposit {
    const TOPIC: &'static str = "partitions-test-inbox";
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

/// Records (key, seq) in handling order.
struct Record(std::sync::Arc<std::sync::Mutex<Vec<(String, u64)>>>);

impl outbox_core::InboxHandler for Record {
    type Event = Deposit;
    const NAME: &'static str = "record";

    fn handle<'a, 'c>(
        &'a self,
        _ctx: &'a mut outbox_core::HandlerContext<'c>,
        event: Deposit,
    ) -> outbox_core::HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.0.lock().unwrap().push((event.key, event.seq));
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn an_inbox_consumer_stores_and_applies_into_partitioned_tables(pool: PgPool) {
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let topic = <Deposit as outbox_core::DomainEvent>::TOPIC;
    reset_topic(&brokers(), topic).await;
    // UUIDv7 ids (legacy partition: before the first boundary), ids of a
    // later day (a dated partition), ids that are not UUIDv7 (default), and
    // one event delivered twice.
    let now = now_ms(&pool).await;
    let mut messages = Vec::new();
    for seq in 0..30_u64 {
        let id = match seq % 3 {
            0 => Uuid::now_v7(),
            1 => id_at(now + DAY_MS + 1),
            _ => Uuid::from_u128(0xf000_0000_0000_4000_8000_0000_0000_0000 | u128::from(seq)),
        };
        let key = format!("account-{}", seq % 2);
        messages.push(TestMessage::event(
            id,
            "Deposited",
            &key,
            serde_json::json!({ "key": key, "seq": seq }),
        ));
    }
    messages.push(messages[4].clone());
    produce(&brokers(), topic, &messages).await;

    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let handle = outbox_runtime::Consumer::builder(pool.clone())
        .group(unique_topic("partitions-inbox"))
        .brokers(brokers())
        .mode(outbox_runtime::Mode::Inbox)
        .handler(Record(seen.clone()))
        .spawn()
        .unwrap();
    let done = eventually(Duration::from_secs(60), || async {
        handle.counts().processed == 30
    })
    .await;
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert!(done, "{counts:?}");
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(seen.len(), 30, "each event applied once: {seen:?}");
    for key in ["account-0", "account-1"] {
        let order: Vec<u64> = seen.iter().filter(|(k, _)| k == key).map(|s| s.1).collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{key}: {order:?}");
    }
    let homes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT CASE WHEN tableoid::regclass::text LIKE 'inbox_event_p%' THEN 'dated'
                     ELSE tableoid::regclass::text END, count(*)
         FROM inbox_event WHERE processed GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        homes,
        [
            ("dated".to_owned(), 10),
            ("inbox_event_default".to_owned(), 10),
            ("inbox_event_legacy".to_owned(), 10)
        ]
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_event").await,
        30
    );
}

/// A writer in the middle of its transaction holds the wake-up trigger's
/// probe lock (shared): that is no relay. `enable` waits for its table
/// lock instead of refusing, and the writer's row is kept.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn enabling_waits_for_a_writer_in_the_middle_of_its_transaction(pool: PgPool) {
    let writer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    // A writer's transaction, held open after its insert (the trigger
    // took the probe lock).
    let mut tx = writer_pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key)
         VALUES ($1, 'Order', 'k', 'OrderPlaced', '{}', 't', 'k')",
    )
    .bind(Uuid::now_v7())
    .execute(&mut *tx)
    .await
    .unwrap();
    let probe_held = scalar(
        &pool,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ShareLock'
           AND classid::int8 = 'outbox_event'::regclass::oid::int8
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .await;
    assert_eq!(probe_held, 1, "the writer holds the probe lock");
    let commit = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        tx.commit().await.unwrap();
    });
    let report = partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    commit.await.unwrap();
    assert_eq!(report.converted.len(), 3);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox_event").await, 1);
}

/// A maintenance pass dropped mid-way (its future cancelled while it
/// waits for a table lock, as a cleanup job's shutdown does) leaves the
/// maintenance lock to the next maintainer at once, not when its pooled
/// connection is closed some day.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_cancelled_pass_releases_the_maintenance_lock(pool: PgPool) {
    partition::enable(
        &pool,
        &PartitionPlan {
            ahead: 1,
            ..PartitionPlan::default()
        },
    )
    .await
    .unwrap();
    let plan = PartitionPlan {
        ahead: 3,
        lock_timeout: Duration::from_secs(30),
        ..PartitionPlan::default()
    };
    // An application's pool: connections are kept.
    let app = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_event IN SHARE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    {
        let pass = partition::maintain(&app, &plan);
        tokio::pin!(pass);
        let waiting = tokio::select! {
            r = &mut pass => panic!("the pass ended while the table was locked: {r:?}"),
            w = eventually(Duration::from_secs(10), || async {
                scalar(
                    &pool,
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'relation'
                       AND database = (SELECT oid FROM pg_database
                                       WHERE datname = current_database())",
                )
                .await
                    > 0
            }) => w,
        };
        assert!(waiting, "the pass waits for a table lock");
    }
    blocker.rollback().await.unwrap();
    // Another maintainer (another process) takes the lock right away.
    let other = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut report = None;
    while report.is_none() && started.elapsed() < Duration::from_secs(3) {
        report = partition::maintain(&other, &plan).await.unwrap();
        if report.is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let report = report.expect("the lock of the cancelled pass was released");
    assert_eq!(report.created, 3 * 2, "{report:?}");
    app.close().await;
    other.close().await;
}

/// The cleanup job keeps as many partitions ahead as `enable` was told,
/// not the default.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn cleanup_keeps_the_partitions_ahead_given_at_enable(pool: PgPool) {
    partition::enable(
        &pool,
        &PartitionPlan {
            ahead: 6,
            ..PartitionPlan::default()
        },
    )
    .await
    .unwrap();
    let ranges = |pool: PgPool| async move {
        partition::list(&pool)
            .await
            .unwrap()
            .iter()
            .filter(|p| p.table == "outbox_event" && p.kind == PartitionKind::Range)
            .count()
    };
    assert_eq!(ranges(pool.clone()).await, 6);
    // The newest four gone (a maintainer that stopped for a while).
    let newest: Vec<String> = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .filter(|p| p.kind == PartitionKind::Range)
        .rev()
        .filter(|p| p.table == "outbox_event")
        .take(4)
        .map(|p| p.name)
        .collect();
    for name in newest {
        sqlx::query(&format!("DROP TABLE {name}"))
            .execute(&pool)
            .await
            .unwrap();
    }
    assert_eq!(ranges(pool.clone()).await, 2);
    let report = cleanup::cleanup(&pool, &Retention::new(Duration::from_secs(30 * 86_400)))
        .await
        .unwrap();
    assert_eq!(report.partitions_dropped, 0);
    assert_eq!(ranges(pool.clone()).await, 6, "six ahead again");
}

/// A table that stays locked (a long transaction reading it) leaves its
/// partitions for the next call, counted busy; the other tables get
/// theirs, and the next call creates the rest.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_busy_table_does_not_stop_the_partitions_of_the_others(pool: PgPool) {
    partition::enable(
        &pool,
        &PartitionPlan {
            ahead: 1,
            ..PartitionPlan::default()
        },
    )
    .await
    .unwrap();
    let plan = PartitionPlan {
        ahead: 3,
        lock_timeout: Duration::from_millis(100),
        ..PartitionPlan::default()
    };
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE processed_event IN ACCESS SHARE MODE")
        .execute(&mut *reader)
        .await
        .unwrap();
    let report = partition::maintain(&pool, &plan).await.unwrap().unwrap();
    assert_eq!(
        (report.created, report.busy),
        (2 * 2, 2),
        "two more for outbox_event and inbox_event, two busy: {report:?}"
    );
    reader.rollback().await.unwrap();
    let report = partition::maintain(&pool, &plan).await.unwrap().unwrap();
    assert_eq!((report.created, report.busy), (2, 0), "{report:?}");
}

/// A partition needed within a period (here: the next one's, dropped) on
/// a table a transaction keeps locked for 1.5 s: its attempts wait longer
/// each time (0.3, 0.6, 1.2 s) and it is created in this pass; at 0.3 s
/// each, all three would have ended by 1.2 s and left it for the next.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_partition_needed_soon_waits_longer_for_a_busy_table(pool: PgPool) {
    let plan = PartitionPlan {
        period: Duration::from_secs(10),
        ahead: 1,
        lock_timeout: Duration::from_millis(300),
    };
    partition::enable(&pool, &plan).await.unwrap();
    let next = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .find(|p| p.table == "processed_event" && p.kind == PartitionKind::Range)
        .expect("a range partition of processed_event");
    sqlx::query(&format!("DROP TABLE {}", next.name))
        .execute(&pool)
        .await
        .unwrap();
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE processed_event IN ACCESS SHARE MODE")
        .execute(&mut *reader)
        .await
        .unwrap();
    let held = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        reader.rollback().await.unwrap();
    });
    let report = partition::maintain(&pool, &plan).await.unwrap().unwrap();
    held.await.unwrap();
    assert_eq!(report.busy, 0, "{report:?}");
    let again = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .any(|p| p.table == "processed_event" && p.from == next.from);
    assert!(
        again,
        "the partition of {:?} is there again: {report:?}",
        next.from
    );
}

/// In the progress mode nothing is marked published: retention drops an
/// old partition whose rows the positions passed, and keeps one holding a
/// row they have not (written after the relay stopped); once a relay
/// passes it, that partition goes too. Nothing is deleted row by row.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn in_the_progress_mode_retention_drops_what_the_positions_passed(pool: PgPool) {
    use outbox_runtime::relay::progress;
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let outbox = past_partitions(&pool, "outbox_event", 40).await;
    progress::enable(&pool).await.unwrap();
    let topic = unique_topic("partitions-progress");
    create_topic(&brokers(), &topic).await;
    let at = |days_ago: usize| outbox[outbox.len() - days_ago].clone();
    let insert_old = |days_ago: usize| {
        let (pool, topic, (from, _)) = (pool.clone(), topic.clone(), at(days_ago));
        async move {
            let id = id_at(from + 1000 + (Uuid::new_v4().as_u128() % 1000) as i64);
            insert_outbox(&pool, id, &topic).await;
            sqlx::query("UPDATE outbox_event SET created_at = to_timestamp($2 / 1000.0) WHERE event_id = $1")
                .bind(id)
                .bind((from + 1000) as f64)
                .execute(&pool)
                .await
                .unwrap();
            id
        }
    };
    let mut committed = vec![insert_old(40).await, insert_old(39).await];
    let publish = || async {
        let relay = Relay::builder(pool.clone())
            .brokers(brokers())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while progress::pending(&pool).await.unwrap() > 0 {
            assert!(std::time::Instant::now() < deadline, "not published");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        relay.shutdown().await.unwrap();
    };
    publish().await;
    committed.push(insert_old(39).await);

    let retention = Retention::new(Duration::from_secs(30 * 86_400));
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    let left: Vec<String> = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert!(!left.contains(&at(40).1), "passed: dropped ({report:?})");
    assert!(
        left.contains(&at(39).1),
        "a row not passed: kept ({report:?})"
    );
    assert_eq!(report.outbox_events, 0, "no row deleted one by one");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox_event").await, 2);

    publish().await;
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    let left: Vec<String> = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert!(
        !left.contains(&at(39).1),
        "passed since: dropped ({report:?})"
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox_event").await, 0);
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(30)).await;
    assert_eq!(verify(&committed, &received), 0);
}

/// A scheduled event cancelled before the window is routine: it does not
/// keep its old partition (nor, on a plain table, its row: see
/// `scheduled.rs`). A row an operator dropped is kept for the record, and
/// keeps its partition.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_cancelled_scheduled_event_does_not_keep_its_partition(pool: PgPool) {
    relay_mode(&pool).await;
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let outbox = past_partitions(&pool, "outbox_event", 40).await;
    let at = |days_ago: usize| outbox[outbox.len() - days_ago].clone();
    for (days_ago, reason) in [(40, "cancelled"), (39, "dropped by an operator")] {
        let (from, _) = at(days_ago);
        let id = id_at(from + 1000);
        insert_outbox(&pool, id, "t").await;
        sqlx::query(
            "UPDATE outbox_event
             SET due_at = to_timestamp($2 / 1000.0) + interval '1 day',
                 parked_at = now() - interval '35 days', discarded_at = now() - interval '35 days',
                 discard_reason = $3, created_at = to_timestamp($2 / 1000.0)
             WHERE event_id = $1",
        )
        .bind(id)
        .bind((from + 1000) as f64)
        .bind(reason)
        .execute(&pool)
        .await
        .unwrap();
    }
    let retention = Retention::new(Duration::from_secs(30 * 86_400));
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    let left: Vec<String> = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert!(
        !left.contains(&at(40).1),
        "the cancelled event's partition dropped"
    );
    assert!(left.contains(&at(39).1), "the dropped row's partition kept");
    assert_eq!(report.partitions_kept, 1, "{report:?}");
    let reasons: Vec<String> = sqlx::query_scalar("SELECT discard_reason FROM outbox_event")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(reasons, ["dropped by an operator"]);
}

/// Partition retention and the inbox's progress mode, where rows are never
/// marked processed: a partition whose row its partition's position does
/// not pass yet is kept, as is one whose passed row was received within the
/// window; one whose rows are passed and old goes. Once the position passes
/// the kept row, its partition goes too.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn retention_keeps_inbox_partitions_until_the_progress_mode_passed_their_rows(pool: PgPool) {
    partition::enable(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let inbox = past_partitions(&pool, "inbox_event", 40).await;
    let at = |days_ago: usize| inbox[inbox.len() - days_ago].clone();
    outbox_runtime::inbox::progress::enable(&pool, "c")
        .await
        .unwrap();
    let store = |days_ago: usize, received_days_ago: i32| {
        let pool = pool.clone();
        let id = id_at(at(days_ago).0 + 1000);
        async move {
            sqlx::query(
                r#"INSERT INTO inbox_event (consumer, event_id, payload, topic, "partition",
                       partition_key, processed, received_at)
                   VALUES ('c', $1, '{}', 't', 0, 'k', true, now() - make_interval(days => $2))"#,
            )
            .bind(id)
            .bind(received_days_ago)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let record = || async {
        sqlx::query(
            r#"INSERT INTO inbox_progress (consumer, topic, "partition", done)
               VALUES ('c', 't', 0, pg_current_snapshot())"#,
        )
        .execute(&pool)
        .await
        .unwrap();
    };
    // 38 and 37 days ago: rows the position passes (37's received
    // yesterday); then 36 days ago a row stored after the position.
    store(38, 35).await;
    store(37, 1).await;
    record().await;
    store(36, 35).await;

    let retention = Retention::new(Duration::from_secs(30 * 86_400));
    cleanup::cleanup(&pool, &retention).await.unwrap();
    let left: Vec<String> = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert!(!left.contains(&at(38).1), "passed and old: dropped");
    assert!(left.contains(&at(37).1), "received within the window: kept");
    assert!(left.contains(&at(36).1), "not passed yet: kept");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM inbox_event").await, 2);

    record().await;
    cleanup::cleanup(&pool, &retention).await.unwrap();
    let left: Vec<String> = partition::list(&pool)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert!(!left.contains(&at(36).1), "passed since: dropped");
    assert!(left.contains(&at(37).1));
}
