//! The loop in the progress mode: the lanes' windows between claims, the
//! rewinds, and the work a batch's finish writes (see
//! [`progress::batch`](super::super::progress::batch)).
//!
//! A position may pass only rows that were delivered or given a state of
//! their own (held, failed, parked). A row of a lane's window that is
//! neither (a transient failure, a row withheld without a hold) stops the
//! lane's position just before it, and the lane's window goes back there:
//! a **rewind**. The lane's later rows of the batch get no state (they are
//! read again; a delivered one is marked published, a write on this rare
//! path, so that it is not sent again), and rows of the lane in batches
//! claimed before the rewind are stale: withheld, given no state, their
//! positions dropped (each lane has a generation, stamped on
//! the positions a claim reads and bumped by a rewind).
//!
//! A finish that does not commit is carried: the next batch's finish
//! writes it first, in its own transaction, or, with no batch open, it is
//! written alone before the next claim; until one of them commits, nothing
//! more is claimed while a batch is open.
//! Positions are facts ("every row of these slots up to here was delivered
//! or has its state"), so writing a carried one late is safe.

use std::collections::{HashMap, HashSet};

use super::super::claim::Batch;
use super::super::progress::Snapshot;
use super::super::progress::batch::{Stand, TopicHold, Windows, Work};
use super::Loop;
use super::evaluate::Evaluated;

/// The loop's state in the progress mode.
#[derive(Debug, Default)]
pub(in crate::relay) struct ProgressMode {
    /// The lanes' windows; `None` while a claim reads them.
    pub(super) windows: Option<Windows>,
    /// Each lane's generation (0 until its first rewind).
    pub(super) generations: HashMap<i32, u64>,
    /// Rewinds not yet applied to the windows (a claim had them).
    pub(super) rewinds: Vec<Stand>,
    /// A finish that did not commit (unless a finish running now took it).
    pub(super) carry: Option<Work>,
    /// The last finish did not commit, and no later one has yet: nothing is
    /// claimed while a batch is open, and then the carried work is written
    /// before the claim. A relay whose positions the database refuses
    /// stops publishing.
    pub(super) failing: bool,
    /// Topics and keys with a row that a batch still open gives a state of
    /// its own, mapped to the last such batch's number: a window's later
    /// rows of theirs in batches claimed meanwhile wait behind it (see
    /// `Loop::behind_stated`).
    pub(super) stated: HashMap<(String, String), u64>,
}

impl ProgressMode {
    /// Applies the pending rewinds, if the windows are here.
    pub(super) fn apply_rewinds(&mut self) {
        if let Some(windows) = self.windows.as_mut() {
            for stand in self.rewinds.drain(..) {
                windows.rewind(&stand);
            }
        }
    }

    /// Whether the batch's row `i` is of a lane rewound since the batch was
    /// claimed.
    pub(super) fn stale(&self, batch: &Batch, i: usize) -> bool {
        let Some(read) = batch.progress.as_ref() else {
            return false;
        };
        let Some(Some(lane)) = read.lanes.get(i) else {
            return false;
        };
        read.stands.iter().any(|s| {
            s.lane == *lane && self.generations.get(lane).copied().unwrap_or(0) != s.generation
        })
    }
}

impl ProgressMode {
    /// After the database refused a batch's row states: the lanes whose
    /// positions stopped before a row that needed one are read again from
    /// there (a rewind; the lanes' rows in batches claimed since are stale).
    pub(super) fn stopped_short(&mut self, short: Vec<Stand>) {
        for stand in short {
            let generation = self.generations.get(&stand.lane).copied().unwrap_or(0) + 1;
            self.generations.insert(stand.lane, generation);
            tracing::debug!(
                lane = stand.lane,
                from = stand.after_id + 1,
                "a row's state was refused: its lane is read again from it"
            );
            self.rewinds.push(Stand {
                generation,
                ..stand
            });
        }
        self.apply_rewinds();
    }
}

