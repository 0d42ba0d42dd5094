//! The relay's loop: claims batch *n+1* while batch *n* is delivered, marks
//! batch *n* while *n+1* is delivered (see the [relay](super)'s docs), and
//! keeps what must wait — keys held behind a failure, topics missing on the
//! broker, marks that did not commit — out of claims and sends. Judging a
//! batch's deliveries is in [`evaluate`].

mod evaluate;
pub(super) mod progress;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::claim::{self, Batch, Finished, Row, Unfinished};
use super::held;
use super::lanes;
use super::progress::batch;
use super::publish::{self, Outcome, Publisher};
use super::topics::{self, Topics};
use super::wake::Waker;
use super::{RelayConfig, RelayStats};
use crate::backoff::Health;
use crate::error::{Error, Result};
use crate::refusal::Trouble;

/// A batch handed to the producer, awaiting its deliveries.
pub(super) struct InFlight {
    /// The batch's number in this relay (see [`Loop::held`]).
    pub(super) seq: u64,
    pub(super) batch: Batch,
    pub(super) sent_at: Instant,
    pub(super) outcomes: Vec<Option<Outcome>>,
    pub(super) pending: Vec<(usize, rdkafka::producer::DeliveryFuture)>,
    /// The batch's `outbox.relay.batch` span, from the hand-over to the
    /// producer until the deliveries are evaluated.
    pub(super) span: tracing::Span,
}

impl InFlight {
    /// Awaits the deliveries; rows never handed over count as withheld.
    async fn deliveries(mut self) -> (Batch, Vec<Outcome>) {
        let pending = std::mem::take(&mut self.pending);
        publish::settle(pending, &self.batch.rows, &mut self.outcomes).await;
        let outcomes = self
            .outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::Withheld))
            .collect();
        (self.batch, outcomes)
    }
}

/// Keys and topics held back after failures, until a deadline.
#[derive(Default)]
pub(super) struct Blocked {
    pub(super) keys: HashMap<String, Instant>,
    pub(super) topics: HashMap<String, (Instant, u32)>,
}

impl Blocked {
    /// Forgets blocks that have ended.
    fn expire(&mut self) {
        let now = Instant::now();
        self.keys.retain(|_, until| *until > now);
        self.topics.retain(|_, (until, _)| *until > now);
    }

    /// Until when `row` is blocked (by its key or its topic), if it is.
    fn deadline(&self, row: &Row) -> Option<Instant> {
        let now = Instant::now();
        let key = self.keys.get(&row.partition_key).copied();
        let topic = self.topics.get(&row.topic).map(|(u, _)| *u);
        key.into_iter().chain(topic).filter(|u| *u > now).max()
    }
}

