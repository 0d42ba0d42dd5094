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
//! dead-lettered, the rest of the queue. An event is unpinned once the
//! transaction that applied, dead-lettered or set it aside in
//! `inbox_event` committed. The events of a partition revoked are dropped
//! here but unpinned by the revocation, once it has committed the
//! partition's offsets (a revocation under way commits what the pins
//! allow: unpinned earlier, an event dropped here would be passed, and
//! lost).
//!
//! A queue whose failed event is through runs in chunks, one per batch:
//! the first [`FIRST_CHUNK`] events, then twice as many each time, its key
//! held until the last chunk is taken. A chunk's event that fails goes
//! back to the front of the queue with the chunk's later events of its
//! key; the dedup rows of those later events, written for the chunk, are
//! taken out again, so a failure costs at most the chunk it falls in, not
//! the rest of a queue that can hold thousands of events.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use tokio::time::Instant;

use super::poller::Shared;
use super::record::{Body, Record};

/// Events of a queue run in the first batch after its failed event is
/// through; each later chunk is twice the one before.
pub(crate) const FIRST_CHUNK: usize = 16;

/// The largest chunk.
const MAX_CHUNK: usize = 4096;

/// A (topic, partition key).
pub(crate) type Key = (Arc<str>, String);

/// A message's place: topic, partition, offset, and the assignment
/// generation it was polled in (read again after a rebalance, it is another
/// record: its partition's pins are of another generation, and it never
/// counts as the retry of the copy polled before).
type Place = (Arc<str>, i32, i64, u64);

fn place(r: &Record) -> Place {
    (r.topic.clone(), r.partition, r.offset, r.generation)
}

/// The failing keys held in memory.
#[derive(Default)]
pub(crate) struct Held {
    /// Each queued key's events, in offset order, when the first is due,
    /// and how many events its next chunk takes.
    queues: HashMap<Key, Queue>,
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
    /// Events of a chunk being run: their key is still held (for the
    /// rest of its queue), but not for them.
    running: HashSet<Place>,
}

/// A key's events waiting in memory.
struct Queue {
    /// In offset order.
    records: VecDeque<Record>,
    /// When the first is due.
    due: Instant,
    /// Events the next chunk takes (once the first has not failed).
    chunk: usize,
}

impl Queue {
    fn new(due: Instant) -> Self {
        Self {
            records: VecDeque::new(),
            due,
            chunk: FIRST_CHUNK,
        }
    }

    /// Puts `r` in offset order: behind the queue (a later event of its
    /// key), or before the events of its partition it precedes (a chunk's
    /// event that failed, or was behind one that did, going back).
    fn insert(&mut self, r: Record) {
        let later = |q: &Record| q.partition == r.partition && q.offset > r.offset;
        if self.records.back().is_none_or(|last| !later(last)) {
            self.records.push_back(r);
            return;
        }
        let at = self
            .records
            .iter()
            .position(later)
            .unwrap_or(self.records.len());
        self.records.insert(at, r);
    }
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

    /// Whether `r` was taken out of its key's queue to run: a failed head
    /// being retried, or an event of a chunk (its key is held, but not for
    /// it).
    pub fn retrying(&self, r: &Record) -> bool {
        let at = place(r);
        (!self.in_flight.is_empty() && self.in_flight.contains_key(&at))
            || (!self.running.is_empty() && self.running.contains(&at))
    }

    /// Whether `key`'s events wait in memory.
    pub fn holds(&self, key: &Key) -> bool {
        self.queues.contains_key(key) || self.pending.contains_key(key)
    }

    /// Whether `n` more events may be held, with at most `max` held.
    pub fn room(&self, n: usize, max: usize) -> bool {
        self.pinned.len() + n <= max
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
        self.forget(Some(shared), r);
    }

    /// Forgets `r`, held here, of a partition revoked or being revoked:
    /// its pin stays in the poller until the revocation has committed the
    /// partition's offsets (which the pin holds back: its next owner reads
    /// it again) and drops the partition's pins ([`Shared::unpin_revoked`]).
    /// Unpinned here, a revocation under way could commit past it.
    fn drop_revoked(&mut self, r: &Record) {
        self.forget(None, r);
    }

