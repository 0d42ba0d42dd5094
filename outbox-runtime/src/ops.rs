//! Operations on the outbox table used by the `outbox` CLI and by
//! applications: status, parked rows (list, requeue), the NOTIFY switch, and
//! the topics the stored events name.

use serde::Serialize;
use sqlx::PgPool;

use crate::error::Result;

/// Backlog of one topic.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct TopicStatus {
    /// The topic.
    pub topic: String,
    /// Rows not yet published (parked ones excluded).
    pub unpublished: i64,
    /// Age in seconds of the oldest unpublished row, if any.
    pub oldest_unpublished_secs: Option<f64>,
    /// Parked rows (given up after repeated failures).
    pub parked: i64,
    /// Published rows still kept.
    pub published: i64,
}

/// The outbox's backlog, in total and per topic.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Status {
    /// Unpublished rows (parked ones excluded).
    pub unpublished: i64,
    /// Age in seconds of the oldest unpublished row, if any.
    pub oldest_unpublished_secs: Option<f64>,
    /// Parked rows.
    pub parked: i64,
    /// Whether commits NOTIFY idle relays.
    pub notify_enabled: bool,
    /// Per topic.
    pub topics: Vec<TopicStatus>,
}

/// Reads the outbox's status.
pub async fn status(pool: &PgPool) -> Result<Status> {
    let topics: Vec<TopicStatus> = sqlx::query_as(
        "SELECT topic,
                count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL) AS unpublished,
                EXTRACT(EPOCH FROM now() - min(created_at)
                    FILTER (WHERE published_at IS NULL AND parked_at IS NULL))::float8
                    AS oldest_unpublished_secs,
                count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NOT NULL) AS parked,
                count(*) FILTER (WHERE published_at IS NOT NULL) AS published
         FROM outbox_event GROUP BY topic ORDER BY topic",
    )
    .fetch_all(pool)
    .await?;
    let unpublished = topics.iter().map(|t| t.unpublished).sum();
    let parked = topics.iter().map(|t| t.parked).sum();
    let oldest_unpublished_secs = topics
        .iter()
        .filter_map(|t| t.oldest_unpublished_secs)
        .fold(None, |acc: Option<f64>, v| {
            Some(acc.map_or(v, |a| a.max(v)))
        });
    Ok(Status {
        unpublished,
        oldest_unpublished_secs,
        parked,
        notify_enabled: notify_enabled(pool).await?,
        topics,
    })
}

/// A parked row.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ParkedEvent {
    /// Outbox row id.
    pub id: i64,
    /// Event id.
    pub event_id: uuid::Uuid,
    /// Topic.
    pub topic: String,
    /// Event type.
    pub event_type: String,
    /// Partition key.
    pub partition_key: String,
    /// Failed attempts.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
}

/// Lists parked rows, oldest first.
pub async fn parked(pool: &PgPool, limit: i64) -> Result<Vec<ParkedEvent>> {
    Ok(sqlx::query_as(
        "SELECT id, event_id, topic, event_type, partition_key, attempts, last_error
         FROM outbox_event WHERE parked_at IS NOT NULL AND published_at IS NULL
         ORDER BY id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Puts parked rows back in the relay's queue (attempts reset); `ids = None`
/// requeues every parked row. Returns how many were requeued.
pub async fn requeue_parked(pool: &PgPool, ids: Option<&[i64]>) -> Result<u64> {
    let result = sqlx::query(
        "UPDATE outbox_event SET parked_at = NULL, attempts = 0
         WHERE parked_at IS NOT NULL AND published_at IS NULL
           AND ($1::bigint[] IS NULL OR id = ANY($1))",
    )
    .bind(ids)
    .execute(pool)
    .await?;
    Ok(result.rows_affected())
}

/// Whether the commit-time NOTIFY trigger is enabled.
pub async fn notify_enabled(pool: &PgPool) -> Result<bool> {
    let enabled: Option<bool> = sqlx::query_scalar(
        "SELECT tgenabled <> 'D' FROM pg_trigger
         WHERE tgname = 'outbox_event_notify' AND tgrelid = 'outbox_event'::regclass",
    )
    .fetch_optional(pool)
    .await?;
    Ok(enabled.unwrap_or(false))
}

/// Enables or disables the commit-time NOTIFY (relays then poll).
pub async fn set_notify(pool: &PgPool, on: bool) -> Result<()> {
    let sql = if on {
        "ALTER TABLE outbox_event ENABLE TRIGGER outbox_event_notify"
    } else {
        "ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_notify"
    };
    sqlx::query(sql).execute(pool).await?;
    Ok(())
}

/// The distinct topics of the rows in the outbox.
pub async fn outbox_topics(pool: &PgPool) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT DISTINCT topic FROM outbox_event ORDER BY topic")
            .fetch_all(pool)
            .await?,
    )
}
