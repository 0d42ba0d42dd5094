//! Per-key order with several relays (lanes), against a real PostgreSQL and
//! a real broker: relays share the lanes out and take over a stopped relay's
//! lanes; a relay with another lane count, or without lanes beside relays
//! with lanes (and the other way round), is refused; an aborted or panicking
//! relay task releases its lanes; a relay whose connections go silent loses
//! its lanes within bounded times; writers of one key publish in commit
//! order. (Relay processes killed and restarted: the `outbox-cli` package's
//! `lanes_processes` test.) The tests of relays with lanes run in the
//! progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test
//! command); the one of relays without lanes only in the default mode (the
//! progress mode refuses a relay without lanes: `progress_relay`).

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use outbox_core::UnitOfWork;
use outbox_runtime::{CancellationToken, Error, Relay, RelayHandle};
use sqlx::postgres::{PgConnection, PgPoolOptions};
use sqlx::{Connection, PgPool};
use uuid::Uuid;

/// A relay with a pool of its own, as a separate service instance would
/// have (the test pool has only 5 connections).
fn relay(pool: &PgPool) -> outbox_runtime::RelayBuilder {
    let own = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with((*pool.connect_options()).clone());
    Relay::builder(own)
        .brokers(brokers())
        .delivery_timeout(Duration::from_secs(10))
}

/// The lanes of each relay, when they are disjoint and cover all 16.
fn split(handles: &[&RelayHandle]) -> Option<Vec<usize>> {
    let mut all = BTreeSet::new();
    let mut sizes = Vec::new();
    for h in handles {
        let lanes = h.lanes();
        sizes.push(lanes.len());
        for lane in lanes {
            if !all.insert(lane) {
                return None;
            }
        }
    }
    (all.len() == 16).then_some(sizes)
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relays_share_the_lanes_and_take_over_a_stopped_relays_lanes(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("lanes-share");
    create_warm_topic(&brokers(), &topic).await;
    let a = relay(&pool).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async { a.lanes().len() == 16 }).await,
        "a lone relay owns every lane, got {:?}",
        a.lanes()
    );
    let b = relay(&pool).spawn().unwrap();
    let c = relay(&pool).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            split(&[&a, &b, &c]).is_some_and(|mut s| {
                s.sort_unstable();
                s == [5, 5, 6]
            })
        })
        .await,
        "three relays split 16 lanes 6/5/5, got {:?} {:?} {:?}",
        a.lanes(),
        b.lanes(),
        c.lanes()
    );

    // `outbox status` shows the three and their lanes.
    let relays = outbox_runtime::ops::relays(&pool).await.unwrap();
    assert_eq!(relays.len(), 3, "{relays:?}");
    let mut owned: Vec<i32> = relays.iter().flat_map(|r| r.lanes.clone()).collect();
    owned.sort_unstable();
    assert_eq!(owned, (0..16).collect::<Vec<_>>());
    assert!(relays.iter().all(|r| r.lane_count == Some(16)));

    // Events keep flowing, in per-key order, while the lanes move.
    let first = commit_messages(&pool, &topic, 3_000, 100, 100).await;
    let stopped = Instant::now();
    b.shutdown().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            split(&[&a, &c]).is_some_and(|s| s == [8, 8])
        })
        .await,
        "the two left split 8/8, got {:?} {:?}",
        a.lanes(),
        c.lanes()
    );
    eprintln!(
        "lanes of a stopped relay taken over in {:?}",
        stopped.elapsed()
    );
    let second = commit_messages(&pool, &topic, 3_000, 100, 100).await;
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    a.shutdown().await.unwrap();
    c.shutdown().await.unwrap();

    let committed: Vec<Uuid> = first.into_iter().chain(second).collect();
    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    let duplicates = verify(&committed, &received);
    assert_eq!(duplicates, 0, "graceful handovers publish nothing twice");
}

