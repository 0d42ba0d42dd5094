//! Sagas under faults: many concurrent order sagas (placed, noted three
//! times, paid, or never paid and cancelled by a payment timeout that sends
//! a compensating `Release`), moved by two consumer processes in each mode
//! (a dedup-mode group running one saga type, an inbox-mode group another,
//! both reading the same orders) that are SIGKILLed and restarted again and
//! again while the orders are written, the broker frozen once. Each saga
//! must reach exactly one final state (paid, or cancelled by its timeout),
//! apply each of its steps once and in order, fire its timeout at most once
//! and never after completion (one `Release` per cancelled order, none for
//! a paid one), within a bound after the last fault.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox::UnitOfWork;
use outbox_core::DomainEvent;
use outbox_runtime::Mode;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::checker::{self, Evidence, Figures, Seen, Written};
use super::children::{self, Child};
use super::common::{
    PrivateBroker, create_topic, create_warm_topic, database_url, free_port, init_tracing,
    read_all, signal,
};
use super::harness::scaled;
use super::{SERIAL, jitter, relay};

const ORDERS: &str = "reliability-saga-orders";
const RELEASES: &str = "reliability-saga-releases";

/// Orders written, one every [`PLACE_EVERY`]: over about the time the
/// consumers are killed.
const ORDER_COUNT: u64 = 240;
const PLACE_EVERY: Duration = Duration::from_millis(150);
/// Every fifth order is never paid: its payment timeout cancels it.
fn pays(order: u64) -> bool {
    !order.is_multiple_of(5)
}
/// An order's messages after its placing: three notes, then the payment
/// (its `seq` on the order's key is the message's place in this list).
const STEPS_AFTER_MS: [u64; 4] = [300, 600, 900, 1_500];
/// The payment timeout a placed order schedules.
const PAYMENT_TIMEOUT_MS: u64 = 12_000;

/// An order's message on [`ORDERS`] (its key: the order id).
macro_rules! message {
    ($name:ident) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        pub struct $name {
            pub order_id: String,
            pub seq: u64,
            pub timeout_ms: u64,
        }
        impl DomainEvent for $name {
            const TOPIC: &'static str = ORDERS;
            const AGGREGATE_TYPE: &'static str = "Order";
            const EVENT_TYPES: &'static [&'static str] = &[stringify!($name)];
            fn event_type(&self) -> &'static str {
                stringify!($name)
            }
            fn event_version(&self) -> u32 {
                1
            }
            fn aggregate_id(&self) -> String {
                self.order_id.clone()
            }
        }
    };
}

message!(Placed);
message!(Noted);
message!(Paid);

/// The compensation a cancelled order sends: release what was reserved.
/// `saga` names the saga type that sent it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Release {
    pub order_id: String,
    pub saga: String,
}

impl DomainEvent for Release {
    const TOPIC: &'static str = RELEASES;
    const AGGREGATE_TYPE: &'static str = "Order";
    const EVENT_TYPES: &'static [&'static str] = &["Release"];
    fn event_type(&self) -> &'static str {
        "Release"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Stage {
    AwaitingPayment,
    Paid,
    Cancelled,
}

