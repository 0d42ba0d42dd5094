//! The compatibility check: compares the schemas of a committed snapshot with
//! the current ones, per event type and version, and names every change with
//! its field path and whether it breaks consumers.
//!
//! Breaking (an event of the same version can no longer be read by one side):
//! a field removed or renamed, a required field added, an optional field
//! made required, a type or format changed, `null` no longer allowed, an
//! enum value or variant removed, an event type's version dropped from the
//! catalogue. Compatible: an optional field added, a field made optional, an
//! enum value or variant added, descriptions and titles changed, a new
//! version or a new event type.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::catalogue::{ContractError, EventKey};

/// What changed between two schemas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breaking {
    /// A field the old schema had is gone (removed or renamed).
    FieldRemoved,
    /// A new field is required: events written before lack it.
    RequiredFieldAdded,
    /// A field that could be absent is now required.
    BecameRequired,
    /// The type or format of a value changed, or `null` is no longer allowed.
    TypeChanged,
    /// An enum value or variant is gone.
    VariantRemoved,
    /// An event type and version of the snapshot is no longer registered.
    EventRemoved,
}

/// A change that does not break consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compatible {
    /// A new optional field.
    OptionalFieldAdded,
    /// A required field may now be absent (or `null`).
    BecameOptional,
    /// A new enum value or variant: consumers built before it fail on
    /// events that carry it (dead letters) until they are upgraded.
    VariantAdded,
    /// A new version of an event type in the snapshot.
    NewVersion,
    /// A new event type.
    NewEventType,
}

/// One change of one event type and version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The event type and version.
    pub key: EventKey,
    /// The field path (`customer`, `address.city`, `lines[].sku`,
    /// `payment(Card).number`); empty for the event itself.
    pub path: String,
    /// `Ok` for a compatible change, `Err` for a breaking one.
    pub kind: Result<Compatible, Breaking>,
    /// What changed, in words.
    pub detail: String,
}

impl Change {
    /// True when the change breaks consumers.
    pub fn is_breaking(&self) -> bool {
        self.kind.is_err()
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = if self.is_breaking() {
            "breaking"
        } else {
            "compatible"
        };
        write!(
            f,
            "{label}: {} v{} (topic `{}`)",
            self.key.event_type, self.key.version, self.key.topic
        )?;
        if !self.path.is_empty() {
            write!(f, ", field `{}`", self.path)?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// The changes between a snapshot and the current schemas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Every change, breaking or not, by event type and version.
    pub changes: Vec<Change>,
}

impl Report {
    /// The breaking changes.
    pub fn breaking(&self) -> impl Iterator<Item = &Change> {
        self.changes.iter().filter(|c| c.is_breaking())
    }

    /// True when nothing breaks consumers.
    pub fn is_compatible(&self) -> bool {
        self.breaking().next().is_none()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for change in &self.changes {
            writeln!(f, "{change}")?;
        }
        let breaking = self.breaking().count();
        if breaking > 0 {
            writeln!(
                f,
                "{breaking} breaking change(s): keep the old shape, or declare a new version \
                 (`#[event(version = N)]`) and keep the old version's type registered"
            )
        } else {
            writeln!(f, "compatible with the snapshot")
        }
    }
}

/// The schema files of an export directory, by event type and version:
/// `<topic>/<event type>.v<version>.json`.
pub(crate) fn schema_files(dir: &Path) -> Result<BTreeMap<EventKey, PathBuf>, ContractError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ContractError::Io { path, source }
    };
    let mut files = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(files),
        Err(error) => return Err(io(dir)(error)),
    };
    for topic_dir in entries {
        let topic_dir = topic_dir.map_err(io(dir))?.path();
        if !topic_dir.is_dir() {
            continue;
        }
        let Some(topic) = topic_dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        for file in std::fs::read_dir(&topic_dir).map_err(io(&topic_dir))? {
            let path = file.map_err(io(&topic_dir))?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some((event_type, version)) = name
                .strip_suffix(".json")
                .and_then(|stem| stem.rsplit_once(".v"))
            else {
                continue;
            };
            let Ok(version) = version.parse::<u32>() else {
                continue;
            };
            files.insert(
                EventKey {
                    topic: topic.to_owned(),
                    event_type: event_type.to_owned(),
                    version,
                },
                path,
            );
        }
    }
    Ok(files)
}