/// Both modes: the lane count is checked before either reads the outbox.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_with_another_lane_count_is_refused(pool: PgPool) {
    relay_mode(&pool).await;
    let running = relay(&pool).lanes(16).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            running.lanes().len() == 16
        })
        .await
    );
    let other = relay(&pool).lanes(8).build().unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), other.run(CancellationToken::new()))
        .await
        .expect("refused at once");
    match result {
        Err(Error::Config(message)) => {
            assert!(message.contains("16 lanes"), "{message}");
            assert!(message.contains("same lane count"), "{message}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    assert_eq!(
        running.lanes().len(),
        16,
        "the running relay keeps its lanes"
    );
    running.shutdown().await.unwrap();

    for unsupported in [3, 10, 100, 128, 2000] {
        let refused = relay(&pool).lanes(unsupported).build();
        assert!(
            matches!(&refused, Err(Error::Config(m)) if m.contains("divisor of 64")
                && m.contains(&format!("got {unsupported}"))),
            "{unsupported} lanes: {:?}",
            refused.err()
        );
    }
}

/// Two writers of one key whose transactions overlap: the first draws its id
/// and then stays in its transaction (a trigger sleeps), the second starts
/// later and commits at once. Kafka must show them in commit order, also when
/// the relay only claims after both committed (it claims in id order).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn writers_of_one_key_publish_in_commit_order(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("lanes-commit-order");
    create_topic(&brokers(), &topic).await;
    sqlx::raw_sql(
        "CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.event_type = 'Slow' THEN PERFORM pg_sleep(1); END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER slow_insert AFTER INSERT ON outbox_event
             FOR EACH ROW EXECUTE FUNCTION slow_insert();",
    )
    .execute(&pool)
    .await
    .unwrap();

    let commits = Arc::new(AtomicUsize::new(0));
    let write = |event_type: &'static str, delay: Duration| {
        let (pool, topic, commits) = (pool.clone(), topic.clone(), commits.clone());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut uow = UnitOfWork::begin(&pool).await.unwrap();
            let mut message = message(&topic, "the-key", 0);
            message.event_type = event_type.into();
            let id = uow.record_message(message);
            uow.commit().await.unwrap();
            (commits.fetch_add(1, Ordering::SeqCst), id)
        })
    };
    let slow = write("Slow", Duration::ZERO);
    // The second writer starts once the first holds the key (its insert is
    // in the trigger's sleep): a fixed delay let a loaded machine start it
    // before the first had even connected.
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                 WHERE datname = $1 AND wait_event = 'PgSleep')",
            )
            .bind(&database)
            .fetch_one(&pool)
            .await
            .unwrap()
        })
        .await,
        "the first writer never reached its insert"
    );
    let fast = write("Fast", Duration::ZERO);
    let (slow_rank, slow_id) = slow.await.unwrap();
    let (fast_rank, fast_id) = fast.await.unwrap();
    let commit_order = if slow_rank < fast_rank {
        vec![slow_id, fast_id]
    } else {
        vec![fast_id, slow_id]
    };
    // The second writer waited for the first's commit at its insert.
    assert_eq!(commit_order, vec![slow_id, fast_id]);

    let handle = relay(&pool).spawn().unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    handle.shutdown().await.unwrap();
    let received = read_topic(&brokers(), &topic, 2, Duration::from_secs(30)).await;
    let order: Vec<Uuid> = received.iter().map(|r| r.event_id()).collect();
    assert_eq!(order, commit_order, "Kafka order is the commit order");
}

/// A relay without lanes claims every row: beside relays with lanes it
/// would publish their keys too, in parallel with them. Either kind refuses
/// to start beside the other, with an error naming both. Default mode only:
/// the progress mode refuses every relay without lanes.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relays_with_and_without_lanes_refuse_each_other(pool: PgPool) {
    let with_lanes = relay(&pool).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            with_lanes.lanes().len() == 16
        })
        .await
    );
    let without = relay(&pool).lanes(0).build().unwrap();
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        without.run(CancellationToken::new()),
    )
    .await
    .expect("refused at once");
    match refused {
        Err(Error::Config(message)) => {
            assert!(message.contains("with 16 lanes"), "{message}");
            assert!(message.contains("without lanes"), "{message}");
        }
        other => panic!("a relay without lanes beside lanes: {other:?}"),
    }
    // The same through the command: the `outbox-cli` package's tests.
    assert_eq!(
        with_lanes.lanes().len(),
        16,
        "the running relay keeps its lanes"
    );
    with_lanes.shutdown().await.unwrap();

    // The other way round.
    let without = relay(&pool).lanes(0).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            outbox_runtime::ops::relays(&pool)
                .await
                .is_ok_and(|r| r.len() == 1 && r[0].lane_count == Some(0))
        })
        .await,
        "the relay without lanes is registered: {:?}",
        outbox_runtime::ops::relays(&pool).await
    );
    let with_lanes = relay(&pool).lanes(16).build().unwrap();
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        with_lanes.run(CancellationToken::new()),
    )
    .await
    .expect("refused at once");
    match refused {
        Err(Error::Config(message)) => {
            assert!(message.contains("without lanes"), "{message}");
            assert!(message.contains("with 16 lanes"), "{message}");
        }
        other => panic!("a relay with lanes beside one without: {other:?}"),
    }
    assert!(!without.is_finished(), "the running relay goes on");
    without.shutdown().await.unwrap();
}

/// Waits until no relay of the outbox holds a lane any more.
async fn no_lane_held(pool: &PgPool) -> bool {
    eventually(Duration::from_secs(5), || async {
        outbox_runtime::ops::relays(pool)
            .await
            .is_ok_and(|relays| relays.iter().all(|r| r.lanes.is_empty()))
    })
    .await
}

