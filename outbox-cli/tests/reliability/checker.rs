//! The invariant checker: from what the writers committed and rolled back,
//! what a reader found in Kafka and what the consumer applied, computes the
//! scenario's figures — committed, published, consumed, lost, phantom,
//! duplicates, order violations — and prints and stores them.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use serde::Serialize;
use uuid::Uuid;

/// One event a writer recorded: its id, its partition key and its place in
/// the key's sequence (the writers of a key are serialized, so `seq` is the
/// key's commit order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub event_id: Uuid,
    pub key: String,
    pub seq: u64,
}

/// One observation of an event (a Kafka message or an applied effect), in
/// the order it was observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub event_id: Uuid,
    pub key: String,
    pub seq: u64,
}

/// Everything the checker needs.
#[derive(Debug, Default)]
pub struct Evidence {
    /// Events whose transaction committed.
    pub committed: Vec<Written>,
    /// Events whose transaction rolled back: must never appear.
    pub rolled_back: Vec<Uuid>,
    /// The committed events that must arrive; `None`: all of them. (A
    /// broker that loses its log loses what was published before.)
    pub must_arrive: Option<HashSet<Uuid>>,
    /// Kafka messages, per partition in offset order (duplicates included).
    pub kafka: Vec<Seen>,
    /// Effects the consumer applied, in the order they were applied.
    pub effects: Vec<Seen>,
    /// Committed events the consumer must dead-letter instead of applying
    /// (their handler misbehaves): they must be in Kafka and dead-lettered;
    /// an applied one counts as a phantom.
    pub expected_dead: HashSet<Uuid>,
    /// The events found in the dead-letter table.
    pub dead_lettered: HashSet<Uuid>,
}

/// The figures of one scenario run.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Figures {
    pub scenario: String,
    /// Events whose transaction committed.
    pub committed: usize,
    /// Events whose transaction rolled back (watched for phantoms).
    pub rolled_back: usize,
    /// Committed events that had to arrive.
    pub must_arrive: usize,
    /// Distinct committed events found in Kafka.
    pub published: usize,
    /// Distinct committed events whose effect the consumer applied.
    pub consumed: usize,
    /// Events that had to arrive and are missing from Kafka or from the
    /// consumer's effects.
    pub lost: usize,
    /// Events in Kafka or applied that were rolled back or never written.
    pub phantom: usize,
    /// Extra copies in Kafka (at-least-once redeliveries).
    pub duplicates: usize,
    /// Effects applied more than once (must be 0: the consumer dedups).
    pub applied_twice: usize,
    /// Per key, events seen after a later event of the key (first Kafka
    /// occurrences, then applied effects).
    pub order_violations: usize,
    /// From the end of the fault until every event committed before it was
    /// applied by the consumer.
    pub recovery_ms: Option<u64>,
    /// Scenario-specific figures (fault counts, latencies, dead tuples).
    pub notes: Vec<(String, String)>,
}

/// Computes the figures.
pub fn check(scenario: &str, evidence: &Evidence) -> Figures {
    let committed: HashMap<Uuid, &Written> =
        evidence.committed.iter().map(|w| (w.event_id, w)).collect();
    let must: HashSet<Uuid> = match &evidence.must_arrive {
        Some(set) => set
            .iter()
            .copied()
            .filter(|id| committed.contains_key(id))
            .collect(),
        None => committed.keys().copied().collect(),
    };
    let in_kafka: HashSet<Uuid> = evidence.kafka.iter().map(|s| s.event_id).collect();
    let mut applied: HashMap<Uuid, usize> = HashMap::new();
    for s in &evidence.effects {
        *applied.entry(s.event_id).or_default() += 1;
    }
    let phantom: HashSet<Uuid> = in_kafka
        .iter()
        .chain(applied.keys())
        .filter(|id| !committed.contains_key(id))
        .copied()
        .collect();
    let lost = must
        .iter()
        .filter(|id| !in_kafka.contains(id) || !applied.contains_key(id))
        .count()
        + evidence
            .expected_dead
            .iter()
            .filter(|id| !in_kafka.contains(id) || !evidence.dead_lettered.contains(id))
            .count();
    let applied_dead = evidence
        .expected_dead
        .iter()
        .filter(|id| applied.contains_key(id))
        .count();
    Figures {
        scenario: scenario.to_owned(),
        committed: committed.len(),
        rolled_back: evidence.rolled_back.len(),
        must_arrive: must.len(),
        published: in_kafka
            .iter()
            .filter(|id| committed.contains_key(id))
            .count(),
        consumed: applied
            .keys()
            .filter(|id| committed.contains_key(id))
            .count(),
        lost,
        phantom: phantom.len() + applied_dead,
        duplicates: evidence.kafka.len() - in_kafka.len(),
        applied_twice: applied.values().filter(|n| **n > 1).count(),
        order_violations: order_violations(&evidence.kafka) + order_violations(&evidence.effects),
        recovery_ms: None,
        notes: Vec::new(),
    }
}