fn read_json(path: &Path) -> Result<Value, ContractError> {
    let text = std::fs::read(path).map_err(|source| ContractError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| ContractError::Json {
        path: path.to_owned(),
        source,
    })
}

/// Compares the schemas exported in `current` with those of the snapshot
/// `snapshot` (both directories written by `Catalogue::export`).
pub fn check_dirs(snapshot: &Path, current: &Path) -> Result<Report, ContractError> {
    let old = schema_files(snapshot)?;
    let new = schema_files(current)?;
    let mut changes = Vec::new();
    for (key, old_path) in &old {
        match new.get(key) {
            None => changes.push(Change {
                key: key.clone(),
                path: String::new(),
                kind: Err(Breaking::EventRemoved),
                detail: format!(
                    "in the snapshot but no longer registered: events of this version may still be \
                     in outboxes and topics; register its Rust type again, or delete `{}` from the \
                     snapshot if no such event exists anywhere",
                    key.file().display()
                ),
            }),
            Some(new_path) => {
                let (old_schema, new_schema) = (read_json(old_path)?, read_json(new_path)?);
                changes.extend(compare_schemas(&old_schema, &new_schema).into_iter().map(
                    |(path, kind, detail)| Change {
                        key: key.clone(),
                        path,
                        kind,
                        detail,
                    },
                ));
            }
        }
    }
    for key in new.keys().filter(|k| !old.contains_key(k)) {
        let older = old
            .keys()
            .any(|k| k.topic == key.topic && k.event_type == key.event_type);
        changes.push(Change {
            key: key.clone(),
            path: String::new(),
            kind: Ok(if older {
                Compatible::NewVersion
            } else {
                Compatible::NewEventType
            }),
            detail: if older {
                "a new version".into()
            } else {
                "a new event type".into()
            },
        });
    }
    changes.sort_by(|a, b| (&a.key, &a.path).cmp(&(&b.key, &b.path)));
    Ok(Report { changes })
}

/// One difference found by [`compare_schemas`]: the field path, its kind and
/// a description.
pub type Difference = (String, Result<Compatible, Breaking>, String);

/// Compares two JSON Schemas of one event type and version (each a whole
/// document: `$ref`s are resolved against its own root).
pub fn compare_schemas(old: &Value, new: &Value) -> Vec<Difference> {
    let mut walk = Walk {
        old_root: old,
        new_root: new,
        ancestors: Vec::new(),
        out: Vec::new(),
    };
    walk.compare(old, new, "", false);
    walk.out
}

struct Walk<'a> {
    old_root: &'a Value,
    new_root: &'a Value,
    /// The `$ref` trails being compared above this point: a recursive type
    /// is compared once per path, not for ever.
    ancestors: Vec<(String, String)>,
    out: Vec<Difference>,
}

/// A schema with its `$ref`s followed and its `null` alternative set apart.
struct Node<'a> {
    schema: &'a Value,
    nullable: bool,
    /// Types other than `null` (empty when the schema names none).
    types: BTreeSet<String>,
    /// Alternatives other than `{"type": "null"}` (`oneOf` / `anyOf`).
    alternatives: Vec<&'a Value>,
}

fn resolve<'a>(root: &'a Value, mut schema: &'a Value, trail: &mut String) -> &'a Value {
    for _ in 0..32 {
        let Some(reference) = schema.get("$ref").and_then(Value::as_str) else {
            break;
        };
        let Some(target) = reference
            .strip_prefix('#')
            .and_then(|pointer| root.pointer(pointer))
        else {
            break;
        };
        trail.push_str(reference);
        schema = target;
    }
    schema
}

