//! Event contracts: the catalogue's export (schemas per event type and
//! version, the AsyncAPI document, the broker's per-topic files), duplicate
//! registrations, and the compatibility check on before/after pairs of Rust
//! types: each pair exports both versions and asserts pass or fail and the
//! field named.

#![allow(missing_docs)]

use std::path::{Path, PathBuf};

use outbox::contracts::{Breaking, Catalogue, Change, check_dirs};
use outbox::prelude::*;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A fresh directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("outbox-contracts-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

/// The baseline every pair starts from: `OrderPlaced` v1 on `shop.orders`.
mod before {
    use super::*;

    #[derive(Serialize, Deserialize, JsonSchema, DomainEvent)]
    #[event(
        topic = "shop.orders",
        aggregate_type = "Order",
        event_type = "OrderPlaced"
    )]
    pub struct OrderPlaced {
        /// The order.
        #[event(aggregate_id)]
        pub order_id: Uuid,
        pub customer: String,
        pub amount_cents: i64,
        pub note: Option<String>,
        pub status: Status,
        pub address: Address,
        pub lines: Vec<Line>,
        pub payment: Payment,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub enum Status {
        Pending,
        Paid,
        Cancelled,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub struct Address {
        pub city: String,
        pub zip: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub struct Line {
        pub sku: String,
        pub quantity: u32,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub enum Payment {
        Card { number: String },
        Cash,
    }

    pub fn sample() -> OrderPlaced {
        OrderPlaced {
            order_id: Uuid::nil(),
            customer: "ada".into(),
            amount_cents: 1250,
            note: None,
            status: Status::Pending,
            address: Address {
                city: "Lyon".into(),
                zip: "69001".into(),
            },
            lines: vec![Line {
                sku: "B-1".into(),
                quantity: 2,
            }],
            payment: Payment::Cash,
        }
    }
}

/// Declares `mod $name` holding a changed `OrderPlaced` (and its sample):
/// the baseline's fields, with the pair's change applied by the body.
macro_rules! after {
    ($name:ident, { $($body:tt)* }) => {
        mod $name {
            #![allow(dead_code, unused_imports)]
            use super::*;
            pub use super::before::{Address, Line, Payment, Status};
            $($body)*
        }
    };
}

/// Exports `before` and `after` catalogues and runs the check.
fn pair(before: Catalogue, after: Catalogue) -> (bool, Vec<Change>) {
    let (old, new) = (TempDir::new(), TempDir::new());
    before.export(&*old).unwrap();
    after.export(&*new).unwrap();
    let report = check_dirs(&old, &new).unwrap();
    (report.is_compatible(), report.changes)
}

fn baseline() -> Catalogue {
    Catalogue::new("shop").event(&before::sample())
}

/// Asserts the pair fails with exactly these breaking (field, kind).
fn assert_breaks(after: Catalogue, expected: &[(&str, Breaking)]) {
    let (ok, changes) = pair(baseline(), after);
    assert!(!ok, "expected a breaking change, got {changes:#?}");
    let breaking: Vec<(&str, Breaking)> = changes
        .iter()
        .filter_map(|c| c.kind.err().map(|k| (c.path.as_str(), k)))
        .collect();
    assert_eq!(breaking, expected, "{changes:#?}");
    for change in changes.iter().filter(|c| c.is_breaking()) {
        let text = change.to_string();
        assert!(text.contains("OrderPlaced v1"), "{text}");
        if !change.path.is_empty() {
            assert!(text.contains(&format!("`{}`", change.path)), "{text}");
        }
    }
}

fn assert_passes(after: Catalogue) -> Vec<Change> {
    let (ok, changes) = pair(baseline(), after);
    assert!(ok, "expected compatible, got {changes:#?}");
    changes
}

macro_rules! order_placed {
    ($($field:ident : $ty:ty = $value:expr),* $(,)?) => {
        #[derive(Serialize, Deserialize, JsonSchema, DomainEvent)]
        #[event(topic = "shop.orders", aggregate_type = "Order", event_type = "OrderPlaced")]
        pub struct OrderPlaced {
            #[event(aggregate_id)]
            pub order_id: Uuid,
            $(pub $field: $ty,)*
        }
        pub fn sample() -> OrderPlaced {
            OrderPlaced { order_id: Uuid::nil(), $($field: $value,)* }
        }
    };
}

fn addr() -> before::Address {
    before::Address {
        city: "Lyon".into(),
        zip: "69001".into(),
    }
}

after!(same, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash);
});

after!(required_added, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash, currency: String = "EUR".into());
});

after!(field_removed, {
    order_placed!(amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash);
});

