//! Replay: publishing stored events again, from the outbox, after Kafka lost
//! them or to rebuild a consumer's projection — selected by outbox id range,
//! creation time range, topic, aggregate type or aggregate id, to their
//! original topic or another one.
//!
//! - Only **published** rows are replayed, up to the newest row when the
//!   replay starts: unpublished ones are the relay's (it publishes them
//!   anyway), parked ones wait for an operator. The
//!   outbox is only read — no row is changed or locked — so a replay is safe
//!   while relays run and leaves the audit trail as it was.
//! - Each message is the original one — same key, payload, event id and
//!   headers — plus a `replay_id` header naming the replay run. Consumers
//!   deduplicate by event id, so a replayed event they already applied is a
//!   duplicate (count it, skip it); a consumer rebuilding from scratch
//!   (new group, empty dedup table) applies it.
//! - In outbox id order, through an idempotent producer (`acks=all`), page
//!   by page: a page's failed deliveries are retried (with their key's later
//!   events held back), and a page is finished before the next one starts,
//!   so per-key order holds. At least once: a replay that stops (error,
//!   crash) can be run again from the id it reports, and some events are
//!   then sent twice.

use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;
use sqlx::types::chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::kafka;
use crate::relay::claim::Row;
use crate::relay::publish::{self, FailureKind, Outcome, Publisher};

/// The Kafka header that marks a replayed message; its value is the replay
/// run's id.
pub const REPLAY_HEADER: &str = "replay_id";

/// Which published events to replay. Every set criterion must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayFilter {
    /// Outbox ids from (inclusive).
    pub from_id: Option<i64>,
    /// Outbox ids up to (inclusive).
    pub to_id: Option<i64>,
    /// Created at or after.
    pub since: Option<DateTime<Utc>>,
    /// Created before.
    pub until: Option<DateTime<Utc>>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only this aggregate id.
    pub aggregate_id: Option<String>,
}

/// A replay run's settings. `Debug` redacts secret Kafka settings.
#[derive(Clone)]
pub struct ReplayOptions {
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// Extra librdkafka settings (TLS, SASL); idempotence and `acks=all`
    /// are enforced.
    pub kafka_settings: Vec<(String, String)>,
    /// The events to replay.
    pub filter: ReplayFilter,
    /// Publish to this topic instead of each event's own.
    pub to_topic: Option<String>,
    /// Rows read and sent per page.
    pub batch_size: i64,
    /// Attempts per page before the replay stops with an error.
    pub max_attempts: u32,
    /// librdkafka `message.timeout.ms`.
    pub delivery_timeout: Duration,
}

impl std::fmt::Debug for ReplayOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured without `..`: a new field must be added here.
        let Self {
            brokers,
            kafka_settings,
            filter,
            to_topic,
            batch_size,
            max_attempts,
            delivery_timeout,
        } = self;
        f.debug_struct("ReplayOptions")
            .field("brokers", brokers)
            .field("kafka_settings", &kafka::Redacted(kafka_settings))
            .field("filter", filter)
            .field("to_topic", to_topic)
            .field("batch_size", batch_size)
            .field("max_attempts", max_attempts)
            .field("delivery_timeout", delivery_timeout)
            .finish()
    }
}

impl ReplayOptions {
    /// Replays the events `filter` selects through `brokers`.
    pub fn new(brokers: impl Into<String>, filter: ReplayFilter) -> Self {
        Self {
            brokers: brokers.into(),
            kafka_settings: Vec::new(),
            filter,
            to_topic: None,
            batch_size: 1000,
            max_attempts: 5,
            delivery_timeout: Duration::from_secs(30),
        }
    }

    fn validate(&self) -> Result<()> {
        let f = &self.filter;
        if let (Some(a), Some(b)) = (f.from_id, f.to_id) {
            if a > b {
                return Err(Error::Config(format!(
                    "empty id range: --from-id {a} is after --to-id {b}"
                )));
            }
        }
        if let (Some(a), Some(b)) = (f.since, f.until) {
            if a >= b {
                return Err(Error::Config(format!(
                    "empty time range: --since {a} is not before --until {b}"
                )));
            }
        }
        if let Some(t) = &self.to_topic {
            if t.is_empty()
                || t.len() > 249
                || !t
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            {
                return Err(Error::Config(format!(
                    "invalid --to-topic `{t}`: 1-249 characters of [a-zA-Z0-9._-]"
                )));
            }
        }
        if !(1..=100_000).contains(&self.batch_size) {
            return Err(Error::Config(format!(
                "replay batch size must be 1..=100000, got {}",
                self.batch_size
            )));
        }
        if self.max_attempts == 0 {
            return Err(Error::Config("replay max attempts must be >= 1".into()));
        }
        Ok(())
    }
}

/// What a replay did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The run's id (the `replay_id` header of every message sent).
    pub replay_id: Uuid,
    /// Events sent and acknowledged.
    pub replayed: u64,
    /// Lowest and highest outbox id replayed.
    pub first_id: Option<i64>,
    /// Highest outbox id replayed.
    pub last_id: Option<i64>,
}

const FILTER: &str = "\
published_at IS NOT NULL
  AND id >= $1
  AND ($2::bigint IS NULL OR id <= $2)
  AND ($3::timestamptz IS NULL OR created_at >= $3)
  AND ($4::timestamptz IS NULL OR created_at < $4)
  AND ($5::text IS NULL OR topic = $5)
  AND ($6::text IS NULL OR aggregate_type = $6)
  AND ($7::text IS NULL OR aggregate_id = $7)";