/// Per key, counts first occurrences whose sequence number is below one
/// already seen for that key. Later copies of an event (duplicates) are not
/// order violations: the consumer drops them.
fn order_violations(seen: &[Seen]) -> usize {
    let mut first = HashSet::new();
    let mut highest: HashMap<&str, u64> = HashMap::new();
    let mut violations = 0;
    for s in seen {
        if !first.insert(s.event_id) {
            continue;
        }
        match highest.get_mut(s.key.as_str()) {
            Some(high) if s.seq < *high => violations += 1,
            Some(high) => *high = s.seq,
            None => {
                highest.insert(&s.key, s.seq);
            }
        }
    }
    violations
}

impl Figures {
    /// Adds a scenario-specific figure.
    pub fn note(&mut self, name: &str, value: impl ToString) {
        self.notes.push((name.to_owned(), value.to_string()));
    }

    /// The table header matching [`Figures::row`].
    pub const HEADER: &'static str = "| scenario | committed | rolled back | must arrive | published | consumed | lost | phantom | duplicates | applied twice | order violations | recovery |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

    /// One Markdown table row.
    pub fn row(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            self.scenario,
            self.committed,
            self.rolled_back,
            self.must_arrive,
            self.published,
            self.consumed,
            self.lost,
            self.phantom,
            self.duplicates,
            self.applied_twice,
            self.order_violations,
            self.recovery_ms
                .map_or("–".to_owned(), |ms| format!("{:.1} s", ms as f64 / 1e3)),
        )
    }

    /// Prints the row and the notes, writes `target/reliability/<slug>.json`,
    /// then asserts the invariants.
    pub fn report_and_assert(&self) {
        self.report();
        self.assert_invariants();
    }

    /// Prints the row and the notes, writes `target/reliability/<slug>.json`.
    pub fn report(&self) {
        eprintln!("{}\n{}", Self::HEADER, self.row());
        for (name, value) in &self.notes {
            eprintln!("  {name}: {value}");
        }
        let dir = reliability_dir();
        let written = std::fs::create_dir_all(&dir).and_then(|()| {
            std::fs::write(
                dir.join(format!("{}.json", slug(&self.scenario))),
                serde_json::to_string_pretty(self).expect("figures as JSON"),
            )
        });
        if let Err(e) = written {
            eprintln!("could not write the figures to {}: {e}", dir.display());
        }
    }

    /// Nothing lost, no phantom, per-key order kept, every effect applied
    /// once, and something was committed at all.
    pub fn assert_invariants(&self) {
        assert_eq!(self.lost, 0, "events lost: {self:#?}");
        assert_eq!(self.phantom, 0, "phantom events: {self:#?}");
        assert_eq!(self.order_violations, 0, "order violations: {self:#?}");
        assert_eq!(self.applied_twice, 0, "effects applied twice: {self:#?}");
        assert!(self.must_arrive > 0, "the scenario committed nothing");
    }
}

