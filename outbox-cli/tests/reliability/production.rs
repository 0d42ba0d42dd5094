//! "A day in production", compressed into a couple of minutes: every
//! process as the README's role (the application's writers, two `outbox
//! relay` processes, a dedup-mode and an inbox-mode consumer process), the
//! partitioned layout with short periods and a maintainer creating
//! partitions ahead and dropping expired ones throughout, a transaction
//! holding the xmin horizon for a while, hostile messages trickling in, a
//! relay and a consumer SIGKILLed and restarted, the broker paused.
//!
//! Checked: nothing lost, no phantom, nothing applied twice, per-key order
//! (both consumer groups); every maintenance pass completes and at least
//! one expired partition is dropped while the relays work; a partition
//! covers "now" and the next period at every sample; dead letters only for
//! the injected messages; no "permission denied" in any process's log.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use outbox_core::DomainEvent;
use outbox_runtime::{CancellationToken, Mode};
use sqlx::PgPool;
use uuid::Uuid;

use super::checker::{self, Evidence};
use super::children::{self, Child};
use super::common::{
    PrivateBroker, create_warm_topic, free_port, init_tracing, outbox_bin, produce, signal,
};
use super::harness::{Load, Writers, collect, effects_of, recovery, scenario_event};
use super::misbehaving::hostile;
use super::profile::Setup;
use super::{SERIAL, group_of, ms};

scenario_event!(ProductionEvent, "reliability-production");

/// Published rows, dedup rows and processed inbox rows older than this go.
/// It is also the dedup window, which must outlive every redelivery: here
/// the longest is a killed consumer's messages read again by the next one
/// (its session timeout, and the stall timeout if the broker kept the dead
/// member's partitions: 10 + 15 s). With 8 s, events applied by the killed
/// consumer were applied again 15 s later, their dedup rows gone.
const RETENTION: Duration = Duration::from_secs(40);
/// How long the writers write.
const DAY: Duration = Duration::from_secs(70);

/// Where this run's process logs go.
fn log_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("outbox-production-{}", *super::RUN));
    std::fs::create_dir_all(&dir).expect("log directory");
    dir
}

/// Every process's log, by name.
#[derive(Default)]
struct Logs(Vec<PathBuf>);

impl Logs {
    fn file(&mut self, name: &str) -> std::fs::File {
        let path = log_dir().join(format!("{name}-{}.log", self.0.len()));
        let file = std::fs::File::create(&path).expect("log file");
        self.0.push(path);
        file
    }

    /// The lines of every log that contain `needle`.
    fn count(&self, needle: &str) -> usize {
        self.0
            .iter()
            .map(|path| {
                std::fs::read_to_string(path)
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.contains(needle))
                    .count()
            })
            .sum()
    }

    /// The lines of every log that say a statement was refused.
    fn refusals(&self) -> Vec<String> {
        let mut found = Vec::new();
        for path in &self.0 {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            for line in text.lines() {
                if line.to_ascii_lowercase().contains("permission denied") {
                    found.push(format!("{}: {line}", path.display()));
                }
            }
        }
        found
    }
}

/// `outbox relay` as the relay role, its output in a log file.
fn relay(url: &str, brokers: &str, logs: &mut Logs) -> tokio::process::Child {
    let log = logs.file("relay");
    tokio::process::Command::new(outbox_bin())
        .args([
            "relay",
            "--batch-size",
            "200",
            "--delivery-timeout-ms",
            "3000",
        ])
        // One record per record batch: the consumers here resume from
        // committed offsets (killed, or expelled while the broker is
        // frozen), and the test broker returns nothing to a fetch that
        // starts inside a record batch (`group_recovery.rs` of the runtime
        // shows it with a plain rdkafka consumer); real Kafka returns the
        // batch and the client skips what it has read.
        .args(["-X", "batch.num.messages=1"])
        .env("DATABASE_URL", url)
        .env("KAFKA_BROKERS", brokers)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the outbox binary")
}

