//! The canary, in the library: a relay and a consumer run with a canary
//! value in every secret Kafka setting and a canary database password, with
//! debug logging (ours and librdkafka's) captured; `Debug` of every
//! configuration, builder and handle, the errors and their chains, and the
//! logs never show it.
//! The relays run in the relay mode the test command asks for
//! (`OUTBOX_TEST_RELAY_MODE=progress`: the progress mode).

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::replay::{ReplayFilter, ReplayOptions};
use outbox_runtime::settings::{KafkaSettings, Settings};
use outbox_runtime::{Consumer, Relay};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const SECRET_KEYS: &[&str] = &[
    "sasl.username",
    "sasl.password",
    "sasl.oauthbearer.config",
    "ssl.key.password",
    "ssl.keystore.password",
];

/// Everything logged in this test binary.
static LOGS: std::sync::LazyLock<Arc<Mutex<Vec<u8>>>> =
    std::sync::LazyLock::new(|| Arc::new(Mutex::new(Vec::new())));

struct Capture;

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_debug_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("debug"))
        .with_writer(|| Capture)
        .with_ansi(false)
        .try_init();
}

fn logs() -> String {
    String::from_utf8_lossy(&LOGS.lock().unwrap()).into_owned()
}

fn canary() -> String {
    format!("CANARY{}", uuid::Uuid::new_v4().simple())
}

/// Kafka settings with the canary in every secret, from the environment
/// the way a service reads it, and librdkafka's debug output on.
fn secret_settings(word: &str) -> KafkaSettings {
    let mut vars: Vec<(String, String)> = SECRET_KEYS
        .iter()
        .map(|key| {
            (
                format!("OUTBOX_KAFKA_{}", key.to_uppercase().replace('.', "_")),
                format!("{word}-{key}"),
            )
        })
        .collect();
    vars.push(("KAFKA_BROKERS".into(), brokers()));
    vars.push(("OUTBOX_KAFKA_DEBUG".into(), "conf,security,broker".into()));
    Settings::from_vars(vars).unwrap().kafka
}

/// The test pool's database with a canary password (trust authentication
/// ignores it).
fn pool_with_password(pool: &PgPool, word: &str) -> PgPool {
    let options = (*pool.connect_options()).clone().password(word);
    PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(options)
}

/// Formats a value and an error with all its causes.
fn chain(error: &dyn std::error::Error) -> String {
    let mut out = format!("{error} / {error:?}");
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(&format!(" / {cause} / {cause:?}"));
        source = cause.source();
    }
    out
}

fn assert_hidden(word: &str, what: &str, text: &str) {
    assert!(!text.contains(word), "{what} shows a secret: {text}");
}

keyed_event!(CanaryEvent, "canary-lib");

struct Count(Arc<std::sync::atomic::AtomicUsize>);

impl InboxHandler for Count {
    type Event = CanaryEvent;
    const NAME: &'static str = "count";
    fn handle<'a, 'c>(
        &'a self,
        _ctx: &'a mut HandlerContext<'c>,
        _event: CanaryEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn relay_and_consumer_never_show_a_secret(pool: PgPool) {
    capture_debug_logs();
    let word = canary();
    let kafka = secret_settings(&word);
    assert_hidden(&word, "KafkaSettings", &format!("{kafka:?}"));
    let mut settings = Settings::default();
    settings.kafka = kafka.clone();
    settings.database.url = Some(format!("postgres://u:{word}@h/d"));
    assert_hidden(&word, "Settings", &format!("{settings:?}"));
    assert_hidden(
        &word,
        "Settings::entries",
        &format!("{:?}", settings.entries()),
    );
    let db = pool_with_password(&pool, &word);
    relay_mode(&pool).await;

    // The relay publishes through it.
    let topic = CanaryEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    commit_messages(&pool, topic, 10, 2, 10).await;
    let builder = Relay::builder(db.clone()).kafka(&kafka);
    assert_hidden(&word, "RelayBuilder", &format!("{builder:?}"));
    let relay = builder.build().unwrap();
    assert_hidden(&word, "Relay", &format!("{relay:?}"));
    let relay = relay.spawn();
    assert_hidden(&word, "RelayHandle", &format!("{relay:?}"));
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();

    // The consumer applies the events.
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let builder = Consumer::builder(db.clone())
        .group(unique_topic("canary"))
        .kafka(&kafka)
        .handler(Count(count.clone()));
    assert_hidden(&word, "ConsumerBuilder", &format!("{builder:?}"));
    let consumer = builder.build().unwrap();
    assert_hidden(&word, "Consumer", &format!("{consumer:?}"));
    assert_hidden(&word, "ConsumerConfig", &format!("{:?}", consumer.config()));
    let consumer = consumer.spawn();
    assert_hidden(&word, "ConsumerHandle", &format!("{consumer:?}"));
    assert!(
        eventually(Duration::from_secs(30), || async {
            count.load(std::sync::atomic::Ordering::SeqCst) == 10
        })
        .await
    );
    consumer.shutdown().await.unwrap();

    let options = ReplayOptions::new(brokers(), ReplayFilter::default()).kafka(&kafka);
    assert_hidden(&word, "ReplayOptions", &format!("{options:?}"));

    // Clients that cannot be created (a key that is no key): the errors and
    // their chains.
    let mut broken = kafka.clone();
    broken.set("security.protocol", "SSL");
    broken.set(
        "ssl.key.pem",
        format!("-----BEGIN PRIVATE KEY-----\n{word}-pem\n-----END PRIVATE KEY-----"),
    );
    let error = Relay::builder(db.clone())
        .kafka(&broken)
        .spawn()
        .unwrap()
        .join()
        .await
        .unwrap_err();
    assert_hidden(&word, "relay error", &chain(&error));
    let error = Consumer::builder(db.clone())
        .group("canary")
        .kafka(&broken)
        .handler(Count(count.clone()))
        .spawn()
        .unwrap()
        .join()
        .await
        .unwrap_err();
    assert_hidden(&word, "consumer error", &chain(&error));
    let error = outbox_runtime::replay::replay(
        &db,
        &ReplayOptions::new(brokers(), ReplayFilter::default()).kafka(&broken),
    )
    .await
    .unwrap_err();
    assert_hidden(&word, "replay error", &chain(&error));
    let error = outbox_runtime::kafka::create_topics(
        broken.brokers(),
        &broken.pairs(),
        &["x".to_owned()],
        1,
        1,
    )
    .await
    .unwrap_err();
    assert_hidden(&word, "create_topics error", &chain(&error));

    let logged = logs();
    assert!(logged.contains("relay started"), "logs captured");
    assert!(logged.contains("librdkafka"), "librdkafka's logs captured");
    assert_hidden(&word, "the logs", &logged);
}
