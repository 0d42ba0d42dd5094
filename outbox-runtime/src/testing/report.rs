//! What one [`TestBus::deliver`](super::TestBus::deliver) did — the events
//! recorded and every delivery's [`Outcome`] — with typed access to the
//! payloads, counts per event type, and assertions whose failure messages
//! show what was there instead.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use outbox_core::DomainEvent;
use uuid::Uuid;

use crate::inbox::DeadLetterReason;
use crate::relay::claim::Row;

/// An event the bus took from an outbox (and marked published).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Published {
    /// The outbox: its database (and `search_path` if set).
    pub outbox: String,
    /// The outbox row's id.
    pub id: i64,
    /// The event id.
    pub event_id: Uuid,
    /// The topic.
    pub topic: String,
    /// The Kafka key (partition key).
    pub key: String,
    /// The event type.
    pub event_type: String,
    /// The event's schema version.
    pub event_version: i32,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// The JSON payload.
    pub payload: String,
    /// The stored headers (correlation and causation ids, trace context,
    /// application entries) as JSON.
    pub headers: String,
    /// The Kafka headers the relay sends with it (and the bus delivers),
    /// in order.
    pub message_headers: Vec<(String, String)>,
}

impl Published {
    pub(super) fn of(outbox: &str, row: Row, message_headers: Vec<(String, String)>) -> Self {
        Self {
            outbox: outbox.to_owned(),
            id: row.id,
            event_id: row.event_id,
            topic: row.topic,
            key: row.partition_key,
            event_type: row.event_type,
            event_version: row.event_version,
            aggregate_type: row.aggregate_type,
            aggregate_id: row.aggregate_id,
            payload: row.payload,
            headers: row.headers,
            message_headers,
        }
    }

    /// The event as `E`, if it is one (topic and event type match, and the
    /// payload decodes: an older version through `E`'s upcasters).
    pub fn decode<E: DomainEvent>(&self) -> Option<E> {
        let version = u32::try_from(self.event_version).unwrap_or(1);
        decode(
            &self.topic,
            &self.event_type,
            version,
            self.payload.as_bytes(),
        )
    }

    /// A stored header's value (`correlation_id`, `causation_id`, …).
    pub fn header(&self, name: &str) -> Option<String> {
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&self.headers).ok()?;
        map.get(name).map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }
}

/// The event as `E`, decoded as a consumer decodes it: by its version, an
/// older one through `E`'s upcasters. A version `E` cannot read (newer, or
/// older than its upcasters) is decoded as it is, if its payload fits: a
/// dead letter of an unsupported version still shows.
fn decode<E: DomainEvent>(
    topic: &str,
    event_type: &str,
    version: u32,
    payload: &[u8],
) -> Option<E> {
    if topic != E::TOPIC || !E::EVENT_TYPES.contains(&event_type) {
        return None;
    }
    match E::from_versioned_payload(event_type, version, payload) {
        Ok(event) => Some(event),
        Err(outbox_core::Error::UnsupportedVersion { .. }) => {
            E::from_payload(event_type, payload).ok()
        }
        Err(_) => None,
    }
}

/// What became of one message delivered to one consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Its handlers ran and committed.
    Handled,
    /// Skipped: the consumer had applied (inbox mode: stored) it already,
    /// or an earlier copy in the same batch.
    Duplicate,
    /// Its event type is ignored on purpose (`ignore_event_type`).
    Ignored,
    /// Written to the dead-letter table.
    DeadLettered {
        /// Why.
        reason: DeadLetterReason,
        /// The error, as the dead letter holds it.
        error: String,
        /// Handler attempts made.
        attempts: i32,
    },
    /// None of the above: not applied (e.g. already dead-lettered at the
    /// same offset, and redelivered).
    Pending,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handled => f.write_str("handled"),
            Self::Duplicate => f.write_str("duplicate"),
            Self::Ignored => f.write_str("ignored"),
            Self::DeadLettered {
                reason,
                error,
                attempts,
            } => write!(f, "dead-lettered ({reason}, {attempts} attempts: {error})"),
            Self::Pending => f.write_str("not applied"),
        }
    }
}

/// One message delivered to one consumer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivered {
    /// The consumer group.
    pub group: String,
    /// The event id (none if its header was missing or not a UUID).
    pub event_id: Option<Uuid>,
    /// The topic.
    pub topic: String,
    /// The key.
    pub key: String,
    /// The event type.
    pub event_type: String,
    /// The event's schema version (the `event_version` header, or
    /// `ce_eventversion`; 1 if absent).
    pub event_version: u32,
    /// Its offset in the bus's log of the topic.
    pub offset: i64,
    /// The payload.
    pub payload: Vec<u8>,
    /// What happened.
    pub outcome: Outcome,
    /// The saga instances it correlates to in the consumer (one per saga
    /// of the consumer that handles its type), and what it did to each.
    pub sagas: Vec<super::SagaEffect>,
}