    /// Forgets `r`: its attempts, its place among the running and in
    /// flight (a retried head's key released), its pin here, and, with
    /// `shared`, in the poller.
    fn forget(&mut self, shared: Option<&Shared>, r: &Record) {
        if self.pinned.is_empty() {
            return;
        }
        let at = place(r);
        if self.pinned.remove(&at)
            && let Some(shared) = shared
        {
            shared.unpin(r);
        }
        self.attempts.remove(&at);
        if !self.running.is_empty() {
            self.running.remove(&at);
        }
        // A retried head is through: the rest of its key's queue is due,
        // from its first chunk.
        if let Some(key) = self.in_flight.remove(&at)
            && let Some(queue) = self.queues.get_mut(&key)
        {
            if queue.records.is_empty() {
                self.queues.remove(&key);
            } else {
                queue.due = Instant::now();
                queue.chunk = FIRST_CHUNK;
            }
        }
    }

    /// `records` were dropped before they ran (their partition was
    /// revoked between [`take_due`](Self::take_due) and the batch's
    /// start): those taken out of memory are forgotten, as `take_due` does
    /// with the events of a partition no longer owned (its next owner
    /// reads them again); a retried head's key is released, so that the
    /// rest of its queue goes the same way.
    pub fn dropped(&mut self, records: &[Record]) {
        for r in records {
            if self.retrying(r) {
                self.drop_revoked(r);
            }
        }
    }

    /// Queues `r` (held by this batch, or joining its key's queue) in
    /// offset order among the events of its key already queued: a retried
    /// head that failed again, or a chunk's event that failed (and the
    /// chunk's later events of its key), goes back before the rest.
    pub fn queue(&mut self, r: Record) {
        let Some(key) = Self::key(&r) else { return };
        let at = place(&r);
        if !self.running.is_empty() {
            self.running.remove(&at);
        }
        let retried = self.in_flight.remove(&at).is_some();
        let pending = self.pending.get(&key).copied();
        let queue = self
            .queues
            .entry(key)
            .or_insert_with(|| Queue::new(pending.unwrap_or_else(Instant::now)));
        // A failure of this batch puts the key's first event due at its
        // retry.
        if let Some(due) = pending {
            queue.due = due;
        }
        if retried {
            queue.records.push_front(r);
        } else {
            queue.insert(r);
        }
    }

    /// The batch's held keys are queued.
    pub fn end_batch(&mut self) {
        self.pending.clear();
    }

    /// When the first queued key is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.queues.values().map(|q| q.due).min()
    }

    /// Takes out what is due by now: of a key whose first event failed
    /// before, that event alone (the key stays held until it is through);
    /// of a key whose failed event is through, its next chunk, in order
    /// (the key held until the last chunk is taken). The events of
    /// partitions this consumer no longer owns, or is giving up, are
    /// dropped (their partition's next owner reads them again).
    pub fn take_due(&mut self, shared: &Shared) -> Vec<Record> {
        let now = Instant::now();
        let due: Vec<Key> = self
            .queues
            .iter()
            .filter(|(_, q)| q.due <= now)
            .map(|(k, _)| k.clone())
            .collect();
        let mut records = Vec::new();
        for key in due {
            let Some(queue) = self.queues.get_mut(&key) else {
                continue;
            };
            let head_failed = queue
                .records
                .front()
                .is_some_and(|r| self.attempts.contains_key(&place(r)));
            if head_failed && queue.records.front().is_some_and(|r| shared.owns(r)) {
                let head = queue.records.pop_front().expect("a head");
                queue.due = now + IN_FLIGHT_TIMEOUT;
                self.in_flight.insert(place(&head), key);
                records.push(head);
                continue;
            }
            let take = queue.chunk.min(queue.records.len());
            queue.chunk = (queue.chunk * 2).min(MAX_CHUNK);
            let chunk: Vec<Record> = queue.records.drain(..take).collect();
            // The key stays held while the rest of its queue waits.
            let rest = !queue.records.is_empty();
            if !rest {
                self.queues.remove(&key);
            }
            for r in chunk {
                if shared.owns(&r) {
                    if rest {
                        self.running.insert(place(&r));
                    }
                    records.push(r);
                } else {
                    self.drop_revoked(&r);
                }
            }
        }
        records
    }
}

#[cfg(test)]
mod tests {
    use outbox_core::{Headers, IncomingEvent};

    use super::*;
    use crate::inbox::record::Event;

    fn record(topic: &Arc<str>, offset: i64, key: &str, generation: u64) -> Record {
        let incoming = IncomingEvent::new(
            uuid::Uuid::new_v4(),
            "t.v1",
            1,
            &**topic,
            key,
            Headers::default(),
        );
        Record {
            topic: topic.clone(),
            partition: 0,
            offset,
            generation,
            body: Body::Event(Box::new(Event {
                incoming,
                handlers: Vec::new(),
                payload: b"{}".to_vec(),
                decoded: Vec::new(),
            })),
        }
    }

