//! `outbox schema export|check`: the plain binary checks two directories and
//! explains why it cannot export; an application's binary (`run_with`)
//! exports its catalogue and checks it against a snapshot. Exit codes: 0
//! compatible, 1 breaking, 2 bad usage.

#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Output};

use outbox::contracts::Catalogue;
use outbox::prelude::*;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("outbox-cli-schema-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn outbox(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .output()
        .expect("run outbox")
}

fn write(dir: &Path, file: &str, schema: serde_json::Value) {
    let path = dir.join(file);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, serde_json::to_vec_pretty(&schema).unwrap()).unwrap();
}

fn order(required: &[&str], amount_type: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "format": "uuid"},
            "customer": {"type": "string"},
            "amount_cents": {"type": amount_type},
        },
        "required": required,
    })
}

#[test]
fn check_passes_a_compatible_change_and_fails_a_breaking_one_naming_the_field() {
    let (snapshot, compatible, breaking) = (TempDir::new(), TempDir::new(), TempDir::new());
    write(
        &snapshot.0,
        "shop.orders/OrderPlaced.v1.json",
        order(&["order_id", "customer"], "integer"),
    );
    // `customer` made optional: compatible.
    write(
        &compatible.0,
        "shop.orders/OrderPlaced.v1.json",
        order(&["order_id"], "integer"),
    );
    // `amount_cents` became a string: breaking.
    write(
        &breaking.0,
        "shop.orders/OrderPlaced.v1.json",
        order(&["order_id", "customer"], "string"),
    );
    let against = snapshot.0.to_str().unwrap();

    let ok = outbox(&[
        "schema",
        "check",
        "--against",
        against,
        "--current",
        compatible.0.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert_eq!(ok.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("compatible: OrderPlaced v1 (topic `shop.orders`), field `customer`"),
        "{stdout}"
    );

    let bad = outbox(&[
        "schema",
        "check",
        "--against",
        against,
        "--current",
        breaking.0.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&bad.stdout);
    assert_eq!(bad.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("breaking: OrderPlaced v1 (topic `shop.orders`), field `amount_cents`: type changed from integer to string"),
        "{stdout}"
    );

    let json = outbox(&[
        "schema",
        "check",
        "--json",
        "--against",
        against,
        "--current",
        breaking.0.to_str().unwrap(),
    ]);
    assert_eq!(json.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(report["compatible"], false);
    assert_eq!(report["changes"][0]["field"], "amount_cents");
    assert_eq!(report["changes"][0]["version"], 1);
    assert_eq!(report["changes"][0]["kind"], "TypeChanged");
}

#[test]
fn the_plain_binary_explains_how_to_export_and_refuses_a_missing_snapshot() {
    let dir = TempDir::new();
    let export = outbox(&["schema", "export", dir.0.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&export.stderr);
    assert_eq!(export.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("outbox_cli::run_with(catalogue)"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 0);

    let missing = dir.0.join("missing");
    let check = outbox(&[
        "schema",
        "check",
        "--against",
        missing.to_str().unwrap(),
        "--current",
        dir.0.to_str().unwrap(),
    ]);
    assert_eq!(check.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&check.stderr).contains("not a directory"));
}

#[derive(Serialize, Deserialize, JsonSchema, DomainEvent)]
#[event(topic = "shop.orders", event_type = "OrderPlaced")]
struct OrderPlaced {
    #[event(aggregate_id)]
    order_id: Uuid,
    customer: String,
}

#[derive(Serialize, Deserialize, JsonSchema, DomainEvent)]
#[event(topic = "shop.orders", event_type = "OrderPlaced")]
struct OrderPlacedRenamed {
    #[event(aggregate_id)]
    order_id: Uuid,
    buyer: String,
}

fn catalogue_v1() -> Catalogue {
    Catalogue::new("shop").event(&OrderPlaced {
        order_id: Uuid::nil(),
        customer: "ada".into(),
    })
}

#[tokio::test]
async fn an_application_binary_exports_its_catalogue_and_checks_it() {
    let dir = TempDir::new();
    let path = dir.0.to_str().unwrap();
    let code =
        outbox_cli::run_with_args(Some(catalogue_v1()), ["outbox", "schema", "export", path]).await;
    assert_eq!(code, ExitCode::SUCCESS);
    assert!(dir.0.join("shop.orders/OrderPlaced.v1.json").is_file());
    assert!(dir.0.join("shop.orders.json").is_file());
    assert!(dir.0.join("asyncapi.json").is_file());

    // Against its own catalogue (no --current): unchanged passes...
    let code = outbox_cli::run_with_args(
        Some(catalogue_v1()),
        ["outbox", "schema", "check", "--against", path],
    )
    .await;
    assert_eq!(code, ExitCode::SUCCESS);
    // ...a rename without a new version fails.
    let renamed = Catalogue::new("shop").event(&OrderPlacedRenamed {
        order_id: Uuid::nil(),
        buyer: "ada".into(),
    });
    let code = outbox_cli::run_with_args(
        Some(renamed),
        ["outbox", "schema", "check", "--against", path],
    )
    .await;
    assert_eq!(code, ExitCode::FAILURE);

    // A catalogue with two types claiming one event type exports nothing.
    let other = TempDir::new();
    let duplicate = catalogue_v1().event(&OrderPlacedRenamed {
        order_id: Uuid::nil(),
        buyer: "ada".into(),
    });
    let code = outbox_cli::run_with_args(
        Some(duplicate),
        ["outbox", "schema", "export", other.0.to_str().unwrap()],
    )
    .await;
    assert_eq!(code, ExitCode::FAILURE);
    assert_eq!(std::fs::read_dir(&other.0).unwrap().count(), 0);
}
