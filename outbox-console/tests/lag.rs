//! The consumer groups page with a broker: a group's lag per partition, its
//! committed offset against the end of the log, read in the background and
//! kept — a page creates no Kafka client, answers in bounded time when the
//! broker does not answer at all, and shows at most `MAX_GROUPS` groups.
//! Needs the broker (`KAFKA_BROKERS`, default 127.0.0.1:9092).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::*;
use outbox_console::{ConsoleConfig, MAX_GROUPS, router};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;
use sqlx::PgPool;
use tokio::net::{TcpListener, TcpStream};

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A topic of five messages and `group` with offset 2 committed on it.
async fn group_at_offset_2(brokers: &str, topic: &str, group: &str) {
    outbox_runtime::kafka::create_topics(brokers, &[], &[topic.to_owned()], 1, 1)
        .await
        .expect("create the test's topic");
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    for i in 0..5 {
        producer
            .send(
                FutureRecord::to(topic)
                    .partition(0)
                    .key("k")
                    .payload(&format!("{i}")),
                Duration::from_secs(10),
            )
            .await
            .expect("produced");
    }
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(2))
        .unwrap();
    consumer.commit(&tpl, CommitMode::Sync).expect("commit");
}

fn lag_row(topic: &str) -> String {
    format!(
        "<tr><td>{topic}</td><td class=\"num\">0</td><td class=\"num\">2</td>\
         <td class=\"num\">5</td><td class=\"num\">3</td></tr>"
    )
}

/// A TCP proxy to `target` that counts the connections it accepts: each
/// Kafka client opens one to its bootstrap server.
async fn counting_proxy(target: String) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (addr, count)
}

/// Loads `/consumers` until `done` holds of the page (at most 60 s).
async fn until(app: &axum::Router, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let page = get(app, "/consumers", None).await;
        assert_eq!(page.status, StatusCode::OK);
        if done(&page.body) {
            return page.body;
        }
        assert!(Instant::now() < deadline, "{}", page.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_lag_of_a_group_is_its_committed_offset_against_the_log_end(pool: PgPool) {
    let brokers = brokers();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("console-lag-{id}");
    let group = format!("console-group-{id}");
    group_at_offset_2(&brokers, &topic, &group).await;
    // The database knows the group by a dead letter.
    dead_letter(&pool, &group, 1, b"{}", json!({}), "boom").await;

    let app = router(pool.clone(), ConsoleConfig::new().brokers(brokers, vec![]));
    let page = until(&app, |p| p.contains(&lag_row(&topic))).await;
    assert!(!page.contains("No broker is configured"));
    assert!(page.contains("at most every 30 s"), "{page}");
}

/// Pages show the kept readings: once every group is read, more pages
/// open no connection to the broker (before, each page created a client
/// per group).
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn pages_create_no_kafka_client(pool: PgPool) {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("console-lag-{id}");
    let group = format!("console-group-{id}");
    group_at_offset_2(&brokers(), &topic, &group).await;
    dead_letter(&pool, &group, 1, b"{}", json!({}), "boom").await;
    for i in 0..11 {
        dead_letter(
            &pool,
            &format!("console-idle-{id}-{i}"),
            1,
            b"{}",
            json!({}),
            "boom",
        )
        .await;
    }
    let (proxy, connections) = counting_proxy(brokers()).await;
    let app = router(
        pool.clone(),
        ConsoleConfig::new()
            .brokers(proxy, vec![])
            .lag_refresh(Duration::from_secs(600)),
    );
    let page = until(&app, |p| !p.contains("reading…")).await;
    assert!(page.contains(&lag_row(&topic)), "{page}");
    assert_eq!(page.matches("no committed offsets").count(), 11, "{page}");
    let after_reading = connections.load(Ordering::SeqCst);
    assert!(after_reading >= 1, "the reading went through the proxy");
    for _ in 0..5 {
        let page = get(&app, "/consumers", None).await;
        assert!(page.body.contains(&lag_row(&topic)));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        connections.load(Ordering::SeqCst),
        after_reading,
        "pages opened connections to the broker"
    );
}

/// A broker that accepts connections and never answers, and more groups
/// than a page shows: each page answers in bounded time (the bound only
/// catches a page that waits for every group's reading), shows the first
/// `MAX_GROUPS` groups and says so.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_silent_broker_and_many_groups_keep_the_page_bounded(pool: PgPool) {
    let total = MAX_GROUPS + 20;
    sqlx::query(
        r#"INSERT INTO dead_letter (consumer, topic, "partition", "offset", reason, error)
           SELECT 'silent-' || lpad(g::text, 4, '0'), 'orders', 0, g, 'handler_failed', 'boom'
           FROM generate_series(1, $1) AS g"#,
    )
    .bind(total as i32)
    .execute(&pool)
    .await
    .unwrap();
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = connections.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            held.push(stream);
        }
    });
    let app = router(pool.clone(), ConsoleConfig::new().brokers(addr, vec![]));
    for _ in 0..3 {
        let started = Instant::now();
        let page = get(&app, "/consumers", None).await;
        let took = started.elapsed();
        assert_eq!(page.status, StatusCode::OK);
        assert!(took < Duration::from_secs(15), "the page took {took:?}");
        assert!(
            page.body
                .contains(&format!("The first {MAX_GROUPS} of {total} groups")),
            "{}",
            page.body
        );
        assert_eq!(page.body.matches("<tr><td>silent-").count(), MAX_GROUPS);
        assert!(page.body.contains("reading…"));
    }
    // One reading at a time, one group after the other: a handful of
    // clients by now, not one per group per page.
    let opened = connections.load(Ordering::SeqCst);
    assert!(opened <= 10, "{opened} connections");
}
