//! Consumer groups that keep going: two consumer processes in each mode
//! (a dedup-mode group and an inbox-mode group), SIGKILLed and restarted
//! again and again while the writers commit, the broker frozen once. Every
//! committed event must be applied by both groups, once, in per-key order,
//! within a bound after the last fault (the recovery time). With
//! `OUTBOX_TEST_INBOX_MODE=progress` the inbox-mode group's processor runs
//! in the progress mode. With `OUTBOX_TEST_DEDUP_MEMORY=1` the dedup-mode
//! members retry from memory (`ConsumerBuilder::memory_retries`), and their
//! handler fails the first attempt of one event in 32 in each process
//! (`harness::flaky`): a key waits in memory while members are killed, its
//! events pinned; each event must still be applied once, in order, with no
//! dead letter.

use std::time::{Duration, Instant};

use outbox_core::DomainEvent;
use outbox_runtime::Mode;
use sqlx::PgPool;
use uuid::Uuid;

use super::checker::{self, Evidence};
use super::children::{self, Child};
use super::common::{
    PrivateBroker, create_warm_topic, database_url, free_port, init_tracing, signal,
};
use super::harness::{Load, Writers, collect, effect_tables, effects_of, scenario_event};
use super::{SERIAL, group_of, jitter, relay};

scenario_event!(GroupCrashEvent, "reliability-group-crashes");

/// Not a test: the body of the consumer processes of
/// [`consumer_groups_killed_and_restarted_keep_going`].
#[tokio::test]
#[ignore = "runs only as a child process of the consumer groups scenario"]
async fn group_consumer_process() {
    children::run_consumer::<GroupCrashEvent>().await;
}

