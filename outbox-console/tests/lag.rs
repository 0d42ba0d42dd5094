//! The consumer groups page with a broker: a group's lag per partition, its
//! committed offset against the end of the log (needs the broker,
//! `KAFKA_BROKERS`, default 127.0.0.1:9092).

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use outbox_console::{ConsoleConfig, router};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_lag_of_a_group_is_its_committed_offset_against_the_log_end(pool: PgPool) {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let id = uuid::Uuid::new_v4().simple().to_string();
    let topic = format!("console-lag-{id}");
    let group = format!("console-group-{id}");
    outbox_runtime::kafka::create_topics(&brokers, &[], std::slice::from_ref(&topic), 1, 1)
        .await
        .expect("create the test's topic");
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    for i in 0..5 {
        producer
            .send(
                FutureRecord::to(&topic)
                    .partition(0)
                    .key("k")
                    .payload(&format!("{i}")),
                Duration::from_secs(10),
            )
            .await
            .expect("produced");
    }
    // The group has read two messages: offset 2 committed.
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&topic, 0, Offset::Offset(2))
        .unwrap();
    consumer.commit(&tpl, CommitMode::Sync).expect("commit");
    drop(consumer);
    // The database knows the group by a dead letter.
    dead_letter(&pool, &group, 1, b"{}", json!({}), "boom").await;

    let app = router(pool.clone(), ConsoleConfig::new().brokers(brokers, vec![]));
    let page = get(&app, "/consumers", None).await;
    assert_eq!(page.status, StatusCode::OK);
    let row = format!(
        "<tr><td>{topic}</td><td class=\"num\">0</td><td class=\"num\">2</td>\
         <td class=\"num\">5</td><td class=\"num\">3</td></tr>"
    );
    assert!(page.body.contains(&row), "{}", page.body);
    assert!(!page.body.contains("No broker is configured"));
}
