//! The consumer lag as operators see it — the `outbox_consumer_lag` gauge
//! and `groups::lag` (the console's consumers page, `outbox groups`) —
//! checked against what the consumer actually has left to read: a handler
//! holds a partition back at a known offset, so the true lag is known. Its
//! own test binary: the metrics endpoint is one per process.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::Consumer;
use outbox_runtime::inbox::groups;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

keyed_event!(Lagging, "consumer-lag-test");

/// Fails the events from `from` on while the gate is closed: the consumer
/// retries the first of them in place, so its partition's committed
/// offset stays there.
struct Gate {
    from: u64,
    open: Arc<AtomicBool>,
}

impl InboxHandler for Gate {
    type Event = Lagging;
    const NAME: &'static str = "gate";

    fn handle<'a, 'c>(&'a self, _: &'a mut HandlerContext<'c>, event: Lagging) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            // Held in the handler: the partition's offset stays here (a
            // failing event would be set aside and the rest read on).
            while event.seq >= self.from && !self.open.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(())
        })
    }
}

async fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}

/// The gauge's value for `group` on `partition`.
fn lag_gauge(body: &str, group: &str, partition: i32) -> Option<f64> {
    let (g, p) = (
        format!("group=\"{group}\""),
        format!("partition=\"{partition}\""),
    );
    body.lines().find_map(|l| {
        let rest = l.strip_prefix("outbox_consumer_lag{")?;
        let (set, value) = rest.split_once("} ")?;
        (set.contains(&g) && set.contains(&p)).then(|| value.trim().parse().ok())?
    })
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_lag_is_what_is_left_to_read(pool: PgPool) {
    init_tracing();
    let server = outbox_runtime::metrics::serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    let brokers = brokers();
    let topic = Lagging::TOPIC;
    reset_topic(&brokers, topic).await;
    // 200 events of one key: one partition, offsets 0..200.
    let messages: Vec<TestMessage> = (0..200)
        .map(|seq| {
            TestMessage::event(
                Uuid::now_v7(),
                "OrderPlaced",
                "k",
                serde_json::json!({ "key": "k", "seq": seq }),
            )
        })
        .collect();
    produce(&brokers, topic, &messages).await;
    let group = unique_topic("lag-group");
    let open = Arc::new(AtomicBool::new(false));
    let consumer = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(&brokers)
        .handler_timeout(Duration::from_secs(600))
        // The first 100 commit in a batch of their own.
        .batch_size(100)
        .kafka_setting("statistics.interval.ms", "500")
        .handler(Gate {
            from: 100,
            open: open.clone(),
        })
        .spawn()
        .unwrap();

    // Held back at offset 100 of 200: 100 messages left to read.
    let deadline = Instant::now() + Duration::from_secs(60);
    let partition = loop {
        let lags = groups::lag(&brokers, &[], &group, Duration::from_secs(5)).unwrap_or_default();
        if let Some(p) = lags.iter().find(|l| l.topic == topic && l.committed == 100) {
            break p.clone();
        }
        assert!(
            Instant::now() < deadline,
            "never held at offset 100: {lags:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let body = loop {
        let body = get(addr, "/metrics").await;
        if lag_gauge(&body, &group, partition.partition).is_some_and(|v| v > 0.0)
            || Instant::now() > deadline
        {
            break body;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let gauge = lag_gauge(&body, &group, partition.partition);
    eprintln!("held: groups::lag {partition:?}; gauge {gauge:?}");
    assert_eq!(partition.lag, 100, "groups::lag: {partition:?}");
    assert_eq!(gauge, Some(100.0), "the gauge while 100 are left");

    // Let go: nothing left.
    open.store(true, Ordering::Release);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (lag, gauge) = loop {
        let lag = groups::lag(&brokers, &[], &group, Duration::from_secs(5))
            .unwrap_or_default()
            .into_iter()
            .find(|l| l.topic == topic && l.partition == partition.partition);
        let gauge = lag_gauge(&get(addr, "/metrics").await, &group, partition.partition);
        if (lag.as_ref().is_some_and(|l| l.lag == 0) && gauge == Some(0.0))
            || Instant::now() > deadline
        {
            break (lag, gauge);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    consumer.shutdown().await.unwrap();
    eprintln!("done: groups::lag {lag:?}; gauge {gauge:?}");
    assert_eq!(lag.map(|l| (l.committed, l.lag)), Some((200, 0)));
    assert_eq!(gauge, Some(0.0));
}
