//! Operations that must not read the whole outbox, against a real
//! PostgreSQL (fresh database per test): `status` on a large table counts
//! the backlog exactly and estimates published rows; with a large backlog
//! it counts exactly up to its bound and estimates beyond, saying so;
//! replay's time range selects exactly the rows created in it.

use outbox_runtime::ops;
use std::time::Duration;

use outbox_runtime::replay::{self, ReplayFilter, ReplayOptions, Selection};
use sqlx::PgPool;
use sqlx::types::chrono::{DateTime, Utc};

/// Inserts `n` rows of `topic` created a minute apart from `start` (minute
/// `first`, `first + 1`, …), published or not.
async fn insert(pool: &PgPool, topic: &str, first: i64, n: i64, published: bool) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key, created_at, published_at)
         SELECT gen_random_uuid(), 'A', 'a' || g, 'E', '{}', $1, 'k' || (g % 10),
                '2026-01-01T00:00:00Z'::timestamptz + g * interval '1 minute',
                CASE WHEN $4 THEN now() END
         FROM generate_series($2::int8, $2::int8 + $3::int8 - 1) AS g",
    )
    .bind(topic)
    .bind(first)
    .bind(n)
    .bind(published)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn status_of_a_large_outbox_counts_the_backlog_and_estimates_published_rows(pool: PgPool) {
    // Statistics only when this test says (no autovacuum's analyze).
    sqlx::query("ALTER TABLE outbox_event SET (autovacuum_enabled = false)")
        .execute(&pool)
        .await
        .unwrap();
    insert(&pool, "big", 0, 90_000, true).await;
    insert(&pool, "small", 0, 30_000, true).await;
    insert(&pool, "small", 50_000, 3, false).await;
    sqlx::query(
        "UPDATE outbox_event SET held_until = now() + interval '1 hour'
                 WHERE id = (SELECT max(id) FROM outbox_event)",
    )
    .execute(&pool)
    .await
    .unwrap();

    // Before the table is analyzed, its statistics say it is small: exact.
    let exact = ops::status(&pool).await.unwrap();
    assert!(!exact.estimated);
    assert_eq!(
        (exact.published, exact.unpublished, exact.held),
        (120_000, 3, 1)
    );

    sqlx::query("ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let status = ops::status(&pool).await.unwrap();
    assert!(status.estimated);
    assert_eq!((status.unpublished, status.held, status.parked), (3, 1, 0));
    let near = |n: i64, expected: i64| (n - expected).abs() <= expected / 10;
    assert!(near(status.published, 120_000), "{status:?}");
    let topic = |name: &str| status.topics.iter().find(|t| t.topic == name).unwrap();
    assert!(near(topic("big").published, 90_000), "{status:?}");
    assert!(near(topic("small").published, 30_000), "{status:?}");
    assert_eq!(topic("small").unpublished, 3);
    assert!(topic("small").oldest_unpublished_secs.is_some());
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_replay_time_range_selects_exactly_the_rows_created_in_it(pool: PgPool) {
    insert(&pool, "t", 0, 1000, true).await;
    // Created inside the range but written last (a transaction that stayed
    // open): its id is out of creation order.
    insert(&pool, "t", 450, 1, true).await;
    // Unpublished: the relay's, never replayed.
    insert(&pool, "t", 500, 1, false).await;
    // 2026-01-01T00:00:00Z, plus minutes.
    let at = |minute: i64| DateTime::<Utc>::from_timestamp(1_767_225_600 + minute * 60, 0).unwrap();
    let count = |since: Option<i64>, until: Option<i64>, topic: Option<&str>| {
        let filter = ReplayFilter {
            since: since.map(at),
            until: until.map(at),
            topic: topic.map(str::to_owned),
            ..ReplayFilter::default()
        };
        let pool = pool.clone();
        async move { replay::count(&pool, &filter).await.unwrap() }
    };
    assert_eq!(count(Some(400), Some(600), None).await, 201);
    assert_eq!(count(Some(400), Some(600), Some("t")).await, 201);
    assert_eq!(count(Some(400), Some(600), Some("other")).await, 0);
    assert_eq!(count(None, Some(10), None).await, 10);
    assert_eq!(count(Some(990), None, None).await, 10);
    assert_eq!(count(Some(5000), None, None).await, 0);
    assert_eq!(count(None, None, None).await, 1001);
}

/// A dry run's counts are exact up to their bound and estimated beyond,
/// saying so; an event published before the dedup window is found wherever
/// it is in the selection, so a replay is refused even when one such event
/// hides behind tens of thousands of recent ones, and refused naming an
/// estimate when there are many.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_dry_run_counts_exactly_up_to_its_bound_and_estimates_beyond(pool: PgPool) {
    insert(&pool, "t", 0, 30_000, true).await;
    sqlx::query("ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let window = Duration::from_secs(7 * 86_400);
    let at = |minute: i64| DateTime::<Utc>::from_timestamp(1_767_225_600 + minute * 60, 0).unwrap();
    let day = ReplayFilter {
        since: Some(at(0)),
        until: Some(at(500)),
        ..ReplayFilter::default()
    };
    let all = ReplayFilter::default();
    let selection = |filter: &ReplayFilter| {
        let (pool, filter) = (pool.clone(), filter.clone());
        async move { replay::selection(&pool, &filter, window).await.unwrap() }
    };
    let exact = Selection {
        matched: 500,
        beyond_window: 0,
        estimated: false,
        example_beyond: None,
    };
    assert_eq!(selection(&day).await, exact);
    let s = selection(&all).await;
    assert!(s.estimated, "{s:?}");
    assert!((24_000..=36_000).contains(&s.matched), "{s:?}");
    assert_eq!(s.beyond_window, 0, "{s:?}");

    // One event published 8 days ago, the last of the selection.
    let last: i64 = sqlx::query_scalar(
        "UPDATE outbox_event SET created_at = now() - interval '9 days',
                                 published_at = now() - interval '8 days'
         WHERE id = (SELECT max(id) FROM outbox_event) RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let s = selection(&all).await;
    assert_eq!(
        (s.beyond_window, s.example_beyond),
        (1, Some(last)),
        "{s:?}"
    );
    let refused = replay::replay(&pool, &ReplayOptions::new("127.0.0.1:9", all.clone()))
        .await
        .expect_err("one event beyond the window");
    assert!(refused.to_string().contains("1 of the ~"), "{refused}");

    // 20,000 of them: both counts estimated, and the refusal says so.
    sqlx::query(
        "UPDATE outbox_event SET created_at = now() - interval '9 days',
                                 published_at = now() - interval '8 days'
         WHERE id < (SELECT min(id) + 20000 FROM outbox_event)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let s = selection(&all).await;
    assert!(s.estimated, "{s:?}");
    assert!((16_000..=24_000).contains(&s.beyond_window), "{s:?}");
    assert!(s.matched >= s.beyond_window, "{s:?}");
    let refused = replay::replay(&pool, &ReplayOptions::new("127.0.0.1:9", all))
        .await
        .expect_err("events beyond the window");
    assert!(
        refused.to_string().contains("refusing to replay: ~"),
        "{refused}"
    );
    // Nothing was sent or changed: every row is still as it was.
    let published: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(published, 30_000);
}

/// `n` unpublished rows, topic `a` but every fourth `b` (both through the
/// whole id range), held for an hour if `held`.
async fn backlog(pool: &PgPool, n: i64, held: bool) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key, held_until)
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}',
                CASE WHEN g % 4 = 0 THEN 'b' ELSE 'a' END, 'k' || g,
                CASE WHEN $2 THEN now() + interval '1 hour' END
         FROM generate_series(1, $1::int8) AS g",
    )
    .bind(n)
    .bind(held)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn status_counts_a_backlog_exactly_up_to_its_bound_and_estimates_beyond(pool: PgPool) {
    let bound = ops::BACKLOG_EXACT_UP_TO;
    sqlx::query("ALTER TABLE outbox_event SET (autovacuum_enabled = false)")
        .execute(&pool)
        .await
        .unwrap();
    // At the bound: exact, in total and per topic.
    backlog(&pool, bound, false).await;
    backlog(&pool, 40, true).await;
    let exact = ops::status(&pool).await.unwrap();
    assert!(!exact.backlog_estimated, "{exact:?}");
    assert_eq!((exact.unpublished, exact.held), (bound + 40, 40));
    let topic = |s: &ops::Status, name: &str| {
        let t = s.topics.iter().find(|t| t.topic == name).unwrap();
        (t.unpublished, t.held)
    };
    assert_eq!(topic(&exact, "a"), (bound * 3 / 4 + 30, 30));
    assert_eq!(topic(&exact, "b"), (bound / 4 + 10, 10));
    let json = serde_json::to_value(&exact).unwrap();
    assert_eq!(json["backlog_estimated"], false);

    // Past it (4 x the bound in the queue, 2 x held): estimated and said so.
    backlog(&pool, bound * 3, false).await;
    backlog(&pool, bound * 2, true).await;
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let status = ops::status(&pool).await.unwrap();
    assert!(status.backlog_estimated, "{status:?}");
    let near = |n: i64, expected: i64| (n - expected).abs() <= expected / 10;
    let held = bound * 2 + 40;
    assert!(near(status.held, held), "{status:?}");
    assert!(near(status.unpublished, bound * 4 + held), "{status:?}");
    let (a, a_held) = topic(&status, "a");
    let (b, b_held) = topic(&status, "b");
    assert!(near(a, (bound * 4 + held) * 3 / 4), "{status:?}");
    assert!(near(b, (bound * 4 + held) / 4), "{status:?}");
    assert!(near(a_held + b_held, held), "{status:?}");
    assert!(status.oldest_unpublished_secs.is_some());
    let json = serde_json::to_value(&status).unwrap();
    assert_eq!(json["backlog_estimated"], true);

    // Published again below the bound: exact once more.
    sqlx::query(
        "UPDATE outbox_event SET published_at = now(), held_until = NULL
         WHERE id > (SELECT min(id) + 99 FROM outbox_event)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let status = ops::status(&pool).await.unwrap();
    assert!(!status.backlog_estimated, "{status:?}");
    assert_eq!((status.unpublished, status.held), (100, 0));
}
