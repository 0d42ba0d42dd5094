//! Re-drive of dead letters: every `redrive_interval` the consumer looks for
//! rows of its group that an operator marked `retry` (`outbox dead-letters
//! retry`) and runs each one again, as if it had just been received — the
//! stored message is parsed again (so a handler registered since, or a
//! raised size limit, now applies) — in one transaction with the row's
//! status update (`FOR UPDATE SKIP LOCKED`: consumers of the group share the
//! work).
//!
//! - dedup mode: the `processed_event` insert, the handlers and the
//!   follow-up events run once, in a savepoint; success → `resolved`
//!   (also when the event turns out to have been applied meanwhile);
//!   failure → `dead` again with the new error, one more attempt counted.
//! - inbox mode: the event goes back into the inbox queue (the dead-lettered
//!   row is reset, or a row is stored if the message never made it into the
//!   inbox) and the dead letter is `resolved`; if its handler fails
//!   `max_attempts` times again, the same dead letter is reopened.
//!
//! Still malformed → `dead` again with the new reason and error.
//!
//! The transaction runs on a guarded connection (`txn.rs`), checked after
//! the handlers: a handler that breaks it without saying so fails; if it
//! ended the transaction, the status update goes into a new one. The status
//! updates apply only to the retry request that was claimed (the row still
//! marked `retry`, not marked again since): a handler that ended the
//! transaction released the row, and another consumer of the group (or an
//! operator) may have settled it meanwhile — that decision stands.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::Value;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::apply::{self, Failure};
use super::db::is_data_error;
use super::dead_letter::{self, DeadLetterReason};
use super::dispatch::Registry;
use super::record::{self, Body, Check, Event, Raw};
use super::txn::{self, Broken, GuardedConn};
use super::{ConsumerConfig, ConsumerStats, Mode};
use crate::backoff::Health;
use crate::refusal::{Statement, Trouble};

/// The re-drive's reads and status updates, as a refusal names them.
const REDRIVE: Statement = Statement {
    name: "consumer: re-drive dead letters",
    needs: "SELECT, UPDATE ON dead_letter",
};

/// Putting a re-driven event back into the inbox.
const REQUEUED: Statement = Statement {
    name: "consumer (inbox): requeue a re-driven event",
    needs: "INSERT, UPDATE ON inbox_event",
};

fn during(statement: Statement) -> impl Fn(sqlx::Error) -> Trouble {
    move |error| Trouble::from(error).during(statement)
}

const CLAIM: &str = r#"
SELECT id, topic, "partition" AS partition, "offset" AS offset, key, headers, payload,
       payload_bytes, retries
FROM dead_letter
WHERE consumer = $1 AND status = 'retry'
ORDER BY id
LIMIT 1
FOR UPDATE SKIP LOCKED"#;

/// The status updates apply only to the retry request that was claimed
/// (`retries` counts the requests): still marked, not re-marked since.
const RESOLVED: &str = "\
UPDATE dead_letter SET status = 'resolved', resolved_at = now()
WHERE id = $1 AND status = 'retry' AND retries = $2";

const DEAD_AGAIN: &str = "\
UPDATE dead_letter
SET status = 'dead', reason = $2, error = $3, handler = COALESCE($4, handler),
    attempts = attempts + $5, last_failed_at = now()
WHERE id = $1 AND status = 'retry' AND retries = $6";

const REQUEUE: &str = r#"
INSERT INTO inbox_event
    (event_id, payload, consumer, topic, "partition", "offset", partition_key,
     event_type, event_version, headers, next_attempt_at)
VALUES ($1, $2::jsonb, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, now())
ON CONFLICT (consumer, event_id) DO UPDATE
SET dead_lettered_at = NULL, attempts = 0, next_attempt_at = now(), last_error = NULL
WHERE inbox_event.dead_lettered_at IS NOT NULL AND NOT inbox_event.processed"#;

const INSERT_PROCESSED: &str = "\
INSERT INTO processed_event (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";

#[derive(sqlx::FromRow)]
struct Row {
    id: i64,
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    headers: Value,
    payload: Option<Vec<u8>>,
    payload_bytes: Option<i64>,
    retries: i32,
}