/// The alternatives of `node`, or the node itself when it has none.
fn as_list<'a>(node: &Node<'a>) -> Vec<&'a Value> {
    match node.alternatives.as_slice() {
        [] => vec![node.schema],
        some => some.to_vec(),
    }
}

fn is_null_schema(schema: &Value) -> bool {
    schema.get("type").and_then(Value::as_str) == Some("null")
        || schema.get("const") == Some(&Value::Null)
}

fn node<'a>(root: &'a Value, schema: &'a Value, trail: &mut String) -> Node<'a> {
    let schema = resolve(root, schema, trail);
    let mut nullable = false;
    let mut types = BTreeSet::new();
    match schema.get("type") {
        Some(Value::String(t)) => {
            types.insert(t.clone());
        }
        Some(Value::Array(list)) => {
            types.extend(list.iter().filter_map(|t| t.as_str().map(String::from)))
        }
        _ => {}
    }
    if types.remove("null") {
        nullable = true;
    }
    let mut alternatives = Vec::new();
    for keyword in ["oneOf", "anyOf"] {
        if let Some(Value::Array(list)) = schema.get(keyword) {
            for alternative in list {
                if is_null_schema(resolve(root, alternative, &mut String::new())) {
                    nullable = true;
                } else {
                    alternatives.push(alternative);
                }
            }
        }
    }
    // `Option<Struct>`: `anyOf: [{"$ref": ...}, {"type": "null"}]`.
    if alternatives.len() == 1 && types.is_empty() && schema.get("properties").is_none() {
        let mut inner = node(root, alternatives[0], trail);
        inner.nullable |= nullable;
        return inner;
    }
    Node {
        schema,
        nullable,
        types,
        alternatives,
    }
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_owned()
    } else {
        format!("{path}.{field}")
    }
}

fn names(types: &BTreeSet<String>, schema: &Value) -> String {
    let mut text = types.iter().cloned().collect::<Vec<_>>().join(" | ");
    if let Some(format) = schema.get("format").and_then(Value::as_str) {
        text.push_str(&format!(" ({format})"));
    }
    text
}

