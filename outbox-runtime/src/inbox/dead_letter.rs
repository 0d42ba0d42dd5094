//! The `dead_letter` table: what a consumer could not apply, kept byte for
//! byte with the reason. Owns the insert the consumer uses and the
//! operations behind `outbox dead-letters list | retry | drop`.
//!
//! Re-drive: [`retry`] only marks rows (`status = 'retry'`); the consumer of
//! the row's group — the process that has the handlers — polls for marked
//! rows ([`ConsumerBuilder::redrive_interval`](super::ConsumerBuilder::redrive_interval))
//! and runs each one again, parsed anew from the stored bytes: in dedup
//! mode once, in one transaction with the row's status (`resolved`, or
//! `dead` again with the new error); in inbox mode the event goes back into
//! the inbox queue.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::db::pg_text;
use super::record::Rejected;
use crate::error::{Error, Result};

/// Why a message was dead-lettered (the `reason` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The payload is missing, not UTF-8, or not JSON.
    NotJson,
    /// No `event_id` header, or one that is not a UUID.
    NoEventId,
    /// No handler for the event type on a subscribed topic (and not
    /// ignored), no `event_type` header, or an invalid `event_version`.
    UnknownEventType,
    /// JSON that does not decode into the handler's event type (or decodes
    /// into another variant than the one named).
    PayloadMismatch,
    /// The message (key, headers and payload) exceeds the consumer's
    /// `max_payload_bytes`. The dead letter keeps a prefix of it.
    Oversized,
    /// A handler kept failing (`max_attempts`); `error` is its last error.
    HandlerFailed,
    /// Headers the consumer cannot trust: a name that is not UTF-8, or an
    /// identity header (`event_id`, `event_type`, ...) given twice with
    /// different values.
    InvalidHeaders,
    /// The message has no key (the partition key, which orders an
    /// aggregate's events).
    NoKey,
    /// The event's schema version (`event_version`) is one the handler's
    /// type does not read: newer than it declares (deploy a handler that
    /// knows it, then retry), or older than its oldest upcaster.
    UnsupportedVersion,
}

impl DeadLetterReason {
    /// Every reason.
    pub const ALL: [DeadLetterReason; 9] = [
        Self::NotJson,
        Self::NoEventId,
        Self::UnknownEventType,
        Self::PayloadMismatch,
        Self::Oversized,
        Self::HandlerFailed,
        Self::InvalidHeaders,
        Self::NoKey,
        Self::UnsupportedVersion,
    ];

    /// The value stored in the `reason` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotJson => "not_json",
            Self::NoEventId => "no_event_id",
            Self::UnknownEventType => "unknown_event_type",
            Self::PayloadMismatch => "payload_mismatch",
            Self::Oversized => "oversized",
            Self::HandlerFailed => "handler_failed",
            Self::InvalidHeaders => "invalid_headers",
            Self::NoKey => "no_key",
            Self::UnsupportedVersion => "unsupported_version",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeadLetterReason {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| Error::Config(format!("unknown dead-letter reason `{s}`")))
    }
}

/// One row of the dead-letter table, for listing.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Row id (what `retry --id` and `drop --id` take).
    pub id: i64,
    /// The consumer group.
    pub consumer: String,
    /// Kafka coordinates of the message.
    pub topic: String,
    /// Kafka partition.
    pub partition: i32,
    /// Kafka offset.
    pub offset: i64,
    /// The message key (lossy UTF-8).
    pub key: Option<String>,
    /// The event id, when the message had a valid one.
    pub event_id: Option<Uuid>,
    /// The event type named by the message.
    pub event_type: Option<String>,
    /// The reason (`not_json`, `handler_failed`, ...).
    pub reason: String,
    /// The error: what was wrong, or the handler's last error.
    pub error: String,
    /// The handler that failed (`handler_failed`).
    pub handler: Option<String>,
    /// Handler attempts made.
    pub attempts: i32,
    /// Re-drives requested so far.
    pub retries: i32,
    /// `dead` (waiting for an operator), `retry` (re-drive requested) or
    /// `resolved` (re-driven successfully).
    pub status: String,
    /// When it was first dead-lettered (UTC, RFC 3339).
    pub created_at: String,
    /// When it last failed (UTC, RFC 3339).
    pub last_failed_at: String,
    /// The Kafka headers.
    pub headers: serde_json::Value,
    /// The payload (lossy UTF-8).
    pub payload: Option<String>,
}

