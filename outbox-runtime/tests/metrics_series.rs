//! Every series name and label that the alert rules
//! (`deploy/prometheus/outbox-alerts.yml`) and the Grafana dashboard
//! (`deploy/grafana/outbox-dashboard.json`) use is emitted: a relay and a
//! consumer run against the real broker with their metrics served, publish
//! and consume events — one of them parked, one dead-lettered — and a
//! scrape of `/metrics` must hold each name (histograms by their `_bucket`,
//! `_sum`, `_count` series) with each label the expressions match or group
//! by. Its own test binary: one metrics recorder per process, and no other
//! relay in it to add to the process-wide series. It runs in the progress
//! mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command):
//! "published" is then "passed by its slot's position".

mod common;
mod deploy;

use std::time::{Duration, Instant};

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler, UnitOfWork};
use outbox_runtime::{Consumer, Relay, ops};
use sqlx::PgPool;

keyed_event!(Placed, "series-orders");
keyed_event!(Opened, "series-tickets");

/// A saga on the consumer: its stuck instances' gauge is emitted.
mod ticket {
    use outbox::{BoxError, SagaContext};
    use serde::{Deserialize, Serialize};

    use super::Opened;

    pub const TIMEOUTS: &str = "series-ticket-timeouts";

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub enum Stage {
        Open,
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct Ticket {
        pub key: String,
        pub stage: Stage,
    }

    #[outbox::saga(name = "series-ticket", timeouts = "series-ticket-timeouts", stage = Stage)]
    impl Ticket {
        #[init]
        fn begin(e: &Opened) -> Self {
            Ticket {
                key: e.key.clone(),
                stage: Stage::Open,
            }
        }

        #[step(start, correlate = key)]
        async fn opened(ctx: &mut SagaContext<Self>, _e: Opened) -> Result<Stage, BoxError> {
            ctx.complete();
            Ok(Stage::Open)
        }
    }
}

/// Fails the events of key `bad` (dead-lettered), applies the others.
struct FailBad;

impl InboxHandler for FailBad {
    type Event = Placed;
    const NAME: &'static str = "fail-bad";

    fn handle<'a, 'c>(&'a self, _: &'a mut HandlerContext<'c>, event: Placed) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            if event.key == "bad" {
                return Err("this key always fails".into());
            }
            Ok(())
        })
    }
}

/// The value of the first sample of `name` whose labels contain all of
/// `labels` (`key="value"`).
fn value(body: &str, name: &str, labels: &[&str]) -> Option<f64> {
    body.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (set, v) = match rest.strip_prefix('{') {
            Some(r) => r.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        labels
            .iter()
            .all(|l| set.contains(l))
            .then(|| v.trim().parse().ok())?
    })
}

