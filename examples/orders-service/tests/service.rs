//! The whole service (HTTP server, relay, payments consumer) against a
//! fresh database and the real broker: however many requests wait on the
//! database, holding every connection of the HTTP pool, the relay and the
//! consumer keep working on their own pool.

use std::time::{Duration, Instant};

use orders_service::service::{Config, serve};
use outbox::prelude::Uuid;
use outbox::runtime::CancellationToken;
use sqlx::PgPool;

fn url_of(pool: &PgPool) -> String {
    let o = pool.connect_options();
    format!(
        "postgres://{}@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().expect("database")
    )
}

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// Waits (at most 30 s) until `sql` counts at least `n`.
async fn until_count(pool: &PgPool, sql: &str, n: i64) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
        if got >= n || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[sqlx::test(migrations = false)]
async fn http_load_cannot_starve_the_relay_or_the_consumer(pool: PgPool) {
    let group = format!("orders-pools-{}", Uuid::now_v7().simple());
    let url = url_of(&pool);
    let mut config = Config::from_vars(|name| match name {
        "DATABASE_URL" => Some(url.clone()),
        "CONSUMER_GROUP" => Some(group.clone()),
        "HTTP_DB_CONNECTIONS" => Some("2".into()),
        "REQUEST_TIMEOUT_MS" => Some("60000".into()),
        _ => None,
    })
    .unwrap();
    // Only payments from now on: the shared broker's topic holds those of
    // earlier demo runs, whose handling would wait on the lock below.
    config.kafka.set("auto.offset.reset", "latest");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let service = tokio::spawn(serve(config, listener, shutdown.clone()));
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !client
        .get(format!("{base}/health"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(Instant::now() < deadline, "the service did not come up");
        assert!(!service.is_finished(), "the service stopped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let topic = format!("orders-pools-{}", Uuid::now_v7().simple());
    outbox::runtime::kafka::create_topics(&brokers(), &[], std::slice::from_ref(&topic), 1, 1)
        .await
        .unwrap();

    // Twenty requests wait on a table lock: the two connections of the
    // HTTP pool are taken, the other requests wait for one.
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let (client, url) = (client.clone(), format!("{base}/orders/{}", Uuid::now_v7()));
        requests.spawn(async move { client.get(url).send().await.map(|r| r.status()) });
    }
    let waiting = until_count(
        &pool,
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND query LIKE 'SELECT id, customer, amount_cents%'",
        2,
    )
    .await;
    assert!(waiting >= 2, "requests wait on the lock: {waiting}");

    // Meanwhile the relay publishes …
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, topic,
                                   partition_key, payload)
         VALUES ($1, 'Probe', 'p', 'Probed', $2, 'p', '{}')",
    )
    .bind(Uuid::now_v7())
    .bind(&topic)
    .execute(&pool)
    .await
    .unwrap();
    let published = until_count(
        &pool,
        "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL",
        1,
    )
    .await;
    assert_eq!(
        published, 1,
        "the relay published while HTTP requests held their pool"
    );

    // … and the consumer's processor works through its inbox (a payment it
    // cannot decode goes to the dead letters without touching `orders`).
    sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, consumer, topic, \"partition\", \"offset\",
                                  partition_key, event_type, event_version, headers)
         VALUES ($1, '{\"unexpected\": true}', $2, 'demo.payments', 0, 0, 'k', 'PaymentCaptured', 1, '{}')",
    )
    .bind(Uuid::now_v7())
    .bind(&group)
    .execute(&pool)
    .await
    .unwrap();
    let dead = until_count(
        &pool,
        "SELECT count(*) FROM dead_letter WHERE reason = 'payload_mismatch'",
        1,
    )
    .await;
    assert_eq!(
        dead, 1,
        "the consumer applied its inbox while HTTP requests held their pool"
    );

    lock.rollback().await.unwrap();
    while let Some(done) = requests.join_next().await {
        let status = done.unwrap().expect("answered");
        assert_eq!(status, reqwest::StatusCode::NOT_FOUND);
    }
    shutdown.cancel();
    service.await.unwrap().expect("stopped cleanly");
}