after!(field_renamed, {
    order_placed!(customer_name: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash);
});

after!(type_changed, {
    order_placed!(customer: String = "a".into(), amount_cents: String = "1".into(), note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash);
});

after!(became_required, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: String = String::new(),
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash);
});

after!(optional_added, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash, coupon: Option<String> = None);
});

after!(made_optional, {
    order_placed!(customer: Option<String> = None, amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash);
});

/// The status enum without `Cancelled`, and with `Refunded` added.
mod statuses {
    use super::*;

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub enum Fewer {
        Pending,
        Paid,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub enum More {
        Pending,
        Paid,
        Cancelled,
        Refunded,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub struct CityAsNumber {
        pub city: u32,
        pub zip: String,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub struct LineWithoutSku {
        pub quantity: u32,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub enum PaymentWithoutCard {
        Cash,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub enum PaymentCardNumberAsInt {
        Card { number: u64 },
        Cash,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub enum PaymentWithVoucher {
        Card { number: String },
        Cash,
        Voucher { code: String },
    }

    /// The address, documented differently: descriptions do not matter.
    #[derive(Serialize, Deserialize, JsonSchema)]
    pub struct DocumentedAddress {
        /// The city, as written on the parcel.
        pub city: String,
        /// The postal code.
        pub zip: String,
    }
}

after!(variant_removed, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: statuses::Fewer = statuses::Fewer::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: Payment = Payment::Cash);
});

after!(variant_added, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: statuses::More = statuses::More::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: statuses::PaymentWithVoucher = statuses::PaymentWithVoucher::Cash);
});

after!(nested_type_changed, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid,
        address: statuses::CityAsNumber = statuses::CityAsNumber { city: 1, zip: String::new() },
        lines: Vec<Line> = vec![], payment: Payment = Payment::Cash);
});

after!(item_field_removed, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(),
        lines: Vec<statuses::LineWithoutSku> = vec![], payment: Payment = Payment::Cash);
});

after!(data_variant_removed, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: statuses::PaymentWithoutCard = statuses::PaymentWithoutCard::Cash);
});

after!(variant_field_changed, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid, address: Address = addr(), lines: Vec<Line> = vec![],
        payment: statuses::PaymentCardNumberAsInt = statuses::PaymentCardNumberAsInt::Cash);
});

after!(descriptions_changed, {
    order_placed!(customer: String = "a".into(), amount_cents: i64 = 1, note: Option<String> = None,
        status: Status = Status::Paid,
        address: statuses::DocumentedAddress = statuses::DocumentedAddress { city: String::new(), zip: String::new() },
        lines: Vec<Line> = vec![], payment: Payment = Payment::Cash);
});

/// Version 2 of `OrderPlaced`: `customer` became a required `buyer`.
mod v2 {
    use super::*;

    #[derive(Serialize, Deserialize, JsonSchema, DomainEvent)]
    #[event(
        topic = "shop.orders",
        aggregate_type = "Order",
        event_type = "OrderPlaced",
        version = 2
    )]
    pub struct OrderPlaced {
        #[event(aggregate_id)]
        pub order_id: Uuid,
        pub buyer: String,
    }
}

fn cat<T: DomainEvent + JsonSchema>(sample: &T) -> Catalogue {
    Catalogue::new("shop").event(sample)
}

#[test]
fn an_unchanged_type_passes_with_no_changes() {
    assert_eq!(assert_passes(cat(&same::sample())), vec![]);
}

#[test]
fn a_required_field_added_breaks() {
    assert_breaks(
        cat(&required_added::sample()),
        &[("currency", Breaking::RequiredFieldAdded)],
    );
}

#[test]
fn a_field_removed_breaks() {
    assert_breaks(
        cat(&field_removed::sample()),
        &[("customer", Breaking::FieldRemoved)],
    );
}

#[test]
fn a_field_renamed_breaks_and_names_both_names() {
    assert_breaks(
        cat(&field_renamed::sample()),
        &[
            ("customer", Breaking::FieldRemoved),
            ("customer_name", Breaking::RequiredFieldAdded),
        ],
    );
    let (_, changes) = pair(baseline(), cat(&field_renamed::sample()));
    assert!(
        changes[0].detail.contains("renamed to `customer_name`?"),
        "{}",
        changes[0]
    );
}

#[test]
fn a_type_changed_breaks() {
    assert_breaks(
        cat(&type_changed::sample()),
        &[("amount_cents", Breaking::TypeChanged)],
    );
    let (_, changes) = pair(baseline(), cat(&type_changed::sample()));
    assert!(
        changes[0].detail.contains("integer (int64) to string"),
        "{}",
        changes[0]
    );
}

