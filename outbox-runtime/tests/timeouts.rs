//! Timeouts against a real PostgreSQL: a migration waiting for the outbox
//! table's lock behind a relay-like claim, or `notify off` waiting behind a
//! writer's open transaction, gives up its place in the lock queue after
//! `lock_timeout` (writers go on) and retries; the
//! relay's claims run with a `statement_timeout`; a database that accepts
//! connections and never answers does not hang the relay.
//!
//! The tests that call `relay_mode` run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command): "published" is
//! then "passed by its slot's position" (see `common::unpublished`).

mod common;

use std::borrow::Cow;
use std::time::Duration;

use common::*;
use outbox_core::{LockPolicy, MIGRATOR};
use outbox_runtime::{Relay, ops};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// A connection of the test's own on the test database.
async fn connection(pool: &PgPool) -> PgConnection {
    PgConnection::connect_with(&pool.connect_options())
        .await
        .expect("connect")
}

/// Opens a transaction that holds what a relay's claim holds: a row lock
/// taken with `FOR UPDATE SKIP LOCKED`, and so the table's `ROW SHARE` lock.
async fn claim_like_blocker(pool: &PgPool) -> PgConnection {
    let mut conn = connection(pool).await;
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    let id: Option<i64> = sqlx::query_scalar(
        "SELECT id FROM outbox_event ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED",
    )
    .fetch_optional(&mut conn)
    .await
    .unwrap();
    assert!(id.is_some(), "a row to lock");
    conn
}

/// Waits until some session of this database waits for a lock on
/// `outbox_event` in `mode`.
async fn someone_waits_for(pool: &PgPool, mode: &str) {
    let waiting = eventually(Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_locks
             WHERE NOT granted AND relation = 'outbox_event'::regclass AND mode = $1)",
        )
        .bind(mode)
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    assert!(waiting, "nobody queued for {mode} on outbox_event");
}

const INSERT: &str = "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id,
                                   event_type, payload, topic, partition_key)
     VALUES (gen_random_uuid(), 'Order', 'k', 'OrderPlaced', '{}', 't', 'k')";

/// Opens a writer's transaction that has inserted an outbox row and not
/// committed yet (its `ROW EXCLUSIVE` lock held).
async fn open_writer(pool: &PgPool) -> PgConnection {
    let mut conn = connection(pool).await;
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    sqlx::query(INSERT).execute(&mut conn).await.unwrap();
    conn
}

/// A writer's insert (one outbox row) on a connection of its own; `true` if
/// it committed within 20 s. Queued behind a waiting `ALTER TABLE` for good,
/// it would not.
async fn writer_commits(pool: &PgPool) -> bool {
    let mut conn = connection(pool).await;
    let insert = async {
        sqlx::query(INSERT).execute(&mut conn).await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(20), insert)
        .await
        .is_ok()
}

#[sqlx::test(migrations = false)]
async fn a_migration_blocked_by_a_claim_lets_writers_through_and_retries(pool: PgPool) {
    // The first migration only: the next ones alter outbox_event.
    let first = Migrator {
        migrations: Cow::Owned(MIGRATOR.migrations[..1].to_vec()),
        ..Migrator::DEFAULT
    };
    first.run(&pool).await.unwrap();
    assert!(writer_commits(&pool).await);
    let blocker = claim_like_blocker(&pool).await;

    let migrating = tokio::spawn({
        let pool = pool.clone();
        async move { outbox_core::migrate(&pool).await }
    });
    someone_waits_for(&pool, "AccessExclusiveLock").await;
    // The migration waits for the claim; a writer still gets through (after
    // at most the migration's lock_timeout), instead of queueing behind it.
    assert!(
        writer_commits(&pool).await,
        "a writer queued behind the waiting migration"
    );
    assert!(!migrating.is_finished(), "the claim still holds the table");

    blocker.close().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), migrating)
        .await
        .expect("the migration finished once the claim ended")
        .unwrap()
        .expect("migrations applied");
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(applied as usize, MIGRATOR.migrations.len());
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn notify_off_behind_an_open_transaction_lets_writers_through_then_gives_up_with_a_clear_error(
    pool: PgPool,
) {
    // `ALTER TABLE … DISABLE TRIGGER` conflicts with writers (and with a
    // relay's batch once marked): it waits for a transaction that wrote.
    let blocker = open_writer(&pool).await;

    let switching = tokio::spawn({
        let pool = pool.clone();
        async move { ops::set_notify(&pool, false).await }
    });
    someone_waits_for(&pool, "ShareRowExclusiveLock").await;
    assert!(
        writer_commits(&pool).await,
        "a writer queued behind the waiting ALTER TABLE"
    );
    drop(blocker);
    tokio::time::timeout(Duration::from_secs(30), switching)
        .await
        .expect("notify off finished once the claim ended")
        .unwrap()
        .expect("notify off");
    assert!(!ops::notify_enabled(&pool).await.unwrap());

    // A transaction that never ends: the switch gives up after its maximum
    // wait, with an error that says why, and changes nothing.
    let blocker = open_writer(&pool).await;
    let policy = LockPolicy::new(Duration::from_millis(200), Duration::from_secs(2));
    let error = tokio::time::timeout(
        Duration::from_secs(30),
        ops::set_notify_with(&pool, true, &policy),
    )
    .await
    .expect("gave up in time")
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("notify on") && error.contains("stayed locked"),
        "{error}"
    );
    assert!(!ops::notify_enabled(&pool).await.unwrap());
    drop(blocker);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_claim_stuck_behind_a_lock_is_cancelled_by_its_statement_timeout(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("stmt-timeout");
    create_topic(&brokers(), &topic).await;
    commit_messages(&pool, &topic, 10, 2, 10).await;
    let mut blocker = connection(&pool).await;
    sqlx::raw_sql("BEGIN; LOCK TABLE outbox_event IN ACCESS EXCLUSIVE MODE")
        .execute(&mut blocker)
        .await
        .unwrap();

    let own = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with((*pool.connect_options()).clone());
    let relay = Relay::builder(own)
        .brokers(brokers())
        .statement_timeout(Duration::from_millis(300))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(200))
        .spawn()
        .unwrap();
    // The claim waits for the lock...
    let claim_waiting = || async {
        sqlx::query_as::<_, (i32, String)>(
            "SELECT pid, query_start::text FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE '/* outbox relay: claim */%'",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let first = loop {
        let waiting = claim_waiting().await;
        if !waiting.is_empty() {
            break waiting;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the relay's claim never waited for the lock"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    // ...and is cancelled by its statement_timeout (and tried again), not
    // left waiting for as long as the lock is held.
    let cancelled = eventually(Duration::from_secs(20), || async {
        let now = claim_waiting().await;
        first.iter().all(|w| !now.contains(w))
    })
    .await;
    blocker.close().await.unwrap();
    assert!(cancelled, "the claim {first:?} waited on");
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_database_that_never_answers_does_not_hang_the_relay() {
    // Accepts connections, reads nothing, answers nothing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (accepted, mut connected) = tokio::sync::mpsc::unbounded_channel();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            conns.push(conn);
            let _ = accepted.send(());
        }
    });
    let options = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database("postgres");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options);
    let relay = Relay::builder(pool)
        .brokers(brokers())
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(200))
        .spawn()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), connected.recv())
        .await
        .expect("the relay connected");
    // Every connect gives up after the pool's acquire timeout (the lane
    // connection's too), so the relay notices the stop.
    tokio::time::timeout(Duration::from_secs(20), relay.shutdown())
        .await
        .expect("the relay stopped although the database never answers")
        .unwrap();
    held.abort();
}
