//! How long the console's pages take on a large outbox: fills a database of
//! its own (`outbox_console_bench`, kept between runs and refilled only
//! when the row count differs) with `ROWS` rows (default 10,000,000), of
//! which 10,000 unpublished, 2,000 parked (a tenth of them dropped) and the
//! rest published, plus 5,000 dead letters (and one whose error is a
//! megabyte of secrets to scrub); then requests each page through
//! the router and prints the median and the slowest of `RUNS` requests
//! (default 7).
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo bench -p outbox-console --bench pages
//! ```

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use outbox_console::{ConsoleConfig, router};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection};
use tower::ServiceExt;

const DB: &str = "outbox_console_bench";

fn env_num(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let rows = env_num("ROWS", 10_000_000);
    let runs = env_num("RUNS", 7).max(1) as usize;
    let mut admin = PgConnection::connect(&base).await.expect("connect");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(DB)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    if !exists {
        sqlx::query(&format!("CREATE DATABASE {DB}"))
            .execute(&mut admin)
            .await
            .unwrap();
    }
    let url = match base.rfind('/') {
        Some(i) => format!("{}/{DB}", &base[..i]),
        None => panic!("DATABASE_URL without a database"),
    };
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    outbox_core::migrate(&pool).await.unwrap();
    let have: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    if have != rows {
        println!("filling {rows} outbox rows (once; kept in database {DB})");
        let started = Instant::now();
        sqlx::query("TRUNCATE outbox_event, dead_letter, outbox_audit RESTART IDENTITY")
            .execute(&pool)
            .await
            .unwrap();
        let chunk = 1_000_000;
        let mut from = 1;
        while from <= rows {
            let to = (from + chunk - 1).min(rows);
            // The last 12,000 rows are the unpublished and parked ones.
            sqlx::query(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key, published_at,
                                           parked_at, attempts, last_error, discarded_at,
                                           discard_reason)
                 SELECT gen_random_uuid(), 'Order', 'o' || g, 'OrderPlaced',
                        jsonb_build_object('order_id', g, 'amount_cents', g % 10000),
                        'topic-' || (g % 8), 'o' || g,
                        CASE WHEN g <= $3 - 12000 THEN now() END,
                        CASE WHEN g > $3 - 2000 THEN now() END,
                        CASE WHEN g > $3 - 2000 THEN 5 ELSE 0 END,
                        CASE WHEN g > $3 - 2000 THEN 'Broker: Message size too large (' || g || ')' END,
                        CASE WHEN g > $3 - 200 THEN now() END,
                        CASE WHEN g > $3 - 200 THEN 'bench' END
                 FROM generate_series($1::int8, $2::int8) AS g",
            )
            .bind(from)
            .bind(to)
            .bind(rows)
            .execute(&pool)
            .await
            .unwrap();
            from = to + 1;
        }
        sqlx::query(
            r#"INSERT INTO dead_letter (consumer, topic, "partition", "offset", headers, payload,
                                        reason, error, status)
               SELECT 'group-' || (g % 4), 'topic-1', 0, g, '{}', '{}'::bytea, 'handler_failed',
                      'boom ' || g, CASE WHEN g % 5 = 0 THEN 'dead' ELSE 'resolved' END
               FROM generate_series(1, 5000) AS g"#,
        )
        .execute(&pool)
        .await
        .unwrap();
        println!("filled in {:.0} s", started.elapsed().as_secs_f64());
    }
    sqlx::query("VACUUM ANALYZE outbox_event")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("VACUUM ANALYZE dead_letter")
        .execute(&pool)
        .await
        .unwrap();
    let parked_id: i64 = sqlx::query_scalar(
        "SELECT id FROM outbox_event WHERE parked_at IS NOT NULL AND discarded_at IS NULL ORDER BY id LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    // A dead letter whose error quotes a hostile header of a megabyte
    // (thousands of `password=` and URLs with credentials to scrub), as
    // stored before consumers capped errors.
    let hostile_id: i64 = sqlx::query_scalar(
        r#"INSERT INTO dead_letter (consumer, topic, "partition", "offset", reason, error)
           VALUES ('bench-hostile', 'topic-1', 0, 0, 'no_event_id',
                   repeat('password=sekrit postgres://u:sekrit@db/x ', 25000))
           ON CONFLICT (consumer, topic, "partition", "offset") DO UPDATE SET reason = EXCLUDED.reason
           RETURNING id"#,
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let app = router(pool.clone(), ConsoleConfig::new());
    let pages = [
        "/".to_owned(),
        "/api/overview".to_owned(),
        "/relays".to_owned(),
        "/consumers".to_owned(),
        "/parked".to_owned(),
        "/parked?topic=topic-3".to_owned(),
        "/parked?error=size%20too%20large%20(99".to_owned(),
        format!("/parked?after={}&limit=50", parked_id + 900),
        format!("/parked/{parked_id}"),
        "/parked/5".to_owned(),
        "/dead-letters".to_owned(),
        "/dead-letters?consumer=group-1&status=all".to_owned(),
        "/dead-letters/17".to_owned(),
        format!("/dead-letters/{hostile_id}"),
        "/audit".to_owned(),
    ];
    println!("{rows} outbox rows; {runs} requests per page");
    println!("{:<48} {:>10} {:>10}", "page", "median", "max");
    for path in pages {
        let mut times: Vec<Duration> = Vec::with_capacity(runs);
        for _ in 0..runs {
            let started = Instant::now();
            let response = app
                .clone()
                .oneshot(Request::get(&path).body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert!(
                response.status().is_success(),
                "{path}: {}",
                response.status()
            );
            axum::body::to_bytes(response.into_body(), 64 << 20)
                .await
                .unwrap();
            times.push(started.elapsed());
            // The overview samples at most once a second: let it sample.
            if path == "/" || path == "/api/overview" {
                tokio::time::sleep(Duration::from_millis(1_050)).await;
            }
        }
        times.sort();
        println!(
            "{:<48} {:>8.1}ms {:>8.1}ms",
            path,
            times[runs / 2].as_secs_f64() * 1e3,
            times[runs - 1].as_secs_f64() * 1e3
        );
    }
}
