//! Macros of the outbox framework: `#[derive(DomainEvent)]`, `#[aggregate]`,
//! `#[inbox_handler]`, `#[command_handler]` and `#[saga]`.
//!
//! Use them through the `outbox` crate, which re-exports them; the generated
//! code only names items through `::outbox`, never this crate or
//! `outbox-core`.
//!
//! Each macro parses its input into a typed form (`internals::ast`,
//! `internals::handler`, `internals::saga`), validates it (`internals::check`,
//! `internals::signature`, `internals::producer`) collecting every mistake at
//! once, then expands. When the input has errors the macros still emit a stub
//! implementation (`#[aggregate]` and the handler attributes: the user's item
//! as written), so one mistake does not cascade into unrelated ones.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod aggregate;
mod domain_event;
mod handler;
mod internals;
mod saga;

use proc_macro::TokenStream;
use syn::{DeriveInput, parse_macro_input};

use crate::internals::handler::Kind;

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

/// Turns `async fn name(ctx: &mut HandlerContext<'_>, event: E) -> Result<(), Err>`
/// into an inbox handler of the event type `E` (a `DomainEvent`).
///
/// The function becomes a unit struct of the same name implementing
/// `outbox::InboxHandler` (`type Event = E`, `NAME` = the function's name), so
/// it registers as `.handler(name)`; `name::call(ctx, event)` still calls the
/// function. `Err` is any error that converts into `outbox::BoxError`.
///
/// `#[inbox_handler(name = "...")]` sets the name used in logs and dead
/// letters.
///
/// Rejected at compile time, each with a spanned message: a function that is
/// not `async`, takes `self`, is generic, does not take exactly the context
/// and the event (by value, with plain argument names), or returns anything
/// but `Result<(), _>`; a first argument other than `&mut HandlerContext<'_>`;
/// an event that is not a `DomainEvent`; and any reach for Kafka — a
/// parameter holding a producer, the relay or a `ClientConfig`, a body naming
/// rdkafka's producer types, building a client or sending to a producer
/// (directly or from a spawned task). Record follow-up events with
/// `ctx.record(event)` instead: the relay publishes them once the transaction
/// commits.
#[proc_macro_attribute]
pub fn inbox_handler(args: TokenStream, input: TokenStream) -> TokenStream {
    handler::expand(Kind::Inbox, args.into(), input.into()).into()
}

/// Turns `async fn name(uow: &mut UnitOfWork, command: C) -> Result<T, E>`
/// into a command handler of the command type `C`.
///
/// The function becomes a unit struct of the same name implementing
/// `outbox::CommandHandler` (`Command = C`, `Output = T`, `Error = E`), run
/// with `outbox::execute(&pool, name, command)`: a Unit of Work of its own,
/// committed on `Ok`, rolled back on `Err`. `name::call(&mut uow, command)`
/// still calls the function on a Unit of Work the caller manages.
///
/// `#[command_handler(name = "...")]` sets the name used in logs.
///
/// Rejected at compile time, with the same spanned messages as
/// `#[inbox_handler]`: a signature other than the one above, a first argument
/// other than `&mut UnitOfWork`, and any reach for Kafka (a producer, the
/// relay or a `ClientConfig` as a parameter; producer types, client creation
/// or producer sends in the body, spawned tasks included). Record events with
/// `uow.record(event)` instead: the relay publishes them once the Unit of
/// Work commits.
#[proc_macro_attribute]
pub fn command_handler(args: TokenStream, input: TokenStream) -> TokenStream {
    handler::expand(Kind::Command, args.into(), input.into()).into()
}

/// Implements `outbox::saga::Saga` for a saga's state, from an `impl` block
/// of its type whose functions are its steps.
///
/// ```text
/// #[saga(name = "order", timeouts = "order-timeouts", stage = Stage)]
/// impl Order {
///     #[init]
///     fn begin(message: &OrderPlaced) -> Self { .. }
///     #[step(start, correlate = order_id)]
///     async fn placed(ctx: &mut SagaContext<Self>, e: OrderPlaced) -> Result<Stage, E> { .. }
///     #[step(from = AwaitingPayment, correlate = order_id)]
///     async fn paid(ctx: &mut SagaContext<Self>, e: PaymentTaken) -> Result<Stage, E> { .. }
///     #[timeout(name = "payment", from = AwaitingPayment)]
///     async fn late(ctx: &mut SagaContext<Self>, t: SagaTimeout<Self>) -> Result<Stage, E> { .. }
/// }
/// ```
///
/// Arguments of `#[saga(...)]`: `stage = Type` (required: the stage enum),
/// `timeouts = "topic"` (required: the topic of its timeouts), `name =
/// "..."` (the stable name its instances are stored under; defaults to the
/// type's name), `stage_field = field` (the field holding the stage;
/// defaults to `stage`), `other_stage = ignore | dead_letter` (what a
/// message in a stage none of its steps accepts does; default `ignore`),
/// `correlate = field` (the correlation field of every message type that
/// does not name its own).
///
/// Functions: `#[init] fn(&M) -> Self` builds a new instance from its start
/// message `M`; `#[step(...)]` is a step of the message type it takes,
/// with `start` (the step run on the instance `#[init]` just built),
/// `from = Stage` or `from = [A, B]` (the stages it runs in; without it
/// and without `start`: any stage no other step of the type accepts) and
/// `correlate = field` (the message field holding the instance id, once per
/// message type); `#[timeout(name = "...", from = ...)]` is a step of the
/// saga's timeout of that name. Steps are `async fn`s taking `&mut
/// SagaContext<Self>` and the message by value and returning `Result<Stage,
/// E>`, `E` any error converting into `outbox::BoxError`. Other items of the
/// block are left as they are.
///
/// Rejected at compile time, each with a spanned message: a message type
/// with no correlation field or with two; no step that starts the saga, a
/// start without its `#[init]`; no step body calling `.complete()`; a
/// `from` stage that no `#[init]` or step body names; two steps of one
/// message type (or timeout) in one stage; a step or `#[init]` with the
/// wrong shape (not `async`, `self`, generic, the wrong number of
/// arguments, no return type). The checks on completion and stages read
/// the bodies' syntax, not their types.
#[proc_macro_attribute]
pub fn saga(args: TokenStream, input: TokenStream) -> TokenStream {
    saga::expand(args.into(), input.into()).into()
}