/// A consumer process (see [`children`]) of this scenario as the consumer
/// role, in `mode`, its output in a log file.
fn consumer(url: &str, brokers: &str, mode: Mode, logs: &mut Logs) -> tokio::process::Child {
    let log = logs.file(&format!("consumer-{mode}"));
    let group = match mode {
        Mode::Inbox => format!("{}-inbox", group_of(ProductionEvent::TOPIC)),
        _ => group_of(ProductionEvent::TOPIC),
    };
    children::consumer(
        "production::production_consumer_process",
        &Child {
            url,
            brokers,
            group: &group,
            mode,
        },
        log,
    )
}

/// Not a test: the body of the consumer processes of [`a_day_in_production`];
/// returns at once unless started by it.
#[tokio::test]
#[ignore = "runs only as a child process of the day-in-production scenario"]
async fn production_consumer_process() {
    children::run_consumer::<ProductionEvent>().await;
}

/// The control group: a plain rdkafka consumer (auto commit, the same
/// session settings as the consumer processes) on a thread of the test,
/// recording the event ids it reads until `stop`. When our groups stall and
/// it does not, the fault is ours; when it stalls too, the broker's.
fn control_member(
    brokers: &str,
    group: &str,
    seen: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<Uuid>>>,
    stop: CancellationToken,
) -> std::thread::JoinHandle<()> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::message::{Headers as _, Message as _};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", children::SESSION_MS)
        .set("heartbeat.interval.ms", "1000")
        .create()
        .expect("control consumer");
    consumer
        .subscribe(&[ProductionEvent::TOPIC])
        .expect("subscribe");
    std::thread::spawn(move || {
        while !stop.is_cancelled() {
            let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let id = m.headers().and_then(|h| {
                h.iter()
                    .find(|h| h.key == "event_id")
                    .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse().ok())
            });
            if let Some(id) = id {
                seen.lock().unwrap().insert(id);
            }
        }
    })
}

/// Stops a child with SIGTERM (a consumer child only ends by a signal).
async fn terminate(mut child: tokio::process::Child) {
    if let Some(pid) = child.id() {
        signal(pid, "-TERM");
    }
    let _ = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
    let _ = child.kill().await;
}

/// SIGKILLs a child and reaps it.
async fn kill(mut child: tokio::process::Child) {
    signal(child.id().expect("running"), "-KILL");
    child.wait().await.expect("reap");
}

/// A REPEATABLE READ transaction with an xid, held for `hold`.
fn hold_xmin(pool: PgPool, after: Duration, hold: Duration) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        let mut tx = pool.begin().await.expect("holder");
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .expect("repeatable read");
        let xid: i64 = sqlx::query_scalar("SELECT txid_current()")
            .fetch_one(&mut *tx)
            .await
            .expect("xid");
        tokio::time::sleep(hold).await;
        tx.commit().await.expect("release");
        xid
    })
}

/// Dead letters per consumer group.
async fn dead_letters(pool: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT consumer, count(*) FROM dead_letter GROUP BY 1")
        .fetch_all(pool)
        .await
        .expect("dead letters")
        .into_iter()
        .collect()
}

