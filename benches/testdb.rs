//! Benchmark: what a handler test costs, per phase — with a fresh database
//! and the migrations per test (what `#[sqlx::test]` does), and with the
//! testing kit's `TestDb` (a clone of a migrated template, reused and reset
//! when free).
//!
//! The test is the README's: place an order (a Unit of Work), deliver it
//! with the `TestBus` to a billing handler that charges it and records a
//! payment, deliver that to an orders handler that marks the order paid.
//!
//! Phases, sqlx::test-like: `create` (CREATE DATABASE), `migrate` (the
//! outbox's migrations and the test's tables), `test` (the body), `drop`
//! (DROP DATABASE). TestDb: `claim` (`TestDb::new`: take a free clone and
//! reset it, or clone the template when none is free), `test`, `release`
//! (dropping the TestDb). `template` is the one-time build of the template.
//!
//! `cargo test --bench testdb -- [--rounds N] [--json PATH]` (a debug
//! build, as tests are; `cargo bench --bench testdb` for a release build).
//! DATABASE_URL names the server; the benchmark's migration set is dropped
//! at start and end.

use std::time::{Duration, Instant};

use outbox::prelude::*;
use outbox::runtime::Consumer;
use outbox::testing::{TestBus, TestDb};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, Executor, PgPool};

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(topic = "bench-orders", aggregate_type = "Order")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
    amount_cents: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, DomainEvent)]
#[event(topic = "bench-payments", aggregate_type = "Payment")]
struct PaymentCaptured {
    #[event(aggregate_id)]
    payment_id: Uuid,
    #[event(partition_key)]
    order_id: Uuid,
}

#[inbox_handler]
async fn charge(ctx: &mut HandlerContext<'_>, event: OrderPlaced) -> Result<(), sqlx::Error> {
    let payment_id = Uuid::now_v7();
    sqlx::query("INSERT INTO charges (id, order_id, amount_cents) VALUES ($1, $2, $3)")
        .bind(payment_id)
        .bind(event.order_id)
        .bind(event.amount_cents)
        .execute(&mut **ctx)
        .await?;
    ctx.record(PaymentCaptured {
        payment_id,
        order_id: event.order_id,
    });
    Ok(())
}

#[inbox_handler]
async fn mark_paid(
    ctx: &mut HandlerContext<'_>,
    event: PaymentCaptured,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
        .bind(event.order_id)
        .execute(&mut **ctx)
        .await?;
    Ok(())
}

const TABLES: &str = "
    CREATE TABLE orders (id uuid PRIMARY KEY, amount_cents bigint NOT NULL, status text NOT NULL);
    CREATE TABLE charges (id uuid PRIMARY KEY, order_id uuid NOT NULL, amount_cents bigint NOT NULL);";

/// The test's body.
async fn handler_test(pool: &PgPool) {
    let mut bus = TestBus::new()
        .service(
            Consumer::builder(pool.clone())
                .group("billing")
                .handler(charge),
        )
        .service(
            Consumer::builder(pool.clone())
                .group("orders")
                .handler(mark_paid),
        );
    let order_id = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id, amount_cents, status) VALUES ($1, 500, 'pending')")
        .bind(order_id)
        .execute(&mut *uow)
        .await
        .unwrap();
    uow.record(OrderPlaced {
        order_id,
        amount_cents: 500,
    });
    uow.commit().await.unwrap();
    let delivery = bus.deliver().await.unwrap();
    delivery.assert_sequence(order_id, &["OrderPlaced", "PaymentCaptured"]);
    delivery.assert_no_dead_letters();
    let status: String = sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(status, "paid");
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Median and maximum of `values`, in ms.
fn stats(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2], values[values.len() - 1])
}

struct Phases {
    name: &'static str,
    phases: Vec<(&'static str, Vec<f64>)>,
}

impl Phases {
    fn new(name: &'static str, phases: &[&'static str]) -> Self {
        Self {
            name,
            phases: phases.iter().map(|p| (*p, Vec::new())).collect(),
        }
    }

    fn add(&mut self, values: &[f64]) {
        for (i, v) in values.iter().enumerate() {
            self.phases[i].1.push(*v);
        }
    }

