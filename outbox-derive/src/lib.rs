//! Macros of the outbox framework: `#[derive(DomainEvent)]` and `#[aggregate]`.
//!
//! Use them through the `outbox` crate, which re-exports both; the generated
//! code only names items through `::outbox`, never this crate or
//! `outbox-core`.
//!
//! Each macro parses its input into a typed form (`internals::ast`),
//! validates it (`internals::check`) collecting every mistake at once, then
//! expands. When the input has errors the macros still emit a stub
//! implementation (and `#[aggregate]` the user's struct), so one mistake does
//! not cascade into unrelated ones.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod aggregate;
mod domain_event;
mod internals;

use proc_macro::TokenStream;
use syn::{DeriveInput, parse_macro_input};

/// Implements `outbox::DomainEvent` for a struct, or for an enum whose
/// variants are the event types of one aggregate.
///
/// Container attributes (on the struct or enum):
///
/// - `#[event(topic = "orders")]` (required): the Kafka topic, made of ASCII
///   letters, digits, `.`, `_` and `-`, at most 249 characters.
/// - `#[event(aggregate_type = "Order")]`: defaults to the topic.
/// - `#[event(event_type = "OrderPlaced")]` (structs only): defaults to the
///   type's name.
/// - `#[event(version = 2)]`: the schema version, at least 1; defaults to 1.
///   On an enum it is the default of every variant.
///
/// Variant attributes: `#[event(event_type = "...", version = N)]`, defaulting
/// to the variant's name and the enum's version.
///
/// Field attributes (per struct, or per variant):
///
/// - `#[event(aggregate_id)]` (exactly one): the id of the aggregate instance,
///   rendered with `Display`.
/// - `#[event(partition_key)]` (at most one): the Kafka key; defaults to the
///   aggregate id.
/// - `#[event(event_id)]` (at most one): a `Uuid` field used as the event id
///   instead of a fresh UUIDv7.
///
/// The type must also implement `serde::Serialize` and
/// `serde::Deserialize`: the payload is its JSON representation.
#[proc_macro_derive(DomainEvent, attributes(event))]
pub fn derive_domain_event(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    domain_event::derive(&input).into()
}

/// Generates the aggregate root of the struct holding an aggregate's state.
///
/// The struct is emitted unchanged; beside it comes `{Name}Root` (or the name
/// given by `#[aggregate(root = Name)]`), which derefs to the state and records
/// the aggregate's events until a Unit of Work collects them.
#[proc_macro_attribute]
pub fn aggregate(args: TokenStream, input: TokenStream) -> TokenStream {
    aggregate::expand(args.into(), input.into()).into()
}
