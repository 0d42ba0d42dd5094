//! Kafka over TLS: a private broker behind a TLS endpoint with a
//! certificate from a CA made here (the test broker, tansu 0.6, cannot serve
//! TLS itself: its `--cert` and `--key` cannot be given together and its
//! TLS acceptor is never used). The broker advertises only the TLS
//! endpoint, so every connection of a client goes through TLS. Topic
//! creation, the relay, a consumer and replay work with `security.protocol
//! = SSL` and `ssl.ca.location`; a wrong CA or host name, or plain text,
//! is refused with the reason in the error. SASL over TLS: PLAIN and
//! SCRAM-SHA-256/512 logins against a SASL endpoint in front of the broker
//! (the test broker cannot authenticate: see `common::sasl`), a wrong
//! password refused; what this build of librdkafka refuses (GSSAPI, OIDC).
//! The relays run in the relay mode the test command asks for
//! (`OUTBOX_TEST_RELAY_MODE=progress`: the progress mode).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::sasl::SaslBroker;
use common::tls::TlsBroker;
use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::replay::{self, ReplayFilter, ReplayOptions};
use outbox_runtime::settings::KafkaSettings;
use outbox_runtime::{Consumer, Relay, kafka};
use sqlx::PgPool;

async fn create(settings: &KafkaSettings, topic: &str) -> outbox_runtime::Result<()> {
    kafka::create_topics(
        settings.brokers(),
        &settings.pairs(),
        &[topic.to_owned()],
        PARTITIONS,
        1,
    )
    .await
    .map(|_| ())
}

keyed_event!(TlsEvent, "tls-kafka-events");

struct Count(Arc<AtomicUsize>);

impl InboxHandler for Count {
    type Event = TlsEvent;
    const NAME: &'static str = "count";
    fn handle<'a, 'c>(
        &'a self,
        _ctx: &'a mut HandlerContext<'c>,
        _event: TlsEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn topics_relay_consumer_and_replay_over_tls(pool: PgPool) {
    init_tracing();
    relay_mode(&pool).await;
    let broker = TlsBroker::start().await;
    let tls = broker.verified();
    let topic = TlsEvent::TOPIC;
    create(&tls, topic).await.expect("topic created over TLS");
    create(&tls, "tls-kafka-replayed").await.unwrap();
    let ids = commit_messages(&pool, topic, 50, 5, 10).await;

    let relay = Relay::builder(pool.clone()).kafka(&tls).spawn().unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();

    let count = Arc::new(AtomicUsize::new(0));
    let consumer = Consumer::builder(pool.clone())
        .group("tls")
        .kafka(&tls)
        .handler(Count(count.clone()))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            count.load(Ordering::SeqCst) == ids.len()
        })
        .await,
        "consumed over TLS: {}",
        count.load(Ordering::SeqCst)
    );
    consumer.shutdown().await.unwrap();

    let mut options = ReplayOptions::new("", ReplayFilter::default()).kafka(&tls);
    options.to_topic = Some("tls-kafka-replayed".into());
    let report = replay::replay(&pool, &options).await.unwrap();
    assert_eq!(report.replayed, ids.len() as u64);
    assert!(broker.proxy.handshakes() >= 3, "clients spoke TLS");
}

#[tokio::test]
async fn a_wrong_ca_a_wrong_host_or_plain_text_is_refused_with_the_reason() {
    let broker = TlsBroker::start().await;
    let quick = |mut s: KafkaSettings| {
        // The admin request gives up after socket.timeout.ms.
        s.set("socket.timeout.ms", "2000");
        s
    };
    let error = create(&quick(broker.settings("localhost", "other-ca.pem")), "t")
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("certificate verify failed"), "{error}");
    let error = create(&quick(broker.settings("127.0.0.1", "ca.pem")), "t")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("certificate verify failed") || error.contains("mismatch"),
        "{error}"
    );
    let mut plain = quick(broker.verified());
    plain.set("security.protocol", "PLAINTEXT");
    let error = create(&plain, "t").await.unwrap_err().to_string();
    assert!(error.contains("no answer from the brokers"), "{error}");
    // And the right CA and host still work.
    create(&broker.verified(), "t").await.unwrap();
}

#[tokio::test]
async fn oauthbearer_and_gssapi_as_this_build_allows() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy(
            &std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into()),
        )
        .unwrap();
    let relay_with = |pairs: &[(&str, &str)]| {
        let mut s = KafkaSettings::default();
        s.set("security.protocol", "SASL_SSL");
        for (k, v) in pairs {
            s.set(*k, *v);
        }
        Relay::builder(pool.clone())
            .kafka(&s)
            .listen(false)
            .lanes(0)
            .spawn()
            .unwrap()
    };
    // Accepted: the client is created (the relay runs until stopped).
    let relay = relay_with(&[
        ("sasl.mechanism", "OAUTHBEARER"),
        ("sasl.oauthbearer.config", "principal=outbox"),
    ]);
    relay.shutdown().await.expect("OAUTHBEARER, unsecured JWT");
    // Refused when the relay starts, with librdkafka's reason: GSSAPI needs
    // libsasl2, OIDC needs libcurl, neither is in this build.
    let error = relay_with(&[("sasl.mechanism", "GSSAPI")])
        .join()
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("GSSAPI"), "{error}");
    let error = relay_with(&[
        ("sasl.mechanism", "OAUTHBEARER"),
        ("sasl.oauthbearer.method", "oidc"),
    ])
    .join()
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("not supported in this build"), "{error}");
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn sasl_plain_and_scram_logins_over_tls(pool: PgPool) {
    relay_mode(&pool).await;
    let broker = SaslBroker::start().await;
    for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
        let topic = format!("sasl-{}", mechanism.to_lowercase());
        create(&broker.settings(mechanism, "s3cret-pw"), &topic)
            .await
            .unwrap_or_else(|e| panic!("{mechanism}: {e}"));
    }
    let logins = broker.proxy.logins();
    assert!(logins >= 3, "{logins} logins");

    // The relay and a consumer log in with SCRAM-SHA-512.
    let scram = broker.settings("SCRAM-SHA-512", "s3cret-pw");
    create(&scram, TlsEvent::TOPIC).await.unwrap();
    let ids = commit_messages(&pool, TlsEvent::TOPIC, 20, 4, 10).await;
    let relay = Relay::builder(pool.clone()).kafka(&scram).spawn().unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let consumer = Consumer::builder(pool.clone())
        .group("sasl")
        .kafka(&scram)
        .handler(Count(count.clone()))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            count.load(Ordering::SeqCst) == ids.len()
        })
        .await
    );
    consumer.shutdown().await.unwrap();
    assert!(
        broker.proxy.logins() > logins,
        "the relay and consumer logged in"
    );

    // A wrong password is refused, and the error says so.
    assert_eq!(broker.proxy.refusals(), 0);
    for mechanism in ["PLAIN", "SCRAM-SHA-512"] {
        let mut wrong = broker.settings(mechanism, "not-the-password");
        wrong.set("socket.timeout.ms", "2000");
        let error = create(&wrong, "never").await.unwrap_err().to_string();
        assert!(
            error.contains("invalid credentials"),
            "{mechanism}: {error}"
        );
    }
    assert!(broker.proxy.refusals() >= 2);
}
