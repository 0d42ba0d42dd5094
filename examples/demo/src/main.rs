//! The demo: orders → billing, end to end.
//!
//! Resets the demo's topics, starts `orders-service` and `billing-service`
//! as child processes (each with its own database), sends a stream of orders
//! over HTTP, shows the events flowing (orders created, `OrderCreated`
//! published, payments captured, orders paid), then checks that every order
//! was paid exactly once and prints the commit → paid latency. Then a few
//! orders whose card billing declines: the orders service's order-payment
//! saga must cancel each once its payment timeout fires and release its
//! stock, and every other order's saga must have ended paid. Exits non-zero
//! if anything is missing, doubled or late, or if a service does not stop
//! cleanly.
//!
//! Modules: `services` (the child processes and the topics), `send` (the
//! HTTP traffic), `progress` (the live counts), `verify` (the summary).

#![forbid(unsafe_code)]

mod progress;
mod send;
mod services;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use outbox::BoxError;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::progress::{Counts, Progress};
use crate::services::{Services, StartOptions};

/// Sends orders to the demo's services and checks each is paid exactly once.
#[derive(Debug, Parser)]
#[command(name = "demo", version)]
struct Args {
    /// How many orders to send.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    orders: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    concurrency: u32,
    /// Send at most this many orders per second (default: as fast as the
    /// service answers). A steady rate measures latency without a backlog.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rate: Option<u32>,
    /// Seconds to wait, once the last order was sent, for every order to be paid.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// The orders service's database (created empty beforehand).
    #[arg(
        long,
        env = "ORDERS_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/outbox_demo_orders",
        hide_env_values = true
    )]
    orders_database_url: String,
    /// The billing service's database (created empty beforehand).
    #[arg(
        long,
        env = "BILLING_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/outbox_demo_billing",
        hide_env_values = true
    )]
    billing_database_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Where the `orders-service` and `billing-service` programs are
    /// (default: beside this one).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where the services' logs go (default: `outbox-demo` in the temporary
    /// directory).
    #[arg(long)]
    log_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("demo: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn connect(url: &str, what: &str) -> Result<PgPool, BoxError> {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|e| {
            format!("cannot connect to the {what} database: {e} (scripts/demo.sh creates it)")
                .into()
        })
}

/// Runs the demo; `Ok(false)` when a check failed.
async fn run(args: Args) -> Result<bool, BoxError> {
    let orders_db = connect(&args.orders_database_url, "orders").await?;
    let billing_db = connect(&args.billing_database_url, "billing").await?;
    let total = u64::from(args.orders);

    println!(
        "== topics: {} and {} (emptied)",
        demo_events::ORDERS_TOPIC,
        demo_events::PAYMENTS_TOPIC
    );
    services::reset_topics(&args.brokers).await?;

    let bin_dir = match args.bin_dir {
        Some(dir) => dir,
        None => std::env::current_exe()?
            .parent()
            .ok_or("the demo program has no directory")?
            .to_owned(),
    };
    let log_dir = args
        .log_dir
        .unwrap_or_else(|| std::env::temp_dir().join("outbox-demo"));
    let mut services = Services::start(StartOptions {
        bin_dir,
        log_dir,
        orders_database_url: args.orders_database_url.clone(),
        billing_database_url: args.billing_database_url.clone(),
        brokers: args.brokers.clone(),
    })
    .await?;
    let plan = Plan {
        orders: total,
        concurrency: args.concurrency as usize,
        rate: args.rate,
        timeout: Duration::from_secs(args.timeout),
    };
    let result = drive(&mut services, &orders_db, &billing_db, &plan).await;
    // Whatever happened, stop the services gracefully and check they did.
    println!("== stopping the services (SIGTERM)");
    let stopped = services.stop().await;
    let mut problems = match result {
        Ok(problems) => problems,
        Err(e) => vec![e.to_string()],
    };
    problems.extend(stopped);
    if problems.is_empty() {
        println!(
            "OK: every order was paid exactly once; every declined card's order cancelled once, its stock released."
        );
        Ok(true)
    } else {
        println!("FAILED:");
        for p in &problems {
            println!("  - {p}");
        }
        Ok(false)
    }
}

/// How long the first order may take to be paid: the services' Kafka
/// clients connect and join their groups meanwhile.
const WARMUP_TIMEOUT: Duration = Duration::from_secs(60);

/// What to send and how long to wait.
struct Plan {
    orders: u64,
    concurrency: usize,
    rate: Option<u32>,
    timeout: Duration,
}

