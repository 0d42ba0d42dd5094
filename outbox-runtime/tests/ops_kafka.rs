//! Operations with the broker: replay after the broker lost its data (a
//! private in-memory broker restarted empty), with a relay running and a
//! deduplicating consumer; and one trace from a command through the relay,
//! Kafka and a handler to its follow-up event. Each test runs in the
//! progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test
//! command): "published" is then "passed by its slot's position", and the
//! tests that publish rows by hand record such a position instead of
//! marking them.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::{
    DomainEvent, HandlerContext, HandlerFuture, Headers, InboxHandler, TraceParent, UnitOfWork,
};
use outbox_runtime::replay::{self, REPLAY_HEADER, ReplayFilter, ReplayOptions};
use outbox_runtime::{Consumer, Error, Relay};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

// Only on the test's private broker, or reset at the test's start.
keyed_event!(Placed, "ops-test-orders");

/// Applies each event's effect (a row per event id: applied twice, the
/// insert would fail on the primary key).
struct Project {
    calls: Arc<AtomicUsize>,
}

impl InboxHandler for Project {
    type Event = Placed;
    const NAME: &'static str = "project";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, e: Placed) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let id = ctx.incoming().event_id;
            sqlx::query("INSERT INTO projection (event_id, key, seq) VALUES ($1, $2, $3)")
                .bind(id)
                .bind(&e.key)
                .bind(e.seq as i64)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}

async fn commit_placed(pool: &PgPool, n: usize, keys: usize) -> Vec<Uuid> {
    let mut ids = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        let mut uow = UnitOfWork::begin(pool).await.unwrap();
        for seq in chunk {
            ids.push(uow.record(Placed {
                key: format!("order-{}", seq % keys),
                seq: *seq as u64,
            }));
        }
        uow.commit().await.unwrap();
    }
    ids
}

/// Makes every row published as a relay would: marks them (the default
/// mode), or records a position of every lane slot that passes them (the
/// progress mode, where rows are not written when published).
async fn publish_all_by_hand(pool: &PgPool) {
    if progress_mode() {
        record_position(pool).await;
    } else {
        sqlx::query("UPDATE outbox_event SET published_at = now()")
            .execute(pool)
            .await
            .unwrap();
    }
    assert_eq!(unpublished(pool).await, 0);
}

fn relay(pool: &PgPool, brokers: &str) -> outbox_runtime::RelayHandle {
    Relay::builder(pool.clone())
        .brokers(brokers)
        .poll_interval(Duration::from_millis(50))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .spawn()
        .unwrap()
}

