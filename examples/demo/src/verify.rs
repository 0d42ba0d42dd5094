//! The summary: every order accepted over HTTP must be stored once, have its
//! `OrderCreated` published, be charged exactly once for its amount, have
//! its `PaymentCaptured` published, and be paid exactly once — with nothing
//! left over (no stray rows, no dead letters, no unprocessed inbox rows).
//! Prints the figures and the commit → paid latency; returns the problems.
//! [`check_sagas`] checks the order-payment saga after the declined cards'
//! orders.

use std::collections::HashMap;
use std::time::Duration;

use outbox::BoxError;
use outbox::prelude::Uuid;
use sqlx::PgPool;

use crate::send::{Order, Sent};

/// What the run did, for the summary.
pub struct Report<'a> {
    /// The orders sent.
    pub sent: &'a Sent,
    /// The order sent and paid before the stream (left out of the latency).
    pub warmup: Order,
    /// How many bad requests were refused.
    pub refused: usize,
    /// From the first order sent until every order was paid; `None` if the
    /// wait timed out.
    pub all_paid_after: Option<Duration>,
}

fn line(label: &str, text: impl std::fmt::Display) {
    println!("  {label:<26}{text}");
}

/// Checks the two databases against what was sent; prints the summary.
pub async fn check(
    report: &Report<'_>,
    orders_db: &PgPool,
    billing_db: &PgPool,
) -> Result<Vec<String>, BoxError> {
    let sent = report.sent;
    let expected: HashMap<Uuid, i64> = sent
        .orders
        .iter()
        .chain([&report.warmup])
        .map(|o| (o.id, o.amount_cents))
        .collect();
    // The warm-up order is checked like the others.
    let n = expected.len();
    let mut problems = Vec::new();
    let mut expect = |ok: bool, problem: String| {
        if !ok {
            problems.push(problem);
        }
    };

    line(
        "orders sent",
        format!(
            "{} accepted (201) in {:.1} s ({:.0}/s) + 1 warm-up, {} failed; {} bad requests refused",
            sent.orders.len(),
            sent.elapsed.as_secs_f64(),
            sent.orders.len() as f64 / sent.elapsed.as_secs_f64().max(1e-9),
            sent.failures.len(),
            report.refused
        ),
    );
    expect(
        sent.failures.is_empty(),
        format!(
            "{} orders were not accepted, the first: {}",
            sent.failures.len(),
            sent.failures
                .first()
                .map(String::as_str)
                .unwrap_or_default()
        ),
    );

    // The orders service's rows.
    let rows: Vec<(Uuid, i64, bool, i32)> = sqlx::query_as(
        "SELECT id, amount_cents, paid_at IS NOT NULL, payments_applied FROM orders",
    )
    .fetch_all(orders_db)
    .await?;
    let (mut stored, mut stray, mut wrong, mut unpaid, mut paid_twice) = (0, 0, 0, 0, 0);
    for (id, amount, paid, applied) in &rows {
        match expected.get(id) {
            None => stray += 1,
            Some(sent_amount) => {
                stored += 1;
                wrong += usize::from(sent_amount != amount);
                unpaid += usize::from(!paid);
                paid_twice += usize::from(*applied > 1);
            }
        }
    }
    line(
        "orders stored",
        format!("{stored}/{n}, {stray} not sent by this run"),
    );
    expect(
        stored == n,
        format!("{} accepted orders are not in the database", n - stored),
    );
    expect(
        stray == 0,
        format!("{stray} orders in the database were not accepted over HTTP (bad input written?)"),
    );
    expect(
        wrong == 0,
        format!("{wrong} orders were stored with another amount"),
    );

    let (published, events): (i64, i64) = sqlx::query_as(
        "SELECT count(published_at), count(*) FROM outbox_event WHERE event_type = 'OrderCreated'",
    )
    .fetch_one(orders_db)
    .await?;
    line(
        "OrderCreated published",
        format!("{published}/{events} outbox rows"),
    );
    expect(
        events as usize == n,
        format!("{events} OrderCreated outbox rows for {n} orders"),
    );
    expect(
        published == events,
        format!("{} OrderCreated events unpublished", events - published),
    );

    // The billing service's charges.
    let charges: Vec<(Uuid, i64, i64, i64)> = sqlx::query_as(
        "SELECT order_id, count(*), min(amount_cents), max(amount_cents) FROM charges GROUP BY order_id",
    )
    .fetch_all(billing_db)
    .await?;
    let (mut charged, mut doubled, mut mischarged, mut stray_charges) = (0, 0, 0, 0);
    for (order_id, count, min, max) in &charges {
        match expected.get(order_id) {
            None => stray_charges += 1,
            Some(amount) => {
                charged += 1;
                doubled += usize::from(*count > 1);
                mischarged += usize::from(min != amount || max != amount);
            }
        }
    }
    line(
        "payments captured",
        format!(
            "{charged}/{n} orders charged, {doubled} charged twice, {mischarged} for a wrong amount"
        ),
    );
    expect(
        charged == n,
        format!("{} orders were never charged", n - charged),
    );
    expect(
        doubled == 0,
        format!("{doubled} orders were charged more than once"),
    );
    expect(
        mischarged == 0,
        format!("{mischarged} orders were charged a wrong amount"),
    );
    expect(
        stray_charges == 0,
        format!("{stray_charges} charges for orders this run did not send"),
    );

    let (published, events): (i64, i64) = sqlx::query_as(
        "SELECT count(published_at), count(*) FROM outbox_event WHERE event_type = 'PaymentCaptured'",
    )
    .fetch_one(billing_db)
    .await?;
    line(
        "PaymentCaptured published",
        format!("{published}/{events} outbox rows"),
    );
    expect(
        published == events,
        format!("{} PaymentCaptured events unpublished", events - published),
    );

    line(
        "orders paid",
        format!("{}/{n}, {paid_twice} paid more than once", stored - unpaid),
    );
    expect(unpaid == 0, format!("{unpaid} orders are not paid"));
    expect(
        paid_twice == 0,
        format!("{paid_twice} orders were paid more than once"),
    );

    // Nothing stuck on the consumer side.
    let count = |pool: &PgPool, sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await }
    };
    let dead_orders = count(orders_db, "SELECT count(*) FROM dead_letter").await?;
    let dead_billing = count(billing_db, "SELECT count(*) FROM dead_letter").await?;
    let inbox_left = count(
        orders_db,
        "SELECT count(*) FROM inbox_event WHERE NOT processed",
    )
    .await?;
    line(
        "left over",
        format!(
            "dead letters: orders {dead_orders}, billing {dead_billing}; unprocessed inbox rows {inbox_left}"
        ),
    );
    expect(
        dead_orders + dead_billing == 0,
        format!("{} dead letters", dead_orders + dead_billing),
    );
    expect(
        inbox_left == 0,
        format!("{inbox_left} inbox rows not processed"),
    );

    // Commit → paid: the order row's insert (in the transaction that also
    // wrote OrderCreated) to the payment's update on the orders side; the
    // warm-up order, which paid for the clients' first connections, is left
    // out.
    let (p50, p99, max): (Option<f64>, Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY ms),
                max(ms)
         FROM (SELECT extract(epoch FROM paid_at - created_at)::float8 * 1000 AS ms
               FROM orders WHERE paid_at IS NOT NULL AND id <> $1) AS latency",
    )
    .bind(report.warmup.id)
    .fetch_one(orders_db)
    .await?;
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0} ms"));
    line(
        "commit → paid latency",
        format!("p50 {}, p99 {}, max {}", ms(p50), ms(p99), ms(max)),
    );
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let end_to_end = match report.all_paid_after {
        Some(after) => format!(
            "every order paid {:.1} s after the first was sent ({build} build)",
            after.as_secs_f64()
        ),
        None => format!("not every order was paid in time ({build} build)"),
    };
    line("end to end", end_to_end);
    Ok(problems)
}