/// Where each group stands per partition, when it has not applied
/// everything: the first and last offset of the committed events it has not
/// applied, and the group's committed offset.
async fn diagnose(pool: &PgPool, brokers: &str, ids: &[Uuid], table: &str, group: &str) -> String {
    let applied: std::collections::HashSet<Uuid> =
        sqlx::query_scalar(&format!("SELECT event_id FROM {table}"))
            .fetch_all(pool)
            .await
            .expect("applied")
            .into_iter()
            .collect();
    let wanted: std::collections::HashSet<Uuid> = ids.iter().copied().collect();
    let mut missing: BTreeMap<i32, (i64, i64, usize)> = BTreeMap::new();
    let mut lost: Vec<Uuid> = Vec::new();
    for r in super::common::read_all(brokers, ProductionEvent::TOPIC, Duration::from_secs(30)).await
    {
        let Some(id) = r.try_event_id() else { continue };
        if wanted.contains(&id) && !applied.contains(&id) {
            lost.push(id);
            let e = missing
                .entry(r.partition)
                .or_insert((r.offset, r.offset, 0));
            e.0 = e.0.min(r.offset);
            e.1 = e.1.max(r.offset);
            e.2 += 1;
        }
    }
    if missing.is_empty() {
        return "nothing missing".into();
    }
    let (brokers, group_name) = (brokers.to_owned(), group.to_owned());
    let committed = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer as _};
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group_name)
            .create()
            .expect("offsets reader");
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..super::common::PARTITIONS {
            tpl.add_partition(ProductionEvent::TOPIC, p);
        }
        consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .map(|t| {
                t.elements()
                    .iter()
                    .map(|e| format!("{}:{:?}", e.partition(), e.offset()))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_else(|e| e.to_string())
    })
    .await
    .expect("offsets");
    // Where the first missing events stand in the group's tables: a dedup
    // row without an effect, a row set aside (or stored) and never
    // processed, a dead letter.
    lost.truncate(5);
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT u.id::text || ': processed_event ' || COALESCE(p.processed_at::text, 'none')
                || '; inbox_event ' || COALESCE(
                    'processed ' || i.processed || ' attempts ' || i.attempts
                    || ' next ' || COALESCE(i.next_attempt_at::text, '-')
                    || ' dead ' || COALESCE(i.dead_lettered_at::text, '-')
                    || ' error ' || COALESCE(i.last_error, '-'), 'none')
                || '; dead_letter ' || (SELECT count(*) FROM dead_letter d
                                        WHERE d.consumer = $2 AND d.event_id = u.id)
         FROM UNNEST($1::uuid[]) AS u(id)
         LEFT JOIN processed_event p ON p.consumer = $2 AND p.event_id = u.id
         LEFT JOIN inbox_event i ON i.consumer = $2 AND i.event_id = u.id",
    )
    .bind(&lost)
    .bind(group)
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| vec![e.to_string()]);
    format!(
        "missing (first offset, last offset, count) per partition {missing:?}; committed \
         {committed}; first missing: {rows:?}"
    )
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_day_in_production(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let started = Instant::now();
    let port = free_port();
    let broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = ProductionEvent::TOPIC;
    // Two relays write the fresh topic at once (see `reset_warm_topic`).
    create_warm_topic(&brokers, topic).await;

    // The owner's part: tables, the partitioned layout, the roles, the
    // maintainer.
    let setup = Setup::prepare_as(&pool, true, RETENTION).await;

    // The processes, each as its role.
    let mut logs = Logs::default();
    let relay_url = setup.url("outbox_relay");
    let consumer_url = setup.url("outbox_consumer");
    let mut relays = vec![
        relay(&relay_url, &brokers, &mut logs),
        relay(&relay_url, &brokers, &mut logs),
    ];
    let mut dedup = consumer(&consumer_url, &brokers, Mode::Dedup, &mut logs);
    let inbox = consumer(&consumer_url, &brokers, Mode::Inbox, &mut logs);
    let control_seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let stop_control = CancellationToken::new();
    let control = control_member(
        &brokers,
        &format!("{}-control", group_of(topic)),
        control_seen.clone(),
        stop_control.clone(),
    );
    let app = setup.pool("outbox_app", 6).await;
    let writers = Writers::start(&app, topic, Load::default()).await;
    let holder = hold_xmin(
        pool.clone(),
        Duration::from_secs(20),
        Duration::from_secs(15),
    );

    // The day: hostile messages every 2 s, and the faults.
    let mut injected = 0;
    let mut recovered = None;
    let mut events = vec![
        (Duration::from_secs(15), "kill relay"),
        (Duration::from_secs(30), "kill dedup consumer"),
        (Duration::from_secs(45), "pause broker"),
    ];
    events.reverse();
    let day = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    while day.elapsed() < DAY {
        tick.tick().await;
        produce(&brokers, topic, &[hostile(injected)]).await;
        injected += 1;
        if let Some((at, what)) = events.last().copied()
            && day.elapsed() >= at
        {
            events.pop();
            match what {
                "kill relay" => {
                    kill(relays.remove(0)).await;
                    relays.push(relay(&relay_url, &brokers, &mut logs));
                }
                "kill dedup consumer" => {
                    kill(dedup).await;
                    dedup = consumer(&consumer_url, &brokers, Mode::Dedup, &mut logs);
                }
                _ => {
                    broker.pause();
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    broker.resume();
                    recovered = Some(recovery(&pool, &writers, None));
                }
            }
        }
    }
    let ledger = writers.stop_checking(&pool).await;
    let xid = holder.await.expect("holder");

    // Everything committed must be applied by both groups.
    let mut evidence = collect(
        &pool,
        &brokers,
        topic,
        &ledger,
        None,
        Duration::from_secs(120),
    )
    .await;
    // The injected messages are judged by their dead letters, below.
    // (One kind of them has no key.)
    evidence
        .kafka
        .retain(|seen| !seen.key.is_empty() && !seen.key.starts_with("hostile-"));
    let ids: Vec<Uuid> = ledger.committed.iter().map(|w| w.event_id).collect();
    let inbox_applied = super::common::eventually(Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(DISTINCT event_id) FROM effect_inbox WHERE event_id = ANY($1)",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await
        .unwrap()
            >= ids.len() as i64
    })
    .await;
    let evidence_inbox = Evidence {
        effects: effects_of(&pool, "effect_inbox").await,
        committed: evidence.committed.clone(),
        rolled_back: evidence.rolled_back.clone(),
        kafka: evidence.kafka.clone(),
        ..Evidence::default()
    };
    // Every hostile message is a dead letter in each group.
    let groups = [group_of(topic), format!("{}-inbox", group_of(topic))];
    let lettered = super::common::eventually(Duration::from_secs(30), || async {
        let letters = dead_letters(&pool).await;
        groups
            .iter()
            .all(|g| letters.get(g).copied().unwrap_or(0) >= injected as i64)
    })
    .await;
    let control_read = {
        let seen = control_seen.lock().unwrap();
        ids.iter().filter(|id| seen.contains(id)).count()
    };
    stop_control.cancel();
    control.join().expect("control consumer");
    let letters = dead_letters(&pool).await;
    let diagnosis = [
        diagnose(&pool, &brokers, &ids, "effect", &groups[0]).await,
        diagnose(&pool, &brokers, &ids, "effect_inbox", &groups[1]).await,
    ];
    for child in relays {
        terminate(child).await;
    }
    terminate(dedup).await;
    terminate(inbox).await;
    drop(broker);

    let mut figures = checker::check("a day in production", &evidence);
    let figures_inbox = checker::check("a day in production (inbox group)", &evidence_inbox);
    figures.recovery_ms = match recovered {
        Some(task) => ms(task.await.expect("recovery")),
        None => None,
    };
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
        "faults",
        "a relay SIGKILLed at 15 s, the dedup consumer at 30 s, the broker paused 5 s at 45 s, \
         a REPEATABLE READ transaction holding xmin from 20 s to 35 s",
    );
    figures.note("dedup group", &diagnosis[0]);
    figures.note("inbox group", &diagnosis[1]);
    figures.note(
        "control group (plain rdkafka consumer) read",
        format!("{control_read} of {}", ids.len()),
    );
    figures.note("held xid", xid);
    figures.note("hostile messages injected", injected);
    figures.note("dead letters by group", format!("{letters:?}"));
    figures.note(
        "writer errors (resolved against the outbox)",
        format!("{} (first: {:?})", ledger.errors, ledger.first_error),
    );
    figures.note(
        "duration",
        format!("{:.0} s", started.elapsed().as_secs_f64()),
    );
    figures.note(
        "consumer rejoins after a stall",
        logs.count("rejoining the group"),
    );
    let refusals = logs.refusals();
    figures.note("refused statements in the logs", refusals.len());
    let maintenance = setup
        .finish(&mut figures)
        .await
        .expect("the production profile");
    figures.report();
    figures_inbox.report();

    assert!(inbox_applied, "the inbox group did not apply every event");
    assert!(
        lettered,
        "dead letters {letters:?} for {injected} hostile messages per group"
    );
    for group in &groups {
        assert_eq!(
            letters.get(group).copied().unwrap_or(0),
            injected as i64,
            "dead letters of {group}: only the injected messages"
        );
    }
    assert_eq!(
        letters.len(),
        groups.len(),
        "dead letters of other consumers: {letters:?}"
    );
    maintenance.assert_kept_up();
    assert!(maintenance.dropped > 0, "no expired partition was dropped");
    assert!(refusals.is_empty(), "refused statements: {refusals:#?}");
    figures.report_and_assert();
    figures_inbox.report_and_assert();
}