pub(super) struct Loop<'a> {
    pub(super) pool: &'a PgPool,
    pub(super) config: &'a RelayConfig,
    pub(super) stats: &'a RelayStats,
    pub(super) latency: metrics::Histogram,
    pub(super) blocked: Blocked,
    /// Topics missing on the broker (see [`topics`]).
    pub(super) topics: Topics,
    pub(super) waker: Waker,
    pub(super) lanes: Arc<lanes::Shared>,
    /// The lane manager's task: the relay stops if it ends by itself.
    pub(super) manager: &'a JoinHandle<()>,
    /// The claim transactions' `BEGIN` (see [`claim::begin`]).
    pub(super) begin: &'a str,
    pub(super) broker: Health,
    pub(super) database: Health,
    pub(super) in_flight: Option<InFlight>,
    /// The last batch's mark-and-commit, and that batch's number.
    pub(super) marking: Option<(u64, JoinHandle<std::result::Result<Finished, Unfinished>>)>,
    /// Keys with a row left unpublished (held back or failed) in a batch
    /// whose transaction has not ended, mapped to the last such batch's
    /// number. That row stays locked until the batch ends, so a claim skips
    /// it and could take later rows of its key: until then these keys are
    /// left out of claims and held back in sends.
    pub(super) held: HashMap<String, u64>,
    /// Keys with a row that a batch still open gives a state of its own (a
    /// failure, a hold), mapped to the last such batch's number.
    pub(super) stated: HashMap<String, u64>,
    /// Keys of [`stated`](Self::stated) whose batch ended while a claim
    /// that may not see that end ran, mapped to that batch's number: the
    /// claim read their later rows before the earlier row's state
    /// committed, so such a row can be behind an unpublished row without
    /// knowing it. Held back in the send of that claim's batch. (Rows
    /// withheld without a state, e.g. by a full producer queue, need not
    /// be: they are read again, and so are their keys' later rows.)
    pub(super) released_keys: HashMap<String, u64>,
    /// The number of the last batch whose transaction ended.
    pub(super) ended: u64,
    /// [`ended`](Self::ended) when the running claim began: keys released
    /// by later ends are held back in its send.
    pub(super) claim_floor: u64,
    /// When held rows were last released, and whether that release was
    /// cut at its limit (see [`held::release`]).
    pub(super) released: Option<(Instant, bool)>,
    /// The number of a batch whose transaction must end before the next
    /// claim: one cut at the byte budget (see [`Batch::cut`]), or one that
    /// holds a window's rows behind held rows (see
    /// [`Loop::holds_window_rows_behind`]).
    pub(super) claim_after: Option<u64>,
    /// With a rate limit: the earliest the next claim may run.
    pub(super) paced: Option<Instant>,
    /// Batches handed to the producer so far.
    pub(super) batches: u64,
    pub(super) producer_unusable: bool,
    /// Rounds in a row whose deliveries failed although the broker had
    /// just answered a probe.
    pub(super) answered_yet_failing: u32,
    /// Whether the last broker probe was answered.
    pub(super) probe_answered: bool,
    /// Rows delivered by batches whose marks did not commit (id → event
    /// id): still unpublished in the table. The next claim first marks them
    /// published ([`claim::record_published`]) and claims nothing until it
    /// could; a claim that meets them meanwhile marks them without sending
    /// them again ([`Outcome::Unrecorded`]), and sends nothing else. So a
    /// relay whose marks the database refuses stops publishing instead of
    /// publishing the same rows round after round.
    pub(super) unrecorded: HashMap<i64, uuid::Uuid>,
    /// After a refusal: no claim before then (see [`crate::refusal`]).
    pub(super) refused_until: Option<Instant>,
    /// After a refused release of held rows: none before then.
    pub(super) release_after: Option<Instant>,
    /// Updates of a missing topic's held rows, running in the background.
    pub(super) topic_updates: Vec<JoinHandle<std::result::Result<u64, Trouble>>>,
    /// In the progress mode (the outbox's, see [`progress`]): its state.
    pub(super) progress: Option<progress::ProgressMode>,
}

/// Rounds of failed deliveries to a broker that answers probes after which
/// the producer is replaced. A broker that lost its state (restarted with
/// empty storage, or a cluster rebuilt) answers metadata requests but never
/// acknowledges the old producer's messages: its idempotence state (producer
/// id, epoch, sequence numbers) is unknown there, and librdkafka keeps
/// retrying it without reporting a fatal error.
const STUCK_ROUNDS: u32 = 2;