    fn print(&mut self, json: &mut Vec<serde_json::Value>) {
        println!("\n{}", self.name);
        println!("  {:<10} {:>10} {:>10}", "phase", "median ms", "max ms");
        let mut totals = vec![0.0; self.phases[0].1.len()];
        let mut out = serde_json::Map::new();
        for (phase, values) in &mut self.phases {
            for (t, v) in totals.iter_mut().zip(values.iter()) {
                *t += v;
            }
            let (median, max) = stats(values);
            println!("  {phase:<10} {median:>10.1} {max:>10.1}");
            out.insert(
                (*phase).to_owned(),
                serde_json::json!({"median_ms": median, "max_ms": max}),
            );
        }
        let (median, max) = stats(&mut totals);
        println!("  {:<10} {median:>10.1} {max:>10.1}", "whole test");
        out.insert(
            "whole_test".into(),
            serde_json::json!({"median_ms": median, "max_ms": max}),
        );
        json.push(serde_json::json!({"variant": self.name, "phases": out}));
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let rounds: usize = arg("--rounds").and_then(|r| r.parse().ok()).unwrap_or(10);
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let master: PgConnectOptions = url.parse().expect("DATABASE_URL");
    let mut json = Vec::new();

    // As #[sqlx::test] does: a database per test, the migrations, a drop.
    let mut fresh = Phases::new(
        "fresh database per test (#[sqlx::test])",
        &["create", "migrate", "test", "drop"],
    );
    let mut conn = master.connect().await.expect("connect");
    for _ in 0..rounds {
        let name = format!("outbox_bench_fresh_{}", Uuid::new_v4().simple());
        let t = Instant::now();
        conn.execute(format!(r#"CREATE DATABASE "{name}""#).as_str())
            .await
            .unwrap();
        let create = t.elapsed();
        let t = Instant::now();
        let pool = PgPool::connect_with(master.clone().database(&name))
            .await
            .unwrap();
        outbox::MIGRATOR.run(&pool).await.unwrap();
        pool.execute(TABLES).await.unwrap();
        let migrate = t.elapsed();
        let t = Instant::now();
        handler_test(&pool).await;
        let test = t.elapsed();
        pool.close().await;
        let t = Instant::now();
        conn.execute(format!(r#"DROP DATABASE "{name}" WITH (FORCE)"#).as_str())
            .await
            .unwrap();
        let drop = t.elapsed();
        fresh.add(&[ms(create), ms(migrate), ms(test), ms(drop)]);
    }
    conn.close().await.ok();
    fresh.print(&mut json);

    // TestDb: the template once, then clones.
    let builder = || TestDb::builder().sql(TABLES);
    builder().drop_databases().await.unwrap();
    let t = Instant::now();
    let first = builder().create().await.unwrap();
    let template = ms(t.elapsed());
    drop(first);
    println!("\nTestDb: building the template and the first clone: {template:.1} ms");

    let mut new_clone = Phases::new(
        "TestDb, no clone free (clone the template)",
        &["claim", "test"],
    );
    let mut reuse = Phases::new(
        "TestDb, a free clone (reset and reuse)",
        &["claim", "test", "release"],
    );
    // The body again on the same pool: what the test costs once its
    // connections are open.
    let mut warm = Phases::new("the test's body on open connections", &["test"]);
    let mut connections = Vec::new();
    // Every clone held: each claim clones the template.
    let mut held = vec![builder().create().await.unwrap()];
    for _ in 0..rounds {
        let t = Instant::now();
        let db = builder().create().await.unwrap();
        let claim = t.elapsed();
        let t = Instant::now();
        handler_test(db.pool()).await;
        let test = t.elapsed();
        new_clone.add(&[ms(claim), ms(test)]);
        held.push(db);
    }
    drop(held);
    new_clone.print(&mut json);
    for _ in 0..rounds {
        let t = Instant::now();
        let db = builder().create().await.unwrap();
        let claim = t.elapsed();
        let t = Instant::now();
        handler_test(db.pool()).await;
        let test = t.elapsed();
        connections.push(db.pool().size());
        let t = Instant::now();
        handler_test(db.pool()).await;
        warm.add(&[ms(t.elapsed())]);
        let t = Instant::now();
        drop(db);
        let release = t.elapsed();
        reuse.add(&[ms(claim), ms(test), ms(release)]);
    }
    reuse.print(&mut json);
    warm.print(&mut json);
    println!("connections the test's pool opened: {connections:?}");
    builder().drop_databases().await.unwrap();

    let json = serde_json::json!({"rounds": rounds, "template_ms": template, "variants": json});
    if let Some(path) = arg("--json") {
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    }
    println!("\n{json}");
}
