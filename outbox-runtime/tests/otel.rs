//! OpenTelemetry end to end (feature `otel`, which this package's tests
//! enable): spans go to the SDK's in-memory exporter through the
//! `tracing-opentelemetry` layer, installed once for the whole file; each
//! test finds its own spans by trace id or span id.
//!
//! A command's span → the Unit of Work's `outbox.commit` → (the relay's
//! `outbox.relay.batch`, linked) → the consumer's `handle_event` (dedup
//! mode) → its follow-up event → (relay) → the next consumer's
//! `handle_event` (inbox mode): one trace, each a child of the one before.
//! Also the rows' `traceparent` with and without an OpenTelemetry layer,
//! and the cap on a batch span's links. The tests with a relay run in the
//! progress mode too (`OUTBOX_TEST_RELAY_MODE=progress`, in the test
//! command): "published" is then "passed by its slot's position" (see
//! `common::unpublished`).

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use common::*;
use opentelemetry::trace::{SpanContext, SpanId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_core::{
    CommandFuture, CommandHandler, DomainEvent, HandlerContext, HandlerFuture, InboxHandler,
    TraceParent, UnitOfWork,
};
use outbox_runtime::{Consumer, Mode, Relay};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tracing::Instrument;
use tracing::instrument::WithSubscriber;
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;

/// The in-memory exporter behind the global subscriber of this file.
fn exporter() -> &'static InMemorySpanExporter {
    static INSTALLED: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    &INSTALLED
        .get_or_init(|| {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let subscriber = tracing_subscriber::registry()
                .with(tracing_subscriber::filter::LevelFilter::INFO)
                .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("otel-test")));
            tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
            (exporter, provider)
        })
        .0
}

fn finished() -> Vec<SpanData> {
    exporter().get_finished_spans().expect("finished spans")
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

fn hex_trace(span: &SpanData) -> String {
    span.span_context.trace_id().to_string()
}

fn hex_span(span: &SpanData) -> String {
    span.span_context.span_id().to_string()
}

/// The `traceparent` the outbox row of `event_id` carries.
async fn row_trace(pool: &PgPool, event_id: Uuid) -> TraceParent {
    let value: String =
        sqlx::query_scalar("SELECT headers->>'traceparent' FROM outbox_event WHERE event_id = $1")
            .bind(event_id)
            .fetch_one(pool)
            .await
            .expect("the row and its traceparent");
    value.parse().expect("a valid traceparent")
}

fn links_to(span: &SpanData, target: &TraceParent) -> bool {
    span.links.iter().any(|link| {
        let cx: &SpanContext = &link.span_context;
        cx.trace_id().to_string() == target.trace_id()
            && cx.span_id().to_string() == target.parent_id()
    })
}

macro_rules! event {
    ($name:ident, $topic:literal, $type:literal) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        struct $name {
            order_id: String,
        }

        impl DomainEvent for $name {
            const TOPIC: &'static str = $topic;
            const AGGREGATE_TYPE: &'static str = "Order";
            const EVENT_TYPES: &'static [&'static str] = &[$type];
            fn event_type(&self) -> &'static str {
                $type
            }
            fn event_version(&self) -> u32 {
                1
            }
            fn aggregate_id(&self) -> String {
                self.order_id.clone()
            }
        }
    };
}

event!(OrderPlaced, "otel.orders", "OrderPlaced");
event!(PaymentCaptured, "otel.payments", "PaymentCaptured");

/// The command: records `OrderPlaced`.
struct PlaceOrder;

impl CommandHandler for PlaceOrder {
    type Command = String;
    type Output = Uuid;
    type Error = outbox_core::Error;
    const NAME: &'static str = "place_order";

    fn handle<'a>(
        &'a self,
        uow: &'a mut UnitOfWork,
        order_id: String,
    ) -> CommandFuture<'a, Uuid, outbox_core::Error> {
        Box::pin(async move { Ok(uow.record(OrderPlaced { order_id })) })
    }
}

/// The first handler (dedup mode): records the follow-up `PaymentCaptured`.
struct Charge;

impl InboxHandler for Charge {
    type Event = OrderPlaced;
    const NAME: &'static str = "charge";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: OrderPlaced,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            ctx.record(PaymentCaptured {
                order_id: event.order_id,
            });
            Ok(())
        })
    }
}

/// The second handler (inbox mode): marks the order paid.
struct MarkPaid;