    /// A consumer owning partition 0 of `orders` (generation 1) that holds
    /// key `k`'s events at `offsets` as a batch whose first event failed
    /// would: pinned, queued, the first due now.
    fn holding(offsets: &[i64]) -> (Shared, Arc<str>, Held) {
        let shared = Shared::new(true);
        let topic: Arc<str> = Arc::from("orders");
        shared.set_owned(&topic, 0, Some(1));
        let mut held = Held::default();
        let first = record(&topic, offsets[0], "k", 1);
        held.failed(&first, 1);
        held.hold_key(Held::key(&first).expect("an event"), Instant::now());
        for &offset in offsets {
            let r = record(&topic, offset, "k", 1);
            held.pin(&shared, &r);
            held.queue(r);
        }
        held.end_batch();
        (shared, topic, held)
    }

    fn offsets(records: &[Record]) -> Vec<i64> {
        records.iter().map(|r| r.offset).collect()
    }

    #[test]
    fn a_retried_head_dropped_on_a_revocation_is_forgotten() {
        let (shared, topic, mut held) = holding(&[3, 4, 5]);
        assert_eq!(shared.pinned_offsets(), vec![3, 4, 5]);

        let due = held.take_due(&shared);
        assert_eq!(offsets(&due), vec![3], "the failed head alone");
        // A revocation starts before the batch does.
        shared.set_revoking(&topic, 0);
        let (kept, dropped) = shared.begin_batch(due);
        assert!(kept.is_empty());
        held.dropped(&dropped);
        assert!(!held.retrying(&dropped[0]), "the head is forgotten");
        assert_eq!(
            shared.pinned_offsets(),
            vec![3, 4, 5],
            "still pinned for the revocation's commit"
        );
        shared.end_revocation(&topic, 0);
        assert!(shared.pinned_offsets().is_empty());

        // Assigned again: the head, read again, is not a retry of the copy
        // dropped, and the rest of its key's queue is dropped when taken.
        shared.set_owned(&topic, 0, Some(2));
        assert!(!held.retrying(&record(&topic, 3, "k", 2)));
        assert!(held.take_due(&shared).is_empty());
        assert!(held.is_empty(), "nothing held or pinned");
    }

    #[test]
    fn a_chunk_dropped_on_a_revocation_is_forgotten() {
        let all: Vec<i64> = (0..40).collect();
        let (shared, topic, mut held) = holding(&all);

        // The head is retried and applied: the rest runs in chunks.
        let head = held.take_due(&shared);
        assert_eq!(offsets(&head), vec![0]);
        held.settled(&shared, &head[0]);
        let chunk = held.take_due(&shared);
        assert_eq!(
            offsets(&chunk),
            (1..=FIRST_CHUNK as i64).collect::<Vec<_>>()
        );
        assert!(held.retrying(&chunk[0]));

        shared.set_revoking(&topic, 0);
        let (kept, dropped) = shared.begin_batch(chunk);
        assert!(kept.is_empty());
        held.dropped(&dropped);
        assert!(!held.retrying(&dropped[0]), "the chunk is forgotten");
        assert_eq!(shared.pinned_offsets(), (1..40).collect::<Vec<_>>());
        shared.end_revocation(&topic, 0);

        // Assigned again, the chunk's events read again are not taken for
        // the chunk's, and what was left of the queue goes when taken.
        shared.set_owned(&topic, 0, Some(2));
        assert!(!held.retrying(&record(&topic, 1, "k", 2)));
        while !held.take_due(&shared).is_empty() {}
        assert!(held.is_empty(), "nothing held or pinned");
        assert!(shared.pinned_offsets().is_empty());
    }

    /// The events of a partition being revoked are dropped from memory,
    /// their pins left for the revocation's commit: unpinned at once, that
    /// commit could pass them, and the partition's next owner would never
    /// read them (seen: a key's ten events lost when consumers of a group
    /// were killed and restarted).
    #[test]
    fn events_dropped_during_a_revocation_stay_pinned_until_it_commits() {
        let (shared, topic, mut held) = holding(&[7, 8, 9]);

        shared.set_revoking(&topic, 0);
        assert!(held.take_due(&shared).is_empty(), "nothing of it runs");
        assert!(held.is_empty(), "nothing held");
        assert_eq!(shared.pinned_offsets(), vec![7, 8, 9]);
        shared.end_revocation(&topic, 0);
        assert!(shared.pinned_offsets().is_empty());
    }
}