#[derive(sqlx::FromRow)]
struct Row {
    id: i64,
    consumer: String,
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    event_id: Option<Uuid>,
    event_type: Option<String>,
    reason: String,
    error: String,
    handler: Option<String>,
    attempts: i32,
    retries: i32,
    status: String,
    created_at: String,
    last_failed_at: String,
    headers: serde_json::Value,
    payload: Option<Vec<u8>>,
}

impl From<Row> for DeadLetter {
    fn from(r: Row) -> Self {
        let lossy = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
        Self {
            id: r.id,
            consumer: r.consumer,
            topic: r.topic,
            partition: r.partition,
            offset: r.offset,
            key: r.key.map(lossy),
            event_id: r.event_id,
            event_type: r.event_type,
            reason: r.reason,
            error: r.error,
            handler: r.handler,
            attempts: r.attempts,
            retries: r.retries,
            status: r.status,
            created_at: r.created_at,
            last_failed_at: r.last_failed_at,
            headers: r.headers,
            payload: r.payload.map(lossy),
        }
    }
}

/// Which dead letters [`list`] returns.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// Only this consumer group.
    pub consumer: Option<String>,
    /// Only these statuses (default: `dead` and `retry`).
    pub statuses: Option<Vec<String>>,
    /// Only this reason.
    pub reason: Option<DeadLetterReason>,
    /// At most this many rows (default 100).
    pub limit: Option<i64>,
    /// Only rows with an id above this one (the last id of the previous
    /// page: keyset pagination).
    pub after_id: Option<i64>,
}

impl DeadLetterFilter {
    /// Dead letters of every consumer in status `dead` or `retry`.
    pub fn new() -> Self {
        Self::default()
    }
    /// Only the consumer group `group`.
    pub fn consumer(mut self, group: impl Into<String>) -> Self {
        self.consumer = Some(group.into());
        self
    }
    /// Only these statuses (`dead`, `retry`, `resolved`).
    pub fn statuses<I: IntoIterator<Item = S>, S: Into<String>>(mut self, statuses: I) -> Self {
        self.statuses = Some(statuses.into_iter().map(Into::into).collect());
        self
    }
    /// Only this reason.
    pub fn reason(mut self, reason: DeadLetterReason) -> Self {
        self.reason = Some(reason);
        self
    }
    /// At most `n` rows.
    pub fn limit(mut self, n: i64) -> Self {
        self.limit = Some(n);
        self
    }
    /// Only rows after the id `id`.
    pub fn after_id(mut self, id: i64) -> Self {
        self.after_id = Some(id);
        self
    }
}

/// The statuses a dead letter can have.
pub const STATUSES: [&str; 3] = ["dead", "retry", "resolved"];

/// The columns of a listed or fetched dead letter.
const COLUMNS: &str = r#"id, consumer, topic, "partition" AS partition, "offset" AS offset, key,
    event_id, event_type, reason, error, handler, attempts, retries, status,
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS created_at,
    to_char(last_failed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS last_failed_at,
    headers, payload"#;

/// One dead letter by id (the primary key), if it exists.
pub async fn get(pool: &PgPool, id: i64) -> Result<Option<DeadLetter>> {
    let row: Option<Row> =
        sqlx::query_as(&format!("SELECT {COLUMNS} FROM dead_letter WHERE id = $1"))
            .bind(id)
            .fetch_optional(pool)
            .await?;
    Ok(row.map(DeadLetter::from))
}

/// Lists dead letters, oldest first, from `after_id` on (the primary key's
/// order: a page costs about its rows while the filter matches most rows).
pub async fn list(pool: &PgPool, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>> {
    let statuses = filter
        .statuses
        .clone()
        .unwrap_or_else(|| vec!["dead".into(), "retry".into()]);
    if let Some(bad) = statuses.iter().find(|s| !STATUSES.contains(&s.as_str())) {
        return Err(Error::Config(format!(
            "unknown dead-letter status `{bad}`: dead, retry or resolved"
        )));
    }
    let limit = filter.limit.unwrap_or(100);
    if limit < 1 {
        return Err(Error::Config(format!("invalid limit {limit}: at least 1")));
    }
    // Without resolved rows, the open rows' partial index answers.
    let open = if statuses.iter().any(|s| s == "resolved") {
        ""
    } else {
        "AND status <> 'resolved'"
    };
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "SELECT {COLUMNS}
           FROM dead_letter
           WHERE ($1::text IS NULL OR consumer = $1) {open}
             AND status = ANY($2)
             AND ($3::text IS NULL OR reason = $3)
             AND id > $5
           ORDER BY id
           LIMIT $4"
    ))
    .bind(filter.consumer.as_deref())
    .bind(&statuses)
    .bind(filter.reason.map(DeadLetterReason::as_str))
    .bind(limit)
    .bind(filter.after_id.unwrap_or(0))
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(DeadLetter::from).collect())
}

