//! Inbox mode, the receiving half: each batch is stored in `inbox_event`
//! with one multi-row `INSERT … ON CONFLICT (event_id) DO NOTHING` (received
//! order kept in `seq`), malformed messages go to the dead-letter table in
//! the same transaction, and only after `COMMIT` are the offsets handed to
//! the polling thread. Nothing runs handlers here: the
//! [`processor`](super::processor) does, from the table.
//!
//! If PostgreSQL refuses a batch because of its data (e.g. a payload `jsonb`
//! cannot hold, such as a `\u0000` escape), the batch is stored message by
//! message and the refused ones are dead-lettered as `not_json`.

use std::sync::atomic::Ordering;

use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::apply;
use super::db::{Health, is_data_error, pg_text};
use super::dead_letter::{self, DeadLetterReason, NewDeadLetter};
use super::dedup::log_rejected;
use super::poller::Shared;
use super::record::{Body, Record};
use super::{ConsumerConfig, Stats};

const INSERT_INBOX: &str = r#"
INSERT INTO inbox_event
    (event_id, payload, consumer, topic, "partition", "offset", partition_key,
     event_type, event_version, headers)
SELECT e, p::jsonb, $1, t, pa, o, k, et, ev, h::jsonb
FROM UNNEST($2::uuid[], $3::text[], $4::text[], $5::int4[], $6::int8[], $7::text[],
            $8::text[], $9::int4[], $10::text[])
     WITH ORDINALITY AS u(e, p, t, pa, o, k, et, ev, h, n)
ORDER BY n
ON CONFLICT (event_id) DO NOTHING"#;

/// Stores batches in inbox mode.
pub(crate) struct Store<'a> {
    pub pool: &'a PgPool,
    pub config: &'a ConsumerConfig,
    pub stats: &'a Stats,
    pub shared: &'a Shared,
    pub wake: &'a Notify,
    pub db: Health,
}

/// What one stored batch did.
struct Report {
    events: u64,
    stored: u64,
    ignored: u64,
    rejected: Vec<(DeadLetterReason, String)>,
}

impl Store<'_> {
    /// Stores `batch`; returns when it committed, or early on shutdown
    /// during a database outage (nothing of it committed then).
    pub async fn process(&mut self, mut batch: Vec<Record>, shutdown: &CancellationToken) {
        loop {
            match self.store(&batch).await {
                Ok(report) => {
                    self.db.up();
                    self.account(report);
                    self.shared.completed(&batch);
                    self.wake.notify_one();
                    break;
                }
                Err(error) if is_data_error(&error) => {
                    tracing::debug!(%error, "batch refused by the database: storing it message by message");
                    if !self.one_by_one(&mut batch, shutdown).await {
                        return;
                    }
                    self.wake.notify_one();
                    break;
                }
                Err(error) => {
                    let wait = self.db.down(&error);
                    if !apply::pause(wait, shutdown).await {
                        return;
                    }
                }
            }
        }
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
    }

    fn account(&self, report: Report) {
        let s = self.stats;
        s.stored.fetch_add(report.stored, Ordering::Relaxed);
        s.duplicates
            .fetch_add(report.events - report.stored, Ordering::Relaxed);
        s.ignored.fetch_add(report.ignored, Ordering::Relaxed);
        if !report.rejected.is_empty() {
            s.dead_lettered
                .fetch_add(report.rejected.len() as u64, Ordering::Relaxed);
            log_rejected(&self.config.group, &report.rejected);
        }
    }

    async fn store(&self, records: &[Record]) -> Result<Report, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let report = insert(&mut tx, &self.config.group, records).await?;
        tx.commit().await?;
        Ok(report)
    }

    /// Stores each record in its own transaction; the ones the database
    /// refuses become `not_json` dead letters. Returns false on shutdown.
    async fn one_by_one(&mut self, batch: &mut [Record], shutdown: &CancellationToken) -> bool {
        for i in 0..batch.len() {
            loop {
                match self.store(&batch[i..=i]).await {
                    Ok(report) => {
                        self.db.up();
                        self.account(report);
                        self.shared.completed(&batch[i..=i]);
                        break;
                    }
                    Err(error) if is_data_error(&error) => {
                        if let Body::Event(event) = &batch[i].body {
                            let rejected = event.rejected(
                                DeadLetterReason::NotJson,
                                format!("the database refused the payload: {error}"),
                                None,
                                0,
                            );
                            batch[i].body = Body::Rejected(Box::new(rejected));
                        } else {
                            // A dead letter itself was refused: nothing
                            // more to try; do not block the partition.
                            tracing::error!(%error, offset = batch[i].offset, "could not store a dead letter");
                            self.shared.completed(&batch[i..=i]);
                            break;
                        }
                    }
                    Err(error) => {
                        let wait = self.db.down(&error);
                        if !apply::pause(wait, shutdown).await {
                            return false;
                        }
                    }
                }
            }
        }
        true
    }
}

/// Inserts the events of `records` into `inbox_event` and their malformed
/// messages into `dead_letter`, on `conn`.
async fn insert(
    conn: &mut PgConnection,
    group: &str,
    records: &[Record],
) -> Result<Report, sqlx::Error> {
    let n = records.len();
    let mut ids = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut topics = Vec::with_capacity(n);
    let mut partitions = Vec::with_capacity(n);
    let mut offsets = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut versions = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    let mut letters = Vec::new();
    let mut ignored = 0;
    for r in records {
        match &r.body {
            Body::Event(e) => {
                let i = &e.incoming;
                ids.push(i.event_id);
                // Checked to be UTF-8 JSON while parsing; an empty string would be
                // refused by the database and dead-lettered as `not_json`.
                payloads.push(std::str::from_utf8(&e.payload).unwrap_or_default());
                topics.push(&*r.topic);
                partitions.push(r.partition);
                offsets.push(r.offset);
                keys.push(i.partition_key.as_str());
                types.push(i.event_type.as_str());
                versions.push(i32::try_from(i.event_version).unwrap_or(i32::MAX));
                headers.push(i.headers.to_json());
            }
            Body::Ignored => ignored += 1,
            Body::Rejected(rejected) => letters.push(NewDeadLetter {
                topic: &r.topic,
                partition: r.partition,
                offset: r.offset,
                rejected,
            }),
        }
    }
    let mut stored = 0;
    if !ids.is_empty() {
        stored = sqlx::query(INSERT_INBOX)
            .bind(pg_text(group).as_ref())
            .bind(&ids)
            .bind(&payloads)
            .bind(&topics)
            .bind(&partitions)
            .bind(&offsets)
            .bind(&keys)
            .bind(&types)
            .bind(&versions)
            .bind(&headers)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    dead_letter::insert(conn, group, &letters).await?;
    Ok(Report {
        events: ids.len() as u64,
        stored,
        ignored,
        rejected: letters
            .iter()
            .map(|l| (l.rejected.reason, l.rejected.error.clone()))
            .collect(),
    })
}