/// Checks the order-payment saga after the declined cards' orders: each of
/// `declined` cancelled once (after `cancelled_after`, `None`: not in time),
/// never charged, its stock reserved and released once; the `paid` other
/// orders' sagas ended paid, none released stock; nothing running, no dead
/// letter. Prints the summary; returns the problems.
pub async fn check_sagas(
    orders_db: &PgPool,
    billing_db: &PgPool,
    declined: &[Uuid],
    paid: i64,
    cancelled_after: Option<Duration>,
) -> Result<Vec<String>, BoxError> {
    let k = declined.len() as i64;
    let mut problems = Vec::new();
    let mut expect = |ok: bool, problem: String| {
        if !ok {
            problems.push(problem);
        }
    };
    let (cancelled, twice, paid_too): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(cancelled_at), count(*) FILTER (WHERE cancellations_applied > 1),
                count(paid_at)
         FROM orders WHERE id = ANY($1)",
    )
    .bind(declined)
    .fetch_one(orders_db)
    .await?;
    let charged: i64 = sqlx::query_scalar("SELECT count(*) FROM charges WHERE order_id = ANY($1)")
        .bind(declined)
        .fetch_one(billing_db)
        .await?;
    let after = cancelled_after.map_or_else(
        || "not all in time".to_owned(),
        |d| format!("all after {:.1} s", d.as_secs_f64()),
    );
    line(
        "declined cards' orders",
        format!(
            "{cancelled}/{k} cancelled ({after}), {twice} cancelled twice, {paid_too} paid, {charged} charged"
        ),
    );
    expect(
        cancelled == k,
        format!(
            "{} declined cards' orders were not cancelled",
            k - cancelled
        ),
    );
    expect(
        twice == 0 && paid_too == 0 && charged == 0,
        format!(
            "declined cards' orders: {twice} cancelled twice, {paid_too} paid, {charged} charged"
        ),
    );

    // The stock events, per order: reserved once for every order whose
    // saga began with it, released once for each cancelled one, never for
    // a paid one.
    let stock: Vec<(Uuid, i64, i64)> = sqlx::query_as(
        "SELECT aggregate_id::uuid,
                count(*) FILTER (WHERE event_type = 'StockReserved'),
                count(*) FILTER (WHERE event_type = 'StockReleased')
         FROM outbox_event WHERE topic = 'demo.stock' GROUP BY 1",
    )
    .fetch_all(orders_db)
    .await?;
    let is_declined = |id: &Uuid| declined.contains(id);
    let reserved_twice = stock.iter().filter(|(_, r, _)| *r > 1).count();
    let released_declined = stock
        .iter()
        .filter(|(id, r, l)| is_declined(id) && *r == 1 && *l == 1)
        .count() as i64;
    let released_paid = stock
        .iter()
        .filter(|(id, _, l)| !is_declined(id) && *l > 0)
        .count();
    line(
        "stock",
        format!(
            "reserved for {} orders ({reserved_twice} twice); released once for {released_declined}/{k} \
             cancelled, for {released_paid} paid",
            stock.len()
        ),
    );
    expect(
        released_declined == k && reserved_twice == 0 && released_paid == 0,
        format!(
            "stock: {released_declined}/{k} cancelled orders reserved and released once, \
             {reserved_twice} reserved twice, {released_paid} paid orders released"
        ),
    );

    let stages: Vec<(String, bool, i64)> = sqlx::query_as(
        "SELECT stage, completed_at IS NOT NULL, count(*) FROM outbox_saga
         WHERE saga_type = 'order-payment' GROUP BY 1, 2",
    )
    .fetch_all(orders_db)
    .await?;
    let of = |stage: &str, done: bool| {
        stages
            .iter()
            .filter(|(s, d, _)| s == stage && *d == done)
            .map(|(_, _, n)| *n)
            .sum::<i64>()
    };
    let running: i64 = stages
        .iter()
        .filter(|(_, d, _)| !d)
        .map(|(_, _, n)| *n)
        .sum();
    line(
        "order-payment sagas",
        format!(
            "{} ended paid, {} cancelled, {running} running",
            of("Paid", true),
            of("Cancelled", true)
        ),
    );
    expect(
        of("Paid", true) == paid && of("Cancelled", true) == k && running == 0,
        format!(
            "order-payment sagas: {} paid (want {paid}), {} cancelled (want {k}), {running} running",
            of("Paid", true),
            of("Cancelled", true)
        ),
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letter")
        .fetch_one(orders_db)
        .await?;
    let dead_billing: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letter")
        .fetch_one(billing_db)
        .await?;
    expect(
        dead + dead_billing == 0,
        format!(
            "{} dead letters after the declined cards",
            dead + dead_billing
        ),
    );
    Ok(problems)
}
