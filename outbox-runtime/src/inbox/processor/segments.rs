//! The processor's segments: a round's claimed rows run a segment (a
//! savepoint) at a time, retries first and apart; a failing handler takes
//! its segment back, and the rows before it run again.

use super::*;

impl Processor {
    /// Runs the claimed rows' handlers in the claiming transaction, one
    /// segment (a savepoint) at a time. The rows that failed before
    /// (retries) run first, together, apart from the rest: if one fails
    /// again, only their segment is taken back. When a handler fails, its segment is taken back to the
    /// savepoint; the failure is recorded on its row in the same
    /// transaction (or the row dead-lettered), the row and the later rows of
    /// its key are left for later, and the rows before it run again, then
    /// the rest. Each event's handlers run at most twice, and a failing
    /// event costs neither the batch nor a transaction of its own.
    ///
    /// After `apply::MAX_SEGMENTS` segments the round ends where it is: a
    /// transaction keeps few subtransactions (past 64, every snapshot of
    /// every session reads `pg_subtrans`). The rows not reached are claimed
    /// again next round.
    pub(super) async fn segments(
        &self,
        tx: &mut PgConnection,
        rows: &[Row],
        items: &mut [Item],
        careful: bool,
        mark: bool,
    ) -> Result<Work, Failure> {
        let n = rows.len();
        let mut work = Work::default();
        // Rows this round does not settle: failed ones, those behind them.
        let mut left = vec![false; n];
        let mut follow_ups = apply::FollowUps::default();
        let (mut start, mut end) = (0, n);
        // Whether handlers ran since the session was last put back.
        let mut restore = false;
        let mut segments = 0;
        // Failures that left the transaction untouched (see `segment`),
        // settled after the last segment.
        let mut declined = Vec::new();
        while start < end && segments < apply::MAX_SEGMENTS {
            segments += 1;
            let result = self
                .segment(
                    tx,
                    rows,
                    items,
                    (&mut left, &mut declined),
                    start..end,
                    careful,
                    restore,
                )
                .await;
            match result {
                Ok(segment) => {
                    restore = segment.batch.processed > 0;
                    start = segment.end;
                    work.add(segment, &mut follow_ups);
                    if start == end {
                        end = n;
                    }
                }
                Err(Failure::Handler {
                    at, handler, error, ..
                }) => {
                    apply::undo(tx, SETTLE).await.map_err(|f| match f {
                        // The savepoint is gone (the handler ended the
                        // transaction): settle it alone.
                        Failure::Suspect(_) if careful => Failure::Handler {
                            at,
                            handler,
                            error: error.clone(),
                            clean: false,
                        },
                        other => other,
                    })?;
                    restore = false;
                    let failed = self
                        .settle_failure(tx, &rows[at], &items[at], handler, error)
                        .await?;
                    work.failed.push(Failed { at, ..failed });
                    left[at] = true;
                    let key = (&rows[at].topic, &rows[at].partition_key);
                    for (j, row) in rows.iter().enumerate().skip(at + 1) {
                        if (&row.topic, &row.partition_key) == key {
                            left[j] = true;
                        }
                    }
                    // The rows before it (in their own segment), then the rest.
                    end = if at > start { at } else { n };
                }
                Err(Failure::Rejected { at, rejected }) => {
                    apply::undo(tx, SETTLE).await?;
                    restore = false;
                    items[at] = Item::Rejected(rejected);
                }
                Err(other) => return Err(other),
            }
        }
        // Rows from `start` on were not reached this round.
        let reached = start;
        for (at, handler, error) in declined {
            let failed = self
                .settle_failure(tx, &rows[at], &items[at], handler, error)
                .await?;
            work.failed.push(Failed { at, ..failed });
        }
        apply::seal(tx).await?;
        follow_ups.write(tx).await?;
        if mark {
            sqlx::query(MARK_PROCESSED)
                .bind(&work.ids)
                .bind(1_i32)
                .bind(&self.config.group)
                .execute(&mut *tx)
                .await
                .map_err(|e| Failure::Outage(during(SETTLE)(e)))?;
        }
        work.settled = work.ids.len();
        work.reached = reached;
        // Malformed rows reached (those left for later are not).
        let letters: Vec<(&Row, &Rejected)> = items[..reached]
            .iter()
            .zip(rows)
            .zip(&left)
            .filter_map(|((item, row), left)| match item {
                Item::Rejected(rejected) if !left => Some((row, &**rejected)),
                _ => None,
            })
            .collect();
        if !letters.is_empty() {
            let new: Vec<NewDeadLetter<'_>> = letters
                .iter()
                .map(|(row, rejected)| NewDeadLetter {
                    topic: &row.topic,
                    partition: row.partition,
                    offset: row.offset,
                    rejected,
                })
                .collect();
            dead_letter::insert(tx, &self.config.group, &new)
                .await
                .map_err(|e| Failure::Outage(crate::inbox::dedup::refused_dead_letters(e)))?;
            for (row, rejected) in &letters {
                sqlx::query(MARK_DEAD)
                    .bind(row.event_id)
                    .bind(pg_text(&rejected.error).as_ref())
                    .bind(0_i32)
                    .bind(&self.config.group)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| Failure::Outage(during(SETTLE)(e)))?;
            }
            work.settled += letters.len();
            work.batch.rejected = letters
                .iter()
                .map(|(_, r)| (r.reason, r.error.clone()))
                .collect();
        }
        work.left = left;
        Ok(work)
    }

    /// Runs the handlers of `range`'s rows (not `left`) after a savepoint.
    ///
    /// A handler that fails without having been given the connection
    /// (`clean`: it changed nothing in the transaction) costs no rollback:
    /// its row and the later rows of its key are left, their dedup rows
    /// taken out again, the failure added to `declined` (settled after the
    /// last segment), and the segment goes on. Most business refusals (a
    /// validation error before any write) fail so; each would otherwise take
    /// its segment back and run the rows before it again.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn segment(
        &self,
        tx: &mut PgConnection,
        rows: &[Row],
        items: &mut [Item],
        (left, declined): (&mut [bool], &mut Vec<(usize, &'static str, String)>),
        range: std::ops::Range<usize>,
        careful: bool,
        restore: bool,
    ) -> Result<Segment, Failure> {
        let group = &self.config.group;
        if restore {
            // A handler of the last segment may have changed the session:
            // the bookkeeping runs as the consumer (see `txn.rs`).
            match txn::probe(&mut *tx).await {
                Ok(()) => {}
                Err(Broken::Outage(error)) => return Err(Failure::Outage(error.into())),
                Err(broken) => return Err(Failure::Suspect(broken.blame())),
            }
        }
        sqlx::query(apply::SAVEPOINT)
            .execute(&mut *tx)
            .await
            .map_err(|e| apply::bookkeeping(e, SETTLE))?;
        let handling = apply::Handling {
            registry: &self.registry,
            timeout: self.config.handler_timeout,
            careful,
            prefetched: None,
        };
        // The retries the round put first run together (see
        // [`retries_first`]); another segment ends before the next retry.
        let retry = |i: usize| !left[i] && rows[i].attempts > 0;
        let end = if retry(range.start) {
            (range.start + 1..range.end)
                .find(|&i| rows[i].attempts == 0)
                .unwrap_or(range.end)
        } else {
            (range.start + 1..range.end)
                .find(|&i| retry(i))
                .unwrap_or(range.end)
        };
        let range = range.start..end;
        let inserted: Vec<usize> = range
            .clone()
            .filter(|&i| !left[i] && matches!(items[i], Item::Event(_)))
            .collect();
        let ids: Vec<Uuid> = inserted.iter().map(|&i| rows[i].event_id).collect();
        let fresh: HashSet<Uuid> = if ids.is_empty() {
            HashSet::new()
        } else {
            sqlx::query_scalar(INSERT_PROCESSED)
                .bind(group)
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| apply::bookkeeping(e, crate::inbox::dedup::PROCESSED))?
                .into_iter()
                .collect()
        };
        let mut segment = Segment {
            end,
            ..Segment::default()
        };
        for i in range {
            if left[i] {
                continue;
            }
            let row = &rows[i];
            match &mut items[i] {
                Item::Event(event) => {
                    if fresh.contains(&row.event_id) {
                        let t = std::time::Instant::now();
                        segment.follow_ups.at = i;
                        match apply::run_handlers(tx, handling, event, &mut segment.follow_ups)
                            .await
                        {
                            Ok(()) => {}
                            Err(Failure::Handler {
                                handler,
                                error,
                                clean: true,
                                ..
                            }) if self
                                .stats
                                .may_undo_dedup(&mut *tx)
                                .await
                                .map_err(|e| apply::bookkeeping(e, UNDO))? =>
                            {
                                let key = (&row.topic, &row.partition_key);
                                for (j, later) in rows.iter().enumerate().skip(i) {
                                    if (&later.topic, &later.partition_key) == key {
                                        left[j] = true;
                                    }
                                }
                                segment.follow_ups.forget(i);
                                declined.push((i, handler, error));
                                continue;
                            }
                            Err(failure) => return Err(failure.at(i)),
                        }
                        segment.batch.handler_time += t.elapsed();
                        segment.batch.processed += 1;
                    } else {
                        segment.batch.duplicates += 1;
                    }
                    segment.ids.push(row.event_id);
                }
                Item::Ignored => {
                    segment.batch.ignored += 1;
                    segment.ids.push(row.event_id);
                }
                Item::Rejected(_) => {}
            }
        }
        // The dedup rows of the rows left meanwhile go again.
        let undone: Vec<Uuid> = inserted
            .iter()
            .map(|&i| (i, rows[i].event_id))
            .filter(|(i, id)| left[*i] && fresh.contains(id))
            .map(|(_, id)| id)
            .collect();
        if !undone.is_empty() {
            sqlx::query(crate::inbox::dedup::UNDO_PROCESSED)
                .bind(group)
                .bind(&undone)
                .execute(&mut *tx)
                .await
                .map_err(|e| apply::bookkeeping(e, UNDO))?;
        }
        Ok(segment)
    }

    pub(super) fn item(&self, row: &Row) -> Item {
        let headers: Headers = serde_json::from_str(&row.headers).unwrap_or_default();
        let incoming = IncomingEvent::new(
            row.event_id,
            row.event_type.clone(),
            u32::try_from(row.event_version).unwrap_or(1),
            row.topic.clone(),
            row.partition_key.clone(),
            headers,
        );
        let mut event = Event {
            incoming,
            handlers: Vec::new(),
            payload: row.payload.as_bytes().to_vec(),
            decoded: Vec::new(),
        };
        match self.registry.route(&row.topic, &row.event_type) {
            Route::Handlers(h) => {
                event.handlers = h.to_vec();
                Item::Event(Box::new(event))
            }
            Route::Ignored => Item::Ignored,
            Route::Unknown => Item::Rejected(Box::new(event.rejected(
                DeadLetterReason::UnknownEventType,
                format!(
                    "no handler for event type `{}` on topic `{}` any more (handled: {})",
                    row.event_type,
                    row.topic,
                    self.registry.known_types(&row.topic)
                ),
                None,
                0,
            ))),
        }
    }
}
