//! Dedup mode: a failing key's events held in the consumer's memory for
//! their first retries (`ConsumerBuilder::memory_retries`; the design is
//! `docs/design/failing-keys-in-memory.md`).
//!
//! This module owns the queues — per (topic, partition key), the events in
//! offset order and when the first is due — the attempts of the events
//! retried so far, and the pins: every event held here pins its partition
//! in the poller ([`Shared::pin`]), so that the committed offset never
//! passes an event that nothing but this memory holds. The applier
//! (`dedup.rs`) decides what is held and runs what is due: a failed head
//! alone (its key's later events stay queued, and so does every new event
//! of the key, while it runs), then, once the head is applied or
//! dead-lettered, the rest of the queue at once. An event is unpinned once
//! the transaction that applied, dead-lettered or set it aside in
//! `inbox_event` committed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use tokio::time::Instant;

use super::poller::Shared;
use super::record::{Body, Record};

/// Most events held in memory per consumer; past it, failures are set
/// aside in `inbox_event`.
pub(crate) const MAX_HELD: usize = 10_000;

/// A (topic, partition key).
pub(crate) type Key = (Arc<str>, String);

/// A message's place: topic, partition, offset.
type Place = (Arc<str>, i32, i64);

fn place(r: &Record) -> Place {
    (r.topic.clone(), r.partition, r.offset)
}

/// The failing keys held in memory.
#[derive(Default)]
pub(crate) struct Held {
    /// Each queued key's events, in offset order, and when the first is due.
    queues: HashMap<Key, (VecDeque<Record>, Instant)>,
    /// Keys held by the batch being applied (queued at its end), and when
    /// their first event is due.
    pending: HashMap<Key, Instant>,
    /// Failed attempts so far of the events retried from memory.
    attempts: HashMap<Place, u32>,
    /// Events pinned in the poller: queued, pending or being retried.
    pinned: HashSet<Place>,
    /// Failed heads taken out of their queue for a retry, with their key
    /// (which stays held meanwhile).
    in_flight: HashMap<Place, Key>,
    /// Events of queues released after their head went through: one of
    /// them that fails is set aside in `inbox_event` rather than held again
    /// (a key failing that often would have its queue run again and again).
    released: HashSet<Place>,
}

/// How long a key waits for the result of its head's retry before its
/// queue is released anyway (a head dropped on a revocation never reports
/// back; the rest of its queue is of the same partition, dropped too).
const IN_FLIGHT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl Held {
    /// The key of an event record (none for other messages: they are not
    /// ordered by key).
    pub fn key(r: &Record) -> Option<Key> {
        match &r.body {
            Body::Event(e) => Some((r.topic.clone(), e.incoming.partition_key.clone())),
            _ => None,
        }
    }

    /// Whether nothing is held or pinned.
    pub fn is_empty(&self) -> bool {
        self.pinned.is_empty() && self.queues.is_empty() && self.pending.is_empty()
    }

    /// Whether `r` is a failed head being retried (its key is held, but
    /// not for it).
    pub fn retrying(&self, r: &Record) -> bool {
        !self.in_flight.is_empty() && self.in_flight.contains_key(&place(r))
    }

    /// Whether `r` was released from a queue (see `released`).
    pub fn was_released(&self, r: &Record) -> bool {
        !self.released.is_empty() && self.released.contains(&place(r))
    }

    /// Whether `key`'s events wait in memory.
    pub fn holds(&self, key: &Key) -> bool {
        self.queues.contains_key(key) || self.pending.contains_key(key)
    }

    /// Whether `n` more events may be held.
    pub fn room(&self, n: usize) -> bool {
        self.pinned.len() + n <= MAX_HELD
    }

    /// Failed attempts of `r` so far (0: never failed here).
    pub fn attempts(&self, r: &Record) -> u32 {
        self.attempts.get(&place(r)).copied().unwrap_or(0)
    }

    /// `r` failed its `attempts`-th attempt and waits for the next.
    pub fn failed(&mut self, r: &Record, attempts: u32) {
        self.attempts.insert(place(r), attempts);
    }

    /// `key`'s events wait in memory from this batch on, the first due at
    /// `due` (the earlier, if the key is held twice in one batch).
    pub fn hold_key(&mut self, key: Key, due: Instant) {
        let at = self.pending.entry(key).or_insert(due);
        *at = (*at).min(due);
    }

    /// Pins `r` in the poller (once).
    pub fn pin(&mut self, shared: &Shared, r: &Record) {
        if self.pinned.insert(place(r)) {
            shared.pin(r);
        }
    }

    /// `r`'s transaction committed (applied, dead-lettered or set aside in
    /// `inbox_event`): unpinned, its attempts forgotten.
    pub fn settled(&mut self, shared: &Shared, r: &Record) {
        if self.pinned.is_empty() {
            return;
        }
        let at = place(r);
        if self.pinned.remove(&at) {
            shared.unpin(r);
        }
        self.attempts.remove(&at);
        if !self.released.is_empty() {
            self.released.remove(&at);
        }
        // A retried head is through: the rest of its key's queue is due.
        if let Some(key) = self.in_flight.remove(&at)
            && let Some((queue, due)) = self.queues.get_mut(&key)
        {
            if queue.is_empty() {
                self.queues.remove(&key);
            } else {
                *due = Instant::now();
            }
        }
    }

    /// Queues `r` (held by this batch, or joining its key's queue) behind
    /// the events of its key already queued.
    pub fn queue(&mut self, r: Record) {
        let Some(key) = Self::key(&r) else { return };
        let due = self.pending.get(&key).copied().unwrap_or_else(Instant::now);
        // A retried head that failed again goes back to the front.
        if self.in_flight.remove(&place(&r)).is_some() {
            let (queue, at) = self
                .queues
                .entry(key)
                .or_insert_with(|| (VecDeque::new(), due));
            queue.push_front(r);
            *at = due;
            return;
        }
        self.queues
            .entry(key)
            .or_insert_with(|| (VecDeque::new(), due))
            .0
            .push_back(r);
    }

    /// The batch's held keys are queued.
    pub fn end_batch(&mut self) {
        self.pending.clear();
    }

    /// When the first queued key is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.queues.values().map(|(_, due)| *due).min()
    }

    /// Takes out what is due by now: of a key whose first event failed
    /// before, that event alone (the key stays held until it is through);
    /// of a key whose failed event is through, the whole queue, in order.
    /// The events of partitions this consumer no longer owns are dropped
    /// and unpinned (their partition's next owner reads them again).
    pub fn take_due(&mut self, shared: &Shared) -> Vec<Record> {
        let now = Instant::now();
        let due: Vec<Key> = self
            .queues
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        let mut records = Vec::new();
        for key in due {
            let Some((queue, at)) = self.queues.get_mut(&key) else {
                continue;
            };
            let head_failed = queue
                .front()
                .is_some_and(|r| self.attempts.contains_key(&place(r)));
            if head_failed && queue.front().is_some_and(|r| shared.owns(r)) {
                let head = queue.pop_front().expect("a head");
                *at = now + IN_FLIGHT_TIMEOUT;
                self.in_flight.insert(place(&head), key);
                records.push(head);
                continue;
            }
            let (queue, _) = self.queues.remove(&key).expect("due key");
            for r in queue {
                if shared.owns(&r) {
                    self.released.insert(place(&r));
                    records.push(r);
                } else {
                    self.settled(shared, &r);
                }
            }
        }
        records
    }
}
