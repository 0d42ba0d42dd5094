//! What an operator sees of the progress mode's lag (`ops::progress_lag`,
//! in `ops::status` and the relay's gauges): per lane, the events its
//! position has not passed and the oldest one's age; the transaction left
//! open that holds the lanes' windows back, with its pid and its age. Real
//! PostgreSQL, real broker. Its own test binary: one metrics recorder per
//! process.

mod common;
mod deploy;

use std::time::Duration;

use common::*;
use outbox_runtime::relay::progress;
use outbox_runtime::{Relay, ops};
use sqlx::PgPool;

/// Every sample of `name` (labels, value).
fn samples(body: &str, name: &str) -> Vec<(String, f64)> {
    body.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (set, v) = match rest.strip_prefix('{') {
                Some(r) => r.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            Some((set.to_owned(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The sum of the samples of `name`.
fn sum(body: &str, name: &str) -> f64 {
    samples(body, name).iter().map(|(_, v)| v).sum()
}

/// The lane slot of `key`.
async fn slot_of_key(pool: &PgPool, key: &str) -> i32 {
    sqlx::query_scalar("SELECT (abs(hashtext($1)) % 64)::int4")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The lag of the progress mode, which is on.
async fn lag(pool: &PgPool) -> ops::ProgressLag {
    ops::progress_lag(pool)
        .await
        .unwrap()
        .expect("the progress mode is on")
}

/// A transaction writes three events of one key and stays open while other
/// writers commit: the relay publishes the others; `status`, the lag and
/// the gauges report the open transaction (its pid, a positive age) and no
/// lag for the others. While a relay cannot deliver, the gauges count the
/// lanes' events. The transaction commits while no relay runs: its lane
/// counts its three events, as old as the transaction. A relay publishes
/// them: every lane at 0, no transaction reported, the gauges at 0.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_transaction_left_open_is_reported_and_its_lane_drains_once_it_commits(pool: PgPool) {
    let server = outbox_runtime::metrics::serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    let topic = unique_topic("progress-lag");
    create_topic(&brokers(), &topic).await;
    progress::enable(&pool).await.unwrap();
    let lag0 = lag(&pool).await;
    assert_eq!(lag0.events(), 0, "{lag0:?}");
    assert_eq!(lag0.holding, None);

    // Before any relay: every committed event is lag, with an age.
    let mut committed = commit_messages(&pool, &topic, 40, 8, 10).await;
    let before = lag(&pool).await;
    assert_eq!(before.events(), 40, "{before:?}");
    assert!(
        before
            .lanes
            .iter()
            .all(|l| (l.events == 0) == l.oldest_secs.is_none()),
        "{before:?}"
    );

    // A relay that cannot reach its broker publishes nothing: its gauges
    // say so (40 events, an age), not "fine".
    let stuck = Relay::builder(pool.clone())
        .brokers(format!("127.0.0.1:{}", free_port()))
        .delivery_timeout(Duration::from_secs(2))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let body = scrape(addr).await;
            sum(&body, "outbox_lane_backlog_events") == 40.0
                && sum(&body, "outbox_lane_oldest_unpublished_seconds") > 0.0
        })
        .await,
        "{}",
        scrape(addr).await
    );
    stuck.shutdown().await.unwrap();

    // The holder: three events of its own key, left uncommitted.
    let mut holder = pool.begin().await.unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let held: Vec<_> = (0..3).map(|seq| message(&topic, "held", seq)).collect();
    let held_ids =
        outbox_core::insert_messages(&mut holder, &held, &outbox_core::Headers::default())
            .await
            .unwrap();
    let holder_xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::int8")
        .fetch_one(&mut *holder)
        .await
        .unwrap();

    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
        .spawn()
        .unwrap();
    // Others commit while it is open (after it: their windows have it in
    // flight); the relay publishes them.
    committed.extend(commit_messages(&pool, &topic, 60, 8, 10).await);
    let reported = eventually(Duration::from_secs(30), || async {
        let status = ops::status(&pool).await.unwrap();
        let Some(p) = status.progress else {
            return false;
        };
        p.events() == 0
            && p.holding.as_ref().is_some_and(|h| {
                h.pid == Some(holder_pid)
                    && h.xid == holder_xid
                    && h.age_secs.is_some_and(|a| a > 0.0)
                    && h.state.as_deref() == Some("idle in transaction")
            })
    })
    .await;
    assert!(reported, "{:?}", ops::status(&pool).await.unwrap().progress);
    let lanes = lag(&pool).await;
    let holding = lanes.holding.clone().unwrap();
    assert!(holding.lanes >= 1, "{holding:?}");
    assert!(
        lanes
            .lanes
            .iter()
            .filter(|l| l.held_back_by.is_some())
            .all(|l| l.held_back_by == Some(holder_xid)),
        "{lanes:?}"
    );
    // The gauges too: the age of the open transaction, no lane's lag.
    assert!(
        eventually(Duration::from_secs(30), || async {
            let body = scrape(addr).await;
            sum(&body, "outbox_progress_blocking_transaction_seconds") > 0.0
                && sum(&body, "outbox_lane_backlog_events") == 0.0
        })
        .await,
        "{}",
        scrape(addr).await
    );
    relay.shutdown().await.unwrap();

    // It commits while no relay runs: its lane counts its three events,
    // which are as old as the transaction.
    let open_for: f64 =
        sqlx::query_scalar("SELECT EXTRACT(EPOCH FROM clock_timestamp() - now())::float8")
            .fetch_one(&mut *holder)
            .await
            .unwrap();
    holder.commit().await.unwrap();
    let after = lag(&pool).await;
    // Its slot's position: lane `slot % 16`'s if the relay recorded one
    // for that lane (a lane with no rows is recorded only after some
    // seconds idle), else the one the mode was enabled with (one lane).
    let slot = slot_of_key(&pool, "held").await;
    let of_slot = |l: &&ops::LaneLag| {
        l.slots
            .trim_matches(|c| c == '{' || c == '}')
            .split(',')
            .any(|s| s == slot.to_string())
    };
    let its = after
        .lanes
        .iter()
        .filter(of_slot)
        .max_by_key(|l| l.lane_count)
        .unwrap_or_else(|| panic!("slot {slot} in {after:?}"));
    assert_eq!(its.events, 3, "{after:?}");
    assert!(
        its.oldest_secs.is_some_and(|a| a >= open_for),
        "{its:?}, open for {open_for}"
    );
    assert_eq!(after.events(), 3, "{after:?}");
    assert_eq!(after.holding, None, "{after:?}");

    // A relay publishes them: nothing left, nothing holding.
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            let l = lag(&pool).await;
            l.events() == 0 && l.holding.is_none()
        })
        .await,
        "{:?}",
        lag(&pool).await
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            let body = scrape(addr).await;
            // Its lane published rows: its position is recorded.
            let lane = format!("lane=\"{}\",lanes=\"16\"", slot % 16);
            samples(&body, "outbox_lane_backlog_events")
                .iter()
                .any(|(labels, _)| labels.contains(&lane))
                && sum(&body, "outbox_lane_backlog_events") == 0.0
                && sum(&body, "outbox_lane_oldest_unpublished_seconds") == 0.0
                && samples(&body, "outbox_progress_blocking_transaction_seconds")
                    == vec![(String::new(), 0.0)]
        })
        .await,
        "{}",
        scrape(addr).await
    );
    // Every series the alert rules use of the progress mode is emitted.
    let body = scrape(addr).await;
    let scrape_now = deploy::Scrape::parse(&body);
    let mut used = 0;
    for rule in deploy::rules() {
        if deploy::PROGRESS_SERIES
            .iter()
            .any(|s| rule.expr.contains(s))
        {
            used += 1;
            assert_eq!(
                scrape_now.missing(&rule.expr),
                Vec::<String>::new(),
                "{}",
                rule.alert
            );
        }
    }
    assert!(used > 0, "an alert rule uses the progress mode's series");
    relay.shutdown().await.unwrap();

    committed.extend(held_ids);
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    assert_eq!(verify(&committed, &received), 0, "each once");
}