#[test]
fn an_optional_field_made_required_breaks() {
    assert_breaks(
        cat(&became_required::sample()),
        &[("note", Breaking::BecameRequired)],
    );
}

#[test]
fn an_enum_value_removed_breaks() {
    assert_breaks(
        cat(&variant_removed::sample()),
        &[("status", Breaking::VariantRemoved)],
    );
}

#[test]
fn a_nested_type_change_is_found_through_refs() {
    assert_breaks(
        cat(&nested_type_changed::sample()),
        &[("address.city", Breaking::TypeChanged)],
    );
}

#[test]
fn a_field_removed_from_list_items_is_named_with_brackets() {
    assert_breaks(
        cat(&item_field_removed::sample()),
        &[("lines[].sku", Breaking::FieldRemoved)],
    );
}

#[test]
fn a_data_carrying_variant_removed_breaks() {
    assert_breaks(
        cat(&data_variant_removed::sample()),
        &[("payment", Breaking::VariantRemoved)],
    );
}

#[test]
fn a_change_inside_a_variant_is_named_with_the_variant() {
    assert_breaks(
        cat(&variant_field_changed::sample()),
        &[("payment(Card).number", Breaking::TypeChanged)],
    );
}

#[test]
fn an_optional_field_added_passes() {
    let changes = assert_passes(cat(&optional_added::sample()));
    assert_eq!(changes.len(), 1, "{changes:#?}");
    assert_eq!(changes[0].path, "coupon");
}

#[test]
fn a_field_made_optional_passes() {
    let changes = assert_passes(cat(&made_optional::sample()));
    assert!(changes.iter().all(|c| c.path == "customer"), "{changes:#?}");
}

#[test]
fn enum_values_and_variants_added_pass() {
    let changes = assert_passes(cat(&variant_added::sample()));
    let details: Vec<&str> = changes.iter().map(|c| c.detail.as_str()).collect();
    assert_eq!(
        details,
        ["variant `Voucher` added", "enum value Refunded added"],
        "{changes:#?}"
    );
}

#[test]
fn descriptions_changed_pass_with_no_changes() {
    assert_eq!(assert_passes(cat(&descriptions_changed::sample())), vec![]);
}

#[test]
fn a_new_version_beside_the_old_one_passes() {
    let after = baseline().event(&v2::OrderPlaced {
        order_id: Uuid::nil(),
        buyer: "ada".into(),
    });
    let changes = assert_passes(after);
    assert_eq!(changes.len(), 1, "{changes:#?}");
    assert_eq!(changes[0].key.version, 2);
    assert_eq!(changes[0].detail, "a new version");
}

#[test]
fn dropping_the_old_version_breaks() {
    let after = cat(&v2::OrderPlaced {
        order_id: Uuid::nil(),
        buyer: "ada".into(),
    });
    let (ok, changes) = pair(baseline(), after);
    assert!(!ok);
    let removed: Vec<_> = changes.iter().filter(|c| c.is_breaking()).collect();
    assert_eq!(removed.len(), 1, "{changes:#?}");
    assert_eq!(removed[0].kind, Err(Breaking::EventRemoved));
    assert_eq!(removed[0].key.version, 1);
    assert!(
        removed[0]
            .to_string()
            .contains("shop.orders/OrderPlaced.v1.json")
    );
}

#[test]
fn two_types_claiming_one_event_type_and_version_are_refused_naming_both() {
    let catalogue = baseline().event(&same::sample());
    let error = catalogue.check().unwrap_err().to_string();
    assert!(
        error.contains("`OrderPlaced` version 1 on topic `shop.orders`"),
        "{error}"
    );
    assert!(error.contains("contracts::before::OrderPlaced"), "{error}");
    assert!(error.contains("contracts::same::OrderPlaced"), "{error}");
    let dir = TempDir::new();
    assert!(catalogue.export(&*dir).is_err());
    assert_eq!(
        std::fs::read_dir(&*dir).unwrap().count(),
        0,
        "nothing written"
    );
    // The same type twice is one contract with two examples.
    let mut twice = baseline();
    twice.add(&before::sample()).unwrap();
    assert!(twice.check().is_ok());
    // Another version of the event type is another contract.
    let mut versions = baseline();
    versions
        .add(&v2::OrderPlaced {
            order_id: Uuid::nil(),
            buyer: String::new(),
        })
        .unwrap();
    assert_eq!(versions.keys().count(), 2);
}

