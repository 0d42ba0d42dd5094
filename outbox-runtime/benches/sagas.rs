//! Saga benchmark: what a saga step costs against plain handlers of the
//! same messages. A topic preloaded with N ~200-byte messages over K order
//! ids (each id: one `Placed`, then `Noted` steps, then one `Paid`, in
//! order on its key) is read, in the same run, by fresh consumer groups in
//! dedup mode that apply every message with:
//!
//! - `noop`: a plain `InboxHandler` that does nothing (the consumer's own
//!   cost: the limit);
//! - `table`: plain handlers keeping the same state by hand in a table of
//!   the application's (`INSERT … ON CONFLICT DO NOTHING` on `Placed`,
//!   `UPDATE … SET notes = notes + 1` on `Noted`, `UPDATE … SET done` on
//!   `Paid`): what an application without sagas writes;
//! - `saga`: a `#[saga]` whose steps do the same (in dedup mode the batch's
//!   instances are locked and read in one statement, and a segment's steps
//!   written back in one).
//!
//! Rates are from the consumer's start (group join included) to the last
//! message applied; each stage's ratio is against `noop` and `table`.
//!
//! `cargo bench -p outbox-runtime --bench sagas -- [--events N] [--orders K] [--stages noop,table,saga] [--json PATH]`
//!
//! Needs PostgreSQL (DATABASE_URL names the server; the benchmark creates
//! its own database `outbox_bench_sagas`) and a broker (KAFKA_BROKERS).

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use outbox::{BoxError, SagaContext, SagaTimeout};
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, ConsumerBuilder};
use rdkafka::producer::FutureRecord;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

const TOPIC: &str = "bench-sagas-orders";
const TIMEOUTS: &str = "bench-sagas-timeouts";
const PARTITIONS: i32 = 4;

/// The benchmark's options (`cargo bench … -- --help`).
#[derive(Parser)]
struct Args {
    /// Messages produced, read by each stage.
    #[arg(long, default_value_t = 50_000)]
    events: u64,
    /// Order ids (saga instances); each gets events / orders messages.
    #[arg(long, default_value_t = 2_000)]
    orders: u64,
    /// The stages, in order: noop, table, saga (repeatable).
    #[arg(long, value_delimiter = ',', default_values_t = [String::from("noop"), String::from("table"), String::from("saga")])]
    stages: Vec<String>,
    /// Also write the results to this JSON file.
    #[arg(long)]
    json: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The messages of one order, on `TOPIC`.
macro_rules! message {
    ($name:ident) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        struct $name {
            order_id: String,
            seq: u64,
            note: String,
        }
        impl DomainEvent for $name {
            const TOPIC: &'static str = TOPIC;
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Stage {
    Open,
    Paid,
}

/// The saga: the same state the `table` stage keeps by hand.
#[derive(Debug, Serialize, Deserialize)]
struct Order {
    order_id: String,
    notes: u64,
    stage: Stage,
}

#[outbox::saga(name = "bench-order", timeouts = "bench-sagas-timeouts", stage = Stage)]
impl Order {
    #[init]
    fn begin(e: &Placed) -> Self {
        Order {
            order_id: e.order_id.clone(),
            notes: 0,
            stage: Stage::Open,
        }
    }

    #[step(start, correlate = order_id)]
    async fn placed(_ctx: &mut SagaContext<Self>, _e: Placed) -> Result<Stage, BoxError> {
        Ok(Stage::Open)
    }

    #[step(from = Open, correlate = order_id)]
    async fn noted(ctx: &mut SagaContext<Self>, _e: Noted) -> Result<Stage, BoxError> {
        ctx.state_mut().notes += 1;
        Ok(Stage::Open)
    }

    #[step(from = Open, correlate = order_id)]
    async fn paid(ctx: &mut SagaContext<Self>, _e: Paid) -> Result<Stage, BoxError> {
        ctx.complete();
        Ok(Stage::Paid)
    }

    #[timeout(name = "unused", from = Open)]
    async fn late(_ctx: &mut SagaContext<Self>, _t: SagaTimeout<Self>) -> Result<Stage, BoxError> {
        Ok(Stage::Open)
    }
}

/// A plain handler of `E` running `sql` (none: nothing) with the order id.
struct Plain<E> {
    sql: Option<&'static str>,
    _event: std::marker::PhantomData<fn() -> E>,
}

impl<E> Plain<E> {
    fn new(sql: Option<&'static str>) -> Self {
        Self {
            sql,
            _event: std::marker::PhantomData,
        }
    }
}

trait OrderId {
    fn order_id(&self) -> &str;
}

macro_rules! order_id {
    ($($t:ty),*) => { $(impl OrderId for $t { fn order_id(&self) -> &str { &self.order_id } })* };
}
order_id!(Placed, Noted, Paid);

impl<E: DomainEvent + OrderId> InboxHandler for Plain<E> {
    type Event = E;
    const NAME: &'static str = "plain";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            if let Some(sql) = self.sql {
                sqlx::query(sql)
                    .bind(event.order_id())
                    .execute(ctx.connection())
                    .await?;
            }
            Ok(())
        })
    }
}

const TABLE: &str = "CREATE TABLE IF NOT EXISTS bench_order (
    order_id text PRIMARY KEY, notes bigint NOT NULL DEFAULT 0, paid boolean NOT NULL DEFAULT false)";
const PLACED: &str = "INSERT INTO bench_order (order_id) VALUES ($1) ON CONFLICT DO NOTHING";
const NOTED: &str = "UPDATE bench_order SET notes = notes + 1 WHERE order_id = $1 AND NOT paid";
const PAID: &str = "UPDATE bench_order SET paid = true WHERE order_id = $1 AND NOT paid";