/// The relay's role (the guide's grants, no `pg_read_all_stats`) reads the
/// lag while a transaction of the application's role holds a window back:
/// its pid and transaction id are shown, its age and state unknown — not
/// an error; granted `pg_read_all_stats`, its age and state too. The
/// position is recorded as a relay records one (no broker needed).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_relay_role_sees_the_holders_pid_and_its_age_only_with_pg_read_all_stats(pool: PgPool) {
    use common::roles::*;
    let roles = Roles::create(&pool).await;
    roles
        .sql("GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_held_topic TO outbox_relay")
        .await;
    progress::enable(&pool).await.unwrap();
    let app = roles.pool("outbox_app", 2);
    let mut holder = app.begin().await.unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let held = [message("lag-roles", "held", 0)];
    outbox_core::insert_messages(&mut holder, &held, &outbox_core::Headers::default())
        .await
        .unwrap();
    let holder_xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::int8")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    commit_messages(&app, "lag-roles", 5, 1, 5).await;
    sqlx::query(
        "INSERT INTO outbox_progress (slots, done)
         SELECT ARRAY(SELECT generate_series(0, 63))::int2[], pg_current_snapshot()",
    )
    .execute(&pool)
    .await
    .unwrap();

    let relay_role = roles.pool("outbox_relay", 1);
    let seen = lag(&relay_role).await;
    assert_eq!(seen.events(), 0, "{seen:?}");
    let h = seen.holding.clone().expect("the holder is reported");
    assert_eq!((h.xid, h.pid), (holder_xid, Some(holder_pid)), "{h:?}");
    assert_eq!((h.age_secs, h.state.as_deref()), (None, None), "{h:?}");
    assert_eq!(h.lanes, 1, "{h:?}");
    // `status` reads the same, as any role that may read the tables.
    let status = ops::status(&relay_role).await.unwrap();
    let shown = status.progress.and_then(|p| p.holding);
    assert_eq!(shown, Some(h), "{seen:?}");

    roles.sql("GRANT pg_read_all_stats TO outbox_relay").await;
    let relay_role = roles.pool("outbox_relay", 1);
    let h = lag(&relay_role)
        .await
        .holding
        .expect("the holder is reported");
    assert_eq!(h.pid, Some(holder_pid), "{h:?}");
    assert!(h.age_secs.is_some_and(|a| a > 0.0), "{h:?}");
    assert_eq!(h.state.as_deref(), Some("idle in transaction"), "{h:?}");

    // Committed, its event is the lane's lag (its transaction was in flight
    // in the position's snapshot); nothing holds the windows back.
    holder.commit().await.unwrap();
    let after = lag(&relay_role).await;
    assert_eq!(after.events(), 1, "{after:?}");
    assert_eq!(after.holding, None, "{after:?}");
    app.close().await;
    relay_role.close().await;
    roles.drop_all().await;
}