impl InboxHandler for MarkPaid {
    type Event = PaymentCaptured;
    const NAME: &'static str = "mark_paid";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: PaymentCaptured,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let event_id = ctx.incoming().event_id;
            sqlx::query("INSERT INTO paid (order_id, event_id) VALUES ($1, $2)")
                .bind(&event.order_id)
                .bind(event_id)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn one_trace_from_the_command_through_the_relay_to_the_second_handler(pool: PgPool) {
    relay_mode(&pool).await;
    exporter();
    sqlx::query("CREATE TABLE paid (order_id text PRIMARY KEY, event_id uuid NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let prefix = format!("{}-", unique_topic("otel"));
    for topic in [OrderPlaced::TOPIC, PaymentCaptured::TOPIC] {
        create_topic(&brokers(), &format!("{prefix}{topic}")).await;
    }
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .topic_prefix(&prefix)
        .spawn()
        .unwrap();
    let billing = Consumer::builder(pool.clone())
        .group(unique_topic("otel-billing"))
        .brokers(brokers())
        .topic_prefix(&prefix)
        .handler(Charge)
        .spawn()
        .unwrap();
    let orders = Consumer::builder(pool.clone())
        .group(unique_topic("otel-orders"))
        .brokers(brokers())
        .topic_prefix(&prefix)
        .mode(Mode::Inbox)
        .processor_poll_interval(Duration::from_millis(50))
        .handler(MarkPaid)
        .spawn()
        .unwrap();

    // The command runs inside the caller's span (an HTTP request's, say).
    let order_id = Uuid::new_v4().to_string();
    let request = tracing::info_span!("http_request", order_id = %order_id);
    let placed_id = outbox_core::execute(&pool, PlaceOrder, order_id.clone())
        .instrument(request.clone())
        .await
        .unwrap();
    let (request_cx, _) = TraceParent::of_span(&request).expect("an OpenTelemetry context");
    drop(request);
    let trace = request_cx.trace_id();

    let paid = eventually(Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, Uuid>("SELECT event_id FROM paid WHERE order_id = $1")
            .bind(&order_id)
            .fetch_optional(&pool)
            .await
            .unwrap()
            .is_some()
    })
    .await;
    assert!(paid, "the second handler ran");
    let captured_id: Uuid = sqlx::query_scalar("SELECT event_id FROM paid WHERE order_id = $1")
        .bind(&order_id)
        .fetch_one(&pool)
        .await
        .unwrap();

    // The rows carry the commit span's and the first handler's contexts.
    let placed_cx = row_trace(&pool, placed_id).await;
    let captured_cx = row_trace(&pool, captured_id).await;
    assert_eq!(placed_cx.trace_id(), trace, "the command's trace");
    assert_eq!(captured_cx.trace_id(), trace, "the follow-up continues it");

    // Every span ends: the handlers' at once, the relay's batches once
    // their deliveries are evaluated.
    let named = |spans: &[SpanData], name: &str, event: Uuid| -> Option<SpanData> {
        spans
            .iter()
            .find(|s| s.name == name && attribute(s, "event_id") == Some(event.to_string()))
            .cloned()
    };
    let mut spans = Vec::new();
    let complete = eventually(Duration::from_secs(30), || {
        spans = finished();
        let batches = spans
            .iter()
            .filter(|s| s.name == "outbox.relay.batch")
            .collect::<Vec<_>>();
        let done = named(&spans, "handle_event", placed_id).is_some()
            && named(&spans, "handle_event", captured_id).is_some()
            && batches.iter().any(|b| links_to(b, &placed_cx))
            && batches.iter().any(|b| links_to(b, &captured_cx));
        async move { done }
    })
    .await;
    assert!(complete, "all spans exported");
    relay.shutdown().await.unwrap();
    billing.shutdown().await.unwrap();
    orders.shutdown().await.unwrap();

    let of_trace = |name: &str| -> Vec<&SpanData> {
        spans
            .iter()
            .filter(|s| s.name == name && hex_trace(s) == trace)
            .collect()
    };
    let request = of_trace("http_request");
    let command = of_trace("command");
    let commit = of_trace("outbox.commit");
    assert_eq!((request.len(), command.len(), commit.len()), (1, 1, 1));
    let (request, command, commit) = (request[0], command[0], commit[0]);
    let first = named(&spans, "handle_event", placed_id).unwrap();
    let second = named(&spans, "handle_event", captured_id).unwrap();

    // command → commit → first handler → second handler, one trace.
    assert_eq!(hex_span(request), request_cx.parent_id());
    assert_eq!(command.parent_span_id, request.span_context.span_id());
    assert_eq!(
        attribute(command, "command").as_deref(),
        Some("place_order")
    );
    assert_eq!(attribute(command, "trace_id"), Some(trace.clone()));
    assert_eq!(commit.parent_span_id, command.span_context.span_id());
    assert_eq!(
        hex_span(commit),
        placed_cx.parent_id(),
        "the row carries the commit span"
    );
    for handler in [&first, &second] {
        assert_eq!(hex_trace(handler), trace);
        assert!(
            handler.parent_span_is_remote,
            "parent from the traceparent header"
        );
    }
    assert_eq!(first.parent_span_id, commit.span_context.span_id());
    assert_eq!(
        attribute(&first, "event_type").as_deref(),
        Some("OrderPlaced")
    );
    assert_eq!(
        hex_span(&first),
        captured_cx.parent_id(),
        "the follow-up carries the handler span"
    );
    assert_eq!(second.parent_span_id, first.span_context.span_id());
    assert_eq!(
        attribute(&second, "event_type").as_deref(),
        Some("PaymentCaptured")
    );

    // Each event's batch is a root span of its own, linked to the event's context.
    for target in [&placed_cx, &captured_cx] {
        let batch = spans
            .iter()
            .find(|s| s.name == "outbox.relay.batch" && links_to(s, target))
            .unwrap();
        assert_eq!(batch.parent_span_id, SpanId::INVALID, "a root");
        assert_ne!(hex_trace(batch), trace);
        assert_eq!(batch.links.dropped_count, 0);
        assert!(attribute(batch, "links").is_some());
        assert_eq!(attribute(batch, "links_dropped").as_deref(), Some("0"));
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_rows_carry_the_commit_span_a_child_of_the_current_span(pool: PgPool) {
    exporter();
    let span = tracing::info_span!("import_orders");
    let (event_id, at_begin) = async {
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        let at_begin = uow.trace_context().unwrap();
        let id = uow.record_message(message("otel.db", "k1", 0));
        uow.commit().await.unwrap();
        (id, at_begin)
    }
    .instrument(span.clone())
    .await;
    let (span_cx, _) = TraceParent::of_span(&span).unwrap();
    drop(span);

    let row = row_trace(&pool, event_id).await;
    assert_eq!(at_begin, span_cx, "begin takes the current span's context");
    assert_eq!(row.trace_id(), span_cx.trace_id());
    assert_ne!(
        row.parent_id(),
        span_cx.parent_id(),
        "the commit span's own id"
    );
    let spans = finished();
    let commit = spans
        .iter()
        .find(|s| s.name == "outbox.commit" && hex_span(s) == row.parent_id())
        .expect("the commit span the row names");
    assert_eq!(commit.parent_span_id.to_string(), span_cx.parent_id());
    assert!(!commit.parent_span_is_remote);
    assert_eq!(attribute(commit, "events").as_deref(), Some("1"));
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_trace_context_the_application_sets_wins_over_the_span(pool: PgPool) {
    exporter();
    let given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let event_id = async {
        let mut uow = UnitOfWork::begin(&pool).await.unwrap();
        uow.set_trace_context(given, Some("rojo=00f067aa0ba902b7"))
            .unwrap();
        let id = uow.record_message(message("otel.db", "k1", 0));
        uow.commit().await.unwrap();
        id
    }
    .instrument(tracing::info_span!("forwarding"))
    .await;
    assert_eq!(row_trace(&pool, event_id).await.to_string(), given);
    let state: Option<String> =
        sqlx::query_scalar("SELECT headers->>'tracestate' FROM outbox_event WHERE event_id = $1")
            .bind(event_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state.as_deref(), Some("rojo=00f067aa0ba902b7"));
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn without_an_opentelemetry_layer_the_unit_of_work_starts_its_own_trace(pool: PgPool) {
    exporter();
    // Spans are enabled (a registry) but nothing gives them an
    // OpenTelemetry context.
    let (event_id, own) = async {
        let span = tracing::info_span!("no_layer");
        async {
            let mut uow = UnitOfWork::begin(&pool).await.unwrap();
            let own = uow.trace_context().unwrap();
            let id = uow.record_message(message("otel.db", "k1", 0));
            uow.commit().await.unwrap();
            (id, own)
        }
        .instrument(span)
        .await
    }
    .with_subscriber(tracing_subscriber::registry())
    .await;
    assert_eq!(row_trace(&pool, event_id).await, own);
    assert!(
        finished().iter().all(|s| hex_trace(s) != own.trace_id()),
        "nothing exported for it"
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_batch_span_links_at_most_128_contexts_and_counts_the_rest(pool: PgPool) {
    relay_mode(&pool).await;
    exporter();
    let topic = unique_topic("otel-links");
    create_topic(&brokers(), &topic).await;
    // One commit, one key (one lane): the relay claims the 300 rows as one
    // batch. Each row carries a trace context of its own.
    let mut contexts = Vec::new();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    for seq in 0..300 {
        let mut m = message(&topic, "one-key", seq);
        let cx = TraceParent::new_root();
        m.headers.traceparent = Some(cx.to_string());
        contexts.push(cx);
        uow.record_message(m);
    }
    uow.commit().await.unwrap();
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .spawn()
        .unwrap();
    let linked_to_ours = |s: &SpanData| contexts.iter().any(|cx| links_to(s, cx));
    let mut batch = None;
    assert!(
        eventually(Duration::from_secs(30), || {
            batch = finished()
                .into_iter()
                .find(|s| s.name == "outbox.relay.batch" && linked_to_ours(s));
            let found = batch.is_some();
            async move { found }
        })
        .await,
        "the batch span exported"
    );
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();
    let batch = batch.unwrap();
    assert_eq!(attribute(&batch, "rows").as_deref(), Some("300"));
    assert_eq!(attribute(&batch, "sent").as_deref(), Some("300"));
    assert_eq!(attribute(&batch, "published").as_deref(), Some("300"));
    assert_eq!(batch.links.len(), 128);
    assert_eq!(attribute(&batch, "links").as_deref(), Some("128"));
    assert_eq!(attribute(&batch, "links_dropped").as_deref(), Some("172"));
    assert!(batch.links.iter().all(|l| contexts.iter().any(|cx| {
        l.span_context.span_id().to_string() == cx.parent_id()
            && l.span_context.trace_id().to_string() == cx.trace_id()
    })));
}
