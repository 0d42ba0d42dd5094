//! A handler's failure, settled in the round's transaction: a failed
//! attempt recorded on its row (its key waits for the back-off), or a dead
//! letter once out of attempts; reported to the logs and counts.

use super::*;

/// A handler's failure, settled in the round's transaction.
pub(super) struct Failed {
    /// The row's index in the round.
    pub(super) at: usize,
    pub(super) handler: &'static str,
    pub(super) error: String,
    pub(super) attempts: i32,
    /// Out of attempts: dead-lettered.
    pub(super) dead: bool,
}

impl Processor {
    /// Records, in the round's transaction, a handler's failure on `row`:
    /// a failed attempt (its key waits for the back-off), or its dead
    /// letter once out of attempts.
    pub(super) async fn settle_failure(
        &self,
        tx: &mut PgConnection,
        row: &Row,
        item: &Item,
        handler: &'static str,
        error: String,
    ) -> Result<Failed, Failure> {
        let attempts = row.attempts.saturating_add(1);
        let dead = u32::try_from(attempts).unwrap_or(u32::MAX) >= self.config.max_attempts;
        let group = &self.config.group;
        if dead {
            if let Item::Event(event) = item {
                let rejected = event.rejected(
                    DeadLetterReason::HandlerFailed,
                    error.clone(),
                    Some(handler),
                    attempts,
                );
                let letter = NewDeadLetter {
                    topic: &row.topic,
                    partition: row.partition,
                    offset: row.offset,
                    rejected: &rejected,
                };
                dead_letter::insert(tx, group, &[letter])
                    .await
                    .map_err(|e| Failure::Outage(crate::inbox::dedup::refused_dead_letters(e)))?;
            }
            sqlx::query(MARK_DEAD)
                .bind(row.event_id)
                .bind(pg_text(&error).as_ref())
                .bind(1_i32)
                .bind(group)
                .execute(&mut *tx)
                .await
                .map_err(|e| Failure::Outage(during(SETTLE)(e)))?;
        } else {
            sqlx::query(RECORD_FAILURE)
                .bind(row.event_id)
                .bind(pg_text(&error).as_ref())
                .bind(self.retry_delay(attempts))
                .bind(group)
                .execute(&mut *tx)
                .await
                .map_err(|e| Failure::Outage(during(SETTLE)(e)))?;
        }
        Ok(Failed {
            at: 0,
            handler,
            error,
            attempts,
            dead,
        })
    }

    /// The back-off before attempt `attempts + 1`, in seconds.
    pub(super) fn retry_delay(&self, attempts: i32) -> f64 {
        backoff::delay(
            self.config.retry_backoff,
            self.config.retry_backoff_max,
            u32::try_from(attempts).unwrap_or(u32::MAX),
        )
        .as_secs_f64()
    }

    /// Logs a settled failure.
    pub(super) fn report_failure(&self, row: &Row, failed: &Failed) {
        let Failed {
            handler,
            error,
            attempts,
            ..
        } = failed;
        if failed.dead {
            tracing::warn!(
                group = %self.config.group,
                event_id = %row.event_id,
                event_type = %row.event_type,
                handler,
                attempts,
                %error,
                "handler kept failing: event dead-lettered (re-drive with `outbox dead-letters retry`)"
            );
        } else {
            tracing::debug!(event_id = %row.event_id, handler, attempts, %error, "handler failed: retrying later");
        }
    }

    /// Settles a handler's failure in a transaction of its own, the round's
    /// having rolled back.
    pub(super) async fn settle_alone(
        &self,
        row: &Row,
        item: &Item,
        handler: &'static str,
        error: &str,
    ) -> Result<(), Trouble> {
        let attempts = row.attempts.saturating_add(1);
        if u32::try_from(attempts).unwrap_or(u32::MAX) >= self.config.max_attempts {
            let Item::Event(event) = item else {
                return Ok(());
            };
            let rejected = event.rejected(
                DeadLetterReason::HandlerFailed,
                error.to_owned(),
                Some(handler),
                attempts,
            );
            self.dead_letter(row, &rejected, 1).await?;
            self.report_failure(
                row,
                &Failed {
                    at: 0,
                    handler,
                    error: error.to_owned(),
                    attempts,
                    dead: true,
                },
            );
        } else {
            self.record_failure(row, error, self.retry_delay(attempts))
                .await?;
        }
        Ok(())
    }

    /// Records a failed attempt on one row (its key waits `delay_secs`).
    pub(super) async fn record_failure(
        &self,
        row: &Row,
        error: &str,
        delay_secs: f64,
    ) -> Result<(), Trouble> {
        let result = async {
            let mut tx = self.pool.begin().await?;
            self.wait_for_partition(&mut tx, row).await?;
            sqlx::query(RECORD_FAILURE)
                .bind(row.event_id)
                .bind(pg_text(error).as_ref())
                .bind(delay_secs)
                .bind(&self.config.group)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
        .await;
        result.map_err(during(SETTLE))
    }

    /// Dead-letters one row and takes it out of the queue.
    pub(super) async fn dead_letter(
        &self,
        row: &Row,
        rejected: &Rejected,
        attempts: i32,
    ) -> Result<(), Trouble> {
        let result = async {
            let mut tx = self.pool.begin().await?;
            self.wait_for_partition(&mut tx, row).await?;
            let letter = NewDeadLetter {
                topic: &row.topic,
                partition: row.partition,
                offset: row.offset,
                rejected,
            };
            dead_letter::insert(&mut tx, &self.config.group, &[letter])
                .await
                .map_err(crate::inbox::dedup::refused_dead_letters)?;
            let marked = sqlx::query(MARK_DEAD)
                .bind(row.event_id)
                .bind(pg_text(&rejected.error).as_ref())
                .bind(attempts)
                .bind(&self.config.group)
                .execute(&mut *tx)
                .await
                .map_err(during(SETTLE))?;
            tx.commit().await?;
            Ok::<_, Trouble>(marked.rows_affected())
        }
        .await;
        match result {
            Ok(n) => {
                self.stats.dead_lettered.fetch_add(n, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