/// An order saga named `$name`, its timeouts on `$timeouts`. Its state
/// keeps the `seq` of every message it applied, in the order applied, and
/// how many times its payment timeout fired.
macro_rules! order_saga {
    ($module:ident, $name:literal, $timeouts:literal) => {
        pub mod $module {
            use std::time::Duration;

            use outbox::{BoxError, SagaContext, SagaTimeout};
            use serde::{Deserialize, Serialize};

            use super::{Noted, Paid, Placed, Release, Stage};

            pub const NAME: &str = $name;
            pub const TIMEOUTS: &str = $timeouts;

            #[derive(Debug, Serialize, Deserialize)]
            pub struct Order {
                pub order_id: String,
                pub applied: Vec<u64>,
                pub timeouts_fired: u32,
                pub stage: Stage,
            }

            #[outbox::saga(name = $name, timeouts = $timeouts, stage = Stage)]
            impl Order {
                #[init]
                fn begin(e: &Placed) -> Self {
                    Order {
                        order_id: e.order_id.clone(),
                        applied: Vec::new(),
                        timeouts_fired: 0,
                        stage: Stage::AwaitingPayment,
                    }
                }

                #[step(start, correlate = order_id)]
                async fn placed(ctx: &mut SagaContext<Self>, e: Placed) -> Result<Stage, BoxError> {
                    ctx.applied.push(e.seq);
                    ctx.schedule_timeout("payment", Duration::from_millis(e.timeout_ms));
                    Ok(Stage::AwaitingPayment)
                }

                #[step(from = AwaitingPayment, correlate = order_id)]
                async fn noted(ctx: &mut SagaContext<Self>, e: Noted) -> Result<Stage, BoxError> {
                    ctx.applied.push(e.seq);
                    Ok(Stage::AwaitingPayment)
                }

                #[step(from = AwaitingPayment, correlate = order_id)]
                async fn paid(ctx: &mut SagaContext<Self>, e: Paid) -> Result<Stage, BoxError> {
                    ctx.applied.push(e.seq);
                    ctx.cancel_timeout("payment");
                    ctx.complete();
                    Ok(Stage::Paid)
                }

                #[timeout(name = "payment", from = AwaitingPayment)]
                async fn payment_late(
                    ctx: &mut SagaContext<Self>,
                    _t: SagaTimeout<Self>,
                ) -> Result<Stage, BoxError> {
                    ctx.timeouts_fired += 1;
                    let order_id = ctx.order_id.clone();
                    ctx.send(Release {
                        order_id,
                        saga: NAME.into(),
                    });
                    ctx.complete();
                    Ok(Stage::Cancelled)
                }
            }
        }
    };
}

order_saga!(dedup_saga, "reliability-order", "reliability-saga-timeouts");
order_saga!(
    inbox_saga,
    "reliability-order-inbox",
    "reliability-saga-timeouts-inbox"
);

/// Not a test: the body of the consumer processes of
/// [`sagas_under_consumer_kills_and_a_broker_pause`].
#[tokio::test]
#[ignore = "runs only as a child process of the sagas scenario"]
async fn saga_consumer_process() {
    children::run_consumer_with(|builder, mode| {
        let builder = builder.ignore_event_type(ORDERS, "WarmUp");
        match mode {
            Mode::Inbox => builder
                .ignore_event_type(inbox_saga::TIMEOUTS, "WarmUp")
                .saga::<inbox_saga::Order>(),
            _ => builder
                .ignore_event_type(dedup_saga::TIMEOUTS, "WarmUp")
                .saga::<dedup_saga::Order>(),
        }
    })
    .await;
}

/// Writes the orders' messages at their times, one Unit of Work per tick;
/// returns what it committed (`seq`: the message's place on its order).
async fn write_orders(pool: PgPool) -> Vec<Written> {
    let mut due: Vec<(Duration, u64, u64)> = (0..ORDER_COUNT)
        .flat_map(|order| {
            let placed = PLACE_EVERY * order as u32;
            let last = if pays(order) { 4 } else { 3 };
            (0..=last).map(move |seq| {
                let after = match seq {
                    0 => 0,
                    n => STEPS_AFTER_MS[n as usize - 1],
                };
                (placed + Duration::from_millis(after), order, seq)
            })
        })
        .collect();
    due.sort();
    let mut due = due.into_iter().peekable();
    let mut written = Vec::new();
    let start = Instant::now();
    while due.peek().is_some() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = start.elapsed();
        let mut uow = UnitOfWork::begin(&pool).await.expect("begin");
        let mut batch = Vec::new();
        while let Some((_, order, seq)) = due.next_if(|(at, _, _)| *at <= now) {
            let order_id = format!("order-{order}");
            let timeout_ms = PAYMENT_TIMEOUT_MS;
            let key = order_id.clone();
            let event_id = match seq {
                0 => uow.record(Placed {
                    order_id,
                    seq,
                    timeout_ms,
                }),
                4 => uow.record(Paid {
                    order_id,
                    seq,
                    timeout_ms,
                }),
                _ => uow.record(Noted {
                    order_id,
                    seq,
                    timeout_ms,
                }),
            };
            batch.push(Written { event_id, key, seq });
        }
        uow.commit().await.expect("commit the orders' messages");
        written.extend(batch);
    }
    written
}