/// Sessions of this database idle inside a transaction, seen from a
/// connection of its own (one from `pool` could be such a session itself).
async fn idle_in_transaction(pool: &PgPool) -> i64 {
    let mut own = PgConnection::connect_with(&pool.connect_options())
        .await
        .unwrap();
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&mut own)
    .await
    .unwrap();
    let _ = own.close().await;
    n
}

/// The task running a relay is aborted (at several points of its first
/// claims), or panics: its lanes are released within seconds, no connection
/// of the pool it ran on (here the application's, shared) is left inside one
/// of its transactions, and a new relay gets every lane. (The lane manager
/// and the metrics task ran on tasks of their own and, orphaned, kept the
/// lanes, and a claim cut off in its `BEGIN` left its connection in the
/// pool inside the transaction, holding the lanes' "in use" locks.)
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_task_aborted_or_panicking_releases_its_lanes(pool: PgPool) {
    relay_mode(&pool).await;
    let cases = [
        ("aborted", 0),
        ("aborted", 1),
        ("aborted", 3),
        ("aborted", 8),
        ("aborted", 20),
        ("panicked", 0),
        ("panicked", 5),
    ];
    for (how, after_ms) in cases {
        let victim = Relay::builder(pool.clone())
            .brokers(brokers())
            .build()
            .unwrap();
        let stats = victim.stats();
        let owns_all = {
            let stats = stats.clone();
            move || {
                let stats = stats.clone();
                async move { stats.lanes().len() == 16 }
            }
        };
        let task = if how == "aborted" {
            tokio::spawn(async move {
                let _ = victim.run(CancellationToken::new()).await;
            })
        } else {
            let owns_all = owns_all.clone();
            tokio::spawn(async move {
                let run = victim.run(CancellationToken::new());
                tokio::pin!(run);
                tokio::select! {
                    _ = &mut run => {}
                    _ = async {
                        while !owns_all().await {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        tokio::time::sleep(Duration::from_millis(after_ms)).await;
                    } => panic!("the task running the relay panics"),
                }
            })
        };
        assert!(
            eventually(Duration::from_secs(10), owns_all.clone()).await,
            "{how}: the relay took its lanes"
        );
        if how == "aborted" {
            tokio::time::sleep(Duration::from_millis(after_ms)).await;
            task.abort();
        }
        let ended = task.await.unwrap_err();
        assert!(
            if how == "aborted" {
                ended.is_cancelled()
            } else {
                ended.is_panic()
            },
            "{how}: {ended:?}"
        );
        assert!(
            no_lane_held(&pool).await,
            "{how} after {after_ms} ms: its lanes are released: {:?}",
            outbox_runtime::ops::relays(&pool).await
        );
        assert!(
            eventually(Duration::from_secs(5), || async {
                idle_in_transaction(&pool).await == 0
            })
            .await,
            "{how} after {after_ms} ms: no session left inside a claim transaction"
        );
        let next = relay(&pool).spawn().unwrap();
        assert!(
            eventually(Duration::from_secs(5), || async {
                next.lanes().len() == 16
            })
            .await,
            "{how} after {after_ms} ms: a new relay owns every lane, got {:?}",
            next.lanes()
        );
        next.shutdown().await.unwrap();
    }
}

/// A relay task aborted while its claim's `BEGIN` waits (here for a lane's
/// "in use" lock the test holds): once that `BEGIN` completes, no connection
/// of the application's pool the relay ran on may be left inside the
/// transaction (it would hold the lanes' "in use" locks and hand the open
/// transaction to the application's next query).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_aborted_inside_a_claim_leaves_no_transaction_open(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("lanes-abort-claim");
    let victim = Relay::builder(pool.clone())
        .brokers(brokers())
        .build()
        .unwrap();
    let stats = victim.stats();
    let task = tokio::spawn(async move {
        let _ = victim.run(CancellationToken::new()).await;
    });
    assert!(
        eventually(Duration::from_secs(10), || async {
            stats.lanes().len() == 16
        })
        .await
    );
    // Lane 0's "in use" lock (kind 2 of the outbox's keys), held exclusively.
    let in_use_0: i64 =
        sqlx::query_scalar("SELECT ('outbox_event'::regclass::oid::int8 << 32) | (2 << 24)")
            .fetch_one(&pool)
            .await
            .unwrap();
    let mut holder = PgConnection::connect_with(&pool.connect_options())
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(in_use_0)
        .execute(&mut holder)
        .await
        .unwrap();
    // A commit wakes the relay: its claim's BEGIN waits for the lock.
    commit_messages(&pool, &topic, 1, 1, 1).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'
                   AND NOT granted AND ((classid::int8 << 32) | objid::int8) = $1)",
            )
            .bind(in_use_0)
            .fetch_one(&pool)
            .await
            .unwrap()
        })
        .await,
        "the claim waits for lane 0"
    );
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(in_use_0)
        .execute(&mut holder)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            idle_in_transaction(&pool).await == 0
        })
        .await,
        "a connection was left inside the aborted relay's claim transaction"
    );
    assert!(no_lane_held(&pool).await);
}