/// The ids of `ids` applied in `table`.
async fn applied(pool: &PgPool, table: &str, ids: &[Uuid]) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(DISTINCT event_id) FROM {table} WHERE event_id = ANY($1)"
    ))
    .bind(ids)
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn consumer_groups_killed_and_restarted_keep_going(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let port = free_port();
    let broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = GroupCrashEvent::TOPIC;
    create_warm_topic(&brokers, topic).await;
    effect_tables(&pool).await;
    // One record per record batch: killed consumers resume from committed
    // offsets (see `children`; the broker mishandles a fetch that starts
    // inside a batch).
    let relay = relay(&pool, &brokers)
        .await
        .kafka_setting("batch.num.messages", "1")
        .spawn()
        .unwrap();
    let writers = Writers::start(&pool, topic, Load::default()).await;
    let url = database_url(&pool);
    let groups = [group_of(topic), format!("{}-inbox", group_of(topic))];
    // `OUTBOX_TEST_INBOX_MODE=progress`: the inbox-mode group's processor in
    // the progress mode (the test command runs the scenario both ways).
    let inbox_progress = std::env::var("OUTBOX_TEST_INBOX_MODE").as_deref() == Ok("progress");
    if inbox_progress {
        outbox_runtime::inbox::progress::enable(&pool, &groups[1])
            .await
            .expect("the inbox progress mode");
    }
    let logs = std::env::temp_dir().join(format!("outbox-groups-{}", *super::RUN));
    std::fs::create_dir_all(&logs).unwrap();
    let mut started = 0;
    let mut spawn = |mode: Mode| {
        started += 1;
        let log = std::fs::File::create(logs.join(format!("consumer-{mode}-{started}.log")))
            .expect("log file");
        let group = if mode == Mode::Inbox {
            &groups[1]
        } else {
            &groups[0]
        };
        children::consumer(
            "groups::group_consumer_process",
            &Child {
                url: &url,
                brokers: &brokers,
                group,
                mode,
            },
            log,
        )
    };
    let mut members: Vec<(Mode, tokio::process::Child)> = [Mode::Dedup, Mode::Inbox]
        .into_iter()
        .flat_map(|mode| [(mode, spawn(mode)), (mode, spawn(mode))])
        .collect();

    // Ten kills in about 40 s, each member in turn, replaced at once; the
    // broker frozen 6 s after the fifth.
    let kills = 10;
    for i in 0..kills {
        tokio::time::sleep(jitter(i, 2_500, 3_000)).await;
        let victim = i as usize % members.len();
        let mode = members[victim].0;
        signal(members[victim].1.id().expect("running"), "-KILL");
        members[victim].1.wait().await.unwrap();
        members[victim] = (mode, spawn(mode));
        if i == 4 {
            broker.pause();
            tokio::time::sleep(Duration::from_secs(6)).await;
            broker.resume();
        }
    }
    let last_fault = Instant::now();
    let ids = writers.committed_ids();
    // Recovery: every event committed before the last fault applied by
    // both groups. A partition left to a killed member costs a stall
    // timeout (15 s), a probe, a rebalance and the backlog it kept: once or
    // twice in a run; on a loaded machine the backlog alone takes a minute.
    let bound = Duration::from_secs(180);
    let mut recovered = None;
    // What both groups had applied, every 10 s: a group that stands still
    // shows apart from one that is slow.
    let mut progress = Vec::new();
    let mut next_mark = Duration::ZERO;
    while last_fault.elapsed() < bound {
        let want = ids.len() as i64;
        let dedup = applied(&pool, "effect", &ids).await;
        let inbox = applied(&pool, "effect_inbox", &ids).await;
        if last_fault.elapsed() >= next_mark {
            progress.push(format!(
                "{}s {dedup}/{inbox}",
                last_fault.elapsed().as_secs()
            ));
            next_mark += Duration::from_secs(10);
        }
        if dedup >= want && inbox >= want {
            recovered = Some(last_fault.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let progress = format!("of {}: {}", ids.len(), progress.join(", "));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ledger = writers.stop().await;
    let evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(60),
    )
    .await;
    let all: Vec<Uuid> = ledger.committed.iter().map(|w| w.event_id).collect();
    let inbox_done = super::common::eventually(Duration::from_secs(60), || async {
        applied(&pool, "effect_inbox", &all).await >= all.len() as i64
    })
    .await;
    let evidence_inbox = Evidence {
        effects: effects_of(&pool, "effect_inbox").await,
        committed: evidence.committed.clone(),
        rolled_back: evidence.rolled_back.clone(),
        kafka: evidence.kafka.clone(),
        ..Evidence::default()
    };
    let in_logs = |what: &str| -> usize {
        std::fs::read_dir(&logs)
            .map(|dir| {
                dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
                    .map(|text| text.matches(what).count())
                    .sum()
            })
            .unwrap_or(0)
    };
    let rejoins = in_logs("rejoining the group");
    let flaky = std::env::var_os(children::DEDUP_MEMORY).is_some();
    let transient_failures = in_logs("flaky handler: failing");
    let dedup_dead_letters: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dead_letter WHERE consumer = $1")
            .bind(&groups[0])
            .fetch_one(&pool)
            .await
            .expect("dead letters");
    for (_, mut child) in members {
        if let Some(pid) = child.id() {
            signal(pid, "-TERM");
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
        let _ = child.kill().await;
    }
    let relay_counts = relay.counts();
    relay.shutdown().await.unwrap();
    drop(broker);

    let mut figures = checker::check(
        match (inbox_progress, flaky) {
            (true, true) => {
                "consumer groups killed and restarted, inbox progress mode, dedup retries from memory"
            }
            (true, false) => "consumer groups killed and restarted, inbox progress mode",
            (false, true) => "consumer groups killed and restarted, dedup retries from memory",
            (false, false) => "consumer groups killed and restarted",
        },
        &evidence,
    );
    let figures_inbox = checker::check(
        if inbox_progress {
            "consumer groups killed and restarted (inbox group, progress mode)"
        } else {
            "consumer groups killed and restarted (inbox group)"
        },
        &evidence_inbox,
    );
    figures.recovery_ms = recovered.map(|d| d.as_millis() as u64);
    figures.note(
        "faults",
        format!(
            "2 dedup-mode and 2 inbox-mode consumer processes, {kills} SIGKILLed and replaced in turn \
             over about 40 s, the broker frozen 6 s after the fifth; sessions {} ms",
            children::SESSION_MS
        ),
    );
    figures.note(
        "inbox group: consumed / lost / applied twice / order violations",
        format!(
            "{} / {} / {} / {}",
            figures_inbox.consumed,
            figures_inbox.lost,
            figures_inbox.applied_twice,
            figures_inbox.order_violations
        ),
    );
    figures.note(
        "applied by the dedup/inbox groups after the last fault",
        &progress,
    );
    figures.note("rejoins after a stall (all members)", rejoins);
    if flaky {
        figures.note(
            "dedup group: transient handler failures retried from memory; dead letters",
            format!("{transient_failures}; {dedup_dead_letters}"),
        );
    }
    figures.note("writer errors", ledger.errors);
    figures.note("relay", format!("{relay_counts:?}"));
    figures.report();
    figures_inbox.report();
    assert!(
        recovered.is_some(),
        "not everything committed before the last fault was applied by both groups within {bound:?}: {progress}"
    );
    assert!(inbox_done, "the inbox group did not apply every event");
    if flaky {
        assert!(
            transient_failures > 0,
            "no handler of the dedup group failed: the run tested no retry from memory"
        );
        assert_eq!(
            dedup_dead_letters, 0,
            "a transient failure was dead-lettered"
        );
    }
    figures.assert_invariants();
    figures_inbox.assert_invariants();
}