#[test]
fn export_writes_sorted_stable_files_and_removes_stale_ones() {
    let dir = TempDir::new();
    let catalogue = baseline().event(&v2::OrderPlaced {
        order_id: Uuid::nil(),
        buyer: "ada".into(),
    });
    let exported = catalogue.export(&*dir).unwrap();
    let mut written: Vec<String> = exported
        .written
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    written.sort();
    assert_eq!(
        written,
        [
            "asyncapi.json",
            "shop.orders.json",
            "shop.orders/OrderPlaced.v1.json",
            "shop.orders/OrderPlaced.v2.json"
        ]
    );
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    let first = read("shop.orders/OrderPlaced.v1.json");
    catalogue.export(&*dir).unwrap();
    assert_eq!(read("shop.orders/OrderPlaced.v1.json"), first, "stable");
    assert!(
        first.starts_with("{\n  \"$defs\""),
        "sorted and pretty: {first}"
    );
    let schema: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(schema["properties"]["address"]["$ref"], "#/$defs/Address");

    // v2 only: the v1 file goes.
    let exported = cat(&v2::OrderPlaced {
        order_id: Uuid::nil(),
        buyer: "ada".into(),
    })
    .export(&*dir)
    .unwrap();
    assert_eq!(
        exported.removed,
        [PathBuf::from("shop.orders/OrderPlaced.v1.json")]
    );
    assert!(!dir.join("shop.orders/OrderPlaced.v1.json").exists());
}

#[test]
fn the_asyncapi_document_names_channels_messages_keys_and_headers() {
    let catalogue = baseline().event(&v2::OrderPlaced {
        order_id: Uuid::nil(),
        buyer: "ada".into(),
    });
    let doc = catalogue.asyncapi().unwrap();
    assert_eq!(doc["asyncapi"], "3.0.0");
    assert_eq!(doc["info"]["title"], "shop");
    let channel = &doc["channels"]["shop.orders"];
    assert_eq!(channel["address"], "shop.orders");
    assert_eq!(
        channel["messages"]["OrderPlaced.v2"]["$ref"],
        "#/components/messages/shop.orders.OrderPlaced.v2"
    );
    let message = &doc["components"]["messages"]["shop.orders.OrderPlaced.v1"];
    assert_eq!(message["name"], "OrderPlaced");
    assert_eq!(
        message["headers"]["properties"]["event_version"]["const"],
        "1"
    );
    assert_eq!(
        message["headers"]["properties"]["aggregate_type"]["const"],
        "Order"
    );
    for header in [
        "event_id",
        "event_type",
        "aggregate_id",
        "correlation_id",
        "traceparent",
    ] {
        assert!(
            message["headers"]["properties"].get(header).is_some(),
            "{header}"
        );
    }
    assert_eq!(message["bindings"]["kafka"]["key"]["type"], "string");
    assert_eq!(message["examples"][0]["payload"]["customer"], "ada");
    // The payload's references resolve inside this document.
    let payload_ref = message["payload"]["$ref"].as_str().unwrap();
    let payload = doc.pointer(&payload_ref[1..]).unwrap();
    let address_ref = payload["properties"]["address"]["$ref"].as_str().unwrap();
    assert!(doc.pointer(&address_ref[1..]).unwrap()["properties"]["city"].is_object());
    let operation = &doc["operations"]["publish.shop.orders"];
    assert_eq!(operation["action"], "send");
    assert_eq!(operation["messages"].as_array().unwrap().len(), 2);
}

#[test]
fn names_that_cannot_name_a_file_are_refused() {
    #[derive(Serialize, Deserialize, JsonSchema, DomainEvent)]
    #[event(topic = "shop.orders", event_type = "../escape")]
    struct Escape {
        #[event(aggregate_id)]
        id: Uuid,
    }
    let error = Catalogue::new("shop")
        .event(&Escape { id: Uuid::nil() })
        .check()
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("`../escape`") && error.contains("Escape"),
        "{error}"
    );
}

/// A recursive type: the check terminates and still finds changes below.
mod tree {
    use super::*;

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub struct Node {
        pub label: String,
        pub children: Vec<Node>,
    }

    #[derive(Serialize, Deserialize, JsonSchema)]
    pub struct Node2 {
        pub label: u32,
        pub children: Vec<Node2>,
    }
}

#[test]
fn recursive_types_are_compared_without_looping() {
    let old = outbox::contracts::schema_of::<tree::Node>();
    let new = outbox::contracts::schema_of::<tree::Node2>();
    let differences = outbox::contracts::compare_schemas(&old, &new);
    let paths: Vec<&str> = differences.iter().map(|d| d.0.as_str()).collect();
    assert_eq!(paths, ["children[].label", "label"], "{differences:#?}");
    assert!(outbox::contracts::compare_schemas(&old, &old).is_empty());
}
