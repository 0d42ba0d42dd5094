//! The broker enforces the event schemas: the test exports a catalogue into
//! the file schema registry of its own broker (`tansu broker
//! --schema-registry`), publishes through the relay, and checks that valid
//! events are accepted and read back in order per key, while an event whose
//! payload breaks its schema is refused by the broker, parked with the
//! broker's refusal as the reason, and holds back nothing but the later
//! events of its key until it is parked. It runs in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command): "published" is
//! then "passed by its slot's position", and a parked row still gets
//! `parked_at` there.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use outbox_core::contracts::Catalogue;
use outbox_core::{DomainEvent, OutboxMessage, UnitOfWork};
use outbox_runtime::{Relay, ops};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

const TOPIC: &str = "shipments";

/// A parcel left the warehouse.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
struct Shipped {
    order_id: String,
    seq: u32,
    parcels: u32,
    /// A nested type: its schema is a `$ref` into the event's `$defs`.
    to: Destination,
}

#[derive(Serialize, Deserialize, schemars::JsonSchema)]
struct Destination {
    city: String,
}

impl DomainEvent for Shipped {
    const TOPIC: &'static str = TOPIC;
    const AGGREGATE_TYPE: &'static str = "Order";
    const EVENT_TYPES: &'static [&'static str] = &["Shipped"];
    fn event_type(&self) -> &'static str {
        "Shipped"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
}

/// A broker of the test's own that validates record values against the
/// schemas exported into its registry directory; stopped by PID on drop.
struct ValidatingBroker {
    child: std::process::Child,
    root: PathBuf,
    brokers: String,
}

impl ValidatingBroker {
    /// Exports `catalogue` into a fresh registry directory and starts the
    /// broker on it (`TANSU_BIN` names the binary, default `tansu`).
    fn start(catalogue: &Catalogue) -> Self {
        let root =
            std::env::temp_dir().join(format!("outbox-registry-{}", Uuid::new_v4().simple()));
        let registry = root.join("schemas");
        catalogue.export(&registry).expect("export the schemas");
        let port = free_port();
        let bin = std::env::var("TANSU_BIN").unwrap_or_else(|_| "tansu".into());
        // tansu resolves a `file://` registry against its working directory.
        let child = std::process::Command::new(bin)
            .current_dir(&root)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://127.0.0.1:{port}"),
                "--advertised-listener-url",
                &format!("tcp://127.0.0.1:{port}"),
                "--storage-engine",
                "memory://tansu/",
                "--schema-registry",
                "file:///schemas",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start tansu (install it with scripts/services.sh)");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the validating broker did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            child,
            root,
            brokers: format!("127.0.0.1:{port}"),
        }
    }
}

impl Drop for ValidatingBroker {
    fn drop(&mut self) {
        signal(self.child.id(), "-KILL");
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn shipped(key: &str, seq: u32) -> Shipped {
    Shipped {
        order_id: key.into(),
        seq,
        parcels: 1 + seq % 3,
        to: Destination {
            city: "Lyon".into(),
        },
    }
}

/// An event of `key` whose payload does not match the schema: written by an
/// out-of-date producer, or by hand into the outbox.
fn broken(key: &str, payload: serde_json::Value) -> OutboxMessage {
    let mut message = OutboxMessage::from_event(&shipped(key, 0)).unwrap();
    message.payload = payload.to_string();
    message
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_broker_refuses_an_event_that_breaks_its_schema_and_the_relay_parks_it(pool: PgPool) {
    relay_mode(&pool).await;
    init_tracing();
    let catalogue = Catalogue::new("shipping").event(&shipped("k0", 0));
    let broker = ValidatingBroker::start(&catalogue);
    create_topic(&broker.brokers, TOPIC).await;

    // Four keys, 40 events; k1's 3rd event has a string where a number
    // belongs, k2's 5th lacks a required field.
    let mut valid = Vec::new();
    let mut bad = Vec::new();
    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
    for seq in 0..40_u32 {
        let key = format!("k{}", seq % 4);
        match seq {
            9 => bad.push(uow.record_message(broken(
                &key,
                serde_json::json!({"order_id": key, "seq": seq, "parcels": "many", "to": {"city": "Lyon"}}),
            ))),
            18 => bad.push(uow.record_message(broken(
                &key,
                serde_json::json!({"order_id": key, "seq": seq, "parcels": 1}),
            ))),
            _ => valid.push(uow.record(shipped(&key, seq))),
        }
    }
    uow.commit().await.unwrap();

    let handle = Relay::builder(pool.clone())
        .brokers(broker.brokers.clone())
        .delivery_timeout(Duration::from_secs(10))
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(100), Duration::from_millis(400))
        .batch_size(8)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = ops::status(&pool).await.unwrap();
        if status.unpublished == 0 && status.parked == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the refused events were not parked or the others not drained: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert_eq!(counts.parked, 2, "{counts:?}");

    // Parked: exactly the two broken events, with the broker's refusal.
    let parked: Vec<(Uuid, Option<String>)> = sqlx::query_as(
        "SELECT event_id, last_error FROM outbox_event WHERE parked_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(parked.iter().map(|p| p.0).collect::<Vec<_>>(), bad);
    for (_, reason) in &parked {
        let reason = reason.clone().unwrap_or_default().to_lowercase();
        assert!(reason.contains("record"), "the broker's refusal: {reason}");
    }

    // Every valid event arrived once, in commit order per key; no broken one.
    let received = read_topic(&broker.brokers, TOPIC, valid.len(), Duration::from_secs(30)).await;
    verify(&valid, &received);
    assert!(received.iter().all(|r| !bad.contains(&r.event_id())));
    assert!(received.iter().all(|r| r.payload["parcels"].is_u64()));
}