/// Asks the owning consumers to run dead letters again: rows in status
/// `dead` (of `consumer`, if given; with these `ids`, or all when `None`)
/// are marked `retry`. Returns how many were marked.
///
/// The consumer of the row's group picks marked rows up within its
/// re-drive interval and runs each once: on success the row becomes
/// `resolved`; on failure it is `dead` again with the new error.
///
/// `executor` is a pool or a transaction's connection (to commit an audit
/// record with the change).
pub async fn retry<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    consumer: Option<&str>,
    ids: Option<&[i64]>,
) -> Result<u64> {
    let result = sqlx::query(
        "UPDATE dead_letter SET status = 'retry', retry_requested_at = now(), retries = retries + 1
         WHERE status = 'dead'
           AND ($1::text IS NULL OR consumer = $1)
           AND ($2::bigint[] IS NULL OR id = ANY($2))",
    )
    .bind(consumer)
    .bind(ids)
    .execute(executor)
    .await?;
    Ok(result.rows_affected())
}

/// Deletes dead letters (of `consumer`, if given; these `ids`, or all when
/// `None`), whatever their status. Returns how many were deleted.
/// `executor` is a pool or a transaction's connection.
pub async fn discard<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    consumer: Option<&str>,
    ids: Option<&[i64]>,
) -> Result<u64> {
    let result = sqlx::query(
        "DELETE FROM dead_letter
         WHERE ($1::text IS NULL OR consumer = $1)
           AND ($2::bigint[] IS NULL OR id = ANY($2))",
    )
    .bind(consumer)
    .bind(ids)
    .execute(executor)
    .await?;
    Ok(result.rows_affected())
}

/// Count of dead letters per status for one consumer group (or all).
pub async fn counts(pool: &PgPool, consumer: Option<&str>) -> Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT status, count(*) FROM dead_letter
         WHERE ($1::text IS NULL OR consumer = $1) GROUP BY status ORDER BY status",
    )
    .bind(consumer)
    .fetch_all(pool)
    .await?)
}

/// Longest error text a dead letter keeps, in bytes: an error that quotes
/// the message (a hostile header of a megabyte) is cut to this, at a
/// character boundary, with a note of its full length.
pub const MAX_ERROR_BYTES: usize = 16 * 1024;

/// `error` as the `error` column keeps it: text PostgreSQL can store (no
/// NUL), at most [`MAX_ERROR_BYTES`] of it followed by
/// `… [truncated: N bytes in all]` when longer.
pub(crate) fn stored_error(error: &str) -> String {
    if error.len() <= MAX_ERROR_BYTES {
        return pg_text(error).into_owned();
    }
    let mut cut = MAX_ERROR_BYTES;
    while !error.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}… [truncated: {} bytes in all]",
        pg_text(&error[..cut]),
        error.len()
    )
}

/// A dead letter to write: the message's coordinates and what was wrong.
pub(crate) struct NewDeadLetter<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub rejected: &'a Rejected,
}

const INSERT: &str = r#"
INSERT INTO dead_letter
    (consumer, topic, "partition", "offset", key, event_id, event_type, headers, payload,
     reason, error, handler, attempts, payload_bytes)
SELECT $1, t, p, o, k, e, et, h::jsonb, pl, r, err, hn, a, pb
FROM UNNEST($2::text[], $3::int4[], $4::int8[], $5::bytea[], $6::uuid[], $7::text[],
            $8::text[], $9::bytea[], $10::text[], $11::text[], $12::text[], $13::int4[],
            $14::int8[])
     AS u(t, p, o, k, e, et, h, pl, r, err, hn, a, pb)
ON CONFLICT (consumer, topic, "partition", "offset") DO UPDATE
SET reason = EXCLUDED.reason, error = EXCLUDED.error, handler = EXCLUDED.handler,
    attempts = dead_letter.attempts + EXCLUDED.attempts, last_failed_at = now(),
    status = 'dead', resolved_at = NULL
WHERE dead_letter.status = 'resolved'"#;