impl Loop<'_> {
    /// What finishing `batch` writes, from its evaluation `e`; rewinds the
    /// lanes whose positions must stop short.
    pub(super) fn progress_work(&mut self, batch: &Batch, e: Evaluated) -> Work {
        if self.progress.is_none() {
            return Work::default();
        }
        let read = batch.progress.as_ref();
        let lane_of = |i: usize| read.and_then(|r| r.lanes.get(i).copied().flatten());
        let published: HashSet<i64> = e.published.iter().copied().collect();
        let mut failures: HashMap<i64, super::super::claim::Failure> =
            e.failures.into_iter().map(|f| (f.id, f)).collect();
        let mut holds: HashMap<i64, f64> = e.holds.into_iter().collect();
        // A window's rows of a topic the broker said is missing get no hold
        // of their own: the topic is held, once (see `progress::Skip`).
        let mut topic_held: HashMap<i64, (String, String)> = HashMap::new();
        for (i, row) in batch.rows.iter().enumerate() {
            if lane_of(i).is_none() {
                continue;
            }
            let Some(reason) = self.topics.confirmed(&row.topic) else {
                continue;
            };
            if failures
                .get(&row.id)
                .is_some_and(|f| !f.counted && !f.park && f.hold.is_some())
            {
                failures.remove(&row.id);
                topic_held.insert(row.id, (row.topic.clone(), reason.to_owned()));
            }
        }
        let Some(mode) = self.progress.as_mut() else {
            return Work::default();
        };
        let mut work = Work {
            skipped: read.map(|r| r.skipped.clone()).unwrap_or_default(),
            ..Work::default()
        };
        // A held row keeps a state of its own until it is published: one
        // that failed without a hold stays due.
        for (i, row) in batch.rows.iter().enumerate() {
            if lane_of(i).is_some() {
                continue;
            }
            if published.contains(&row.id) {
                work.published.push(row.event_id);
            } else if let Some(f) = failures.get_mut(&row.id)
                && !f.park
                && f.hold.is_none()
            {
                f.hold = Some(0.0);
            }
        }
        let state = |id: i64,
                     failures: &HashMap<i64, super::super::claim::Failure>,
                     holds: &HashMap<i64, f64>,
                     topic_held: &HashMap<i64, (String, String)>| {
            published.contains(&id)
                || holds.contains_key(&id)
                || topic_held.contains_key(&id)
                || failures
                    .get(&id)
                    .is_some_and(|f| f.park || f.hold.is_some())
        };
        for stand in read.map(|r| r.stands.as_slice()).unwrap_or_default() {
            let current = mode.generations.get(&stand.lane).copied().unwrap_or(0);
            let rows: Vec<i64> = batch
                .rows
                .iter()
                .enumerate()
                .filter(|(i, _)| lane_of(*i) == Some(stand.lane))
                .map(|(_, r)| r.id)
                .collect();
            let stale = current != stand.generation;
            let first_undone = if stale {
                rows.first().copied()
            } else {
                rows.iter()
                    .copied()
                    .find(|id| !state(*id, &failures, &holds, &topic_held))
            };
            // The lane's first row that needs a state of its own: where its
            // position stops if the database refuses the states.
            let stated = rows
                .iter()
                .copied()
                .filter(|id| first_undone.is_none_or(|undone| *id < undone))
                .find(|id| {
                    failures.contains_key(id)
                        || holds.contains_key(id)
                        || topic_held.contains_key(id)
                });
            let delivered_after = match stated {
                Some(stated) => batch
                    .rows
                    .iter()
                    .enumerate()
                    .filter(|(i, r)| {
                        lane_of(*i) == Some(stand.lane)
                            && r.id > stated
                            && first_undone.is_none_or(|undone| r.id < undone)
                            && published.contains(&r.id)
                    })
                    .map(|(_, r)| r.event_id)
                    .collect(),
                None => Vec::new(),
            };
            let stand = &Stand {
                stated,
                delivered_after,
                ..stand.clone()
            };
            // The lane's rows of held topics before the first undone: their
            // topic's hold starts at most at the lane's position.
            for id in rows
                .iter()
                .filter(|id| first_undone.is_none_or(|undone| **id < undone))
            {
                if let Some((topic, reason)) = topic_held.remove(id) {
                    let hold = TopicHold {
                        since: Snapshot::parse(&stand.done).unwrap_or(Snapshot {
                            xmin: 0,
                            xmax: 0,
                            xip: Vec::new(),
                        }),
                        reason,
                        rows: 1,
                    };
                    match work.topics.entry(topic) {
                        std::collections::hash_map::Entry::Occupied(mut e) => {
                            e.get_mut().merge(hold)
                        }
                        std::collections::hash_map::Entry::Vacant(e) => {
                            e.insert(hold);
                        }
                    }
                }
            }
            let Some(undone) = first_undone else {
                work.stands.push(stand.clone());
                continue;
            };
            // Rows from the first undone on are read again: no state. Those
            // among them that were delivered (of other keys, or of a batch
            // claimed before a rewind) are marked published, not sent again:
            // a write per row, on this rare path only.
            for (i, row) in batch.rows.iter().enumerate() {
                if lane_of(i) == Some(stand.lane) && row.id >= undone && published.contains(&row.id)
                {
                    work.published.push(row.event_id);
                }
            }
            for id in rows.iter().filter(|id| **id >= undone) {
                failures.remove(id);
                holds.remove(id);
                topic_held.remove(id);
            }
            if stale {
                continue;
            }
            let rewound = Stand {
                after_id: undone - 1,
                generation: current + 1,
                ..stand.clone()
            };
            mode.generations.insert(stand.lane, current + 1);
            tracing::debug!(
                lane = stand.lane,
                from = undone,
                "a row was neither delivered nor held: its lane is read again from it"
            );
            work.stands.push(rewound.clone());
            mode.rewinds.push(rewound);
        }
        mode.apply_rewinds();
        // In the batch's order (the failures' order is the rows').
        let mut ordered: Vec<_> = failures.into_values().collect();
        ordered.sort_by_key(|f| f.id);
        work.failures = ordered;
        let mut held: Vec<(i64, f64)> = holds.into_iter().collect();
        held.sort_by_key(|h| h.0);
        work.holds = held;
        work
    }
}