fn page_sql() -> String {
    format!(
        "SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version,
                COALESCE($8, topic) AS topic, partition_key, payload::text AS payload,
                (headers || jsonb_build_object('{REPLAY_HEADER}', $9::text))::text AS headers,
                attempts, ctid::text AS tid
         FROM outbox_event WHERE {FILTER} ORDER BY id LIMIT $10"
    )
}

/// How many published events `filter` selects (a dry run).
pub async fn count(pool: &PgPool, filter: &ReplayFilter) -> Result<u64> {
    let sql = format!("SELECT count(*) FROM outbox_event WHERE {FILTER}");
    let n: i64 = sqlx::query_scalar(&sql)
        .bind(filter.from_id.unwrap_or(i64::MIN))
        .bind(filter.to_id)
        .bind(filter.since)
        .bind(filter.until)
        .bind(filter.topic.as_deref())
        .bind(filter.aggregate_type.as_deref())
        .bind(filter.aggregate_id.as_deref())
        .fetch_one(pool)
        .await?;
    Ok(n as u64)
}

/// Replays the published events `options.filter` selects, in id order.
///
/// On a page that keeps failing it stops with [`Error::ReplayStopped`],
/// which names the outbox id to resume from.
pub async fn replay(pool: &PgPool, options: &ReplayOptions) -> Result<ReplayReport> {
    options.validate()?;
    let mut settings: Vec<(String, String)> = vec![
        ("linger.ms".into(), "5".into()),
        ("reconnect.backoff.max.ms".into(), "1000".into()),
        (
            "message.timeout.ms".into(),
            options.delivery_timeout.as_millis().to_string(),
        ),
    ];
    settings.extend(options.kafka_settings.iter().cloned());
    let mut publisher = Publisher::new(kafka::client_config(&options.brokers, &settings))?;
    let replay_id = Uuid::now_v7();
    let mut report = ReplayReport {
        replay_id,
        replayed: 0,
        first_id: None,
        last_id: None,
    };
    tracing::info!(%replay_id, filter = ?options.filter, to_topic = ?options.to_topic, "replay started");
    let sql = page_sql();
    let f = &options.filter;
    let mut from = f.from_id.unwrap_or(i64::MIN);
    // What the outbox holds now: rows committed during the replay are the
    // relay's business.
    let newest: Option<i64> = sqlx::query_scalar("SELECT max(id) FROM outbox_event")
        .fetch_one(pool)
        .await?;
    let to_id = match (f.to_id, newest) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    loop {
        let page: Vec<Row> = sqlx::query_as(&sql)
            .bind(from)
            .bind(to_id)
            .bind(f.since)
            .bind(f.until)
            .bind(f.topic.as_deref())
            .bind(f.aggregate_type.as_deref())
            .bind(f.aggregate_id.as_deref())
            .bind(options.to_topic.as_deref())
            .bind(replay_id.to_string())
            .bind(options.batch_size)
            .fetch_all(pool)
            .await?;
        let Some(last) = page.last().map(|r| r.id) else {
            break;
        };
        let full = page.len() as i64 == options.batch_size;
        report.first_id.get_or_insert(page[0].id);
        send_page(&mut publisher, page, options, &mut report).await?;
        report.last_id = Some(last);
        if !full {
            break;
        }
        from = last + 1;
    }
    publisher.flush(Duration::from_secs(10));
    metrics::counter!("outbox_replayed_total").increment(report.replayed);
    tracing::info!(%replay_id, replayed = report.replayed, "replay done");
    Ok(report)
}

/// Sends one page until every row is acknowledged, or fails after
/// `max_attempts`.
async fn send_page(
    publisher: &mut Publisher,
    mut rows: Vec<Row>,
    options: &ReplayOptions,
    report: &mut ReplayReport,
) -> Result<()> {
    let mut attempt = 0;
    let mut last_error = String::new();
    while !rows.is_empty() {
        attempt += 1;
        if attempt > options.max_attempts {
            return Err(Error::ReplayStopped {
                replayed: report.replayed,
                resume_from: rows[0].id,
                reason: last_error,
            });
        }
        let mut outcomes: Vec<Option<Outcome>> = (0..rows.len()).map(|_| None).collect();
        let pending = publisher.send(&rows, 0..rows.len(), &mut outcomes);
        publish::settle(pending, &rows, &mut outcomes).await;
        let mut failed = Vec::new();
        let mut fatal = false;
        for (row, outcome) in rows.into_iter().zip(outcomes) {
            match outcome {
                Some(Outcome::Delivered) => report.replayed += 1,
                Some(Outcome::Failed(kind, error)) => {
                    fatal |= kind == FailureKind::Fatal;
                    if last_error.is_empty() || failed.is_empty() {
                        last_error = error;
                    }
                    failed.push(row);
                }
                _ => failed.push(row),
            }
        }
        rows = failed;
        if !rows.is_empty() {
            tracing::warn!(
                attempt,
                remaining = rows.len(),
                error = %last_error,
                "replay: deliveries failed, retrying"
            );
            if fatal {
                publisher.recreate(&last_error);
            } else {
                publisher.recover_if_fatal();
            }
            tokio::time::sleep(crate::backoff::delay(
                Duration::from_millis(200),
                Duration::from_secs(5),
                attempt,
            ))
            .await;
        }
    }
    Ok(())
}
