//! Validation of what parsing alone cannot decide: a legal Kafka topic, one
//! aggregate id per event type, at most one partition key and event id,
//! distinct event types, and the rules on where attributes may go.

use std::collections::BTreeMap;

use syn::{Ident, LitInt};

use crate::internals::Ctxt;
use crate::internals::ast::{Container, Event};
use crate::internals::attr;
use crate::internals::symbol::{AGGREGATE_ID, EVENT_ID, PARTITION_KEY, Symbol};

/// Kafka's limit on the length of a topic name.
const MAX_TOPIC_LEN: usize = 249;

/// Checks a parsed `#[derive(DomainEvent)]` input, recording every problem.
pub fn check(cx: &Ctxt, cont: &Container) {
    check_topic(cx, cont);
    check_aggregate_type(cx, cont);
    check_enum(cx, cont);
    check_upcast_from(cx, cont);
    for event in cont.events() {
        check_event(cx, event);
    }
    check_distinct_event_types(cx, cont);
}

fn check_topic(cx: &Ctxt, cont: &Container) {
    match &cont.attrs.topic {
        // Written with a value of the wrong kind: already reported.
        None if cont.attrs.topic_written => {}
        None => cx.error_spanned_by(
            cont.ident,
            "missing `#[event(topic = \"...\")]`: a DomainEvent needs the Kafka topic it is \
             published to",
        ),
        Some(lit) => {
            if let Err(msg) = kafka_topic(&lit.value()) {
                cx.error_spanned_by(lit, msg);
            }
        }
    }
}

fn check_aggregate_type(cx: &Ctxt, cont: &Container) {
    if let Some(lit) = &cont.attrs.aggregate_type
        && lit.value().is_empty()
    {
        cx.error_spanned_by(lit, "`aggregate_type` must not be empty");
    }
}

fn check_enum(cx: &Ctxt, cont: &Container) {
    if !cont.is_enum() {
        return;
    }
    if let Some((key, _)) = &cont.attrs.event_type {
        cx.error_spanned_by(
            key,
            "`#[event(event_type = \"...\")]` names one event type: on an enum, put it on each \
             variant (each defaults to the variant's name)",
        );
    }
    if cont.events().is_empty() {
        cx.error_spanned_by(
            cont.ident,
            "an enum without variants cannot be a DomainEvent: it carries no event type",
        );
    }
}

/// `upcast_from(...)`: on a struct (an enum's variants read their declared
/// version only), not generic, of a version after 1.
fn check_upcast_from(cx: &Ctxt, cont: &Container) {
    let Some((key, _)) = &cont.attrs.upcast_from else {
        return;
    };
    if cont.is_enum() {
        cx.error_spanned_by(
            key,
            "`upcast_from` is for a struct event: an enum's variants read their declared \
             version only; give the event type its own struct to evolve it",
        );
    } else if !cont.generics.params.is_empty() {
        cx.error_spanned_by(
            key,
            "`upcast_from` is not supported on a generic event type",
        );
    } else if cont.default_version() < 2 {
        cx.error_spanned_by(
            key,
            "`upcast_from` converts the previous version into this one: declare this one's \
             version, 2 or more (`#[event(version = 2, upcast_from(...))]`)",
        );
    }
}

fn check_event(cx: &Ctxt, event: &Event) {
    if let Some(lit) = &event.attrs.event_type
        && lit.value().is_empty()
    {
        cx.error_spanned_by(lit, "`event_type` must not be empty");
    }

    if event.fields.is_empty() {
        let msg = format!(
            "`{}` has no fields, but an event needs one marked `#[event(aggregate_id)]`: the id \
             of the aggregate the event belongs to",
            event.ident,
        );
        cx.error_spanned_by(event.ident, msg);
        return;
    }

    if event.aggregate_id().is_none() {
        cx.error_spanned_by(
            event.ident,
            "no field is marked `#[event(aggregate_id)]`: mark the field that identifies the \
             aggregate (it is also the partition key unless `#[event(partition_key)]` marks \
             another)",
        );
    }

    at_most_one(cx, event, AGGREGATE_ID, "aggregate id", |f| {
        f.aggregate_id.as_ref()
    });
    at_most_one(cx, event, PARTITION_KEY, "partition key", |f| {
        f.partition_key.as_ref()
    });
    at_most_one(cx, event, EVENT_ID, "event id", |f| f.event_id.as_ref());
}