fn strings(schema: &Value, keyword: &str) -> BTreeSet<String> {
    match schema.get(keyword) {
        Some(Value::Array(list)) => list
            .iter()
            .map(|v| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .collect(),
        _ => BTreeSet::new(),
    }
}

impl Walk<'_> {
    fn push(&mut self, path: &str, kind: Result<Compatible, Breaking>, detail: String) {
        self.out.push((path.to_owned(), kind, detail));
    }

    /// Compares `old` and `new` at `path`; `became_required` when the field
    /// itself became required (reported there, not again as `null` lost).
    fn compare(&mut self, old: &Value, new: &Value, path: &str, became_required: bool) {
        let (mut old_trail, mut new_trail) = (String::new(), String::new());
        let o = node(self.old_root, old, &mut old_trail);
        let n = node(self.new_root, new, &mut new_trail);
        let trails = (old_trail, new_trail);
        let referenced = !(trails.0.is_empty() && trails.1.is_empty());
        if referenced {
            if self.ancestors.contains(&trails) {
                return;
            }
            self.ancestors.push(trails);
        }
        self.compare_nodes(&o, &n, path, became_required);
        if referenced {
            self.ancestors.pop();
        }
    }

    fn compare_nodes(&mut self, o: &Node<'_>, n: &Node<'_>, path: &str, became_required: bool) {
        if o.nullable && !n.nullable && !became_required {
            self.push(
                path,
                Err(Breaking::TypeChanged),
                "`null` is no longer allowed".into(),
            );
        } else if !o.nullable && n.nullable {
            self.push(
                path,
                Ok(Compatible::BecameOptional),
                "may now be `null`".into(),
            );
        }
        // An enum whose variants are all bare values is an `enum` list; with
        // data it becomes alternatives: compare the variants either way.
        if !o.alternatives.is_empty() || !n.alternatives.is_empty() {
            let old_variants = self.variants(self.old_root, &as_list(o));
            let new_variants = self.variants(self.new_root, &as_list(n));
            if let (Some(old_variants), Some(new_variants)) = (old_variants, new_variants) {
                self.compare_variants(&old_variants, &new_variants, path);
                return;
            }
        }
        let (old_format, new_format) = (o.schema.get("format"), n.schema.get("format"));
        if (!o.types.is_empty() || !n.types.is_empty())
            && (o.types != n.types || old_format != new_format)
        {
            self.push(
                path,
                Err(Breaking::TypeChanged),
                format!(
                    "type changed from {} to {}",
                    describe(&o.types, o.schema),
                    describe(&n.types, n.schema)
                ),
            );
            return;
        }
        self.compare_values(o.schema, n.schema, path);
        self.compare_alternatives(&o.alternatives, &n.alternatives, path);
        self.compare_object(o.schema, n.schema, path);
        for keyword in ["items", "additionalProperties"] {
            if let (Some(a), Some(b)) = (o.schema.get(keyword), n.schema.get(keyword))
                && a.is_object()
                && b.is_object()
            {
                let suffix = if keyword == "items" { "[]" } else { "{}" };
                self.compare(a, b, &format!("{path}{suffix}"), false);
            }
        }
        if let (Some(Value::Array(a)), Some(Value::Array(b))) =
            (o.schema.get("prefixItems"), n.schema.get("prefixItems"))
        {
            if a.len() != b.len() {
                self.push(
                    path,
                    Err(Breaking::TypeChanged),
                    format!("tuple of {} items became one of {}", a.len(), b.len()),
                );
            }
            for (i, (a, b)) in a.iter().zip(b).enumerate() {
                self.compare(a, b, &format!("{path}[{i}]"), false);
            }
        }
    }

    fn compare_values(&mut self, old: &Value, new: &Value, path: &str) {
        let (old_values, new_values) = (strings(old, "enum"), strings(new, "enum"));
        if !old_values.is_empty() || !new_values.is_empty() {
            for gone in old_values.difference(&new_values) {
                self.push(
                    path,
                    Err(Breaking::VariantRemoved),
                    format!("enum value {gone} removed"),
                );
            }
            for added in new_values.difference(&old_values) {
                self.push(
                    path,
                    Ok(Compatible::VariantAdded),
                    format!("enum value {added} added"),
                );
            }
        }
        if let (Some(a), Some(b)) = (old.get("const"), new.get("const"))
            && a != b
        {
            self.push(
                path,
                Err(Breaking::TypeChanged),
                format!("constant changed from {a} to {b}"),
            );
        }
    }

    fn compare_object(&mut self, old: &Value, new: &Value, path: &str) {
        let empty = serde_json::Map::new();
        let old_props = old.get("properties").and_then(Value::as_object);
        let new_props = new.get("properties").and_then(Value::as_object);
        if old_props.is_none() && new_props.is_none() {
            return;
        }
        let (old_props, new_props) = (old_props.unwrap_or(&empty), new_props.unwrap_or(&empty));
        let (old_required, new_required) = (strings(old, "required"), strings(new, "required"));
        let removed: Vec<&String> = old_props
            .keys()
            .filter(|k| !new_props.contains_key(*k))
            .collect();
        let added_required: Vec<&String> = new_props
            .keys()
            .filter(|k| !old_props.contains_key(*k) && new_required.contains(*k))
            .collect();
        for field in &removed {
            let hint = match added_required.as_slice() {
                [one] if removed.len() == 1 => format!(" (renamed to `{one}`?)"),
                _ => String::new(),
            };
            self.push(
                &join(path, field),
                Err(Breaking::FieldRemoved),
                format!("field removed{hint}"),
            );
        }
        for (field, new_schema) in new_props {
            let at = join(path, field);
            match old_props.get(field) {
                None if new_required.contains(field) => self.push(
                    &at,
                    Err(Breaking::RequiredFieldAdded),
                    "required field added: events written before lack it".into(),
                ),
                None => self.push(
                    &at,
                    Ok(Compatible::OptionalFieldAdded),
                    "optional field added".into(),
                ),
                Some(old_schema) => {
                    let (was, is) = (old_required.contains(field), new_required.contains(field));
                    if !was && is {
                        self.push(
                            &at,
                            Err(Breaking::BecameRequired),
                            "optional field became required: events written before may lack it"
                                .into(),
                        );
                    } else if was && !is {
                        self.push(
                            &at,
                            Ok(Compatible::BecameOptional),
                            "field became optional".into(),
                        );
                    }
                    self.compare(old_schema, new_schema, &at, !was && is);
                }
            }
        }
    }

    fn compare_variants(
        &mut self,
        old: &BTreeMap<String, Option<&Value>>,
        new: &BTreeMap<String, Option<&Value>>,
        path: &str,
    ) {
        for (id, old_schema) in old {
            match new.get(id) {
                None => self.push(
                    path,
                    Err(Breaking::VariantRemoved),
                    format!("variant `{id}` removed"),
                ),
                Some(new_schema) => {
                    if let (Some(a), Some(b)) = (old_schema, new_schema) {
                        self.compare(a, b, &format!("{path}({id})"), false);
                    }
                }
            }
        }
        for id in new.keys().filter(|id| !old.contains_key(*id)) {
            self.push(
                path,
                Ok(Compatible::VariantAdded),
                format!("variant `{id}` added"),
            );
        }
    }

    /// Alternatives that cannot be named are compared by position.
    fn compare_alternatives(&mut self, old: &[&Value], new: &[&Value], path: &str) {
        if old.is_empty() && new.is_empty() {
            return;
        }
        if old.len() == new.len() {
            for (i, (a, b)) in old.iter().zip(new).enumerate() {
                self.compare(a, b, &format!("{path}(#{i})"), false);
            }
        } else {
            self.push(
                path,
                Err(Breaking::TypeChanged),
                format!("{} alternatives became {}", old.len(), new.len()),
            );
        }
    }

    /// Names each alternative when all can be named: by a constant (a tag
    /// property's or its own), by its enum values, or by its single required
    /// property (serde's externally tagged enums). The schema to compare
    /// further is `None` for a bare value.
    #[allow(clippy::type_complexity)]
    fn variants<'v>(
        &self,
        root: &'v Value,
        alternatives: &[&'v Value],
    ) -> Option<BTreeMap<String, Option<&'v Value>>> {
        let mut ids = BTreeMap::new();
        for alternative in alternatives {
            let schema = resolve(root, alternative, &mut String::new());
            let text = |v: &Value| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            if let Some(value) = schema.get("const") {
                ids.insert(text(value), None);
                continue;
            }
            if let Some(Value::Array(values)) = schema.get("enum") {
                for value in values {
                    ids.insert(text(value), None);
                }
                continue;
            }
            let properties = schema.get("properties").and_then(Value::as_object)?;
            let tag = properties
                .values()
                .find_map(|p| resolve(root, p, &mut String::new()).get("const").map(text));
            if let Some(tag) = tag {
                ids.insert(tag, Some(*alternative));
                continue;
            }
            let required = strings(schema, "required");
            if properties.len() == 1 && required.len() == 1 {
                let name = required.into_iter().next()?;
                ids.insert(name.clone(), properties.get(&name));
                continue;
            }
            return None;
        }
        Some(ids)
    }
}

fn describe(types: &BTreeSet<String>, schema: &Value) -> String {
    if types.is_empty() {
        if schema.get("enum").is_some() || schema.get("const").is_some() {
            "an enumeration".into()
        } else if schema.get("oneOf").is_some() || schema.get("anyOf").is_some() {
            "alternatives".into()
        } else {
            "any value".into()
        }
    } else {
        names(types, schema)
    }
}
