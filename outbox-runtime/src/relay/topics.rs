//! Topics missing on the broker, learned from its metadata before a batch
//! is sent: their rows are held (see [`held`](super::held)) without being
//! handed to the producer.
//!
//! librdkafka fails a record for a topic it does not know only after
//! `topic.metadata.propagation.max.ms` (30 s by default), and every row
//! of the batch behind it waits as long: one missing topic would stall
//! every other. So before a batch is sent, each of its topics the relay has
//! not seen on the broker yet is looked up in the broker's metadata (one
//! request per topic, off the async threads, bounded by a timeout). A topic
//! the broker has is remembered and not asked about again; a delivery that
//! fails on the topic's account (deleted since, authorization revoked)
//! makes the relay ask again.
//!
//! A missing topic is held for a while: its rows in the batch are withheld
//! and held in the table until then, with the reason in `last_error`, and
//! rows of it claimed meanwhile are held until the same time without asking
//! the broker. The broker is asked again after a hold that starts at a
//! floor ([`RelayConfig::missing_topic_hold`](super::RelayConfig::missing_topic_hold))
//! and doubles up to a cap, each stretched by a random share of itself (so
//! relays and topics spread out). In the table the rows are held longer:
//! until twice the cap past the next lookup. Still missing at a lookup, the
//! topic's held rows are held longer in one statement once that runs short
//! (about once per cap), before their hold ends: a missing topic's rows do
//! not come back into claims, a release at a time, while it is missing, and
//! are touched once per cap, not per lookup. Found created, its rows' holds
//! are ended in one statement: they come back in id order (one `held_until`
//! for all) and are sent, each key in order (a key's later rows stay behind
//! its earlier held row, see [`held`](super::held)). A topic created
//! meanwhile is published after the next lookup, within about twice the cap.
//! Rows that come back anyway (the relay was idle, or restarted) have their
//! topic looked up again by the claim that meets them.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::backoff::Backoff;

/// How long a metadata request may take. Rows of a topic the broker did
/// not answer about are held for [`LOOKUP_PAUSE`], then looked up again:
/// sent unchecked, a missing topic's rows would hold up the batch.
pub(crate) const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// After a lookup that got no answer, none for this long (the broker may be
/// down: the relay's outage handling takes over); the topics it was about
/// are held as long.
const LOOKUP_PAUSE: Duration = Duration::from_secs(1);

/// A topic the broker does not have.
struct Missing {
    /// Its rows are held in the table until then: twice the cap past the
    /// next lookup, so that they do not come back into claims while it is
    /// missing, and are touched again only once the cap runs short.
    until: Instant,
    /// When the broker is asked again (the growing hold).
    recheck_at: Instant,
    hold: Backoff,
    /// Why, for `last_error`.
    reason: String,
    /// Held only because the broker did not answer: not known missing.
    unconfirmed: bool,
}

/// What the relay knows of its batches' topics on the broker.
pub(crate) struct Topics {
    present: HashSet<String>,
    missing: HashMap<String, Missing>,
    first: Duration,
    max: Duration,
    /// No lookups until then (the last one got no answer).
    paused_until: Option<Instant>,
}

/// The answer of the broker about one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lookup {
    Present,
    /// Missing or not writable: the reason.
    Missing(String),
}

/// What a lookup asks of the table's held rows of a topic.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Still missing: hold its held rows until `secs` from now.
    Extend { topic: String, secs: f64 },
    /// Created: end its rows' holds now.
    Release { topic: String },
}

