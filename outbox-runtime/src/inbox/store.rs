//! Inbox mode, the receiving half: each batch is stored in `inbox_event`
//! (received order kept in `seq`), malformed messages go to the dead-letter
//! table in the same transaction, and only after `COMMIT` are the offsets
//! handed to the polling thread. Nothing runs handlers here: the
//! [`processor`](super::processor) does, from the table.
//!
//! A batch is written with one binary `COPY … FROM STDIN` (PostgreSQL then
//! inserts the rows page by page, far cheaper than row by row). A `COPY`
//! cannot skip duplicates: if the batch holds an event already stored (a
//! redelivery), the transaction rolls back and the batch is written again
//! with one multi-row `INSERT … ON CONFLICT (consumer, event_id) DO NOTHING`.
//!
//! Batches are split by partition over `writers` connections (default 2)
//! that store their parts concurrently: PostgreSQL inserts with more than
//! one core, and a partition's messages still go through one connection, in
//! order.
//!
//! If PostgreSQL refuses a batch because of its data (e.g. a payload `jsonb`
//! cannot hold, such as a `\u0000` escape), the batch is stored message by
//! message and the refused ones are dead-lettered as `not_json`.

use std::sync::atomic::Ordering;

use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::apply;
use super::db::{is_data_error, pg_text};
use super::dead_letter::{self, DeadLetterReason, NewDeadLetter};
use super::dedup::log_rejected;
use super::poller::Shared;
use super::record::{Body, Record};
use super::{ConsumerConfig, Stats};
use crate::backoff::Health;
use crate::refusal::{Statement, Trouble};

/// Storing a batch, as a refusal names it.
const STORE: Statement = Statement {
    name: "consumer (inbox): store received events",
    needs: "INSERT ON inbox_event (and dead_letter, for malformed messages)",
};

const INSERT_INBOX: &str = r#"
INSERT INTO inbox_event
    (event_id, payload, consumer, topic, "partition", "offset", partition_key,
     event_type, event_version, headers, processed)
SELECT e, p::jsonb, $1, t, pa, o, k, et, ev, h::jsonb, $11
FROM UNNEST($2::uuid[], $3::text[], $4::text[], $5::int4[], $6::int8[], $7::text[],
            $8::text[], $9::int4[], $10::text[])
     WITH ORDINALITY AS u(e, p, t, pa, o, k, et, ev, h, n)
ORDER BY n
ON CONFLICT (consumer, event_id) DO NOTHING"#;

/// Stores batches in inbox mode.
pub(crate) struct Store<'a> {
    pub pool: &'a PgPool,
    pub config: &'a ConsumerConfig,
    pub stats: &'a Stats,
    pub shared: &'a Shared,
    pub wake: &'a Notify,
    pub db: Health,
    /// The consumer is in the progress mode: rows are stored out of the
    /// default mode's queue (see [`super::progress`]).
    pub progress: bool,
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
    /// during a database outage (then what did not commit is not
    /// acknowledged: it will be read again).
    ///
    /// The batch is split by partition over `writers` connections that
    /// store their parts concurrently, each in its own transaction (a
    /// partition always goes to the same part, so its messages keep their
    /// order in `seq`); each part's offsets are released when it commits.
    pub async fn process(&mut self, batch: Vec<Record>, shutdown: &CancellationToken) {
        let mut parts: Vec<Vec<Record>> = (0..self.config.writers.max(1))
            .map(|_| Vec::new())
            .collect();
        let n = parts.len();
        for record in batch {
            parts[writer_of(&record.topic, record.partition, n)].push(record);
        }
        let mut pending: Vec<usize> = (0..n).filter(|i| !parts[*i].is_empty()).collect();
        let mut refused = Vec::new();
        while !pending.is_empty() {
            let results =
                futures_util::future::join_all(pending.iter().map(|i| self.store(&parts[*i])))
                    .await;
            let mut outage = None;
            let mut again = Vec::new();
            for (i, result) in pending.iter().zip(results) {
                match result {
                    Ok(report) => {
                        self.account(report);
                        self.shared.completed(&parts[*i]);
                    }
                    Err(error) if is_data_error(&error) => refused.push((*i, error)),
                    Err(error) => {
                        again.push(*i);
                        outage = Some(error);
                    }
                }
            }
            pending = again;
            match outage {
                None => self.db.up(),
                Some(error) => {
                    let wait = self.db.down(Trouble::from(&error).during(STORE));
                    if !apply::pause(wait, shutdown).await {
                        return;
                    }
                }
            }
        }
        for (i, error) in refused {
            tracing::debug!(%error, "batch refused by the database: storing it message by message");
            if !self.one_by_one(&mut parts[i], shutdown).await {
                return;
            }
        }
        self.wake.notify_one();
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

    /// Stores `records` in one transaction: `COPY`, or `INSERT … ON
    /// CONFLICT DO NOTHING` when some are stored already.
    async fn store(&self, records: &[Record]) -> Result<Report, sqlx::Error> {
        match self.store_with(records, Method::Copy).await {
            Err(error) if is_unique_violation(&error) => {
                self.store_with(records, Method::Insert).await
            }
            other => other,
        }
    }

    async fn store_with(&self, records: &[Record], method: Method) -> Result<Report, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let report = insert(&mut tx, &self.config.group, records, method, self.progress).await?;
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
                        let wait = self.db.down(Trouble::from(&error).during(STORE));
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Copy,
    Insert,
}

