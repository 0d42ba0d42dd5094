//! Benchmark: Unit of Work commits/s against plain sqlx writing the same rows.
//!
//! Each commit inserts one domain row and N outbox rows (N = 1, 10, 100), at
//! concurrency 1 and 16. The plain-sqlx variant writes the same rows by hand
//! (same serialization, same headers: a correlation id and a W3C
//! `traceparent`; one UNNEST insert, without the Unit of Work's key locks
//! and transaction checks); the two run interleaved in the same process so
//! machine noise hits both alike.
//!
//! A second table measures what the commit-time NOTIFY (the trigger that
//! wakes idle relays) costs the write path: the same Unit of Work commits
//! with the trigger enabled and disabled.
//!
//! `cargo bench --bench uow -- [--seconds S] [--rounds R] [--json PATH]`
//! (DATABASE_URL names the server; the benchmark uses its own database,
//! `outbox_bench`, recreated at start).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::TraceParent;
use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "bench.orders", aggregate_type = "Order")]
struct ItemAdded {
    #[event(aggregate_id)]
    order_id: Uuid,
    line: u32,
    sku: String,
    quantity: u32,
    price_cents: i64,
    note: String,
}

fn item(order_id: Uuid, line: u32) -> ItemAdded {
    ItemAdded {
        order_id,
        line,
        sku: format!("SKU-{line:05}"),
        quantity: 1 + line % 7,
        price_cents: 1_999,
        note: "gift wrap, leave at the door".into(),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    UnitOfWork,
    PlainSqlx,
}

async fn commit_uow(pool: &PgPool, events: u32) -> Result<(), outbox::Error> {
    let order_id = Uuid::now_v7();
    let mut uow = UnitOfWork::begin(pool).await?;
    sqlx::query("INSERT INTO bench_order (id, amount_cents) VALUES ($1, $2)")
        .bind(order_id)
        .bind(1_999_i64 * i64::from(events))
        .execute(&mut *uow)
        .await?;
    for line in 0..events {
        uow.record(item(order_id, line));
    }
    uow.commit().await?;
    Ok(())
}

async fn commit_plain(pool: &PgPool, events: u32) -> Result<(), sqlx::Error> {
    let order_id = Uuid::now_v7();
    // The same headers as the Unit of Work's rows: a correlation id and a
    // new trace.
    let headers = serde_json::json!({
        "correlation_id": Uuid::now_v7(),
        "traceparent": TraceParent::new_root().to_string(),
    })
    .to_string();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO bench_order (id, amount_cents) VALUES ($1, $2)")
        .bind(order_id)
        .bind(1_999_i64 * i64::from(events))
        .execute(&mut *tx)
        .await?;
    let n = events as usize;
    let (mut ids, mut payloads, mut aggs) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for line in 0..events {
        ids.push(Uuid::now_v7());
        payloads.push(serde_json::to_string(&item(order_id, line)).expect("serializable"));
        aggs.push(order_id.to_string());
    }
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, event_version,
                                   topic, partition_key, payload, headers)
         SELECT e, 'Order', a, 'ItemAdded', 1, 'bench.orders', a, p::jsonb, $4::jsonb
         FROM UNNEST($1::uuid[], $2::text[], $3::text[]) AS u(e, a, p)",
    )
    .bind(&ids)
    .bind(&aggs)
    .bind(&payloads)
    .bind(&headers)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Runs `concurrency` writers for `duration`; returns commits done.
