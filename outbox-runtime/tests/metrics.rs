//! The Prometheus endpoint with a relay and a consumer running against the
//! real broker: the published counter, the backlog gauges (scheduled
//! events apart), the consumer's
//! counters and lag, as scraped over HTTP. Its
//! own test binary, so that no other relay in the process adds to the
//! process-wide counters. It runs in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command): "published" is
//! then "passed by its slot's position" (see `common::unpublished`), and
//! the backlog gauges count what the positions have not passed.

mod common;

use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, Relay};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

keyed_event!(Placed, "metrics-test-orders");

struct Noop;

impl InboxHandler for Noop {
    type Event = Placed;
    const NAME: &'static str = "noop";

    fn handle<'a, 'c>(&'a self, _: &'a mut HandlerContext<'c>, _: Placed) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async { Ok(()) })
    }
}

/// The value of the first sample of `name` whose labels contain `labels`.
fn labelled(body: &str, name: &str, labels: &[&str]) -> Option<f64> {
    body.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix('{')?;
        let (set, value) = rest.split_once("} ")?;
        labels
            .iter()
            .all(|x| set.contains(x))
            .then(|| value.trim().parse().ok())?
    })
}

/// The value of an unlabelled sample, if present.
fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_metrics_endpoint_counts_published_events(pool: PgPool) {
    relay_mode(&pool).await;
    init_tracing();
    let server = outbox_runtime::metrics::serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    // One endpoint per process: a second one is refused, naming the first.
    let second = outbox_runtime::metrics::serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap_err();
    assert!(second.to_string().contains(&addr.to_string()), "{second}");

    let topic = Placed::TOPIC;
    reset_topic(&brokers(), topic).await;
    commit_messages(&pool, topic, 120, 6, 40).await;
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .batch_size(50)
        .spawn()
        .unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    // A scheduled event an hour ahead: counted apart from the backlog.
    let mut uow = outbox_core::UnitOfWork::begin(&pool).await.unwrap();
    let later = std::time::SystemTime::now() + Duration::from_secs(3600);
    uow.record_message_at(later, message(topic, "k0", 120));
    uow.commit().await.unwrap();

    // Counters are copied every second, the backlog sampled every 5 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let (ok, body) = loop {
        let body = get(addr, "/metrics").await;
        let ok = sample(&body, "outbox_relay_published_total") == Some(120.0)
            && sample(&body, "outbox_backlog_events") == Some(0.0)
            && sample(&body, "outbox_scheduled") == Some(1.0);
        if ok || std::time::Instant::now() > deadline {
            break (ok, body);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(ok, "{body}");
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(
        body.contains("outbox_relay_batch_duration_seconds_bucket"),
        "{body}"
    );
    assert_eq!(sample(&body, "outbox_parked_events"), Some(0.0), "{body}");
    assert_eq!(sample(&body, "outbox_held_events"), Some(0.0), "{body}");
    assert_eq!(
        sample(&body, "outbox_scheduled_overdue_seconds"),
        Some(0.0),
        "{body}"
    );
    assert!(
        sample(&body, "outbox_relay_batches_total").unwrap() >= 3.0,
        "{body}"
    );
    assert!(get(addr, "/health").await.ends_with("OK"));

    relay.shutdown().await.unwrap();

    // A consumer: its counters by group, and its lag once caught up.
    let group = unique_topic("metrics-group");
    let consumer = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(brokers())
        .handler(Noop)
        .spawn()
        .unwrap();
    let g = format!("group=\"{group}\"");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (ok, body) = loop {
        let body = get(addr, "/metrics").await;
        let ok = labelled(&body, "outbox_consumer_processed_total", &[&g]) == Some(120.0)
            && labelled(&body, "outbox_consumer_received_total", &[&g]) == Some(120.0)
            && labelled(&body, "outbox_consumer_lag", &[&g, "partition=\"0\""]) == Some(0.0);
        if ok || std::time::Instant::now() > deadline {
            break (ok, body);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(ok, "{body}");
    assert_eq!(
        labelled(&body, "outbox_consumer_duplicates_total", &[&g]),
        Some(0.0)
    );
    assert!(
        body.contains("outbox_consumer_batch_duration_seconds_bucket"),
        "{body}"
    );
    assert_eq!(labelled(&body, "outbox_consumer_up", &[&g]), Some(1.0));
    consumer.shutdown().await.unwrap();
    let body = get(addr, "/metrics").await;
    assert_eq!(
        labelled(&body, "outbox_consumer_up", &[&g]),
        Some(0.0),
        "a stopped consumer shows"
    );
}