/// Reports every field after the first that plays the role `key`, on its key.
fn at_most_one(
    cx: &Ctxt,
    event: &Event,
    key: Symbol,
    role: &str,
    marker: impl Fn(&attr::Field) -> Option<&syn::Path>,
) {
    let mut marked = event
        .fields
        .iter()
        .filter_map(|field| marker(&field.attrs).map(|path| (field, path)));
    let Some((first, _)) = marked.next() else {
        return;
    };
    for (_, path) in marked {
        let msg = format!(
            "duplicate `#[event({key})]`: field `{}` is already the {role}",
            first.name(),
        );
        cx.error_spanned_by(path, msg);
    }
}

/// Two variants of an enum must not carry the same event type: decoding could
/// not tell them apart.
fn check_distinct_event_types(cx: &Ctxt, cont: &Container) {
    let mut seen: BTreeMap<String, &Ident> = BTreeMap::new();
    for event in cont.events() {
        let event_type = event.event_type();
        if let Some(first) = seen.get(&event_type) {
            let msg = format!("duplicate event type `{event_type}`: variant `{first}` has it too");
            cx.error_at(event.event_type_span(), msg);
        } else {
            seen.insert(event_type, event.ident);
        }
    }
}

/// Checks a Kafka topic name: 1 to 249 characters among ASCII letters,
/// digits, `.`, `_` and `-`, and neither `.` nor `..`.
pub fn kafka_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty() {
        return Err("the Kafka topic must not be empty".to_owned());
    }
    if topic == "." || topic == ".." {
        return Err(format!(
            "`{topic}` is not a legal Kafka topic: `.` and `..` are reserved"
        ));
    }
    if let Some(c) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "illegal character {c:?} in Kafka topic `{topic}`: a topic may only contain ASCII \
             letters, digits, `.`, `_` and `-`"
        ));
    }
    if topic.len() > MAX_TOPIC_LEN {
        return Err(format!(
            "the Kafka topic is {} characters long; the limit is {MAX_TOPIC_LEN}",
            topic.len()
        ));
    }
    Ok(())
}

/// Checks a declared schema version: at least 1 and, since the outbox stores
/// it as an `INT4`, at most `i32::MAX`.
pub fn event_version(lit: &LitInt) -> Result<u32, String> {
    let value = lit
        .base10_parse::<u64>()
        .map_err(|_| format!("`version` must be at most {}", i32::MAX))?;
    if value == 0 {
        return Err("`version` must be at least 1".to_owned());
    }
    if value > i32::MAX as u64 {
        return Err(format!(
            "`version` must be at most {} (it is stored as an INT4)",
            i32::MAX
        ));
    }
    Ok(value as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legal_topics() {
        for topic in [
            "orders",
            "a",
            "Orders.v2",
            "order_events-2024",
            "...",
            "a..b",
        ] {
            assert_eq!(kafka_topic(topic), Ok(()), "{topic}");
        }
        assert_eq!(kafka_topic(&"x".repeat(249)), Ok(()));
    }

    #[test]
    fn empty_topic() {
        assert_eq!(
            kafka_topic(""),
            Err("the Kafka topic must not be empty".to_owned())
        );
    }

    #[test]
    fn dot_topics() {
        for topic in [".", ".."] {
            let err = kafka_topic(topic).unwrap_err();
            assert!(err.contains("reserved"), "{err}");
        }
    }

    #[test]
    fn illegal_characters() {
        for (topic, c) in [
            ("order events", ' '),
            ("orders/v2", '/'),
            ("comandes-é", 'é'),
            ("a:b", ':'),
            ("tab\t", '\t'),
        ] {
            let err = kafka_topic(topic).unwrap_err();
            assert!(
                err.starts_with(&format!("illegal character {c:?}")),
                "{err}"
            );
        }
    }

    #[test]
    fn too_long() {
        let err = kafka_topic(&"x".repeat(250)).unwrap_err();
        assert_eq!(
            err,
            "the Kafka topic is 250 characters long; the limit is 249"
        );
    }

    fn version(src: &str) -> Result<u32, String> {
        event_version(&syn::parse_str::<LitInt>(src).unwrap())
    }

    #[test]
    fn versions() {
        assert_eq!(version("1"), Ok(1));
        assert_eq!(version("2u32"), Ok(2));
        assert_eq!(version("2147483647"), Ok(2_147_483_647));
        assert!(version("0").unwrap_err().contains("at least 1"));
        assert!(version("2147483648").unwrap_err().contains("at most"));
        assert!(
            version("99999999999999999999999")
                .unwrap_err()
                .contains("at most")
        );
    }
}