impl Delivered {
    /// The event as `E`, if it is one, as the handler got it (an older
    /// version through `E`'s upcasters).
    pub fn decode<E: DomainEvent>(&self) -> Option<E> {
        decode(
            &self.topic,
            &self.event_type,
            self.event_version,
            &self.payload,
        )
    }
}

/// Counts of one event type ([`Delivery::counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TypeCounts {
    /// Taken from an outbox.
    pub recorded: usize,
    /// Deliveries to consumers (copies and redeliveries included).
    pub delivered: usize,
    /// Handled.
    pub handled: usize,
    /// Skipped as duplicates.
    pub duplicates: usize,
    /// Ignored.
    pub ignored: usize,
    /// Dead-lettered.
    pub dead_lettered: usize,
}

/// What a [`TestBus::deliver`](super::TestBus::deliver) did. Its `Display`
/// lists it all; the assertions print it when they fail.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Delivery {
    /// Every event taken from an outbox, in the order taken.
    pub published: Vec<Published>,
    /// Every delivery, in order.
    pub delivered: Vec<Delivered>,
    /// Rounds run (a round delivers what the outboxes held when it started).
    pub rounds: usize,
    /// The back-offs waited on the test clock before retries, in order.
    pub retry_waits: Vec<Duration>,
    /// Failed handler attempts.
    pub handler_failures: u64,
}

impl Delivery {
    /// The published events of type `E`, decoded, in order.
    pub fn published<E: DomainEvent>(&self) -> Vec<E> {
        self.published
            .iter()
            .filter_map(Published::decode)
            .collect()
    }

    /// The events of type `E` some consumer handled, decoded, in order.
    pub fn handled_events<E: DomainEvent>(&self) -> Vec<E> {
        self.handled().filter_map(Delivered::decode).collect()
    }

    /// The deliveries that were handled.
    pub fn handled(&self) -> impl Iterator<Item = &Delivered> {
        self.delivered
            .iter()
            .filter(|d| d.outcome == Outcome::Handled)
    }

    /// The deliveries that were dead-lettered.
    pub fn dead_lettered(&self) -> impl Iterator<Item = &Delivered> {
        self.delivered
            .iter()
            .filter(|d| matches!(d.outcome, Outcome::DeadLettered { .. }))
    }

    /// How many deliveries were skipped as duplicates.
    pub fn duplicates(&self) -> usize {
        self.delivered
            .iter()
            .filter(|d| d.outcome == Outcome::Duplicate)
            .count()
    }

    /// Counts per event type.
    pub fn counts(&self) -> BTreeMap<String, TypeCounts> {
        let mut counts: BTreeMap<String, TypeCounts> = BTreeMap::new();
        for p in &self.published {
            counts.entry(p.event_type.clone()).or_default().recorded += 1;
        }
        for d in &self.delivered {
            let c = counts.entry(d.event_type.clone()).or_default();
            c.delivered += 1;
            match d.outcome {
                Outcome::Handled => c.handled += 1,
                Outcome::Duplicate => c.duplicates += 1,
                Outcome::Ignored => c.ignored += 1,
                Outcome::DeadLettered { .. } => c.dead_lettered += 1,
                Outcome::Pending => {}
            }
        }
        counts
    }

    /// The event types published with key `key`, in order.
    pub fn types_for_key(&self, key: &str) -> Vec<&str> {
        self.published
            .iter()
            .filter(|p| p.key == key)
            .map(|p| p.event_type.as_str())
            .collect()
    }

    /// Asserts that an event of type `E` matching `matches` was published;
    /// returns the first one.
    ///
    /// # Panics
    ///
    /// If none was, listing the `E`s published and every event type.
    #[track_caller]
    pub fn assert_published<E: DomainEvent + fmt::Debug>(&self, matches: impl Fn(&E) -> bool) -> E {
        let all = self.published::<E>();
        match all.iter().position(matches) {
            Some(i) => all.into_iter().nth(i).expect("the match"),
            None => panic!(
                "no published `{}` matches; published `{}`s: {}\n{self}",
                E::EVENT_TYPES.join("|"),
                E::EVENT_TYPES.join("|"),
                list(&all)
            ),
        }
    }

    /// Asserts that no event of type `E` was published.
    ///
    /// # Panics
    ///
    /// If one was, listing them.
    #[track_caller]
    pub fn assert_not_published<E: DomainEvent + fmt::Debug>(&self) {
        let all = self.published::<E>();
        if !all.is_empty() {
            panic!(
                "expected no `{}`, published: {}\n{self}",
                E::EVENT_TYPES.join("|"),
                list(&all)
            );
        }
    }