/// Sends the traffic, follows it, verifies it; returns the problems found.
async fn drive(
    services: &mut Services,
    orders_db: &PgPool,
    billing_db: &PgPool,
    plan: &Plan,
) -> Result<Vec<String>, BoxError> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let base = services.base_url().to_owned();
    let mut problems = Vec::new();

    println!("== bad input is refused (4xx, nothing written)");
    let refused = send::bad_requests(&client, &base).await;
    problems.extend(refused.problems);

    println!(
        "== warm-up: one order, sent and paid before the stream (the services' clients connect)"
    );
    let url = format!("{base}/orders");
    let warmup = send::place(&client, &url, plan.orders)
        .await
        .map_err(|e| format!("the warm-up order was not accepted: {e}"))?;
    let warm_started = Instant::now();
    loop {
        let paid: bool = sqlx::query_scalar("SELECT paid_at IS NOT NULL FROM orders WHERE id = $1")
            .bind(warmup.id)
            .fetch_one(orders_db)
            .await?;
        if paid {
            println!("  paid after {:.2} s", warm_started.elapsed().as_secs_f64());
            break;
        }
        if let Some(exited) = services.exited() {
            return Err(exited.into());
        }
        if warm_started.elapsed() >= WARMUP_TIMEOUT {
            return Err(format!(
                "the warm-up order was not paid within {} s: is the broker up? see the services' logs",
                WARMUP_TIMEOUT.as_secs()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let baseline = Counts::read(orders_db, billing_db).await?;

    let pace = plan.rate.map_or_else(
        || "as fast as answered".to_owned(),
        |r| format!("at most {r}/s"),
    );
    println!(
        "== sending {} orders to {base}/orders ({} at a time, {pace})",
        plan.orders, plan.concurrency
    );
    let started = Instant::now();
    let mut sender = tokio::spawn(send::orders(
        client.clone(),
        base.clone(),
        plan.orders,
        plan.concurrency,
        plan.rate,
    ));
    let mut progress = Progress::new(plan.orders);
    let mut sent: Option<send::Sent> = None;
    let mut deadline = None;
    let mut timed_out = false;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let counts = loop {
        tick.tick().await;
        let counts = Counts::read(orders_db, billing_db).await?.since(&baseline);
        progress.update(&counts, started.elapsed());
        if sent.is_none() && sender.is_finished() {
            sent = Some((&mut sender).await?);
            deadline = Some(Instant::now() + plan.timeout);
        }
        if let Some(exited) = services.exited() {
            progress.finish(&counts, started.elapsed());
            sender.abort();
            return Err(exited.into());
        }
        if let (Some(sent), Some(deadline)) = (&sent, deadline) {
            let n = sent.orders.len() as u64;
            if counts.all_reached(n) {
                break counts;
            }
            if Instant::now() >= deadline {
                timed_out = true;
                problems.push(format!(
                    "not every order was paid within {} s of the last one sent",
                    plan.timeout.as_secs()
                ));
                break counts;
            }
        }
    };
    let elapsed = started.elapsed();
    progress.finish(&counts, elapsed);
    let all_paid_after = (!timed_out).then_some(elapsed);
    let sent = sent.expect("the loop ends once the orders were sent");

    // A duplicate delivery would show up shortly after the last payment:
    // give it a moment before counting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!("== summary");
    let report = verify::Report {
        sent: &sent,
        warmup,
        refused: refused.count,
        all_paid_after,
    };
    problems.extend(verify::check(&report, orders_db, billing_db).await?);
    if let Some(order) = sent.orders.first() {
        let shown = send::show(&client, &base, order.id).await;
        println!("  {:<26}GET /orders/{} → {shown}", "an order", order.id);
    }

    println!(
        "== a payment that never comes: {DECLINED} orders of `{}`, whose card billing declines; \
         the order-payment saga cancels each after {} ms and releases its stock",
        demo_events::DECLINED_CUSTOMER,
        services::PAYMENT_TIMEOUT_MS
    );
    let mut declined = Vec::new();
    for j in 0..DECLINED {
        let order = send::place_for(
            &client,
            &url,
            plan.orders + 1 + j,
            demo_events::DECLINED_CUSTOMER,
        )
        .await
        .map_err(|e| format!("a declined card's order was not accepted: {e}"))?;
        declined.push(order.id);
    }
    let placed = Instant::now();
    let cancelled_after = loop {
        let cancelled: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM orders WHERE id = ANY($1) AND cancelled_at IS NOT NULL",
        )
        .bind(&declined)
        .fetch_one(orders_db)
        .await?;
        if cancelled as usize == declined.len() {
            break Some(placed.elapsed());
        }
        if let Some(exited) = services.exited() {
            return Err(exited.into());
        }
        if placed.elapsed() >= plan.timeout {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // A second cancellation or a late timeout would show up now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let paid_orders = sent.orders.len() as i64 + 1;
    problems.extend(
        verify::check_sagas(
            orders_db,
            billing_db,
            &declined,
            paid_orders,
            cancelled_after,
        )
        .await?,
    );
    if let Some(id) = declined.first() {
        let shown = send::show(&client, &base, *id).await;
        println!("  {:<26}GET /orders/{id} → {shown}", "a cancelled order");
    }
    Ok(problems)
}

/// Orders of the customer whose card is declined, sent after the stream.
const DECLINED: u64 = 5;