async fn projected(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM projection")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn replay_restores_every_event_after_the_broker_lost_its_data(pool: PgPool) {
    relay_mode(&pool).await;
    init_tracing();
    sqlx::query("CREATE TABLE projection (event_id uuid PRIMARY KEY, key text, seq bigint)")
        .execute(&pool)
        .await
        .unwrap();
    let port = free_port();
    let brokers = format!("127.0.0.1:{port}");
    let mut broker = PrivateBroker::start(port, port);
    create_topic(&brokers, Placed::TOPIC).await;

    // Published and consumed.
    let ids = commit_placed(&pool, 300, 12).await;
    let r = relay(&pool, &brokers);
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    r.shutdown().await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let consumer = |pool: &PgPool, brokers: &str| {
        Consumer::builder(pool.clone())
            .group("projection")
            .brokers(brokers)
            .handler(Project {
                calls: calls.clone(),
            })
            .spawn()
            .unwrap()
    };
    let c = consumer(&pool, &brokers);
    assert!(
        eventually(Duration::from_secs(60), || async {
            projected(&pool).await == 300
        })
        .await
    );
    c.shutdown().await.unwrap();

    // The broker loses everything: a fresh in-memory broker on the same port.
    drop(broker);
    broker = PrivateBroker::start(port, port);
    create_topic(&brokers, Placed::TOPIC).await;
    assert!(
        read_topic(&brokers, Placed::TOPIC, 1, Duration::from_secs(3))
            .await
            .is_empty(),
        "the new broker is empty"
    );

    // A dry run counts; nothing is sent.
    let all = ReplayFilter::default();
    assert_eq!(replay::count(&pool, &all).await.unwrap(), 300);
    let by_key = ReplayFilter {
        aggregate_id: Some("order-3".into()),
        ..ReplayFilter::default()
    };
    assert_eq!(replay::count(&pool, &by_key).await.unwrap(), 25);

    // Replay while a relay runs and new events are committed: the relay
    // publishes the new ones, the replay only the published ones.
    let r = relay(&pool, &brokers);
    let writer = {
        let pool = pool.clone();
        tokio::spawn(async move { commit_placed(&pool, 100, 5).await })
    };
    let mut options = ReplayOptions::new(brokers.clone(), all);
    options.batch_size = 64; // several pages
    let report = replay::replay(&pool, &options).await.unwrap();
    let new_ids = writer.await.unwrap();
    assert!(report.replayed >= 300, "{report:?}");
    assert!(wait_until_published(&pool, Duration::from_secs(60)).await);
    r.shutdown().await.unwrap();

    let received = read_topic(&brokers, Placed::TOPIC, 400, Duration::from_secs(60)).await;
    let mut expected = ids.clone();
    expected.extend(&new_ids);
    verify_all_arrived(&expected, &received);
    let replayed: Vec<&Received> = received
        .iter()
        .filter(|m| m.headers.get(REPLAY_HEADER) == Some(&report.replay_id.to_string()))
        .collect();
    // Every original event was replayed, with its own id, key and headers.
    let replayed_ids: std::collections::HashSet<Uuid> =
        replayed.iter().map(|m| m.event_id()).collect();
    assert!(ids.iter().all(|id| replayed_ids.contains(id)));
    assert!(
        replayed
            .iter()
            .all(|m| m.headers.contains_key("correlation_id")
                && m.headers.contains_key("traceparent")
                && m.key.starts_with("order-")),
        "original headers and keys"
    );
    // In outbox id order per key (the replay sends pages in id order).
    let outbox_ids: std::collections::HashMap<Uuid, i64> =
        sqlx::query_as::<_, (Uuid, i64)>("SELECT event_id, id FROM outbox_event")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let mut last: std::collections::HashMap<&str, i64> = Default::default();
    for m in &replayed {
        let id = outbox_ids[&m.event_id()];
        if let Some(prev) = last.insert(m.key.as_str(), id) {
            assert!(prev < id, "key {} out of order", m.key);
        }
    }

    // The consumer (its offsets were lost with the broker) reads it all
    // again: the replayed events are duplicates, the new ones are applied.
    let before = calls.load(Ordering::SeqCst);
    let c = consumer(&pool, &brokers);
    assert!(
        eventually(Duration::from_secs(60), || async {
            projected(&pool).await == 400
        })
        .await
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            c.counts().duplicates >= 300
        })
        .await,
        "{:?}",
        c.counts()
    );
    c.shutdown().await.unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst) - before,
        100,
        "only the new events' handlers ran"
    );
    // The replay changed no row: every row is published as the relay left
    // it, marked (the default mode) or passed by the positions, none
    // written (the progress mode).
    assert_eq!(unpublished(&pool).await, 0);
    let marked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    let expected = if progress_mode() { 0 } else { 400 };
    assert_eq!(marked, expected, "the replay changed no row");
    drop(broker);
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_replay_that_cannot_deliver_stops_and_names_where_to_resume(pool: PgPool) {
    relay_mode(&pool).await;
    let ids = commit_placed(&pool, 10, 2).await;
    publish_all_by_hand(&pool).await;
    let first: i64 = sqlx::query_scalar("SELECT min(id) FROM outbox_event")
        .fetch_one(&pool)
        .await
        .unwrap();
    // A topic that does not exist on the broker (it does not auto-create).
    let mut options = ReplayOptions::new(brokers(), ReplayFilter::default());
    options.to_topic = Some(unique_topic("missing"));
    options.max_attempts = 2;
    options.delivery_timeout = Duration::from_secs(2);
    let error = replay::replay(&pool, &options).await.unwrap_err();
    match &error {
        Error::ReplayStopped {
            replayed,
            resume_from,
            reason,
        } => {
            assert_eq!(*replayed, 0);
            assert_eq!(*resume_from, first);
            assert!(!reason.is_empty());
        }
        other => panic!("expected ReplayStopped, got {other:?}"),
    }
    assert!(
        error.to_string().contains(&format!("--from-id {first}")),
        "{error}"
    );
    assert_eq!(ids.len(), 10);

    // Bad filters are refused before anything is sent.
    let mut bad = ReplayOptions::new(
        brokers(),
        ReplayFilter {
            from_id: Some(5),
            to_id: Some(4),
            ..ReplayFilter::default()
        },
    );
    assert!(matches!(
        replay::replay(&pool, &bad).await,
        Err(Error::Config(_))
    ));
    bad.filter = ReplayFilter::default();
    bad.to_topic = Some("no spaces".into());
    assert!(matches!(
        replay::replay(&pool, &bad).await,
        Err(Error::Config(_))
    ));
}

