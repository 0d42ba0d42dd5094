//! The catalogue of an application's event types: registration (refusing two
//! Rust types that claim one topic, event type and version), the schema of
//! each, and the export of a directory of schemas.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use schemars::generate::SchemaSettings;
use serde_json::{Value, json};

use super::json::{embed, pointer_segment, pretty};
use crate::event::DomainEvent;

/// What identifies an event contract: the topic, the event type name and its
/// version.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventKey {
    /// The Kafka topic.
    pub topic: String,
    /// The event type name (the `event_type` header).
    pub event_type: String,
    /// The schema version (the `event_version` header).
    pub version: u32,
}

impl EventKey {
    /// The schema file of this event type and version, relative to an
    /// export directory: `<topic>/<event type>.v<version>.json`.
    pub fn file(&self) -> PathBuf {
        Path::new(&self.topic).join(format!("{}.v{}.json", self.event_type, self.version))
    }

    /// A name for documents: `<topic>.<event type>.v<version>`.
    pub(crate) fn id(&self) -> String {
        format!("{}.{}.v{}", self.topic, self.event_type, self.version)
    }
}

impl fmt::Display for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "event type `{}` version {} on topic `{}`",
            self.event_type, self.version, self.topic
        )
    }
}

/// Why a catalogue cannot be used or exported.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// Two Rust types claim the same topic, event type and version.
    #[error(
        "{key} is claimed by two Rust types: `{first}` and `{second}`; give one of them another event type or version"
    )]
    Duplicate {
        /// The contested contract.
        key: EventKey,
        /// The type registered first.
        first: &'static str,
        /// The type registered second.
        second: &'static str,
    },
    /// A topic or event type name that cannot name a file.
    #[error(
        "`{name}` (the {what} of `{rust_type}`) can only use ASCII letters, digits, `.`, `_` and `-`, and may not start with `.`"
    )]
    Name {
        /// The name.
        name: String,
        /// `topic` or `event type`.
        what: &'static str,
        /// The Rust type.
        rust_type: &'static str,
    },
    /// A sample could not be serialized.
    #[error("the sample of `{rust_type}` cannot be serialized: {message}")]
    Sample {
        /// The Rust type.
        rust_type: &'static str,
        /// The serializer's error.
        message: String,
    },
    /// Several errors at once.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ContractError>),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A file that is not a JSON schema.
    #[error("{path}: not JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The error.
        source: serde_json::Error,
    },
}

/// One registered event type and version.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub rust_type: &'static str,
    pub aggregate_type: &'static str,
    pub schema: Value,
    /// Sample payloads and their keys (AsyncAPI examples).
    pub examples: Vec<(String, Value)>,
}

/// The event types of an application, each with its JSON Schema.
///
/// Register a sample value of each event type (for an enum, one per
/// variant): the topic comes from the type, the event type, version and key
/// from the value, exactly as the outbox would write it. An older version
/// kept for its schema is a separate Rust type declaring the same event type
/// and the old version (`#[event(event_type = "OrderPlaced", version = 1)]`).
///
/// ```ignore
/// let catalogue = Catalogue::new("orders-service")
///     .event(&OrderPlaced { order_id: Uuid::nil(), amount_cents: 1250 })
///     .event(&OrderPlacedV1 { order_id: Uuid::nil() });
/// catalogue.export("schemas")?;
/// ```
#[derive(Debug, Clone)]
pub struct Catalogue {
    title: String,
    api_version: String,
    pub(crate) entries: BTreeMap<EventKey, Entry>,
    errors: Vec<ContractError>,
}

impl Clone for ContractError {
    fn clone(&self) -> Self {
        match self {
            Self::Duplicate { key, first, second } => Self::Duplicate {
                key: key.clone(),
                first,
                second,
            },
            Self::Name {
                name,
                what,
                rust_type,
            } => Self::Name {
                name: name.clone(),
                what,
                rust_type,
            },
            Self::Sample { rust_type, message } => Self::Sample {
                rust_type,
                message: message.clone(),
            },
            Self::Many(errors) => Self::Many(errors.clone()),
            other => Self::Many(vec![Self::Io {
                path: PathBuf::new(),
                source: std::io::Error::other(other.to_string()),
            }]),
        }
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The JSON Schema (draft 2020-12) of `T`, as `schemars` generates it.
pub fn schema_of<T: JsonSchema>() -> Value {
    SchemaSettings::draft2020_12()
        .into_generator()
        .into_root_schema_for::<T>()
        .to_value()
}

impl Catalogue {
    /// An empty catalogue of the application `title` (the AsyncAPI title).
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            api_version: String::from("1"),
            entries: BTreeMap::new(),
            errors: Vec::new(),
        }
    }

    /// The version of the application's API (the AsyncAPI `info.version`,
    /// default `1`).
    pub fn api_version(mut self, version: impl Into<String>) -> Self {
        self.api_version = version.into();
        self
    }

    /// Registers the event type and version of `sample`. A second Rust type
    /// claiming the same topic, event type and version is an error, reported
    /// by [`check`](Self::check) and [`export`](Self::export) with both
    /// types' names; the same type again adds an example.
    pub fn event<T: DomainEvent + JsonSchema>(mut self, sample: &T) -> Self {
        if let Err(error) = self.add(sample) {
            self.errors.push(error);
        }
        self
    }