/// Snapshots are the whole cluster's: a transaction left open in another
/// database is in the lanes' snapshots too, but cannot write this outbox
/// and holds nothing back. It is not reported; one of this database is.
/// (A transaction is in a snapshot's list of those in progress once a later
/// one has completed: each is followed by a committed write here.)
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_transaction_of_another_database_is_not_reported_as_holding(pool: PgPool) {
    progress::enable(&pool).await.unwrap();
    // The server's database the tests connect to, beside the test's own.
    let elsewhere = sqlx::PgPool::connect(&std::env::var("DATABASE_URL").unwrap())
        .await
        .unwrap();
    let name = "SELECT current_database()";
    let here: String = sqlx::query_scalar(name).fetch_one(&pool).await.unwrap();
    let there: String = sqlx::query_scalar(name)
        .fetch_one(&elsewhere)
        .await
        .unwrap();
    assert_ne!(here, there);
    let write = "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key)
                 VALUES (gen_random_uuid(), 'A', 'a', 'E', '{}', 'lanes', 'k')";
    let record = || async {
        sqlx::query(write).execute(&pool).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox_progress (slots, done)
             SELECT ARRAY(SELECT generate_series(0, 63))::int2[], pg_current_snapshot()",
        )
        .execute(&pool)
        .await
        .unwrap();
    };
    let mut other = elsewhere.begin().await.unwrap();
    let theirs: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::int8")
        .fetch_one(&mut *other)
        .await
        .unwrap();
    record().await;
    let seen = lag(&pool).await;
    assert!(
        seen.lanes[0].done.contains(&theirs.to_string()),
        "the other database's transaction is in the snapshot: {seen:?}"
    );
    assert!(seen.holding.is_none(), "{seen:?}");

    let mut mine = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *mine)
        .await
        .unwrap();
    sqlx::query(write).execute(&mut *mine).await.unwrap();
    record().await;
    let seen = lag(&pool).await;
    let Some(holding) = seen.holding.clone() else {
        panic!("this database's transaction: {seen:?}");
    };
    assert_eq!(holding.pid, Some(pid));
    other.rollback().await.unwrap();
    mine.rollback().await.unwrap();
}

/// Inserts `n` events of the topics `t0`..`t2` (by `g % 3`), one key per
/// row unless `key` names one, in one transaction.
async fn insert_events(pool: &PgPool, from: i64, n: i64, key: Option<&str>) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                   topic, partition_key)
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't' || (g % 3), coalesce($3, 'k' || g)
         FROM generate_series($1, $1 + $2 - 1) AS g",
    )
    .bind(from)
    .bind(n)
    .bind(key)
    .execute(pool)
    .await
    .unwrap();
}