/// One saga type's instances: order id → (stage, completed, state).
async fn instances(pool: &PgPool, saga: &str) -> HashMap<String, (String, bool, Applied)> {
    sqlx::query_as::<_, (String, String, bool, sqlx::types::Json<Applied>)>(
        "SELECT saga_id, stage, completed_at IS NOT NULL, state FROM outbox_saga WHERE saga_type = $1",
    )
    .bind(saga)
    .fetch_all(pool)
    .await
    .expect("saga instances")
    .into_iter()
    .map(|(id, stage, completed, state)| (id, (stage, completed, state.0)))
    .collect()
}

/// What a saga's state says it did.
#[derive(Debug, Clone, Deserialize)]
struct Applied {
    applied: Vec<u64>,
    timeouts_fired: u32,
}

/// How many completed instances of `saga`.
async fn completed(pool: &PgPool, saga: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox_saga WHERE saga_type = $1 AND completed_at IS NOT NULL",
    )
    .bind(saga)
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

/// Checks one saga type's instances against what was written: the usual
/// figures (the steps a saga applied as its effects) and the saga's own
/// invariants, returned as failures.
async fn check_saga(
    pool: &PgPool,
    (saga, label): (&str, &str),
    written: &[Written],
    kafka: &[Seen],
) -> (Figures, Vec<String>) {
    let instances = instances(pool, saga).await;
    let releases: HashMap<String, i64> = sqlx::query_as(
        "SELECT aggregate_id, count(*) FROM outbox_event
         WHERE topic = $1 AND payload->>'saga' = $2 GROUP BY aggregate_id",
    )
    .bind(RELEASES)
    .bind(saga)
    .fetch_all(pool)
    .await
    .expect("releases")
    .into_iter()
    .collect();
    let mut by_key: HashMap<&str, Vec<&Written>> = HashMap::new();
    for w in written {
        by_key.entry(&w.key).or_default().push(w);
    }
    let mut failures = Vec::new();
    let mut effects = Vec::new();
    let mut must = HashSet::new();
    let (mut paid, mut cancelled, mut paid_late) = (0, 0, 0);
    for (key, messages) in &by_key {
        let Some((stage, done, state)) = instances.get(*key) else {
            failures.push(format!("{key}: no instance"));
            continue;
        };
        let released = releases.get(*key).copied().unwrap_or(0);
        let seq_of: HashMap<u64, &Written> = messages.iter().map(|w| (w.seq, *w)).collect();
        for seq in &state.applied {
            match seq_of.get(seq) {
                Some(w) => effects.push(Seen {
                    event_id: w.event_id,
                    key: w.key.clone(),
                    seq: *seq,
                }),
                None => failures.push(format!("{key}: applied message {seq} never written")),
            }
        }
        let has_payment = messages.len() == 5;
        match (stage.as_str(), done) {
            ("Paid", true) => {
                paid += 1;
                // Every message of the order, the payment last.
                must.extend(messages.iter().map(|w| w.event_id));
                if state.timeouts_fired != 0 || released != 0 {
                    failures.push(format!(
                        "{key}: paid, yet its timeout fired {} times and it sent {released} releases",
                        state.timeouts_fired
                    ));
                }
            }
            ("Cancelled", true) => {
                cancelled += 1;
                if has_payment {
                    paid_late += 1;
                }
                // Everything before the last step it applied.
                let last = state.applied.iter().copied().max().unwrap_or(0);
                must.extend(
                    messages
                        .iter()
                        .filter(|w| w.seq <= last)
                        .map(|w| w.event_id),
                );
                if state.timeouts_fired != 1 || released != 1 {
                    failures.push(format!(
                        "{key}: cancelled with its timeout fired {} times and {released} releases sent",
                        state.timeouts_fired
                    ));
                }
                if state.applied.contains(&4) {
                    failures.push(format!("{key}: cancelled after its payment was applied"));
                }
            }
            (stage, done) => failures.push(format!(
                "{key}: not in one final state: stage {stage}, completed {done}"
            )),
        }
        if !has_payment && stage != "Cancelled" {
            failures.push(format!("{key}: never paid, yet {stage}"));
        }
    }
    if instances.len() != by_key.len() {
        failures.push(format!(
            "{} instances for {} orders",
            instances.len(),
            by_key.len()
        ));
    }
    let mut figures = checker::check(
        &format!("sagas under consumer kills ({label})"),
        &Evidence {
            committed: written.to_vec(),
            must_arrive: Some(must),
            kafka: kafka.to_vec(),
            effects,
            ..Evidence::default()
        },
    );
    figures.note(
        "orders paid / cancelled by their timeout (of them, paid too late)",
        format!("{paid} / {cancelled} ({paid_late})"),
    );
    (figures, failures)
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn sagas_under_consumer_kills_and_a_broker_pause(pool: PgPool) {
    let _serial = SERIAL.lock().await;
    init_tracing();
    let port = free_port();
    let broker = PrivateBroker::start(port, port);
    let brokers = format!("127.0.0.1:{port}");
    create_warm_topic(&brokers, ORDERS).await;
    create_warm_topic(&brokers, dedup_saga::TIMEOUTS).await;
    create_warm_topic(&brokers, inbox_saga::TIMEOUTS).await;
    create_topic(&brokers, RELEASES).await;
    // One record per record batch: killed consumers resume from committed
    // offsets (see `children`).
    let relay = relay(&pool, &brokers)
        .await
        .kafka_setting("batch.num.messages", "1")
        .spawn()
        .unwrap();
    let writer_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("writer pool");
    let writer = tokio::spawn(write_orders(writer_pool));
    let url = database_url(&pool);
    let groups = [
        format!("{ORDERS}-{}", *super::RUN),
        format!("{ORDERS}-inbox-{}", *super::RUN),
    ];
    let logs = std::env::temp_dir().join(format!("outbox-sagas-{}", *super::RUN));
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
            "sagas::saga_consumer_process",
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
    let written = writer.await.expect("writer");
    // Recovery: every saga of both types in a final state. The last orders
    // are placed about when the faults end; the unpaid ones end when their
    // timeout fires, 12 s later.
    let bound = scaled(Duration::from_secs(180));
    let mut recovered = None;
    let mut progress = Vec::new();
    let mut next_mark = Duration::ZERO;
    while last_fault.elapsed() < bound {
        let dedup = completed(&pool, dedup_saga::NAME).await;
        let inbox = completed(&pool, inbox_saga::NAME).await;
        if last_fault.elapsed() >= next_mark {
            progress.push(format!(
                "{}s {dedup}/{inbox}",
                last_fault.elapsed().as_secs()
            ));
            next_mark += Duration::from_secs(10);
        }
        if dedup >= ORDER_COUNT as i64 && inbox >= ORDER_COUNT as i64 {
            recovered = Some(last_fault.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let progress = format!("of {ORDER_COUNT}: {}", progress.join(", "));
    // A late copy of a timeout or a step would show now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let kafka: Vec<Seen> = read_all(&brokers, ORDERS, Duration::from_secs(60))
        .await
        .into_iter()
        .filter_map(|r| {
            Some(Seen {
                event_id: r.try_event_id()?,
                seq: r.payload["seq"].as_u64()?,
                key: r.key,
            })
        })
        .collect();
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

    let mut failures = Vec::new();
    for (saga, label) in [
        (dedup_saga::NAME, "dedup-mode saga"),
        (inbox_saga::NAME, "inbox-mode saga"),
    ] {
        let (mut figures, failed) = check_saga(&pool, (saga, label), &written, &kafka).await;
        figures.recovery_ms = recovered.map(|d| d.as_millis() as u64);
        figures.note(
            "faults",
            format!(
                "2 dedup-mode and 2 inbox-mode consumer processes, {kills} SIGKILLed and replaced \
                 in turn over about 40 s, the broker frozen 6 s after the fifth; sessions {} ms",
                children::SESSION_MS
            ),
        );
        figures.note(
            "sagas completed (dedup/inbox) after the last fault",
            &progress,
        );
        figures.note("relay", format!("{relay_counts:?}"));
        figures.note("saga invariant failures", failed.len());
        figures.report();
        figures.assert_invariants();
        failures.extend(failed.into_iter().map(|f| format!("{saga}: {f}")));
    }
    assert!(
        failures.is_empty(),
        "saga invariants broken ({}): {:#?}",
        failures.len(),
        &failures[..failures.len().min(20)]
    );
    assert!(
        recovered.is_some(),
        "not every saga reached a final state within {bound:?} of the last fault: {progress}"
    );
}