    /// Registers `sample` like [`event`](Self::event), failing at once.
    pub fn add<T: DomainEvent + JsonSchema>(&mut self, sample: &T) -> Result<(), ContractError> {
        let rust_type = std::any::type_name::<T>();
        for (name, what) in [(T::TOPIC, "topic"), (sample.event_type(), "event type")] {
            if !valid_name(name) {
                return Err(ContractError::Name {
                    name: name.to_owned(),
                    what,
                    rust_type,
                });
            }
        }
        let key = EventKey {
            topic: T::TOPIC.to_owned(),
            event_type: sample.event_type().to_owned(),
            version: sample.event_version(),
        };
        let payload = serde_json::to_value(sample).map_err(|error| ContractError::Sample {
            rust_type,
            message: error.to_string(),
        })?;
        let example = (sample.partition_key(), payload);
        if let Some(entry) = self.entries.get_mut(&key) {
            if entry.rust_type != rust_type {
                return Err(ContractError::Duplicate {
                    key,
                    first: entry.rust_type,
                    second: rust_type,
                });
            }
            entry.examples.push(example);
            return Ok(());
        }
        self.entries.insert(
            key,
            Entry {
                rust_type,
                aggregate_type: T::AGGREGATE_TYPE,
                schema: schema_of::<T>(),
                examples: vec![example],
            },
        );
        Ok(())
    }

    /// The registered event types and versions, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &EventKey> {
        self.entries.keys()
    }

    /// The JSON Schema of a registered event type and version.
    pub fn schema(&self, key: &EventKey) -> Option<&Value> {
        self.entries.get(key).map(|e| &e.schema)
    }

    /// The application title given to [`new`](Self::new).
    pub fn title(&self) -> &str {
        &self.title
    }

    pub(crate) fn version_text(&self) -> &str {
        &self.api_version
    }

    /// Fails with every registration error (duplicates, bad names).
    pub fn check(&self) -> Result<(), ContractError> {
        match self.errors.as_slice() {
            [] => Ok(()),
            [one] => Err(one.clone()),
            many => Err(ContractError::Many(many.to_vec())),
        }
    }

    /// The AsyncAPI 3.0 document of the catalogue.
    pub fn asyncapi(&self) -> Result<Value, ContractError> {
        self.check()?;
        Ok(super::asyncapi::document(self))
    }

    /// The schema a broker's file schema registry expects for `topic`
    /// (`<topic>.json`): the record value must match one of the topic's
    /// registered event types and versions (older versions included: their
    /// rows may still be in an outbox or replayed); the key is not checked.
    pub fn topic_schema(&self, topic: &str) -> Value {
        let mut defs = serde_json::Map::new();
        let mut any_of = Vec::new();
        for (key, entry) in self.entries.iter().filter(|(k, _)| k.topic == topic) {
            let name = format!("{}.v{}", key.event_type, key.version);
            // The broker compiles the value's schema on its own: references
            // are relative to it, not to this file's root.
            let at = format!("/$defs/{}", pointer_segment(&name));
            any_of.push(json!({"$ref": format!("#{at}")}));
            defs.insert(name, embed(entry.schema.clone(), &at));
        }
        json!({
            "type": "object",
            "properties": {
                "value": {
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "anyOf": any_of,
                    "$defs": defs,
                }
            }
        })
    }

    /// Writes the catalogue into `dir` (created if missing): `asyncapi.json`,
    /// `<topic>/<event type>.v<version>.json` per event type and version, and
    /// `<topic>.json` per topic for a broker's file schema registry. Files are
    /// pretty JSON with sorted keys, so that a committed snapshot diffs well.
    /// Schema files of event types no longer registered are removed.
    pub fn export(&self, dir: impl AsRef<Path>) -> Result<Exported, ContractError> {
        self.check()?;
        let dir = dir.as_ref();
        let mut written = Vec::new();
        let write = |relative: PathBuf, value: &Value, written: &mut Vec<PathBuf>| {
            let path = dir.join(&relative);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|source| ContractError::Io {
                    path: parent.to_owned(),
                    source,
                })?;
            }
            std::fs::write(&path, pretty(value))
                .map_err(|source| ContractError::Io { path, source })?;
            written.push(relative);
            Ok::<(), ContractError>(())
        };
        for (key, entry) in &self.entries {
            write(key.file(), &entry.schema, &mut written)?;
        }
        let topics: BTreeSet<&str> = self.entries.keys().map(|k| k.topic.as_str()).collect();
        for topic in &topics {
            write(
                PathBuf::from(format!("{topic}.json")),
                &self.topic_schema(topic),
                &mut written,
            )?;
        }
        write(
            PathBuf::from("asyncapi.json"),
            &super::asyncapi::document(self),
            &mut written,
        )?;
        let mut removed = Vec::new();
        for stale in super::check::schema_files(dir)?
            .into_keys()
            .filter(|k| !self.entries.contains_key(k))
        {
            let path = dir.join(stale.file());
            std::fs::remove_file(&path).map_err(|source| ContractError::Io {
                path: path.clone(),
                source,
            })?;
            removed.push(stale.file());
        }
        Ok(Exported { written, removed })
    }
}

/// What [`Catalogue::export`] did, paths relative to the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    /// Files written.
    pub written: Vec<PathBuf>,
    /// Schema files of event types no longer registered, removed.
    pub removed: Vec<PathBuf>,
}