impl Topics {
    /// Holds of missing topics start at `first` and double up to `max`
    /// (each stretched by up to itself).
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            present: HashSet::new(),
            missing: HashMap::new(),
            first,
            max,
            paused_until: None,
        }
    }

    /// The topics of `topics` to look up now: not known to be present, and
    /// not missing with a hold still running.
    pub fn due<'a>(&self, topics: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let now = Instant::now();
        let mut due: Vec<String> = Vec::new();
        for topic in topics {
            if self.present.contains(topic)
                || self.missing.get(topic).is_some_and(|m| m.until > now)
                || due.iter().any(|t| t == topic)
            {
                continue;
            }
            due.push(topic.to_owned());
        }
        due
    }

    /// Records the broker's answers; returns what to do to the held rows of
    /// the topics (hold those of a topic still missing longer, once their
    /// hold runs short; release those of a topic created).
    pub fn record(&mut self, answers: Vec<(String, Lookup)>) -> Vec<Action> {
        let now = Instant::now();
        let mut actions = Vec::new();
        for (topic, answer) in answers {
            match answer {
                Lookup::Present => {
                    if self.missing.remove(&topic).is_some() {
                        tracing::info!(%topic, "topic now exists on the broker: publishing its held events");
                        actions.push(Action::Release {
                            topic: topic.clone(),
                        });
                    }
                    self.present.insert(topic);
                }
                Lookup::Missing(reason) => {
                    let again = self.missing.get(&topic).is_some_and(|m| !m.unconfirmed);
                    let missing = self
                        .missing
                        .entry(topic.clone())
                        .or_insert_with(|| Missing {
                            until: now,
                            recheck_at: now,
                            hold: Backoff::jittered(self.first, self.max),
                            reason: String::new(),
                            unconfirmed: false,
                        });
                    let hold = missing.hold.next();
                    missing.recheck_at = now + hold;
                    let extend = !again || missing.until < missing.recheck_at + self.max;
                    if extend {
                        missing.until = missing.recheck_at + self.max * 2;
                    }
                    missing.reason = reason;
                    missing.unconfirmed = false;
                    tracing::error!(
                        %topic,
                        hold_s = hold.as_secs_f64(),
                        error = %missing.reason,
                        "topic missing on the broker: holding its events back"
                    );
                    if again && extend {
                        actions.push(Action::Extend {
                            topic,
                            secs: missing.until.saturating_duration_since(now).as_secs_f64(),
                        });
                    }
                }
            }
        }
        actions
    }

    /// The missing topics to ask the broker about again (see
    /// [`Missing::recheck_at`]).
    pub fn rechecks_due(&self) -> Vec<String> {
        let now = Instant::now();
        if self.paused() {
            return Vec::new();
        }
        self.missing
            .iter()
            .filter(|(_, m)| m.recheck_at <= now)
            .map(|(topic, _)| topic.clone())
            .collect()
    }

    /// Whether lookups are paused after one that got no answer.
    pub fn paused(&self) -> bool {
        self.paused_until
            .is_some_and(|until| until > Instant::now())
    }

    /// A lookup about `topics` got no answer (or lookups are paused): no
    /// lookups for a while, and those of `topics` not known to be present
    /// are held as long (a topic held as missing keeps its hold).
    pub fn unanswered(&mut self, topics: Vec<String>, error: &str) {
        let now = Instant::now();
        if !self.paused() {
            tracing::warn!(
                error,
                "topic metadata lookup got no answer: holding the topics' events briefly"
            );
            self.paused_until = Some(now + LOOKUP_PAUSE);
        }
        for topic in topics {
            if self.present.contains(&topic) {
                continue;
            }
            let reason = format!(
                "topic `{topic}` could not be looked up on the broker ({error}): its events wait"
            );
            let (first, max) = (self.first, self.max);
            let missing = self.missing.entry(topic).or_insert_with(|| Missing {
                until: now,
                recheck_at: now,
                hold: Backoff::jittered(first, max),
                reason: reason.clone(),
                unconfirmed: true,
            });
            missing.recheck_at = now + LOOKUP_PAUSE;
            if missing.until <= now {
                missing.until = now + LOOKUP_PAUSE;
                if missing.unconfirmed {
                    missing.reason = reason;
                }
            }
        }
    }

    /// A delivery to `topic` failed on the topic's account: ask the broker
    /// about it again before sending to it next time.
    pub fn forget(&mut self, topic: &str) {
        self.present.remove(topic);
    }

    /// Topics another relay (or this one, before a restart) holds as
    /// missing in the table (the progress mode's `outbox_held_topic`):
    /// asked about at the next lookup, their rows held meanwhile.
    pub fn adopt(&mut self, topics: &[String]) {
        let now = Instant::now();
        for topic in topics {
            if self.missing.get(topic).is_some_and(|m| !m.unconfirmed) {
                continue;
            }
            self.present.remove(topic);
            self.missing.insert(
                topic.clone(),
                Missing {
                    until: now + self.max * 2,
                    recheck_at: now,
                    hold: Backoff::jittered(self.first, self.max),
                    reason: format!(
                        "topic `{topic}` is held as missing on the broker: its events wait"
                    ),
                    unconfirmed: false,
                },
            );
        }
    }

    /// Why `topic` is missing, if the broker said it is (not only held
    /// while a lookup got no answer).
    pub fn confirmed(&self, topic: &str) -> Option<&str> {
        self.held(topic)?;
        let missing = self.missing.get(topic)?;
        (!missing.unconfirmed).then_some(missing.reason.as_str())
    }

    /// Until when `topic`'s rows are held, and why, if it is missing.
    pub fn held(&self, topic: &str) -> Option<(Instant, &str)> {
        let missing = self.missing.get(topic)?;
        (missing.until > Instant::now()).then_some((missing.until, missing.reason.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_topic_is_looked_up_again_after_a_growing_hold_its_rows_held_longer() {
        let (first, max) = (Duration::from_millis(100), Duration::from_millis(1000));
        let mut topics = Topics::new(first, max);
        assert_eq!(topics.due(["a", "b", "a"]), ["a", "b"]);
        let actions = topics.record(vec![
            ("a".into(), Lookup::Present),
            ("b".into(), Lookup::Missing("b is missing".into())),
        ]);
        assert!(actions.is_empty(), "a first hold touches no held row");
        assert!(topics.held("a").is_none());
        let (until, reason) = topics.held("b").unwrap();
        assert_eq!(reason, "b is missing");
        // Held in the table for twice the cap past the next lookup.
        let hold = until - Instant::now();
        assert!(hold > max * 2 && hold < first * 2 + max * 2, "{hold:?}");
        // Neither is asked about while present or held.
        assert!(topics.due(["a", "b"]).is_empty());
        assert!(topics.rechecks_due().is_empty());

        // The next lookup: after the first hold (100-200 ms).
        std::thread::sleep(first * 2 + Duration::from_millis(5));
        assert_eq!(topics.rechecks_due(), ["b"]);
        let actions = topics.record(vec![("b".into(), Lookup::Missing("still".into()))]);
        // The rows' hold still covers the next lookup and a cap: untouched.
        assert!(actions.is_empty(), "{actions:?}");
        assert!(topics.held("b").is_some(), "still held");
        // Lookups until the rows' hold runs short: then it is extended.
        let mut extended = None;
        for _ in 0..8 {
            while topics.rechecks_due().is_empty() {
                std::thread::sleep(Duration::from_millis(10));
            }
            assert!(topics.held("b").is_some(), "held past each lookup");
            let actions = topics.record(vec![("b".into(), Lookup::Missing("still".into()))]);
            if let Some(Action::Extend { topic, secs }) = actions.first() {
                extended = Some((topic.clone(), *secs));
                break;
            }
        }
        let (topic, secs) = extended.expect("extended once the hold ran short");
        assert_eq!(topic, "b");
        assert!(secs > 2.0 && secs < 4.1, "{secs}");

        // Created meanwhile: its rows are released, it is no longer held.
        let actions = topics.record(vec![("b".into(), Lookup::Present)]);
        assert_eq!(actions, [Action::Release { topic: "b".into() }]);
        assert!(topics.held("b").is_none());
        assert!(topics.due(["b"]).is_empty());

        // A delivery failure on the topic's account: asked about again.
        topics.forget("a");
        assert_eq!(topics.due(["a"]), ["a"]);
        // No answer: the topic is held briefly (not known missing), and
        // lookups pause.
        topics.unanswered(vec!["a".into()], "timed out");
        assert!(topics.paused());
        assert!(topics.due(["a"]).is_empty());
        let (until, reason) = topics.held("a").unwrap();
        assert!(reason.contains("could not be looked up"), "{reason}");
        assert!(until - Instant::now() <= LOOKUP_PAUSE);
        // Found missing after that: a first hold, nothing to extend.
        assert!(
            topics
                .record(vec![("a".into(), Lookup::Missing("gone".into()))])
                .is_empty()
        );
    }
}