impl Loop<'_> {
    /// Publishes until `shutdown`; fails if the lane manager ended by
    /// itself (it panicked), after settling the batch in flight.
    pub(super) async fn run(
        &mut self,
        publisher: &mut Publisher,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let mut result = Ok(());
        loop {
            if result.is_ok() && self.manager.is_finished() {
                tracing::error!("the lane manager stopped: the relay stops");
                result = Err(Error::Task("the relay's lane manager stopped".into()));
            }
            let stopping = shutdown.is_cancelled() || result.is_err();
            if stopping && self.in_flight.is_none() {
                break;
            }
            if self
                .marking
                .as_ref()
                .is_some_and(|(_, task)| task.is_finished())
            {
                // Ended already: release its keys before the claim.
                self.finish_marking().await;
            }
            self.topic_updates_done().await;
            let mut claim_next = !stopping && !self.broker.is_down();
            if self.progress.as_ref().is_some_and(|p| p.failing) {
                // A finish that did not commit goes with the open batch's
                // (or alone, once none is open) before anything is claimed.
                if self.in_flight.is_none() && self.marking.is_some() {
                    // The finish that carries it: nothing else to wait for.
                    self.finish_marking().await;
                }
                if self.in_flight.is_some() || self.marking.is_some() {
                    claim_next = false;
                }
            }
            if let Some(after) = self.claim_after {
                // A batch cut at the byte budget may lock rows it did not
                // return, one holding window rows behind held rows writes
                // holds the next claim must see: no claim until its
                // transaction has ended.
                if self.in_flight.as_ref().is_some_and(|f| f.seq == after) {
                    claim_next = false;
                } else {
                    self.finish_marking().await;
                }
            }
            let limit = self.config.batch_size as i64;
            if !stopping
                && self.progress.is_none()
                && self.release_after.is_none_or(|at| at <= Instant::now())
                && self
                    .released
                    .is_none_or(|(at, full)| full || at.elapsed() >= held::RELEASE_INTERVAL)
            {
                // Rows whose hold has ended go back into the claim's index.
                let full =
                    match held::release(self.pool, limit, self.config.statement_timeout).await {
                        Ok(Some(n)) => {
                            self.database.permitted(held::RELEASING);
                            n >= limit as u64
                        }
                        Ok(None) => false,
                        Err(refused @ Trouble::Refused(_)) => {
                            let wait = self.database.down(refused);
                            self.release_after = Some(Instant::now() + wait);
                            false
                        }
                        Err(error) => {
                            tracing::debug!(%error, "releasing held rows failed");
                            false
                        }
                    };
                self.released = Some((Instant::now(), full));
            }
            self.blocked.expire();
            if !stopping {
                let due = self.topics.rechecks_due();
                self.look_up_topics(publisher, due).await;
            }
            let keys: Vec<String> = self.held.keys().cloned().collect();
            // Ends from now on may commit after the claim's reads.
            let ended = self.ended;
            self.released_keys.retain(|_, seq| *seq > ended);
            self.claim_floor = ended;
            let max_bytes = i64::try_from(self.config.max_batch_bytes).unwrap_or(i64::MAX);
            let pool = self.pool.clone();
            let claimable = self.lanes.claimable();
            if let Ok(mut held) = self.stats.lanes.lock() {
                held.clone_from(&claimable.lanes);
            }
            let begin = self.begin.to_owned();
            // Rows delivered by batches whose marks did not commit: marked
            // published before anything is claimed.
            let unrecorded: Vec<(i64, uuid::Uuid)> = if claim_next {
                self.unrecorded.iter().map(|(id, e)| (*id, *e)).collect()
            } else {
                Vec::new()
            };
            let to_record: Vec<uuid::Uuid> = unrecorded.iter().map(|(_, e)| *e).collect();
            let statement_timeout = self.config.statement_timeout;
            // In the progress mode, the claim takes the windows (and gives
            // them back), and writes a carried finish first.
            let nothing_open = self.in_flight.is_none() && self.marking.is_none();
            let mut windows = None;
            let mut progress_claim = None;
            let mut carried_to_claim = false;
            if let Some(mode) = self.progress.as_mut() {
                mode.apply_rewinds();
                windows = Some(mode.windows.take().unwrap_or_default());
                let carry = if claim_next && nothing_open {
                    mode.carry.clone()
                } else {
                    None
                };
                carried_to_claim = carry.is_some();
                progress_claim = Some((
                    mode.generations.clone(),
                    carry,
                    nothing_open && mode.carry.is_none(),
                ));
            }
            // The next claim runs while the batch in flight is delivered. As
            // soon as its deliveries are known the batch is marked and
            // committed, even while the claim still waits for a connection:
            // the claim never holds up the transaction that would free one
            // (with a small pool, waiting for both would deadlock).
            //
            // It runs on a task of its own, so that it is never dropped half
            // way: a claim cut off inside its `BEGIN` round trip would give
            // its connection back to the pool inside the open transaction,
            // holding the lanes' "in use" locks (and, with the application's
            // pool, handing the transaction to the application). A claim
            // whose relay is gone finishes and drops its batch: rolled back.
            let step = Instant::now();
            let pace = [self.paced, self.refused_until]
                .into_iter()
                .flatten()
                .max()
                .filter(|at| claim_next && *at > step);
            let stop = shutdown.clone();
            let claim = async move {
                if let Some(at) = pace {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = stop.cancelled() => return (None, Duration::ZERO, windows),
                    }
                }
                let start = Instant::now();
                let (claimed, windows) = if claim_next {
                    let task = tokio::spawn(async move {
                        let mut windows = windows;
                        let result = async {
                            if !to_record.is_empty() {
                                claim::record_published(&pool, &to_record, statement_timeout)
                                    .await?;
                            }
                            match (progress_claim, windows.as_mut()) {
                                (Some((generations, carry, record_idle)), Some(windows)) => {
                                    if let Some(work) = carry {
                                        batch::record_carried(&pool, &work, statement_timeout)
                                            .await?;
                                    }
                                    let skip = if claimable.any() && claimable.count > 0 {
                                        windows.held_topics(&pool, claimable.scope).await.map_err(
                                            |e| Trouble::from(e).during(batch::HELD_TOPICS),
                                        )?
                                    } else {
                                        Default::default()
                                    };
                                    batch::claim(
                                        &pool,
                                        &begin,
                                        limit,
                                        max_bytes,
                                        &keys,
                                        &claimable,
                                        windows,
                                        &generations,
                                        record_idle,
                                        skip,
                                    )
                                    .await
                                    .map_err(|e| Trouble::from(e).during(claim::CLAIM))
                                }
                                _ => {
                                    claim::claim(&pool, &begin, limit, max_bytes, &keys, &claimable)
                                        .await
                                        .map_err(|e| Trouble::from(e).during(claim::CLAIM))
                                }
                            }
                        }
                        .await;
                        (result, windows)
                    });
                    match task.await {
                        Ok((result, windows)) => (Some(result), windows),
                        // The windows are lost with the task: read again
                        // from the recorded positions.
                        Err(e) => (Some(Err(Trouble::from(Error::Task(e.to_string())))), None),
                    }
                } else {
                    (None, windows)
                };
                (claimed, start.elapsed(), windows)
            };
            let mut claim = std::pin::pin!(claim);
            let mut claimed = None;
            let mut transient: Option<String> = None;
            let mut delivered_some = false;
            let mut delivery_time = Duration::ZERO;
            if let Some(in_flight) = self.in_flight.take() {
                let start = Instant::now();
                let sent_at = in_flight.sent_at;
                let in_flight_seq = in_flight.seq;
                let batch_span = in_flight.span.clone();
                let mut deliveries = std::pin::pin!(in_flight.deliveries());
                let (batch, outcomes) = tokio::select! {
                    delivered = &mut deliveries => delivered,
                    done = &mut claim => {
                        claimed = Some(done);
                        deliveries.await
                    }
                };
                self.latency.record(sent_at.elapsed());
                delivery_time = start.elapsed();
                let evaluated = self.evaluate(in_flight_seq, &batch, outcomes);
                batch_span.record("published", evaluated.published.len());
                drop(batch_span);
                delivered_some = !evaluated.published.is_empty();
                transient = evaluated.transient.clone();
                if claimed.is_none() {
                    let mut previous = std::pin::pin!(self.finish_marking());
                    tokio::select! {
                        _ = &mut previous => {}
                        done = &mut claim => {
                            claimed = Some(done);
                            previous.await;
                        }
                    }
                } else {
                    self.finish_marking().await;
                }
                self.finish_batch(in_flight_seq, batch, evaluated);
            }
            let (claimed, claim_time, windows) = match claimed {
                Some(done) => done,
                None => claim.await,
            };
            if let Some(mode) = self.progress.as_mut() {
                mode.windows = windows;
                mode.apply_rewinds();
                if carried_to_claim && matches!(claimed, Some(Ok(_))) {
                    mode.carry = None;
                    // Not only a failed finish is carried: an idle claim's
                    // count of rows passed over is too.
                    if std::mem::take(&mut mode.failing) {
                        tracing::info!("a finish that had not committed is written");
                    }
                    self.database.permitted(batch::RECORD);
                }
            }
            tracing::trace!(
                claimed = claimed
                    .as_ref()
                    .and_then(|c| c.as_ref().ok())
                    .map(|b| b.rows.len()),
                claim_ms = claim_time.as_secs_f64() * 1e3,
                delivery_ms = delivery_time.as_secs_f64() * 1e3,
                step_ms = step.elapsed().as_secs_f64() * 1e3,
                "relay step"
            );

            let mut idle = false;
            if let Some(Ok(_)) = &claimed {
                self.database.answered();
                self.database.permitted(claim::CLAIM);
                if self.progress.is_some() {
                    self.database.permitted(batch::HELD_TOPICS);
                }
                if !unrecorded.is_empty() {
                    for (id, _) in &unrecorded {
                        self.unrecorded.remove(id);
                    }
                    self.database.permitted(claim::MARK);
                    tracing::info!(
                        rows = unrecorded.len(),
                        "delivered events whose marks had failed are marked published"
                    );
                }
            }
            if let Some(Ok(batch)) = &claimed
                && let Some(read) = batch.progress.as_ref()
            {
                // Topics held in the table: asked about at the next lookup.
                self.topics.adopt(&read.held_topics);
            }
            match claimed {
                Some(Ok(mut batch)) if batch.rows.is_empty() => {
                    idle = true;
                    // Rows of held topics passed over: counted with the
                    // next finish.
                    if let (Some(read), Some(mode)) =
                        (batch.progress.as_mut(), self.progress.as_mut())
                        && !read.skipped.is_empty()
                    {
                        let skipped = batch::Work {
                            skipped: std::mem::take(&mut read.skipped),
                            ..batch::Work::default()
                        };
                        match mode.carry.as_mut() {
                            Some(carry) => carry.then(skipped),
                            None => mode.carry = Some(skipped),
                        }
                    }
                    if batch.progress.as_ref().is_some_and(|p| p.commit) {
                        // Idle lanes' positions, recorded by the claim.
                        if let Err(error) = batch.tx.commit().await {
                            tracing::debug!(%error, "recording idle lanes' positions failed");
                        }
                    }
                }
                Some(Ok(batch)) => {
                    if self
                        .marking
                        .as_ref()
                        .is_some_and(|(_, task)| task.is_finished())
                    {
                        // A batch whose marks failed may have unlocked its
                        // delivered rows before this claim ran: they must
                        // be known as such before anything is sent.
                        self.finish_marking().await;
                    }
                    self.pace(batch.rows.len());
                    self.waker.busy().await;
                    let due = self.topics.due(batch.rows.iter().map(|r| r.topic.as_str()));
                    self.look_up_topics(publisher, due).await;
                    self.in_flight = Some(self.send(publisher, batch));
                }
                Some(Err(error)) => {
                    self.stats.failed_round();
                    let wait = self.database.down(&error);
                    self.sleep(wait, shutdown).await;
                }
                None => {}
            }

            // Only a delivery proves the producer works: a round whose rows
            // were all held back proves nothing.
            if delivered_some {
                self.answered_yet_failing = 0;
            }
            if let Some(error) = transient {
                if self.probe_answered {
                    self.answered_yet_failing += 1;
                    if self.answered_yet_failing >= STUCK_ROUNDS {
                        self.answered_yet_failing = 0;
                        self.producer_unusable = true;
                        tracing::warn!(
                            rounds = STUCK_ROUNDS,
                            "the broker answers but deliveries keep failing"
                        );
                    }
                }
                if std::mem::take(&mut self.producer_unusable) {
                    self.finish_in_flight_before_recreate().await;
                    publisher.recreate(&error);
                } else {
                    publisher.recover_if_fatal();
                }
                self.wait_for_broker(publisher, &error, shutdown).await;
            } else if self.broker.is_down() && self.in_flight.is_none() {
                self.wait_for_broker(publisher, "", shutdown).await;
            }

            if idle && self.in_flight.is_none() && !shutdown.is_cancelled() {
                // Nothing to overlap the last batch's mark-and-commit with:
                // wait for it. If it releases held keys, their rows are
                // claimable now; otherwise wait for work.
                if !self.finish_marking().await {
                    tokio::select! {
                        _ = self.waker.wait(shutdown) => {}
                        _ = wait_finished(self.manager) => {}
                    }
                }
            }
        }
        self.finish_marking().await;
        self.topic_updates_done().await;
        if let Some(work) = self.progress.as_mut().and_then(|p| p.carry.take())
            && let Err(error) =
                batch::record_carried(self.pool, &work, self.config.statement_timeout).await
        {
            tracing::warn!(
                %error,
                "a batch's progress could not be recorded: its events will be published again"
            );
        }
        if !self.unrecorded.is_empty() {
            let event_ids: Vec<uuid::Uuid> = self.unrecorded.values().copied().collect();
            if let Err(error) =
                claim::record_published(self.pool, &event_ids, self.config.statement_timeout).await
            {
                tracing::warn!(
                    %error,
                    rows = event_ids.len(),
                    "delivered events could not be marked published: they will be published again"
                );
            }
        }
        result
    }

    /// Collects the updates of missing topics' held rows that have ended: a
    /// refusal is reported (see [`crate::refusal`]), anything else only
    /// logged (the next lookup tries again).
    async fn topic_updates_done(&mut self) {
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.topic_updates)
            .into_iter()
            .partition(JoinHandle::is_finished);
        self.topic_updates = running;
        for task in done {
            match task.await {
                Ok(Ok(_)) => self.database.permitted(held::TOPIC_ROWS),
                Ok(Err(refused @ Trouble::Refused(_))) => {
                    self.database.down(refused);
                }
                Ok(Err(error)) => {
                    tracing::debug!(%error, "updating a topic's held rows failed");
                }
                Err(error) => tracing::debug!(%error, "updating a topic's held rows failed"),
            }
        }
    }

    /// With a rate limit: the next claim waits until `rows` / rate seconds
    /// after this one's turn (at most a second's worth of catching up).
    fn pace(&mut self, rows: usize) {
        let Some(rate) = self.config.max_events_per_second else {
            return;
        };
        let now = Instant::now();
        let turn = self
            .paced
            .filter(|at| *at + Duration::from_secs(1) > now)
            .unwrap_or(now);
        self.paced = Some(turn + Duration::from_secs_f64(rows as f64 / f64::from(rate)));
    }

    /// Asks the broker about topics (a batch's not known yet, or missing
    /// ones whose hold has ended: see [`topics`]); a topic found missing
    /// again has its held rows held longer, one found created has them
    /// released, in the background.
    async fn look_up_topics(&mut self, publisher: &mut Publisher, due: Vec<String>) {
        if due.is_empty() {
            return;
        }
        if self.topics.paused() {
            self.topics
                .unanswered(due, "an earlier lookup got no answer");
            return;
        }
        let due_again = due.clone();
        match publisher.lookup(due, topics::LOOKUP_TIMEOUT).await {
            Ok(answers) => {
                let scope = self.progress.as_ref().map(|_| self.lanes.claimable().scope);
                for action in self.topics.record(answers) {
                    let (pool, timeout) = (self.pool.clone(), self.config.statement_timeout);
                    self.topic_updates.push(tokio::spawn(async move {
                        held::topic_rows(&pool, &action, timeout, scope).await
                    }));
                }
            }
            Err(error) => self.topics.unanswered(due_again, &error),
        }
    }

    /// Hands a claimed batch to the producer, holding back rows of keys that
    /// are held (a row of theirs is still locked unpublished), released
    /// while the batch was claimed (see [`Loop::released_keys`]) or blocked,
    /// rows of blocked topics and of topics missing on the broker, rows behind a held row of their key (see
    /// [`held`]), and the later rows of these rows' keys in the batch.
    fn send(&mut self, publisher: &mut Publisher, mut batch: Batch) -> InFlight {
        self.batches += 1;
        if self.progress.is_some() {
            self.behind_stated(&mut batch);
        }
        let seq = self.batches;
        if batch.cut || self.holds_window_rows_behind(&batch) {
            self.claim_after = Some(seq);
        }
        let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(batch.rows.len());
        let mut go = Vec::with_capacity(batch.rows.len());
        // Topic and key of the rows withheld so far in this batch.
        let mut withheld: std::collections::HashSet<(&str, &str)> =
            std::collections::HashSet::new();
        // Rows delivered before, by a batch whose marks did not commit:
        // marked with this batch, not sent again; and until every such row
        // is marked, nothing else is sent.
        let unrecorded: std::collections::HashSet<i64> = batch
            .rows
            .iter()
            .filter(|row| self.unrecorded.remove(&row.id).is_some())
            .map(|row| row.id)
            .collect();
        let recording = !self.unrecorded.is_empty();
        for (i, row) in batch.rows.iter().enumerate() {
            let topic_key = (row.topic.as_str(), row.partition_key.as_str());
            if unrecorded.contains(&row.id) {
                outcomes.push(Some(Outcome::Unrecorded));
            } else if recording
                || self.progress.as_ref().is_some_and(|p| p.stale(&batch, i))
                || self.held.contains_key(&row.partition_key)
                || self
                    .released_keys
                    .get(&row.partition_key)
                    .is_some_and(|seq| *seq > self.claim_floor)
                || self.blocked.deadline(row).is_some()
                || self.topics.held(&row.topic).is_some()
                || batch
                    .progress
                    .as_ref()
                    .is_some_and(|p| p.held_topics.contains(&row.topic))
                || row.behind_held_secs.is_some()
                || withheld.contains(&topic_key)
            {
                withheld.insert(topic_key);
                outcomes.push(Some(Outcome::Withheld));
            } else {
                outcomes.push(None);
                go.push(i);
            }
        }
        let span = tracing::info_span!(
            parent: None,
            "outbox.relay.batch",
            batch = seq,
            rows = batch.rows.len(),
            sent = go.len(),
            published = tracing::field::Empty,
            links = tracing::field::Empty,
            links_dropped = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        super::trace_links::link_events(&span, &batch.rows, &go);
        let pending = span.in_scope(|| publisher.send(&batch.rows, go, &mut outcomes));
        // Rows held back now (here, or by the producer: a full queue, an
        // earlier row of their key refused) keep their keys held: they stay
        // locked until the batch ends. Not, in the progress mode, a
        // window's rows: they are not locked, and a window row left without
        // a state stops its lane's position and sends the lane back there,
        // the key's later rows with it (a key's rows are all of one lane);
        // holding the key would withhold its rows of the next batch, read
        // again from there, and so on while batches overlap: the lane would
        // never move again.
        let read = batch.progress.as_ref();
        for (i, (row, outcome)) in batch.rows.iter().zip(&outcomes).enumerate() {
            let window_row = read.is_some_and(|r| r.lanes.get(i).copied().flatten().is_some());
            if !window_row
                && outcome
                    .as_ref()
                    .is_some_and(|o| !matches!(o, Outcome::Unrecorded))
            {
                self.held.insert(row.partition_key.clone(), seq);
            }
        }
        InFlight {
            seq,
            batch,
            sent_at: Instant::now(),
            outcomes,
            pending,
            span,
        }
    }

    /// In the progress mode, a window's rows whose key has a row that a
    /// batch still open gives a state of its own (a hold, a failure) wait
    /// behind that row, as behind a held row: held, and published after it.
    ///
    /// A window's rows are not locked, and this batch was claimed while
    /// that batch was open, its states not committed: the claim's probe
    /// (see [`held`]) did not see that row held. It may also have found no
    /// other held row before the key's later rows, the rows that row was
    /// held behind having been marked published by a batch that ended
    /// meanwhile: sent now, those rows would go out before it.
    ///
    /// Per topic, as the probe is: a row of another topic given a state
    /// (one missing on the broker, say) holds back none of these.
    fn behind_stated(&self, batch: &mut Batch) {
        let Some(stated) = self.progress.as_ref().map(|p| &p.stated) else {
            return;
        };
        if stated.is_empty() {
            return;
        }
        let Batch { rows, progress, .. } = batch;
        let Some(read) = progress.as_ref() else {
            return;
        };
        for (i, row) in rows.iter_mut().enumerate() {
            let window_row = read.lanes.get(i).copied().flatten().is_some();
            if window_row
                && row.behind_held_secs.is_none()
                && stated.contains_key(&(row.topic.clone(), row.partition_key.clone()))
            {
                row.behind_held_secs = Some(0.0);
            }
        }
    }

    /// In the progress mode, whether the batch holds window rows behind a
    /// held row of their key whose hold has ended (or that a batch still
    /// open gives a state: [`Loop::behind_stated`]): it ends before the next
    /// claim (see [`Loop::claim_after`]). That claim then reads their holds, ended
    /// at once, as held rows, and the key's later rows of the windows after
    /// them in the same batch (see [`progress::fetch`](super::progress::fetch)).
    /// Claimed while this batch is open, it would not see those holds, and
    /// would hold the key's later rows behind them as well, each batch the
    /// key's rows of the next: a key with rows in every batch would never
    /// leave the held rows' path, each of its events written twice (a hold,
    /// a mark). Rows behind a hold that has not ended (a key blocked after
    /// a failure) wait for it whatever the next claim does: those do not
    /// cost the loop its overlap.
    fn holds_window_rows_behind(&self, batch: &Batch) -> bool {
        let Some(read) = batch.progress.as_ref() else {
            return false;
        };
        batch.rows.iter().enumerate().any(|(i, row)| {
            row.behind_held_secs.is_some_and(|secs| secs <= 0.0)
                && read.lanes.get(i).copied().flatten().is_some()
        })
    }

    /// Starts finishing a batch whose deliveries are judged: its marks (or,
    /// in the progress mode, its work after any carried) and commit, in the
    /// background.
    fn finish_batch(&mut self, seq: u64, batch: Batch, evaluated: evaluate::Evaluated) {
        if self.progress.is_some() {
            let own = self.progress_work(&batch, evaluated);
            let work = match self.progress.as_mut().and_then(|p| p.carry.take()) {
                Some(mut carried) => {
                    carried.then(own);
                    carried
                }
                None => own,
            };
            self.marking = Some((seq, tokio::spawn(batch.finish_progress(work))));
        } else {
            self.marking = Some((seq, tokio::spawn(batch.finish_owned(evaluated))));
        }
    }

    /// Before the producer is replaced, the batch sent through the old one is
    /// settled: its deliveries are awaited and recorded like any other.
    async fn finish_in_flight_before_recreate(&mut self) {
        if let Some(in_flight) = self.in_flight.take() {
            let seq = in_flight.seq;
            let (batch, outcomes) = in_flight.deliveries().await;
            let evaluated = self.evaluate(seq, &batch, outcomes);
            self.finish_marking().await;
            self.finish_batch(seq, batch, evaluated);
        }
        self.producer_unusable = false;
    }

    /// Waits for the previous batch's mark-and-commit. Once its transaction
    /// has ended (committed or rolled back), its rows are unlocked: the keys
    /// it held are released.
    /// Returns whether it released any.
    async fn finish_marking(&mut self) -> bool {
        let mut released = false;
        if let Some((seq, task)) = self.marking.take() {
            let result = task
                .await
                .map_err(|e| Unfinished {
                    trouble: Trouble::from(Error::Task(e.to_string())),
                    delivered: Vec::new(),
                    work: None,
                })
                .and_then(|r| r);
            if self.claim_after.is_some_and(|after| after <= seq) {
                self.claim_after = None;
            }
            let before = self.held.len();
            self.held.retain(|_, last| *last > seq);
            let released_keys = &mut self.released_keys;
            self.stated.retain(|key, last| {
                let keep = *last > seq;
                if !keep {
                    released_keys.insert(key.clone(), seq);
                }
                keep
            });
            if let Some(mode) = self.progress.as_mut() {
                mode.stated.retain(|_, last| *last > seq);
            }
            self.ended = self.ended.max(seq);
            released = self.held.len() < before;
            match result {
                Ok(finished) => {
                    self.database.answered();
                    if let Some(mode) = self.progress.as_mut() {
                        mode.failing = false;
                    }
                    for statement in finished.ran {
                        self.database.permitted(statement);
                    }
                    if let Some(mode) = self.progress.as_mut()
                        && !finished.short.is_empty()
                    {
                        mode.stopped_short(finished.short);
                    }
                    if let Some(refused) = finished.refused {
                        // Its rows come back as they were: not before the
                        // refusal's delay, or the relay would spin on them.
                        let wait = self.database.down(refused);
                        self.refused_until = Some(Instant::now() + wait);
                    }
                }
                Err(Unfinished {
                    trouble,
                    delivered,
                    work,
                }) => {
                    // The batch's transaction rolled back: its delivered
                    // rows stay unpublished in the table, and are marked
                    // before the next claim (see `unrecorded`); in the
                    // progress mode, its work is carried.
                    self.stats.failed_round();
                    self.unrecorded.extend(delivered);
                    if let (Some(mode), Some(work)) = (self.progress.as_mut(), work) {
                        mode.carry = Some(*work);
                        mode.failing = true;
                    }
                    let refused = trouble.refusal().is_some();
                    let wait = self.database.down(trouble);
                    if refused {
                        self.refused_until = Some(Instant::now() + wait);
                    }
                }
            }
        }
        released
    }

    /// Backs off until the broker answers again.
    async fn wait_for_broker(
        &mut self,
        publisher: &mut Publisher,
        error: &str,
        shutdown: &CancellationToken,
    ) {
        let wait = self.broker.down(error);
        self.sleep(wait, shutdown).await;
        if shutdown.is_cancelled() {
            return;
        }
        publisher.recover_if_fatal();
        self.probe_answered = publisher.probe(Duration::from_secs(2)).await;
        if self.probe_answered {
            // Deliveries will tell whether it is really back.
            self.broker.up();
        }
    }

    async fn sleep(&self, d: Duration, shutdown: &CancellationToken) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}

/// Returns once `task` has ended (polling: the handle is borrowed).
async fn wait_finished(task: &JoinHandle<()>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