/// After a failed delivery, a replay holds back the later events of that
/// key: they are sent only once the failed one is delivered. Key `k`'s first
/// event goes to a topic the broker does not have; its second, to a topic
/// that exists, must not be sent before it (the other key's event is). Once
/// the topic exists, a replay from the id it names delivers both.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_replay_holds_back_a_keys_later_events_after_a_failed_delivery(pool: PgPool) {
    relay_mode(&pool).await;
    let (missing, present) = (
        unique_topic("replay-missing"),
        unique_topic("replay-present"),
    );
    create_topic(&brokers(), &present).await;
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    let first = uow.record_message(message(&missing, "k", 0));
    let second = uow.record_message(message(&present, "k", 1));
    let other = uow.record_message(message(&present, "other", 0));
    uow.commit().await.unwrap();
    publish_all_by_hand(&pool).await;
    let first_id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event WHERE event_id = $1")
        .bind(first)
        .fetch_one(&pool)
        .await
        .unwrap();

    let mut options = ReplayOptions::new(brokers(), ReplayFilter::default());
    options.max_attempts = 2;
    options.delivery_timeout = Duration::from_secs(2);
    match replay::replay(&pool, &options).await {
        Err(Error::ReplayStopped {
            replayed,
            resume_from,
            ..
        }) => {
            assert_eq!(replayed, 1, "only the other key's event");
            assert_eq!(resume_from, first_id);
        }
        other => panic!("expected the replay to stop, got {other:?}"),
    }
    let sent: Vec<Uuid> = read_all(&brokers(), &present, Duration::from_secs(30))
        .await
        .iter()
        .map(|m| m.event_id())
        .collect();
    assert_eq!(
        sent,
        vec![other],
        "k's second event was held back behind its failed first one"
    );

    create_topic(&brokers(), &missing).await;
    options.filter.from_id = Some(first_id);
    let report = replay::replay(&pool, &options).await.unwrap();
    assert_eq!(report.replayed, 3);
    let on_missing: Vec<Uuid> = read_all(&brokers(), &missing, Duration::from_secs(30))
        .await
        .iter()
        .map(|m| m.event_id())
        .collect();
    assert_eq!(on_missing, vec![first]);
    let on_present: Vec<Uuid> = read_all(&brokers(), &present, Duration::from_secs(30))
        .await
        .iter()
        .map(|m| m.event_id())
        .collect();
    assert!(on_present.contains(&second), "{on_present:?}");
}