/// Everything the rules and the dashboard use that `body` lacks, by
/// where it is used.
fn missing(body: &str) -> Vec<String> {
    let scrape = deploy::Scrape::parse(body);
    let mut missing = Vec::new();
    for rule in deploy::rules() {
        // The progress mode's series: checked in `progress_lag.rs`.
        if deploy::PROGRESS_SERIES
            .iter()
            .any(|s| rule.expr.contains(s))
        {
            continue;
        }
        for m in scrape.missing(&rule.expr) {
            missing.push(format!("alert {}: {m}", rule.alert));
        }
    }
    for (place, query) in deploy::dashboard_queries() {
        for m in scrape.missing(&query) {
            missing.push(format!("dashboard {place}: {m}"));
        }
    }
    missing
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_alerts_and_the_dashboard_use_only_series_the_code_emits(pool: PgPool) {
    relay_mode(&pool).await;
    init_tracing();
    let server = outbox_runtime::metrics::serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    let prefix = format!("{}.", unique_topic("series"));
    let topic = format!("{prefix}{}", Placed::TOPIC);
    create_topic(&brokers(), &topic).await;
    for t in [Opened::TOPIC, ticket::TIMEOUTS] {
        create_topic(&brokers(), &format!("{prefix}{t}")).await;
    }

    // 20 events on four keys, one too large for the producer (parked), one
    // its handler fails (dead-lettered).
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    for seq in 0..20 {
        uow.record_message(message(Placed::TOPIC, &format!("k{}", seq % 4), seq));
    }
    let mut poison = message(Placed::TOPIC, "poison", 0);
    poison.payload =
        serde_json::json!({ "key": "poison", "seq": 0, "blob": "x".repeat(300_000) }).to_string();
    uow.record_message(poison);
    uow.record_message(message(Placed::TOPIC, "bad", 0));
    uow.commit().await.unwrap();

    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .topic_prefix(&prefix)
        .kafka_setting("message.max.bytes", "100000")
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(100), Duration::from_millis(200))
        .spawn()
        .unwrap();
    let group = unique_topic("series-group");
    let consumer = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(brokers())
        .topic_prefix(&prefix)
        .handler(FailBad)
        .saga::<ticket::Ticket>()
        .saga_stuck_after(Duration::from_secs(60))
        .max_attempts(1)
        .spawn()
        .unwrap();

    let g = format!("group=\"{group}\"");
    let deadline = Instant::now() + Duration::from_secs(60);
    let (body, missing) = loop {
        let status = ops::status(&pool).await.unwrap();
        let counts = consumer.counts();
        let body = scrape(addr).await;
        let missing = missing(&body);
        let settled = status.unpublished == 0
            && status.parked == 1
            && counts.processed == 20
            && counts.dead_lettered == 1
            // The gauges sampled every 5 s and the lag show it too.
            && value(&body, "outbox_parked_events", &[]) == Some(1.0)
            && value(&body, "outbox_backlog_events", &[]) == Some(0.0)
            && value(&body, "outbox_dead_letters", &[&g]) == Some(1.0)
            && value(&body, "outbox_consumer_lag", &[&g]).is_some()
            // The poison's failed rounds end once nothing is left to publish.
            && value(&body, "outbox_relay_consecutive_failures", &[]) == Some(0.0);
        if (settled && missing.is_empty()) || Instant::now() > deadline {
            break (body, missing);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        missing.is_empty(),
        "used by the rules or the dashboard but not emitted:\n  {}\n\nthe scrape:\n{body}",
        missing.join("\n  ")
    );
    assert_eq!(
        value(&body, "outbox_parked_events", &[]),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        value(&body, "outbox_dead_letters", &[&g]),
        Some(1.0),
        "{body}"
    );
    assert_eq!(value(&body, "outbox_relay_up", &[]), Some(1.0), "{body}");
    assert_eq!(
        value(&body, "outbox_consumer_up", &[&g]),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        value(&body, "outbox_relay_consecutive_failures", &[]),
        Some(0.0),
        "{body}"
    );
    assert!(value(&body, "outbox_relay_failed_total", &[]).unwrap() >= 2.0);

    // Stuck instances of the saga: running, no step for over a minute, no
    // timeout still to come. Not one waiting for its timeout, due in an
    // hour; not a completed one; not one that just moved.
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let due = sqlx::types::chrono::Utc::now() + Duration::from_secs(3600);
    let timeout = uow.record_message_at(due, message(ticket::TIMEOUTS, "t-2", 0));
    uow.commit().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_saga (saga_type, saga_id, state, stage, version, timeouts, updated_at,
                                  completed_at)
         VALUES ('series-ticket', 't-1', '{}', 'Open', 1, '{}', now() - interval '2 hours', NULL),
                ('series-ticket', 't-2', '{}', 'Open', 1, jsonb_build_object('close', $1::text),
                 now() - interval '2 hours', NULL),
                ('series-ticket', 't-3', '{}', 'Open', 2, '{}', now() - interval '2 hours', now()),
                ('series-ticket', 't-4', '{}', 'Open', 1, '{}', now(), NULL)",
    )
    .bind(timeout.to_string())
    .execute(&pool)
    .await
    .unwrap();
    let saga = "saga=\"series-ticket\"";
    assert!(
        eventually(Duration::from_secs(20), || async {
            value(&scrape(addr).await, "outbox_sagas_stuck", &[saga]) == Some(1.0)
        })
        .await,
        "{}",
        scrape(addr).await
    );

    // A stopped relay and consumer show as such (what OutboxRelayDown and
    // OutboxConsumerDown look for).
    relay.shutdown().await.unwrap();
    consumer.shutdown().await.unwrap();
    let body = scrape(addr).await;
    assert_eq!(value(&body, "outbox_relay_up", &[]), Some(0.0), "{body}");
    assert_eq!(
        value(&body, "outbox_consumer_up", &[&g]),
        Some(0.0),
        "{body}"
    );
}

/// The check itself: a series name or a label the scrape does not have is
/// reported, wherever the expression uses it.
#[test]
fn the_check_reports_what_a_scrape_lacks() {
    let body = "\
# TYPE outbox_relay_published_total counter
outbox_relay_published_total 3
outbox_backlog_events 0
outbox_consumer_lag{group=\"g\",topic=\"t\",partition=\"0\"} 5
outbox_relay_batch_duration_seconds_bucket{le=\"0.1\"} 1
outbox_relay_batch_duration_seconds_sum 0.05
outbox_relay_batch_duration_seconds_count 1
";
    let scrape = deploy::Scrape::parse(body);
    let ok = [
        "rate(outbox_relay_published_total{job=~\"$job\"}[5m]) > 0",
        "sum by (group, topic) (max by (group, topic, partition) (outbox_consumer_lag)) > 1000",
        "histogram_quantile(0.99, sum by (job, le) (rate(outbox_relay_batch_duration_seconds_bucket[5m])))",
        "rate(outbox_relay_batch_duration_seconds_sum[5m]) / rate(outbox_relay_batch_duration_seconds_count[5m])",
        "label_values(outbox_consumer_lag{job=~\"$job\"}, topic)",
        "query_result(count by (job) ({__name__=~\"outbox_backlog_events|outbox_consumer_lag\"}))",
    ];
    for expr in ok {
        assert_eq!(scrape.missing(expr), Vec::<String>::new(), "{expr}");
    }
    let wrong = [
        (
            "rate(outbox_relay_publishd_total[5m])",
            "series outbox_relay_publishd_total",
        ),
        // A histogram is stored as its _bucket, _sum and _count series.
        (
            "outbox_relay_batch_duration_seconds > 1",
            "series outbox_relay_batch_duration_seconds",
        ),
        (
            "outbox_backlog_events{group=\"g\"}",
            "label group on outbox_backlog_events",
        ),
        (
            "sum by (partition) (outbox_backlog_events)",
            "label partition (grouping)",
        ),
        (
            "label_values(outbox_backlog_events, topic)",
            "label topic (grouping)",
        ),
        (
            "{__name__=~\"outbox_backlog_events|outbox_relay_up\"}",
            "series outbox_relay_up",
        ),
    ];
    for (expr, expected) in wrong {
        let missing = scrape.missing(expr);
        assert!(
            missing.iter().any(|m| m.starts_with(expected)),
            "{expr}: {missing:?}"
        );
    }
}