    /// Asserts that a consumer handled an event of type `E` matching
    /// `matches`; returns the first one.
    ///
    /// # Panics
    ///
    /// If none did, listing what became of the `E`s delivered.
    #[track_caller]
    pub fn assert_handled<E: DomainEvent + fmt::Debug>(&self, matches: impl Fn(&E) -> bool) -> E {
        if let Some(e) = self
            .handled()
            .filter_map(Delivered::decode::<E>)
            .find(|e| matches(e))
        {
            return e;
        }
        let mut seen = String::new();
        for d in &self.delivered {
            if let Some(e) = d.decode::<E>() {
                seen.push_str(&format!("\n  {e:?} → {} ({})", d.outcome, d.group));
            }
        }
        if seen.is_empty() {
            seen.push_str(" none delivered");
        }
        panic!(
            "no handled `{}` matches; the `{}`s delivered:{seen}\n{self}",
            E::EVENT_TYPES.join("|"),
            E::EVENT_TYPES.join("|"),
        );
    }

    /// Asserts that the events published with key `key` are exactly these
    /// event types, in this order.
    ///
    /// # Panics
    ///
    /// If they are not, showing the types that were.
    #[track_caller]
    pub fn assert_sequence(&self, key: impl fmt::Display, event_types: &[&str]) {
        let key = key.to_string();
        let actual = self.types_for_key(&key);
        if actual != event_types {
            panic!("events for key {key}: expected {event_types:?}, published {actual:?}\n{self}");
        }
    }

    /// Asserts that nothing was dead-lettered.
    ///
    /// # Panics
    ///
    /// If something was, with the reasons and errors.
    #[track_caller]
    pub fn assert_no_dead_letters(&self) {
        let dead: Vec<String> = self
            .dead_lettered()
            .map(|d| format!("  {} {} ({}): {}", d.group, d.event_type, d.key, d.outcome))
            .collect();
        if !dead.is_empty() {
            panic!(
                "expected no dead letters, {} written:\n{}\n{self}",
                dead.len(),
                dead.join("\n")
            );
        }
    }

    /// Asserts that an event of type `E` matching `matches` was
    /// dead-lettered; returns the delivery.
    ///
    /// # Panics
    ///
    /// If none was, listing the dead letters written.
    #[track_caller]
    pub fn assert_dead_lettered<E: DomainEvent>(&self, matches: impl Fn(&E) -> bool) -> &Delivered {
        if let Some(d) = self
            .dead_lettered()
            .find(|d| d.decode::<E>().is_some_and(|e| matches(&e)))
        {
            return d;
        }
        panic!(
            "no dead-lettered `{}` matches; dead letters: {}\n{self}",
            E::EVENT_TYPES.join("|"),
            self.dead_lettered().count()
        );
    }

    /// Asserts that every delivered event was handled exactly once per
    /// consumer group (copies and redeliveries skipped as duplicates) and
    /// nothing was dead-lettered or left unapplied.
    ///
    /// # Panics
    ///
    /// Naming the events handled more than once or never.
    #[track_caller]
    pub fn assert_each_handled_once(&self) {
        let mut times: BTreeMap<(&str, Option<Uuid>), (usize, &str)> = BTreeMap::new();
        for d in &self.delivered {
            let entry = times
                .entry((d.group.as_str(), d.event_id))
                .or_insert((0, d.event_type.as_str()));
            if d.outcome == Outcome::Handled {
                entry.0 += 1;
            }
        }
        let wrong: Vec<String> = times
            .iter()
            .filter(|(_, (n, _))| *n != 1)
            .map(|((group, id), (n, t))| format!("  {group}: {t} {id:?} handled {n} times"))
            .collect();
        if !wrong.is_empty() {
            panic!(
                "expected each event handled once:\n{}\n{self}",
                wrong.join("\n")
            );
        }
    }
}

fn list<E: fmt::Debug>(events: &[E]) -> String {
    if events.is_empty() {
        return "none".into();
    }
    let items: Vec<String> = events.iter().map(|e| format!("\n  {e:?}")).collect();
    items.concat()
}

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "delivery: {} rounds, {} events published, {} deliveries, {} handler failures, retry waits {:?}",
            self.rounds,
            self.published.len(),
            self.delivered.len(),
            self.handler_failures,
            self.retry_waits
        )?;
        writeln!(f, "published:")?;
        for p in &self.published {
            writeln!(
                f,
                "  #{} {} {} key={} {}",
                p.id, p.topic, p.event_type, p.key, p.payload
            )?;
        }
        writeln!(f, "delivered:")?;
        for d in &self.delivered {
            writeln!(
                f,
                "  {} ← {}@{} {} key={}: {}",
                d.group, d.topic, d.offset, d.event_type, d.key, d.outcome
            )?;
            for s in &d.sagas {
                writeln!(f, "    saga {} {}: {}", s.saga_type, s.saga_id, s.outcome)?;
            }
        }
        Ok(())
    }
}
