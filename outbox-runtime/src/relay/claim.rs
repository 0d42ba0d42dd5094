//! Claiming unpublished rows (`FOR UPDATE SKIP LOCKED`, id order) and closing
//! a claimed batch: marking the delivered rows published and recording the
//! failures, in the claim's own transaction.

use sqlx::{PgPool, Postgres, Transaction};

use crate::error::Result;

/// One claimed outbox row, ready to publish.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct Row {
    pub id: i64,
    pub event_id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub topic: String,
    pub partition_key: String,
    pub payload: String,
    pub headers: String,
    pub attempts: i32,
}

/// Rows claimed in one transaction; their row locks last until
/// [`Batch::finish`] commits.
pub(crate) struct Batch {
    pub tx: Transaction<'static, Postgres>,
    pub rows: Vec<Row>,
}

const CLAIM: &str = "\
SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version, topic,
       partition_key, payload::text AS payload, headers::text AS headers, attempts
FROM outbox_event
WHERE published_at IS NULL AND parked_at IS NULL
  AND partition_key <> ALL($2::text[])
  AND topic <> ALL($3::text[])
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED";

/// `statement_timestamp()`: the time the deliveries were known, not the
/// claim's transaction start that `now()` would give.
const MARK_PUBLISHED: &str =
    "UPDATE outbox_event SET published_at = statement_timestamp() WHERE id = ANY($1)";

const RECORD_FAILURES: &str = "\
UPDATE outbox_event o
SET attempts = o.attempts + f.counted::int,
    last_error = f.error,
    last_attempt_at = now(),
    parked_at = CASE WHEN f.park THEN now() END
FROM UNNEST($1::bigint[], $2::text[], $3::bool[], $4::bool[]) AS f(id, error, counted, park)
WHERE o.id = f.id";

/// Claims up to `limit` unpublished rows, skipping rows other relays hold and
/// the keys and topics currently blocked by failures.
pub(crate) async fn claim(
    pool: &PgPool,
    limit: i64,
    blocked_keys: &[String],
    blocked_topics: &[String],
) -> Result<Batch> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query_as::<_, Row>(CLAIM)
        .bind(limit)
        .bind(blocked_keys)
        .bind(blocked_topics)
        .fetch_all(&mut *tx)
        .await?;
    Ok(Batch { tx, rows })
}

/// A delivery failure to record on a row.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub id: i64,
    pub error: String,
    /// Counts toward `attempts` (message-level and topic-level failures).
    pub counted: bool,
    /// Parks the row (too many message-level failures).
    pub park: bool,
}

impl Batch {
    /// Marks `published` rows, records `failures`, commits. Rows in neither
    /// list (withheld) are only unlocked.
    pub async fn finish(mut self, published: &[i64], failures: &[Failure]) -> Result<()> {
        if !published.is_empty() {
            sqlx::query(MARK_PUBLISHED)
                .bind(published)
                .execute(&mut *self.tx)
                .await?;
        }
        if !failures.is_empty() {
            let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
            let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
            let counted: Vec<bool> = failures.iter().map(|f| f.counted).collect();
            let park: Vec<bool> = failures.iter().map(|f| f.park).collect();
            sqlx::query(RECORD_FAILURES)
                .bind(&ids)
                .bind(&errors)
                .bind(&counted)
                .bind(&park)
                .execute(&mut *self.tx)
                .await?;
        }
        self.tx.commit().await?;
        Ok(())
    }
}
