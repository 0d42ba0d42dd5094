//! The AsyncAPI 3.0 document of a catalogue: a channel per topic, a message
//! per event type and version with its payload schema, the Kafka key and the
//! headers the relay writes, and a `send` operation per topic.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::catalogue::Catalogue;
use super::json::{embed, pointer_segment};

/// The headers every message carries (written by the relay from the outbox
/// row), then those it carries when set.
const IDENTITY_HEADERS: [(&str, &str); 6] = [
    (
        "event_id",
        "The event's unique id (UUID); consumers deduplicate by it.",
    ),
    ("event_type", "The event type name."),
    (
        "event_version",
        "The schema version of the event type (decimal).",
    ),
    ("aggregate_type", "The aggregate type the event belongs to."),
    ("aggregate_id", "The id of the aggregate instance."),
    ("content-type", "Always `application/json`."),
];
const OPTIONAL_HEADERS: [(&str, &str); 5] = [
    (
        "correlation_id",
        "The id shared by every message of one business flow (UUID).",
    ),
    (
        "causation_id",
        "The id of the message that caused this one (UUID).",
    ),
    (
        "traceparent",
        "W3C trace context of the span that recorded the event.",
    ),
    ("tracestate", "W3C trace state accompanying `traceparent`."),
    (
        "replay_id",
        "Set on messages sent again by a replay: the replay's id.",
    ),
];

/// The AsyncAPI document of `catalogue`.
pub(crate) fn document(catalogue: &Catalogue) -> Value {
    let mut channels: BTreeMap<&str, Map<String, Value>> = BTreeMap::new();
    let mut messages = Map::new();
    let mut schemas = Map::new();
    for (key, entry) in &catalogue.entries {
        let id = key.id();
        let schema_at = format!("/components/schemas/{}", pointer_segment(&id));
        schemas.insert(id.clone(), embed(entry.schema.clone(), &schema_at));

        let mut properties = Map::new();
        for (name, description) in IDENTITY_HEADERS.iter().chain(&OPTIONAL_HEADERS) {
            properties.insert(
                (*name).to_owned(),
                json!({"type": "string", "description": description}),
            );
        }
        properties.insert("event_type".into(), json!({"const": key.event_type}));
        properties.insert(
            "event_version".into(),
            json!({"const": key.version.to_string()}),
        );
        properties.insert(
            "aggregate_type".into(),
            json!({"const": entry.aggregate_type}),
        );
        properties.insert("content-type".into(), json!({"const": "application/json"}));
        let headers = json!({
            "type": "object",
            "properties": properties,
            "required": IDENTITY_HEADERS.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            "additionalProperties": {"type": "string"},
        });
        let examples: Vec<Value> = entry
            .examples
            .iter()
            .enumerate()
            .map(|(n, (partition_key, payload))| {
                json!({
                    "name": format!("example{}", n + 1),
                    "summary": format!("Kafka key `{partition_key}`"),
                    "headers": {
                        "event_type": key.event_type,
                        "event_version": key.version.to_string(),
                        "aggregate_type": entry.aggregate_type,
                        "content-type": "application/json",
                    },
                    "payload": payload,
                })
            })
            .collect();
        messages.insert(
            id.clone(),
            json!({
                "name": key.event_type,
                "title": format!("{} v{}", key.event_type, key.version),
                "summary": format!(
                    "`{}` version {} (Rust type `{}`)",
                    key.event_type, key.version, entry.rust_type
                ),
                "contentType": "application/json",
                "headers": headers,
                "payload": {"$ref": format!("#{schema_at}")},
                "bindings": {"kafka": {
                    "key": {
                        "type": "string",
                        "description": "The partition key (the aggregate id unless the type names another field): a key's events keep their order."
                    },
                    "bindingVersion": "0.5.0"
                }},
                "examples": examples,
            }),
        );
        channels.entry(key.topic.as_str()).or_default().insert(
            format!("{}.v{}", key.event_type, key.version),
            json!({"$ref": format!("#/components/messages/{}", pointer_segment(&id))}),
        );
    }
    let mut channel_docs = Map::new();
    let mut operations = Map::new();
    for (topic, channel_messages) in channels {
        let refs: Vec<Value> = channel_messages
            .keys()
            .map(|name| {
                json!({"$ref": format!(
                    "#/channels/{}/messages/{}",
                    pointer_segment(topic),
                    pointer_segment(name)
                )})
            })
            .collect();
        channel_docs.insert(
            topic.to_owned(),
            json!({
                "address": topic,
                "title": topic,
                "messages": channel_messages,
                "bindings": {"kafka": {"topic": topic, "bindingVersion": "0.5.0"}},
            }),
        );
        operations.insert(
            format!("publish.{topic}"),
            json!({
                "action": "send",
                "channel": {"$ref": format!("#/channels/{}", pointer_segment(topic))},
                "summary": format!("The relay publishes the outbox's `{topic}` events."),
                "messages": refs,
            }),
        );
    }
    json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": catalogue.title(),
            "version": catalogue.version_text(),
            "description": "Events published through the transactional outbox. Payloads are JSON; the Kafka key is the partition key; headers carry the event's identity.",
        },
        "defaultContentType": "application/json",
        "channels": channel_docs,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    })
}