/// The true backlog: rows per topic and per lane of 16 (no row is held,
/// parked or passed).
async fn truth(pool: &PgPool) -> (Vec<(String, i64)>, Vec<i64>) {
    let topics: Vec<(String, i64)> =
        sqlx::query_as("SELECT topic, count(*) FROM outbox_event GROUP BY topic ORDER BY topic")
            .fetch_all(pool)
            .await
            .unwrap();
    let lanes: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT l, count(e.id) FROM generate_series(0, 15) AS l
         LEFT JOIN outbox_event e ON e.lane_slot % 16 = l GROUP BY l ORDER BY l",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    (topics, lanes.into_iter().map(|(_, n)| n).collect())
}

/// Each lane's lag: its count up to the bound (`LAG_EXACT_UP_TO` + 1:
/// more), one lane of 16 per position.
async fn lane_events(pool: &PgPool) -> Vec<i64> {
    let lag = lag(pool).await;
    assert_eq!(lag.lanes.len(), 16, "{lag:?}");
    lag.lanes
        .iter()
        .enumerate()
        .map(|(i, l)| {
            assert_eq!(l.lane, i.to_string());
            assert_eq!(l.lane_count, Some(16));
            l.events
        })
        .collect()
}

/// `status`, the lag per lane and the backlog gauges' statement in the
/// progress mode with 16 lanes' positions: below their bounds the counts are
/// exact (in total, per topic, per lane), also with most rows in one slot
/// (one key); past them (35,000 rows) `status` says its backlog is estimated
/// and the estimates are near the truth, and each lane shows its count up to
/// its bound (more: the bound + 1).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn backlog_and_lag_are_exact_below_their_bounds_and_estimated_past_them(pool: PgPool) {
    progress::enable(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_progress (slots, done)
         SELECT ARRAY(SELECT s::int2 FROM generate_series(l, 63, 16) s), pg_current_snapshot()
         FROM generate_series(0, 15) l",
    )
    .execute(&pool)
    .await
    .unwrap();
    let gauges = async |pool: &PgPool| -> i64 {
        let (backlog, _, _, _): (i64, Option<f64>, i64, i64) =
            sqlx::query_as(ops::progress_gauges_sql())
                .fetch_one(pool)
                .await
                .unwrap();
        backlog
    };

    // Below the bounds: 3,000 rows over many keys, 2,000 of one key (one
    // slot, one lane).
    insert_events(&pool, 1, 3_000, None).await;
    insert_events(&pool, 3_001, 2_000, Some("hot")).await;
    sqlx::query("ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let (topics, lanes) = truth(&pool).await;
    let status = ops::status(&pool).await.unwrap();
    assert!(!status.backlog_estimated, "{status:?}");
    assert_eq!(status.unpublished, 5_000);
    let counted: Vec<(String, i64)> = status
        .topics
        .iter()
        .map(|t| (t.topic.clone(), t.unpublished))
        .collect();
    assert_eq!(counted, topics);
    let bound = ops::LAG_EXACT_UP_TO + 1;
    let capped: Vec<i64> = lanes.iter().map(|n| (*n).min(bound)).collect();
    assert_eq!(lane_events(&pool).await, capped);
    let progress = status.progress.as_ref().expect("the progress mode");
    assert_eq!(
        progress.lanes.iter().map(|l| l.events).collect::<Vec<_>>(),
        capped
    );
    assert_eq!(gauges(&pool).await, 5_000);

    // Past them: 30,000 more rows over many keys.
    insert_events(&pool, 5_001, 30_000, None).await;
    sqlx::query("ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    let (topics, lanes) = truth(&pool).await;
    let near = |estimate: i64, truth: i64| {
        estimate as f64 >= truth as f64 / 1.5 && estimate as f64 <= truth as f64 * 1.5
    };
    let status = ops::status(&pool).await.unwrap();
    assert!(status.backlog_estimated, "{status:?}");
    assert!(status.unpublished > ops::BACKLOG_EXACT_UP_TO, "{status:?}");
    assert!(near(status.unpublished, 35_000), "{status:?}");
    for (topic, n) in &topics {
        let t = status.topics.iter().find(|t| &t.topic == topic).unwrap();
        assert!(near(t.unpublished, *n), "{topic}: {} of {n}", t.unpublished);
    }
    let backlog = gauges(&pool).await;
    assert!(near(backlog, 35_000), "gauges: {backlog}");
    let capped: Vec<i64> = lanes.iter().map(|n| (*n).min(bound)).collect();
    let shown = lane_events(&pool).await;
    assert_eq!(shown, capped);
    assert!(
        shown
            .iter()
            .zip(&lanes)
            .all(|(s, n)| *s == *n || *s == bound),
        "{shown:?} of {lanes:?}"
    );
}