/// The re-drive task of one consumer.
pub(crate) struct Redriver {
    pub pool: PgPool,
    pub config: Arc<ConsumerConfig>,
    pub registry: Arc<Registry>,
    pub stats: Arc<ConsumerStats>,
    pub wake: Arc<Notify>,
}

/// The outcome of one re-driven row.
enum Outcome {
    Resolved,
    Dead(DeadLetterReason, String),
}

impl Redriver {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut db = Health::new(
            "database (dead-letter re-drive)",
            self.config.outage_backoff,
            self.config.outage_backoff_max,
        )
        .reporting(self.stats.problems.clone());
        let mut conn = GuardedConn::new(self.pool.clone(), self.config.handler_timeout);
        while apply::pause(self.config.redrive_interval, &shutdown).await {
            loop {
                if shutdown.is_cancelled() {
                    return;
                }
                match self.one(&mut conn).await {
                    Ok(true) => db.up(),
                    Ok(false) => {
                        db.up();
                        break;
                    }
                    Err(error) => {
                        conn.discard();
                        let wait = db.down(&error);
                        apply::pause(wait, &shutdown).await;
                        break;
                    }
                }
            }
            // Idle until the next look: the connection goes back to the pool.
            conn.release().await;
        }
    }

    /// Re-drives one marked row; false when there is none.
    async fn one(&self, conn: &mut GuardedConn) -> Result<bool, Trouble> {
        let mut tx = conn.begin().await.map_err(during(super::dedup::TX_GUARD))?;
        let row: Option<Row> = sqlx::query_as(CLAIM)
            .bind(&self.config.group)
            .fetch_optional(&mut *tx)
            .await
            .map_err(during(REDRIVE))?;
        let Some(row) = row else {
            return Ok(false);
        };
        let headers: Vec<(String, Option<String>)> = match &row.headers {
            Value::Object(map) => map
                .iter()
                .map(|(k, v)| {
                    let v = match v {
                        Value::Null => None,
                        Value::String(s) => Some(s.clone()),
                        other => Some(other.to_string()),
                    };
                    (k.clone(), v)
                })
                .collect(),
            _ => Vec::new(),
        };
        let raw = Raw {
            topic: &row.topic,
            partition: row.partition,
            offset: row.offset,
            key: row.key.as_deref(),
            payload: row.payload.as_deref(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.as_str().into(), v.as_deref().map(str::as_bytes)))
                .collect(),
            bad_names: 0,
        };
        let check = match self.config.mode {
            Mode::Dedup => Check::Decode,
            Mode::Inbox => Check::Json,
        };
        let body = match row.payload_bytes {
            // Only a prefix was kept: nothing to run.
            Some(size) => Body::Rejected(Box::new(record::Rejected {
                key: None,
                event_id: None,
                event_type: None,
                headers: Default::default(),
                payload: None,
                reason: DeadLetterReason::Oversized,
                error: format!(
                    "the dead letter keeps only the first {} of the payload's {size} bytes: it \
                     cannot be re-driven (replay the event from the producer's outbox)",
                    row.payload.as_ref().map_or(0, Vec::len)
                ),
                handler: None,
                attempts: 0,
                payload_bytes: Some(size),
            })),
            None => record::parse(&raw, &self.registry, self.config.max_payload_bytes, check),
        };
        let (outcome, attempts, handler) = match body {
            Body::Ignored => (Outcome::Resolved, 0, None),
            Body::Rejected(r) => (Outcome::Dead(r.reason, r.error), 0, None),
            Body::Event(mut event) => match self.config.mode {
                Mode::Dedup => match self.apply(&mut tx, &mut event).await {
                    Ok(()) => (Outcome::Resolved, 1, None),
                    Err(Failure::Outage(error)) => return Err(error),
                    Err(Failure::Suspect(error)) => return Err(error.into()),
                    Err(Failure::Handler { handler, error, .. }) => {
                        self.stats.handler_failures.fetch_add(1, Ordering::Relaxed);
                        (
                            Outcome::Dead(DeadLetterReason::HandlerFailed, error),
                            1,
                            Some(handler),
                        )
                    }
                    Err(Failure::Rejected { rejected, .. }) => {
                        (Outcome::Dead(rejected.reason, rejected.error), 0, None)
                    }
                },
                Mode::Inbox => match self.requeue(&mut tx, &row, &event).await {
                    Ok(()) => (Outcome::Resolved, 0, None),
                    Err(error) if is_data_error(&error) => (
                        Outcome::Dead(
                            DeadLetterReason::NotJson,
                            format!("the database refused the payload: {error}"),
                        ),
                        0,
                        None,
                    ),
                    Err(error) => return Err(during(REQUEUED)(error)),
                },
            },
        };
        // A handler that ended the transaction took the row's lock with it:
        // the status update goes into a new transaction, and applies only if
        // the row is still marked (the update's condition is checked again
        // on the row's latest version).
        let mut tx = match txn::probe(&mut tx).await {
            Ok(()) => tx,
            Err(Broken::Outage(error)) => return Err(error.into()),
            Err(_) => {
                drop(tx);
                conn.begin().await.map_err(during(super::dedup::TX_GUARD))?
            }
        };
        let updated = match &outcome {
            Outcome::Resolved => {
                sqlx::query(RESOLVED)
                    .bind(row.id)
                    .bind(row.retries)
                    .execute(&mut *tx)
                    .await
            }
            Outcome::Dead(reason, error) => {
                sqlx::query(DEAD_AGAIN)
                    .bind(row.id)
                    .bind(reason.as_str())
                    .bind(dead_letter::stored_error(error))
                    .bind(handler)
                    .bind(attempts)
                    .bind(row.retries)
                    .execute(&mut *tx)
                    .await
            }
        }
        .map_err(during(REDRIVE))?
        .rows_affected()
            == 1;
        apply::seal(&mut tx)
            .await
            .map_err(|_| Trouble::from("the re-drive transaction was broken before its commit"))?;
        tx.commit().await?;
        if !updated {
            tracing::info!(
                group = %self.config.group,
                id = row.id,
                "dead letter settled elsewhere while it was re-driven (another consumer of the \
                 group, or an operator): left as it is"
            );
            return Ok(true);
        }
        match outcome {
            Outcome::Resolved => {
                self.stats.redriven.fetch_add(1, Ordering::Relaxed);
                if self.config.mode == Mode::Inbox {
                    self.wake.notify_one();
                }
                tracing::info!(group = %self.config.group, id = row.id, "dead letter re-driven");
            }
            Outcome::Dead(reason, error) => {
                tracing::warn!(group = %self.config.group, id = row.id, %reason, %error, "dead letter failed again");
            }
        }
        Ok(true)
    }

    /// Dedup mode: the event, applied once, in a savepoint of `conn`'s
    /// transaction.
    async fn apply(&self, conn: &mut PgConnection, event: &mut Event) -> Result<(), Failure> {
        let mut sp = conn.begin().await?;
        let fresh = sqlx::query(INSERT_PROCESSED)
            .bind(&self.config.group)
            .bind(event.incoming.event_id)
            .execute(&mut *sp)
            .await?
            .rows_affected()
            == 1;
        if fresh {
            let mut follow_ups = apply::FollowUps::default();
            let handling = apply::Handling {
                registry: &self.registry,
                timeout: self.config.handler_timeout,
                careful: true,
                prefetched: None,
            };
            apply::run_handlers(&mut sp, handling, event, &mut follow_ups).await?;
            follow_ups.write(&mut sp).await?;
            self.stats.processed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
        }
        sp.commit().await?;
        Ok(())
    }

    /// Inbox mode: the event back into the inbox queue.
    async fn requeue(
        &self,
        conn: &mut PgConnection,
        row: &Row,
        event: &Event,
    ) -> Result<(), sqlx::Error> {
        let i = &event.incoming;
        let mut sp = conn.begin().await?;
        sqlx::query(REQUEUE)
            .bind(i.event_id)
            .bind(std::str::from_utf8(&event.payload).unwrap_or_default())
            .bind(&self.config.group)
            .bind(&row.topic)
            .bind(row.partition)
            .bind(row.offset)
            .bind(&i.partition_key)
            .bind(&i.event_type)
            .bind(i32::try_from(i.event_version).unwrap_or(i32::MAX))
            .bind(i.headers.to_json())
            .execute(&mut *sp)
            .await?;
        sp.commit().await
    }
}