/// Events published longer ago than the consumers' dedup window may have
/// lost their dedup rows: replayed, they would be applied again. A replay
/// that selects any is refused (nothing sent) unless forced, or unless the
/// dedup window is declared longer.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_replay_beyond_the_dedup_window_is_refused_without_force(pool: PgPool) {
    relay_mode(&pool).await;
    let topic = unique_topic("replay-window");
    create_topic(&brokers(), &topic).await;
    let committed = commit_messages(&pool, &topic, 10, 2, 5).await;
    // Published 8 days or an hour ago: in the progress mode a row has no
    // time of its own, its creation stands for its publication.
    let published_at = if progress_mode() {
        ""
    } else {
        "published_at = now() - age, "
    };
    sqlx::query(&format!(
        "UPDATE outbox_event SET {published_at}created_at = now() - age - interval '1 s'
         FROM (SELECT id AS row, CASE WHEN id % 2 = 0 THEN interval '8 days'
                                      ELSE interval '1 hour' END AS age
               FROM outbox_event) AS a
         WHERE id = a.row",
    ))
    .execute(&pool)
    .await
    .unwrap();
    if progress_mode() {
        publish_all_by_hand(&pool).await;
    }
    assert_eq!(unpublished(&pool).await, 0);
    let old: (i64, i64) = sqlx::query_as(
        "SELECT count(*), min(id) FROM outbox_event
         WHERE coalesce(published_at, created_at) < now() - interval '7 days'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(old.0, 5);

    let options = ReplayOptions::new(brokers(), ReplayFilter::default());
    match replay::replay(&pool, &options).await {
        Err(Error::Config(message)) => {
            assert!(message.contains("5 of the 10 events"), "{message}");
            assert!(
                message.contains(&format!("outbox id {}", old.1)),
                "{message}"
            );
            assert!(message.contains("dedup window 7d"), "{message}");
            assert!(message.contains("--force"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // (The same through the command: the `outbox-cli` package's tests.)
    assert!(
        read_all(&brokers(), &topic, Duration::from_secs(30))
            .await
            .is_empty(),
        "a refused replay sends nothing"
    );

    // Within the window: the recent half alone is replayed.
    let recent = ReplayOptions::new(
        brokers(),
        ReplayFilter {
            from_id: Some(old.1 + 1),
            to_id: Some(old.1 + 1),
            ..ReplayFilter::default()
        },
    );
    assert_eq!(replay::replay(&pool, &recent).await.unwrap().replayed, 1);
    // A longer declared window, or --force, lets the rest through.
    let mut longer = ReplayOptions::new(brokers(), ReplayFilter::default());
    longer.dedup_window = Duration::from_secs(30 * 86_400);
    assert_eq!(replay::replay(&pool, &longer).await.unwrap().replayed, 10);
    let mut forced = ReplayOptions::new(brokers(), ReplayFilter::default());
    forced.force = true;
    assert_eq!(replay::replay(&pool, &forced).await.unwrap().replayed, 10);
    let received = read_all(&brokers(), &topic, Duration::from_secs(30)).await;
    assert_eq!(received.len(), 21);
    assert_eq!(committed.len(), 10);
}

/// Every id arrived (duplicates allowed), nothing else.
fn verify_all_arrived(expected: &[Uuid], received: &[Received]) {
    let want: std::collections::HashSet<Uuid> = expected.iter().copied().collect();
    let got: std::collections::HashSet<Uuid> = received.iter().map(|m| m.event_id()).collect();
    assert!(got.is_subset(&want), "phantom events");
    assert_eq!(got.len(), want.len(), "events missing");
}

// ---- Tracing ----------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TraceOrder {
    order: String,
}

impl DomainEvent for TraceOrder {
    const TOPIC: &'static str = "ops-test-trace-orders";
    const AGGREGATE_TYPE: &'static str = "Order";
    const EVENT_TYPES: &'static [&'static str] = &["OrderPlaced"];
    fn event_type(&self) -> &'static str {
        "OrderPlaced"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.order.clone()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PaymentRequested {
    order: String,
}

impl DomainEvent for PaymentRequested {
    const TOPIC: &'static str = "ops-test-trace-payments";
    const AGGREGATE_TYPE: &'static str = "Payment";
    const EVENT_TYPES: &'static [&'static str] = &["PaymentRequested"];
    fn event_type(&self) -> &'static str {
        "PaymentRequested"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.order.clone()
    }
}

struct RequestPayment;

impl InboxHandler for RequestPayment {
    type Event = TraceOrder;
    const NAME: &'static str = "request_payment";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, e: TraceOrder) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            ctx.record(PaymentRequested { order: e.order });
            Ok(())
        })
    }
}

