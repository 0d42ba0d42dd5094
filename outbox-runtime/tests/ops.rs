//! Operations against a real PostgreSQL (fresh database per test): the
//! retention cleanup (what it deletes, what it never touches, dead letters
//! when asked, the refused window, one leader among concurrent jobs) and
//! dropping parked rows. The tests of the outbox's rows run in the progress
//! mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command): there
//! a row is published once its slot's position passes it (recorded here as
//! a relay records one), not by `published_at`, and the retention deletes
//! the rows created before its window that the positions passed. The
//! others (dedup rows, inbox rows, dead letters, sagas, the leader lock)
//! touch no outbox row and run in the default mode only.

mod common;

use std::time::Duration;

use common::*;
use outbox_runtime::cleanup::{self, Cleanup, Retention};
use outbox_runtime::{Error, ops};
use sqlx::PgPool;
use uuid::Uuid;

const DAY: u64 = 86_400;

fn days(n: u64) -> Duration {
    Duration::from_secs(n * DAY)
}

/// Commits `n` outbox rows on `topic`; returns their ids.
async fn rows(pool: &PgPool, topic: &str, n: usize) -> Vec<i64> {
    let ids = commit_messages(pool, topic, n, n, n).await;
    sqlx::query_scalar("SELECT id FROM outbox_event WHERE event_id = ANY($1) ORDER BY id")
        .bind(&ids)
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn set(pool: &PgPool, sql: &str, ids: &[i64]) {
    sqlx::query(&format!("UPDATE outbox_event SET {sql} WHERE id = ANY($1)"))
        .bind(ids)
        .execute(pool)
        .await
        .unwrap();
}

async fn remaining(pool: &PgPool, ids: &[i64]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE id = ANY($1)")
        .bind(ids)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn cleanup_deletes_old_published_and_processed_rows_only(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("cleanup");
    // Outbox, in id order: old published (deleted), old unpublished, old
    // parked, old dropped, young published (all kept). The young rows come
    // last: the cleanup's range ends before the first row created within
    // the window, so every kept old row is inside it. Published: marked
    // (the default mode), or passed by the position recorded after their
    // commit (the progress mode: old or young by their creation); there
    // the unpublished rows are written by a transaction still open when
    // the position is recorded (its rows are not passed, whatever their
    // ids).
    let old_published = rows(&pool, &topic, 7).await;
    let mut open = pool.begin().await.unwrap();
    let old_unpublished: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key)
         SELECT gen_random_uuid(), 'order', 'u' || g, 'placed', '{}', $1, 'u' || g
         FROM generate_series(1, 2) g
         RETURNING id",
    )
    .bind(&topic)
    .fetch_all(&mut *open)
    .await
    .unwrap();
    let old_parked = rows(&pool, &topic, 2).await;
    let old_dropped = rows(&pool, &topic, 1).await;
    let young_published = rows(&pool, &topic, 3).await;
    if progress_mode() {
        record_position(&pool).await;
    }
    open.commit().await.unwrap();
    let old = "created_at = now() - interval '40 days'";
    if progress_mode() {
        set(&pool, old, &old_published).await;
    } else {
        set(
            &pool,
            &format!("{old}, published_at = now() - interval '40 days'"),
            &old_published,
        )
        .await;
        set(
            &pool,
            "published_at = now() - interval '1 day'",
            &young_published,
        )
        .await;
    }
    set(&pool, old, &old_unpublished).await;
    set(
        &pool,
        &format!("{old}, parked_at = now() - interval '39 days', attempts = 5"),
        &old_parked,
    )
    .await;
    set(
        &pool,
        &format!("{old}, parked_at = now(), discarded_at = now(), discard_reason = 'x'"),
        &old_dropped,
    )
    .await;

    // Dedup rows: 2,500 old ones interleaved with 500 young ones (several
    // page ranges), of two consumers.
    sqlx::query(
        "INSERT INTO processed_event (consumer, event_id, processed_at)
         SELECT CASE WHEN g % 2 = 0 THEN 'billing' ELSE 'shipping' END, gen_random_uuid(),
                CASE WHEN g % 6 = 0 THEN now() - interval '1 day' ELSE now() - interval '40 days' END
         FROM generate_series(1, 3000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Inbox: old processed (deleted); old pending, old dead-lettered,
    // young processed (kept).
    sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, consumer, received_at, processed, processed_at, dead_lettered_at)
         SELECT gen_random_uuid(), '{}'::jsonb, 'billing', now() - interval '41 days',
                k = 'old_done', CASE k WHEN 'old_done' THEN now() - interval '40 days'
                                       WHEN 'young_done' THEN now() - interval '1 day' END,
                CASE WHEN k = 'old_dead' THEN now() - interval '40 days' END
         FROM (VALUES ('old_done'), ('old_done'), ('old_done'), ('old_pending'), ('old_dead'), ('young_done')) v(k)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE inbox_event SET processed = true WHERE processed_at > now() - interval '2 days'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE processed_event")
        .execute(&pool)
        .await
        .unwrap();

    let retention = Retention::new(days(30)).batch_size(2);
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    assert_eq!(report.outbox_events, 7);
    assert_eq!(report.processed_events, 2500);
    assert_eq!(report.inbox_events, 3);
    // Two rows per statement: the outbox alone needs four statements.
    assert!(report.statements > 4, "{report:?}");

    assert_eq!(remaining(&pool, &old_published).await, 0);
    assert_eq!(remaining(&pool, &young_published).await, 3);
    assert_eq!(remaining(&pool, &old_unpublished).await, 2);
    assert_eq!(remaining(&pool, &old_parked).await, 2);
    assert_eq!(remaining(&pool, &old_dropped).await, 1);
    assert_eq!(
        unpublished(&pool).await,
        5,
        "the rows kept unpublished: old, parked and dropped"
    );
    let young: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(young, 500);
    let inbox: Vec<(bool, bool)> = sqlx::query_as(
        "SELECT processed, dead_lettered_at IS NOT NULL FROM inbox_event ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(inbox, vec![(false, false), (false, true), (true, false)]);

    // A second pass finds nothing more.
    let again = cleanup::cleanup(&pool, &retention).await.unwrap();
    assert_eq!(
        (
            again.outbox_events,
            again.processed_events,
            again.inbox_events
        ),
        (0, 0, 0)
    );
}

/// Inserts a dead letter named `name` (in its error) with the status and
/// ages (days) of its last failure and its resolution.
async fn dead_letter(pool: &PgPool, name: &str, status: &str, failed: i32, resolved: Option<i32>) {
    sqlx::query(
        "INSERT INTO dead_letter (consumer, topic, \"partition\", \"offset\", payload, reason, error,
                                  status, created_at, last_failed_at, resolved_at)
         VALUES ('billing', 'orders', 0, (SELECT coalesce(max(\"offset\"), 0) + 1 FROM dead_letter), $5, 'handler_failed', $1,
                 $2, now() - make_interval(days => $3), now() - make_interval(days => $3),
                 now() - make_interval(days => $4))",
    )
    .bind(name)
    .bind(status)
    .bind(failed)
    .bind(resolved)
    .bind(vec![b'x'; 600])
    .execute(pool)
    .await
    .unwrap();
}

async fn dead_letters_left(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT error FROM dead_letter WHERE error NOT LIKE 'young-%' ORDER BY error",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn cleanup_deletes_resolved_and_old_dead_letters_when_asked(pool: PgPool) {
    // Young ones first (several heap pages of them), then the cases.
    for i in 0..200 {
        dead_letter(&pool, &format!("young-{i}"), "dead", 1, None).await;
    }
    dead_letter(&pool, "dead-100d", "dead", 100, None).await;
    dead_letter(&pool, "dead-10d", "dead", 10, None).await;
    dead_letter(&pool, "resolved-20d", "resolved", 100, Some(20)).await;
    dead_letter(&pool, "resolved-1d", "resolved", 100, Some(1)).await;
    dead_letter(&pool, "resolved-100d", "resolved", 120, Some(100)).await;
    dead_letter(&pool, "retry-200d", "retry", 200, None).await;
    sqlx::query("ANALYZE dead_letter")
        .execute(&pool)
        .await
        .unwrap();
    let all = dead_letters_left(&pool).await;
    assert_eq!(all.len(), 6);

    // Not asked: dead letters stay.
    let report = cleanup::cleanup(&pool, &Retention::new(days(30)))
        .await
        .unwrap();
    assert_eq!(report.dead_letters, 0);
    assert_eq!(dead_letters_left(&pool).await, all);

    // Resolved ones, by their resolution's age.
    let retention = Retention::new(days(30))
        .batch_size(20)
        .resolved_dead_letters(days(7));
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    assert_eq!(report.dead_letters, 2, "{report:?}");
    assert!(report.statements > 3, "several page ranges: {report:?}");
    assert_eq!(
        dead_letters_left(&pool).await,
        ["dead-100d", "dead-10d", "resolved-1d", "retry-200d"]
    );

    // Any status but retry, by the last failure or resolution.
    let retention = Retention::new(days(30)).dead_letters(days(90));
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    assert_eq!(report.dead_letters, 1, "{report:?}");
    assert_eq!(
        dead_letters_left(&pool).await,
        ["dead-10d", "resolved-1d", "retry-200d"]
    );
    let young: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dead_letter WHERE error LIKE 'young-%'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(young, 200);

    // A scheduled job counts them too.
    dead_letter(&pool, "resolved-50d", "resolved", 60, Some(50)).await;
    let job = Cleanup::new(
        pool.clone(),
        Retention::new(days(30)).resolved_dead_letters(days(7)),
        Duration::from_secs(3600),
    )
    .unwrap()
    .spawn();
    assert!(
        eventually(Duration::from_secs(10), || async {
            job.counts().passes >= 1
        })
        .await
    );
    assert_eq!(job.counts().deleted, 1, "{:?}", job.counts());
    job.shutdown().await.unwrap();

    // A zero age is refused.
    let error = cleanup::cleanup(
        &pool,
        &Retention::new(days(30)).dead_letters(Duration::ZERO),
    )
    .await
    .unwrap_err();
    assert!(error.to_string().contains("dead letters"), "{error}");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_retention_shorter_than_the_dedup_window_is_refused(pool: PgPool) {
    sqlx::query(
        "INSERT INTO processed_event (consumer, event_id, processed_at)
         VALUES ('billing', gen_random_uuid(), now() - interval '3 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // 2 days < the default 7-day dedup window.
    let error = cleanup::cleanup(&pool, &Retention::new(days(2)))
        .await
        .unwrap_err();
    let Error::Config(message) = &error else {
        panic!("expected a configuration error, got {error:?}");
    };
    assert!(
        message.contains("retention 2d is shorter than the dedup window 7d"),
        "{message}"
    );
    assert!(
        cleanup::cleanup_as_leader(&pool, &Retention::new(days(2)))
            .await
            .is_err()
    );
    assert!(
        Cleanup::new(
            pool.clone(),
            Retention::new(days(2)),
            Duration::from_secs(1)
        )
        .is_err()
    );
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept, 1, "nothing deleted");

    // With a shorter dedup window declared, the same retention runs.
    let r = Retention::new(days(2)).dedup_window(days(1));
    let report = cleanup::cleanup(&pool, &r).await.unwrap();
    assert_eq!(report.processed_events, 1);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn concurrent_cleanup_jobs_have_one_leader(pool: PgPool) {
    let interval = Duration::from_millis(100);
    let pool_b = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let a = Cleanup::new(pool.clone(), Retention::new(days(30)), interval)
        .unwrap()
        .spawn();
    let b = Cleanup::new(pool_b.clone(), Retention::new(days(30)), interval)
        .unwrap()
        .spawn();
    assert!(
        eventually(Duration::from_secs(10), || async {
            a.counts().passes + b.counts().passes >= 5
        })
        .await
    );
    let (ca, cb) = (a.counts(), b.counts());
    assert!(ca.leader != cb.leader, "exactly one leader: {ca:?} {cb:?}");
    let (leader, follower) = if ca.leader { (a, b) } else { (b, a) };
    assert_eq!(follower.counts().passes, 0, "the follower never ran a pass");
    // A one-off pass is refused while a job leads.
    assert_eq!(
        cleanup::cleanup_as_leader(&pool, &Retention::new(days(30)))
            .await
            .unwrap(),
        None
    );

    // The leader stops: the follower takes over.
    leader.shutdown().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            let c = follower.counts();
            c.leader && c.passes >= 1
        })
        .await,
        "{:?}",
        follower.counts()
    );
    follower.shutdown().await.unwrap();
    assert!(
        cleanup::cleanup_as_leader(&pool, &Retention::new(days(30)))
            .await
            .unwrap()
            .is_some(),
        "the lock is free once every job stopped"
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dropping_parked_rows_keeps_them_out_of_the_queue(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("drop");
    let ids = rows(&pool, &topic, 4).await;
    set(
        &pool,
        "parked_at = now(), attempts = 5, last_error = 'too large'",
        &ids[..3],
    )
    .await;
    // In the progress mode the windows then pass every row, as a relay's
    // do once it parked some: the fourth row is published, and the parked
    // rows, requeued, must wait again though the position passed them.
    let passed = if progress_mode() {
        record_position(&pool).await;
        1
    } else {
        0
    };

    // A reason is required.
    assert!(matches!(
        ops::discard_parked(&pool, Some(&ids[..1]), " ").await,
        Err(Error::Config(_))
    ));
    // Only parked rows can be dropped: the unparked one is ignored.
    let n = ops::discard_parked(
        &pool,
        Some(&[ids[0], ids[3]]),
        "payload rejected by the broker",
    )
    .await
    .unwrap();
    assert_eq!(n, 1);
    let (discarded, reason, parked): (bool, Option<String>, bool) = sqlx::query_as(
        "SELECT discarded_at IS NOT NULL, discard_reason, parked_at IS NOT NULL
         FROM outbox_event WHERE id = $1",
    )
    .bind(ids[0])
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(discarded && parked, "kept, still out of the relay's queue");
    assert_eq!(reason.as_deref(), Some("payload rejected by the broker"));

    let listed: Vec<i64> = ops::parked(&pool, 100)
        .await
        .unwrap()
        .iter()
        .map(|p| p.id)
        .collect();
    assert_eq!(listed, ids[1..3].to_vec());
    let status = ops::status(&pool).await.unwrap();
    assert_eq!(
        (status.parked, status.discarded, status.unpublished),
        (2, 1, 1 - passed)
    );

    // --all requeues the parked rows, not the dropped one; its id does.
    assert_eq!(ops::requeue_parked(&pool, None).await.unwrap(), 2);
    assert_eq!(ops::status(&pool).await.unwrap().discarded, 1);
    assert_eq!(
        ops::requeue_parked(&pool, Some(&ids[..1])).await.unwrap(),
        1
    );
    let status = ops::status(&pool).await.unwrap();
    assert_eq!(
        (status.parked, status.discarded, status.unpublished),
        (0, 0, 4 - passed)
    );
    assert_eq!(unpublished(&pool).await, 4 - passed);
    let _ = Uuid::nil();
}

/// `n` dedup rows of consumer `c`, processed `age_days` ago.
async fn dedup_rows(pool: &PgPool, n: i64, age_days: i64) {
    sqlx::query(
        "INSERT INTO processed_event (consumer, event_id, processed_at)
         SELECT 'c', gen_random_uuid(), now() - make_interval(days => $2::int4)
         FROM generate_series(1, $1::int8)",
    )
    .bind(n)
    .bind(age_days as i32)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn cleanup_reads_only_the_pages_that_hold_old_dedup_rows(pool: PgPool) {
    // Young rows over many pages, one old row between them (a page of its
    // own range), young rows after; summarized.
    dedup_rows(&pool, 30_000, 1).await;
    dedup_rows(&pool, 1, 40).await;
    dedup_rows(&pool, 30_000, 1).await;
    sqlx::query("VACUUM ANALYZE processed_event")
        .execute(&pool)
        .await
        .unwrap();
    let retention = Retention::new(days(30)).batch_size(100);
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    assert_eq!(report.processed_events, 1, "{report:?}");
    // 60,001 rows at 100 a statement would be hundreds of page ranges: only
    // the old row's page is read.
    assert_eq!(report.statements, 1, "{report:?}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 60_000);

    // Nothing past the window any more: the pass runs no statement.
    let report = cleanup::cleanup(&pool, &retention).await.unwrap();
    assert_eq!(report, cleanup::CleanupReport::default());
}

/// A saga instance of `saga_type`/`id`, completed `completed` days ago
/// (`None`: running), its last step `updated` days ago.
async fn saga(pool: &PgPool, id: &str, completed: Option<i32>, updated: i32) {
    sqlx::query(
        "INSERT INTO outbox_saga (saga_type, saga_id, state, stage, updated_at, completed_at)
         VALUES ('order', $1, '{}', 'Done', now() - make_interval(days => $3),
                 now() - make_interval(days => $2))",
    )
    .bind(id)
    .bind(completed)
    .bind(updated)
    .execute(pool)
    .await
    .unwrap();
}

async fn sagas_left(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT saga_id FROM outbox_saga ORDER BY saga_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Completed saga instances go once older than the window (or their own
/// retention); running ones stay however long they have been idle; a
/// retention shorter than the dedup window is refused, deleting nothing.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn cleanup_deletes_completed_sagas_past_their_retention_only(pool: PgPool) {
    saga(&pool, "a-done-40d", Some(40), 40).await;
    saga(&pool, "b-done-31d", Some(31), 31).await;
    saga(&pool, "c-done-20d", Some(20), 20).await;
    saga(&pool, "d-done-today", Some(0), 0).await;
    // Running, idle for a year: never deleted (it is stuck, not done).
    saga(&pool, "e-running", None, 365).await;

    // Refused: shorter than the dedup window (7 days).
    let error = cleanup::cleanup(&pool, &Retention::new(days(30)).completed_sagas(days(3)))
        .await
        .unwrap_err();
    let Error::Config(message) = &error else {
        panic!("expected a configuration error, got {error:?}");
    };
    assert!(
        message.contains("completed sagas' retention 3d"),
        "{message}"
    );
    assert_eq!(sagas_left(&pool).await.len(), 5, "nothing deleted");

    // Their own, longer retention: only the 40-day-old one.
    let report = cleanup::cleanup(&pool, &Retention::new(days(30)).completed_sagas(days(35)))
        .await
        .unwrap();
    assert_eq!(report.sagas, 1);
    // The window (30 days) by default, in batches of one statement each.
    let report = cleanup::cleanup(&pool, &Retention::new(days(30)).batch_size(1))
        .await
        .unwrap();
    assert_eq!(report.sagas, 1);
    assert_eq!(
        sagas_left(&pool).await,
        ["c-done-20d", "d-done-today", "e-running"]
    );
    let again = cleanup::cleanup(&pool, &Retention::new(days(30)))
        .await
        .unwrap();
    assert_eq!(again.sagas, 0);
}