/// `broker paused (SIGSTOP) 5 s` → `broker-paused-sigstop-5-s`.
fn slug(name: &str) -> String {
    name.to_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// `target/reliability/`, beside the test's scratch directory.
fn reliability_dir() -> PathBuf {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(&tmp).join("reliability")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(key: &str, seq: u64) -> Written {
        Written {
            event_id: Uuid::new_v4(),
            key: key.into(),
            seq,
        }
    }

    fn seen(w: &Written) -> Seen {
        Seen {
            event_id: w.event_id,
            key: w.key.clone(),
            seq: w.seq,
        }
    }

    #[test]
    fn a_clean_run_has_no_finding() {
        let a = [written("a", 0), written("a", 1), written("b", 0)];
        let evidence = Evidence {
            committed: a.to_vec(),
            kafka: a.iter().map(seen).collect(),
            effects: a.iter().map(seen).collect(),
            ..Evidence::default()
        };
        let f = check("clean", &evidence);
        assert_eq!(
            (f.committed, f.published, f.consumed, f.lost, f.phantom),
            (3, 3, 3, 0, 0)
        );
        assert_eq!(
            (f.duplicates, f.applied_twice, f.order_violations),
            (0, 0, 0)
        );
    }

    #[test]
    fn missing_rolled_back_reordered_and_repeated_events_are_counted() {
        let a = [
            written("a", 0),
            written("a", 1),
            written("a", 2),
            written("b", 0),
        ];
        let ghost = written("a", 3);
        let evidence = Evidence {
            committed: a.to_vec(),
            rolled_back: vec![ghost.event_id],
            // a/1 before a/0 (violation), a/1 again (a duplicate, not a
            // violation), the rolled-back a/3 (phantom), b/0 missing (lost).
            kafka: [&a[1], &a[0], &a[1], &a[2], &ghost]
                .into_iter()
                .map(seen)
                .collect(),
            effects: [&a[0], &a[1], &a[2], &a[2], &a[3]]
                .into_iter()
                .map(seen)
                .collect(),
            ..Evidence::default()
        };
        let f = check("faulty", &evidence);
        assert_eq!(f.lost, 1, "b/0 never reached Kafka");
        assert_eq!(f.phantom, 1);
        assert_eq!(f.duplicates, 1);
        assert_eq!(f.applied_twice, 1);
        assert_eq!(f.order_violations, 1);
        assert_eq!((f.published, f.consumed), (3, 4));
    }

    #[test]
    fn only_the_events_that_must_arrive_can_be_lost() {
        let a = [written("a", 0), written("a", 1)];
        let evidence = Evidence {
            committed: a.to_vec(),
            must_arrive: Some([a[1].event_id].into()),
            kafka: vec![seen(&a[1])],
            effects: a.iter().map(seen).collect(),
            ..Evidence::default()
        };
        let f = check("partial", &evidence);
        assert_eq!((f.must_arrive, f.lost, f.published), (1, 0, 1));
        let evidence = Evidence {
            kafka: vec![seen(&a[0])],
            ..evidence
        };
        assert_eq!(check("partial", &evidence).lost, 1);
    }

    #[test]
    fn events_meant_for_dead_letters_must_be_dead_lettered_and_never_applied() {
        let a = [written("a", 0), written("a", 1), written("a", 2)];
        let good = a[0].event_id;
        let base = Evidence {
            committed: a.to_vec(),
            must_arrive: Some([good].into()),
            kafka: a.iter().map(seen).collect(),
            effects: vec![seen(&a[0])],
            expected_dead: [a[1].event_id, a[2].event_id].into(),
            dead_lettered: [a[1].event_id, a[2].event_id].into(),
            ..Evidence::default()
        };
        let f = check("dead letters", &base);
        assert_eq!((f.lost, f.phantom), (0, 0));
        // One of them not dead-lettered: lost.
        let evidence = Evidence {
            dead_lettered: [a[1].event_id].into(),
            ..Evidence { ..base }
        };
        assert_eq!(check("dead letters", &evidence).lost, 1);
        // One of them applied: a phantom effect.
        let evidence = Evidence {
            effects: vec![seen(&a[0]), seen(&a[2])],
            dead_lettered: [a[1].event_id, a[2].event_id].into(),
            ..evidence
        };
        assert_eq!(check("dead letters", &evidence).phantom, 1);
    }

    #[test]
    #[should_panic(expected = "events lost")]
    fn a_lost_event_fails_the_scenario() {
        let a = [written("a", 0)];
        let evidence = Evidence {
            committed: a.to_vec(),
            ..Evidence::default()
        };
        check("lost", &evidence).assert_invariants();
    }
}