/// A relay whose connections go silent — its host frozen, or a half-open
/// connection: a proxy in front of PostgreSQL stops passing data and closes
/// nothing — loses its lanes within the lane timeout (10 s) and its claimed
/// rows within the claim idle timeout (here 2 s delivery timeout + 1 s
/// back-off cap + 5 s); a second relay takes over and publishes in per-key
/// order. When the first one comes back it finds its sessions ended and
/// rejoins.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_silent_relay_loses_its_lanes_and_rows_within_bounded_times(pool: PgPool) {
    relay_mode(&pool).await;
    init_tracing();
    let topic = unique_topic("lanes-frozen");
    create_warm_topic(&brokers(), &topic).await;
    let options = pool.connect_options().as_ref().clone();
    let upstream = format!("127.0.0.1:{}", options.get_port()).parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let frozen_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options.clone().host("127.0.0.1").port(proxy.addr.port()));
    let settings = |b: outbox_runtime::RelayBuilder| {
        b.brokers(brokers())
            .batch_size(50)
            .delivery_timeout(Duration::from_secs(2))
            .outage_backoff(Duration::from_millis(100), Duration::from_secs(1))
    };
    let first = settings(Relay::builder(frozen_pool)).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            first.lanes().len() == 16
        })
        .await
    );
    let mut committed = commit_messages(&pool, &topic, 500, 40, 10).await;
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);

    // Writers go on; the first relay's database connections go silent while
    // it works.
    let writing = {
        let (pool, topic) = (pool.clone(), topic.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for _ in 0..40 {
                ids.extend(commit_messages(&pool, &topic, 40, 40, 10).await);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            ids
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.freeze();
    let frozen_at = Instant::now();
    let second = settings(relay(&pool)).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(40), || async {
            second.lanes().len() == 16
        })
        .await,
        "the second relay owns every lane; the silent one still holds {:?}",
        outbox_runtime::ops::relays(&pool).await
    );
    eprintln!(
        "lanes of the silent relay taken over after {:?}",
        frozen_at.elapsed()
    );
    committed.extend(writing.await.unwrap());
    assert!(
        wait_until_published(&pool, Duration::from_secs(60)).await,
        "everything published while the first relay is silent"
    );
    eprintln!("backlog drained {:?} after the freeze", frozen_at.elapsed());

    // It comes back: its sessions were ended; it reconnects and takes a share.
    proxy.thaw();
    assert!(
        eventually(Duration::from_secs(30), || async {
            split(&[&first, &second]).is_some_and(|s| s == [8, 8])
        })
        .await,
        "the first relay rejoined: {:?} {:?}",
        first.lanes(),
        second.lanes()
    );
    committed.extend(commit_messages(&pool, &topic, 500, 40, 10).await);
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    first.shutdown().await.unwrap();
    second.shutdown().await.unwrap();

    let received = read_topic(&brokers(), &topic, committed.len(), Duration::from_secs(60)).await;
    let duplicates = verify(&committed, &received);
    eprintln!(
        "silent relay: {} events, 0 lost, in order, {duplicates} duplicates",
        committed.len()
    );
}

/// A relay of an earlier version held database-wide lane locks, which this
/// version's relays cannot see (nor it theirs): side by side both would
/// publish every key. A relay of this version refuses to start while one
/// runs (here: its lane lock held by hand). Both modes.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_relay_refuses_to_run_beside_relays_of_an_earlier_version(pool: PgPool) {
    relay_mode(&pool).await;
    let mut earlier = PgConnection::connect_with(&pool.connect_options())
        .await
        .unwrap();
    // The earlier version's lane 3 (class 0x6F626C00, two-key form).
    sqlx::query("SELECT pg_advisory_lock(1868721152, 3)")
        .execute(&mut earlier)
        .await
        .unwrap();
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        relay(&pool).build().unwrap().run(CancellationToken::new()),
    )
    .await
    .expect("refused at once");
    match refused {
        Err(Error::Config(message)) => assert!(message.contains("earlier version"), "{message}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    earlier.close().await.unwrap();
    let now = relay(&pool).spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async { now.lanes().len() == 16 }).await,
        "once it is gone, the relay starts"
    );
    now.shutdown().await.unwrap();
}