async fn run(
    pool: &PgPool,
    variant: Variant,
    events: u32,
    concurrency: usize,
    duration: Duration,
) -> u64 {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (pool, done) = (pool.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let ok = match variant {
                    Variant::UnitOfWork => commit_uow(&pool, events).await.is_ok(),
                    Variant::PlainSqlx => commit_plain(&pool, events).await.is_ok(),
                };
                assert!(ok, "commit failed");
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.expect("writer task");
    }
    done.load(Ordering::Relaxed)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut seconds = 2.0_f64;
    let mut rounds = 3_u32;
    let mut json_path: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => seconds = args.next().ok_or("--seconds N")?.parse()?,
            "--rounds" => rounds = args.next().ok_or("--rounds N")?.parse()?,
            "--json" => json_path = Some(args.next().ok_or("--json PATH")?),
            "--bench" => {}
            other => return Err(format!("unknown argument {other}").into()),
        }
    }

    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let admin: PgConnectOptions = url.parse()?;
    let mut conn = admin.connect().await?;
    sqlx::query("DROP DATABASE IF EXISTS outbox_bench WITH (FORCE)")
        .execute(&mut conn)
        .await?;
    sqlx::query("CREATE DATABASE outbox_bench")
        .execute(&mut conn)
        .await?;
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(admin.database("outbox_bench"))
        .await?;
    outbox::migrate(&pool).await?;
    sqlx::query("CREATE TABLE bench_order (id uuid PRIMARY KEY, amount_cents bigint NOT NULL)")
        .execute(&pool)
        .await?;

    let slice = Duration::from_secs_f64(seconds / f64::from(rounds));
    println!(
        "UnitOfWork vs plain sqlx, {seconds} s per variant and point ({rounds} interleaved rounds)"
    );
    println!(
        "{:>7} {:>6} {:>14} {:>14} {:>7} {:>14}",
        "events", "conc", "uow commits/s", "sqlx commits/s", "ratio", "uow events/s"
    );
    let mut results = Vec::new();
    for concurrency in [1_usize, 16] {
        for events in [1_u32, 10, 100] {
            // Warm-up, then truncate so both variants see the same table sizes.
            run(
                &pool,
                Variant::UnitOfWork,
                events,
                concurrency,
                Duration::from_millis(300),
            )
            .await;
            run(
                &pool,
                Variant::PlainSqlx,
                events,
                concurrency,
                Duration::from_millis(300),
            )
            .await;
            sqlx::query("TRUNCATE outbox_event, bench_order")
                .execute(&pool)
                .await?;
            let (mut uow, mut plain) = (0_u64, 0_u64);
            for round in 0..rounds {
                // Alternate which variant goes first.
                let order = if round % 2 == 0 {
                    [Variant::UnitOfWork, Variant::PlainSqlx]
                } else {
                    [Variant::PlainSqlx, Variant::UnitOfWork]
                };
                for variant in order {
                    let n = run(&pool, variant, events, concurrency, slice).await;
                    match variant {
                        Variant::UnitOfWork => uow += n,
                        Variant::PlainSqlx => plain += n,
                    }
                }
            }
            let secs = slice.as_secs_f64() * f64::from(rounds);
            let (uow_rate, plain_rate) = (uow as f64 / secs, plain as f64 / secs);
            let ratio = uow_rate / plain_rate;
            println!(
                "{events:>7} {concurrency:>6} {uow_rate:>14.0} {plain_rate:>14.0} {ratio:>7.3} {:>14.0}",
                uow_rate * f64::from(events)
            );
            results.push(serde_json::json!({
                "events_per_commit": events,
                "concurrency": concurrency,
                "uow_commits_per_s": uow_rate.round(),
                "plain_sqlx_commits_per_s": plain_rate.round(),
                "ratio": (ratio * 1000.0).round() / 1000.0,
            }));
        }
    }
    println!();
    println!("commit-time NOTIFY cost (UnitOfWork, trigger enabled vs disabled)");
    println!(
        "{:>7} {:>6} {:>16} {:>16} {:>7}",
        "events", "conc", "notify commits/s", "silent commits/s", "ratio"
    );
    let mut notify_results = Vec::new();
    for concurrency in [1_usize, 16] {
        for events in [1_u32, 10] {
            sqlx::query("TRUNCATE outbox_event, bench_order")
                .execute(&pool)
                .await?;
            let (mut on, mut off) = (0_u64, 0_u64);
            for round in 0..rounds {
                let order = if round % 2 == 0 {
                    [true, false]
                } else {
                    [false, true]
                };
                for notify in order {
                    let sql = if notify {
                        "ALTER TABLE outbox_event ENABLE TRIGGER outbox_event_notify"
                    } else {
                        "ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_notify"
                    };
                    sqlx::query(sql).execute(&pool).await?;
                    let n = run(&pool, Variant::UnitOfWork, events, concurrency, slice).await;
                    if notify {
                        on += n;
                    } else {
                        off += n;
                    }
                }
            }
            sqlx::query("ALTER TABLE outbox_event ENABLE TRIGGER outbox_event_notify")
                .execute(&pool)
                .await?;
            let secs = slice.as_secs_f64() * f64::from(rounds);
            let (on_rate, off_rate) = (on as f64 / secs, off as f64 / secs);
            println!(
                "{events:>7} {concurrency:>6} {on_rate:>16.0} {off_rate:>16.0} {:>7.3}",
                on_rate / off_rate
            );
            notify_results.push(serde_json::json!({
                "events_per_commit": events,
                "concurrency": concurrency,
                "notify_commits_per_s": on_rate.round(),
                "silent_commits_per_s": off_rate.round(),
                "ratio": ((on_rate / off_rate) * 1000.0).round() / 1000.0,
            }));
        }
    }

    let json = serde_json::json!({
        "benchmark": "uow",
        "seconds": seconds,
        "results": results,
        "notify_cost": notify_results,
    });
    println!("{json}");
    if let Some(path) = json_path {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    pool.close().await;
    sqlx::query("DROP DATABASE IF EXISTS outbox_bench WITH (FORCE)")
        .execute(&mut conn)
        .await?;
    Ok(())
}