fn is_unique_violation(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("23505"))
}

const COPY_INBOX: &str = r#"
COPY inbox_event
    (event_id, payload, consumer, topic, "partition", "offset", partition_key,
     event_type, event_version, headers, processed)
FROM STDIN WITH (FORMAT binary)"#;

/// Writes the events of `records` with one binary `COPY` and their
/// malformed messages with one insert, on `conn`.
async fn copy(
    conn: &mut PgConnection,
    group: &str,
    records: &[Record],
    progress: bool,
) -> Result<Report, sqlx::Error> {
    let mut data = Vec::with_capacity(records.len() * 512 + 32);
    data.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
    data.extend_from_slice(&0_i32.to_be_bytes()); // flags
    data.extend_from_slice(&0_i32.to_be_bytes()); // header extension
    let group = pg_text(group);
    let mut events = 0;
    let mut ignored = 0;
    let mut letters = Vec::new();
    for r in records {
        match &r.body {
            Body::Event(e) => {
                let i = &e.incoming;
                data.extend_from_slice(&11_i16.to_be_bytes());
                field(&mut data, i.event_id.as_bytes());
                jsonb(&mut data, &e.payload);
                field(&mut data, group.as_bytes());
                field(&mut data, r.topic.as_bytes());
                field(&mut data, &r.partition.to_be_bytes());
                field(&mut data, &r.offset.to_be_bytes());
                field(&mut data, i.partition_key.as_bytes());
                field(&mut data, i.event_type.as_bytes());
                let version = i32::try_from(i.event_version).unwrap_or(i32::MAX);
                field(&mut data, &version.to_be_bytes());
                jsonb(&mut data, i.headers.to_json().as_bytes());
                field(&mut data, &[u8::from(progress)]);
                events += 1;
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
    data.extend_from_slice(&(-1_i16).to_be_bytes());
    let mut stored = 0;
    if events > 0 {
        let mut copy = conn.copy_in_raw(COPY_INBOX).await?;
        copy.send(data).await?;
        stored = copy.finish().await?;
    }
    dead_letter::insert(conn, &group, &letters).await?;
    Ok(Report {
        events,
        stored,
        ignored,
        rejected: letters
            .iter()
            .map(|l| (l.rejected.reason, l.rejected.error.clone()))
            .collect(),
    })
}

/// One field of a binary `COPY` row: length, then bytes. Payloads are
/// bounded by `max_payload_bytes` (at most 1 GiB).
fn field(data: &mut Vec<u8>, value: &[u8]) {
    let len = i32::try_from(value.len()).unwrap_or(i32::MAX);
    data.extend_from_slice(&len.to_be_bytes());
    data.extend_from_slice(value);
}

/// A `jsonb` field: format version 1, then the JSON text.
fn jsonb(data: &mut Vec<u8>, text: &[u8]) {
    let len = i32::try_from(text.len() + 1).unwrap_or(i32::MAX);
    data.extend_from_slice(&len.to_be_bytes());
    data.push(1);
    data.extend_from_slice(text);
}

/// The writer (part of a batch) a partition belongs to.
fn writer_of(topic: &str, partition: i32, writers: usize) -> usize {
    use std::hash::{Hash, Hasher};
    if writers <= 1 {
        return 0;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    topic.hash(&mut h);
    let spread = h.finish() as usize;
    spread.wrapping_add(partition.unsigned_abs() as usize) % writers
}

/// Inserts the events of `records` into `inbox_event` and their malformed
/// messages into `dead_letter`, on `conn`.
async fn insert(
    conn: &mut PgConnection,
    group: &str,
    records: &[Record],
    method: Method,
    progress: bool,
) -> Result<Report, sqlx::Error> {
    if method == Method::Copy {
        return copy(conn, group, records, progress).await;
    }
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
            .bind(progress)
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