/// Writes dead letters on `conn` (normally inside the batch's transaction).
/// A message already dead-lettered is not duplicated (redelivery after a
/// crash); one that was re-driven (`resolved`) and failed again is reopened.
pub(crate) async fn insert(
    conn: &mut PgConnection,
    consumer: &str,
    letters: &[NewDeadLetter<'_>],
) -> Result<u64, sqlx::Error> {
    if letters.is_empty() {
        return Ok(0);
    }
    let n = letters.len();
    let mut topics = Vec::with_capacity(n);
    let mut partitions = Vec::with_capacity(n);
    let mut offsets = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut ids = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut reasons = Vec::with_capacity(n);
    let mut errors = Vec::with_capacity(n);
    let mut handlers = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut sizes = Vec::with_capacity(n);
    for l in letters {
        let r = l.rejected;
        topics.push(pg_text(l.topic).into_owned());
        partitions.push(l.partition);
        offsets.push(l.offset);
        keys.push(r.key.as_deref());
        ids.push(r.event_id);
        types.push(r.event_type.as_deref().map(|t| pg_text(t).into_owned()));
        headers
            .push(pg_text(&serde_json::Value::Object(r.headers.clone()).to_string()).into_owned());
        payloads.push(r.payload.as_deref());
        reasons.push(r.reason.as_str());
        errors.push(stored_error(&r.error));
        handlers.push(r.handler);
        attempts.push(r.attempts);
        sizes.push(r.payload_bytes);
    }
    let result = sqlx::query(INSERT)
        .bind(pg_text(consumer).as_ref())
        .bind(&topics)
        .bind(&partitions)
        .bind(&offsets)
        .bind(&keys)
        .bind(&ids)
        .bind(&types)
        .bind(&headers)
        .bind(&payloads)
        .bind(&reasons)
        .bind(&errors)
        .bind(&handlers)
        .bind(&attempts)
        .bind(&sizes)
        .execute(conn)
        .await?;
    Ok(result.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_errors_are_cut_with_their_length() {
        assert_eq!(stored_error("boom\0"), "boom\u{FFFD}");
        let exact = "x".repeat(MAX_ERROR_BYTES);
        assert_eq!(stored_error(&exact), exact);
        // A character across the limit is not split.
        let long = format!(
            "{}é{}",
            "x".repeat(MAX_ERROR_BYTES - 1),
            "y".repeat(1 << 20)
        );
        let stored = stored_error(&long);
        assert!(stored.starts_with(&"x".repeat(MAX_ERROR_BYTES - 1)));
        assert!(
            stored.ends_with(&format!("… [truncated: {} bytes in all]", long.len())),
            "{}",
            &stored[MAX_ERROR_BYTES - 10..]
        );
        assert!(stored.len() < MAX_ERROR_BYTES + 64);
    }

    /// A consumer's dead letter keeps a capped error: a hostile `event_id`
    /// header of a megabyte quoted in the error is not stored whole.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn a_megabyte_error_is_stored_capped(pool: PgPool) {
        let hostile = "password=".repeat((1 << 20) / 9);
        let rejected = Rejected {
            key: Some(b"k".to_vec()),
            event_id: None,
            event_type: None,
            headers: serde_json::Map::new(),
            payload: Some(b"{}".to_vec()),
            reason: DeadLetterReason::NoEventId,
            error: format!("the `event_id` header `{hostile}` is not a UUID"),
            handler: None,
            attempts: 0,
            payload_bytes: None,
        };
        let mut conn = pool.acquire().await.unwrap();
        let letters = [NewDeadLetter {
            topic: "orders",
            partition: 0,
            offset: 7,
            rejected: &rejected,
        }];
        assert_eq!(insert(&mut conn, "capped", &letters).await.unwrap(), 1);
        let error: String = sqlx::query_scalar("SELECT error FROM dead_letter")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(error.len() <= MAX_ERROR_BYTES + 64, "{} bytes", error.len());
        assert!(error.starts_with("the `event_id` header `password="));
        assert!(
            error.ends_with(&format!(
                "[truncated: {} bytes in all]",
                rejected.error.len()
            )),
            "{}",
            &error[error.len() - 80..]
        );
    }

    #[test]
    fn reasons_round_trip() {
        for r in DeadLetterReason::ALL {
            assert_eq!(r.as_str().parse::<DeadLetterReason>().unwrap(), r);
        }
        assert!("nope".parse::<DeadLetterReason>().is_err());
    }
}