/// Message `seq` of `rounds` per order over `orders`: its order and its
/// type (an order's messages are produced in order, on its key).
fn message_of(seq: u64, orders: u64, rounds: u64) -> (u64, &'static str) {
    let nth = seq / orders;
    let event_type = match nth {
        0 => "Placed",
        n if n + 1 == rounds => "Paid",
        _ => "Noted",
    };
    (seq % orders, event_type)
}

async fn preload(
    brokers: &str,
    events: u64,
    orders: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    common::recreate_topic(brokers, TOPIC, PARTITIONS).await?;
    common::recreate_topic(brokers, TIMEOUTS, 1).await?;
    let producer = common::preload_producer(brokers)?;
    let rounds = events / orders;
    let mut pending = Vec::with_capacity(events as usize);
    for seq in 0..rounds * orders {
        let (order, event_type) = message_of(seq, orders, rounds);
        let key = format!("order-{order}");
        let id = Uuid::now_v7().to_string();
        let payload =
            serde_json::json!({ "order_id": key, "seq": seq, "note": "x".repeat(140) }).to_string();
        let record = FutureRecord::to(TOPIC)
            .key(key.as_bytes())
            .payload(payload.as_bytes())
            .headers(common::identity_headers(&id, event_type));
        pending.push(common::queue(&producer, record).await);
    }
    common::delivered(pending).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let brokers = common::brokers();
    let db = common::BenchDb::create("outbox_bench_sagas", 8).await?;
    let pool = db.pool.clone();
    sqlx::query(TABLE).execute(&pool).await?;
    let rounds = (a.events / a.orders).max(2);
    let events = rounds * a.orders;
    println!(
        "sagas benchmark: {events} messages on {PARTITIONS} partitions, {} orders of {rounds} messages \
         (Placed, Noted x {}, Paid), dedup mode",
        a.orders,
        rounds - 2
    );
    preload(&brokers, events, a.orders).await?;
    let mut results = Vec::new();
    let mut rates = std::collections::HashMap::new();
    for (n, stage) in a.stages.iter().enumerate() {
        // Each stage starts from no state.
        sqlx::query("TRUNCATE bench_order, outbox_saga")
            .execute(&pool)
            .await?;
        let builder = Consumer::builder(pool.clone())
            .group(format!("bench-sagas-{stage}-{n}"))
            .brokers(&brokers);
        let builder: ConsumerBuilder = match stage.as_str() {
            "noop" => builder
                .handler(Plain::<Placed>::new(None))
                .handler(Plain::<Noted>::new(None))
                .handler(Plain::<Paid>::new(None)),
            "table" => builder
                .handler(Plain::<Placed>::new(Some(PLACED)))
                .handler(Plain::<Noted>::new(Some(NOTED)))
                .handler(Plain::<Paid>::new(Some(PAID))),
            "saga" => builder.saga::<Order>(),
            other => return Err(format!("unknown stage `{other}`: noop, table or saga").into()),
        };
        let start = Instant::now();
        let handle = builder.spawn()?;
        loop {
            let c = handle.counts();
            if c.processed + c.dead_lettered >= events {
                break;
            }
            if start.elapsed() > Duration::from_secs(900) {
                return Err(format!("stage {stage} did not finish: {c:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = start.elapsed();
        let counts = handle.counts();
        handle.shutdown().await?;
        if counts.dead_lettered > 0 {
            return Err(format!("stage {stage} dead-lettered {}", counts.dead_lettered).into());
        }
        // Every order reached its end, with every note counted.
        let check = match stage.as_str() {
            "table" => Some("SELECT count(*) FROM bench_order WHERE paid AND notes = $1"),
            "saga" => Some(
                "SELECT count(*) FROM outbox_saga WHERE saga_type = 'bench-order'
                 AND completed_at IS NOT NULL AND (state->>'notes')::int8 = $1",
            ),
            _ => None,
        };
        if let Some(check) = check {
            let done: i64 = sqlx::query_scalar(check)
                .bind((rounds - 2) as i64)
                .fetch_one(&pool)
                .await?;
            if done != a.orders as i64 {
                return Err(
                    format!("stage {stage}: {done} of {} orders complete", a.orders).into(),
                );
            }
        }
        let rate = events as f64 / took.as_secs_f64();
        rates.insert(stage.clone(), rate);
        let ratio = |base: &str| rates.get(base).map(|b| rate / b);
        println!(
            "{stage:>6}: {rate:>8.0} messages/s, took {:.2} s{}{}",
            took.as_secs_f64(),
            ratio("noop").map_or(String::new(), |r| format!(", {r:.2} x noop")),
            ratio("table").map_or(String::new(), |r| format!(", {r:.2} x table")),
        );
        results.push(serde_json::json!({
            "stage": stage,
            "messages_per_s": rate.round(),
            "took_s": (took.as_secs_f64() * 1000.0).round() / 1000.0,
            "over_noop": ratio("noop").map(|r| (r * 1000.0).round() / 1000.0),
            "over_table": ratio("table").map(|r| (r * 1000.0).round() / 1000.0),
        }));
    }
    let json = serde_json::json!({
        "benchmark": "sagas",
        "events": events,
        "orders": a.orders,
        "partitions": PARTITIONS,
        "stages": results,
    });
    println!("{json}");
    if let Some(path) = a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    db.drop_database().await?;
    Ok(())
}
