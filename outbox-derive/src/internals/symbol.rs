//! The names of the attributes and keys the macros understand.

use std::fmt::{self, Display};

use syn::{Ident, Path};

/// An attribute or key name, comparable with the `Path`s and `Ident`s syn
/// parses.
#[derive(Copy, Clone, PartialEq, Eq)]
pub struct Symbol(&'static str);

/// `#[event(...)]`.
pub const EVENT: Symbol = Symbol("event");
/// `#[aggregate(...)]`.
pub const AGGREGATE: Symbol = Symbol("aggregate");
/// `#[inbox_handler(...)]`.
pub const INBOX_HANDLER: Symbol = Symbol("inbox_handler");
/// `#[command_handler(...)]`.
pub const COMMAND_HANDLER: Symbol = Symbol("command_handler");

/// Container: the Kafka topic.
pub const TOPIC: Symbol = Symbol("topic");
/// Container: the aggregate type.
pub const AGGREGATE_TYPE: Symbol = Symbol("aggregate_type");
/// Container (struct) or variant: the event type name.
pub const EVENT_TYPE: Symbol = Symbol("event_type");
/// Container or variant: the schema version.
pub const VERSION: Symbol = Symbol("version");

/// Container (struct): the struct of the previous version, converted with `From`.
pub const UPCAST_FROM: Symbol = Symbol("upcast_from");

/// Field: the aggregate id.
pub const AGGREGATE_ID: Symbol = Symbol("aggregate_id");
/// Field: the Kafka partition key.
pub const PARTITION_KEY: Symbol = Symbol("partition_key");
/// Field: the event id.
pub const EVENT_ID: Symbol = Symbol("event_id");

/// `#[aggregate(root = Name)]`: the name of the generated root type.
pub const ROOT: Symbol = Symbol("root");

/// `#[inbox_handler(name = "...")]`, `#[command_handler(name = "...")]`: the
/// handler's name in logs and dead letters.
pub const NAME: Symbol = Symbol("name");

/// `#[saga(...)]` on an `impl` block.
pub const SAGA: Symbol = Symbol("saga");
/// `#[init]`: builds a saga's new instance.
pub const INIT: Symbol = Symbol("init");
/// `#[step(...)]`: a saga step of a message type.
pub const STEP: Symbol = Symbol("step");
/// `#[timeout(...)]`: a saga step of one of its timeouts.
pub const TIMEOUT: Symbol = Symbol("timeout");
/// Saga: the topic of its timeouts.
pub const TIMEOUTS: Symbol = Symbol("timeouts");
/// Saga: the stage enum.
pub const STAGE: Symbol = Symbol("stage");
/// Saga: the field holding the stage.
pub const STAGE_FIELD: Symbol = Symbol("stage_field");
/// Saga: what a message in another stage does.
pub const OTHER_STAGE: Symbol = Symbol("other_stage");
/// Saga or step: the message field holding the instance id.
pub const CORRELATE: Symbol = Symbol("correlate");
/// Step: the message starts an instance.
pub const START: Symbol = Symbol("start");
/// Step: the stages it runs in.
pub const FROM: Symbol = Symbol("from");

impl Symbol {
    /// The name.
    pub fn as_str(self) -> &'static str {
        self.0
    }
}

impl PartialEq<Symbol> for Ident {
    fn eq(&self, word: &Symbol) -> bool {
        self == word.0
    }
}

impl PartialEq<Symbol> for &Ident {
    fn eq(&self, word: &Symbol) -> bool {
        *self == word.0
    }
}

impl PartialEq<Symbol> for Path {
    fn eq(&self, word: &Symbol) -> bool {
        self.is_ident(word.0)
    }
}

impl PartialEq<Symbol> for &Path {
    fn eq(&self, word: &Symbol) -> bool {
        self.is_ident(word.0)
    }
}

impl Display for Symbol {
    fn fmt(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str(self.0)
    }
}