/// A span's name and fields.
type SpanRecord = (String, std::collections::HashMap<String, String>);

/// Records the fields of every span created (on this thread).
#[derive(Clone, Default)]
struct Spans(Arc<std::sync::Mutex<Vec<SpanRecord>>>);

struct Fields(std::collections::HashMap<String, String>);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Spans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = Fields(Default::default());
        attrs.record(&mut fields);
        self.0
            .lock()
            .unwrap()
            .push((attrs.metadata().name().to_owned(), fields.0));
    }
}

async fn headers_of(pool: &PgPool, event_type: &str) -> Vec<(Uuid, Headers)> {
    let rows: Vec<(Uuid, sqlx::types::Json<Headers>)> = sqlx::query_as(
        "SELECT event_id, headers FROM outbox_event WHERE event_type = $1 ORDER BY id",
    )
    .bind(event_type)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter().map(|(id, h)| (id, h.0)).collect()
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn one_trace_from_the_command_to_the_follow_up_event(pool: PgPool) {
    relay_mode(&pool).await;
    use tracing_subscriber::layer::SubscriberExt;
    let spans = Spans::default();
    // The test's runtime runs every task on this thread.
    let _subscriber =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    reset_topic(&brokers(), TraceOrder::TOPIC).await;
    reset_topic(&brokers(), PaymentRequested::TOPIC).await;

    // A command that starts its own trace, and one that continues the
    // caller's (e.g. an HTTP request's).
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    uow.record(TraceOrder {
        order: "o-1".into(),
    });
    uow.commit().await.unwrap();
    let caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    assert!(uow.set_trace_context("not a traceparent", None).is_err());
    uow.set_trace_context(caller, Some("vendor=1")).unwrap();
    uow.record(TraceOrder {
        order: "o-2".into(),
    });
    uow.commit().await.unwrap();

    let originals = headers_of(&pool, "OrderPlaced").await;
    assert_eq!(originals.len(), 2);
    let started: TraceParent = originals[0]
        .1
        .traceparent
        .as_deref()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(originals[1].1.traceparent.as_deref(), Some(caller));
    assert_eq!(originals[1].1.tracestate.as_deref(), Some("vendor=1"));

    let r = relay(&pool, &brokers());
    let group = unique_topic("trace");
    let c = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(brokers())
        .handler(RequestPayment)
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(60), || async {
            headers_of(&pool, "PaymentRequested").await.len() == 2
        })
        .await,
        "{:?}",
        c.counts()
    );
    c.shutdown().await.unwrap();
    r.shutdown().await.unwrap();

    let follow_ups = headers_of(&pool, "PaymentRequested").await;
    for (original_id, original) in &originals {
        let sent: TraceParent = original.traceparent.as_deref().unwrap().parse().unwrap();
        let (_, follow) = follow_ups
            .iter()
            .find(|(_, h)| h.causation_id == Some(*original_id))
            .expect("a follow-up caused by each original");
        let next: TraceParent = follow.traceparent.as_deref().unwrap().parse().unwrap();
        assert_eq!(next.trace_id(), sent.trace_id(), "same trace");
        assert_ne!(next.parent_id(), sent.parent_id(), "a new parent span");
        assert_eq!(follow.correlation_id, original.correlation_id);
        assert_eq!(follow.tracestate, original.tracestate);
        // The handling ran in a span of that trace.
        let recorded = spans.0.lock().unwrap();
        let span = recorded
            .iter()
            .find(|(name, f)| {
                name == "handle_event"
                    && f.get("event_id").map(String::as_str) == Some(&original_id.to_string())
            })
            .map(|(_, f)| f.clone())
            .expect("a handle_event span per handled event");
        assert_eq!(span["trace_id"], sent.trace_id());
        assert_eq!(span["event_type"], "OrderPlaced");
    }
    assert_ne!(started.trace_id(), "0af7651916cd43dd8448eb211c80319c");
}
