//! Claiming unpublished rows (`FOR UPDATE SKIP LOCKED`, id order, only of the
//! lanes this relay owns) and closing a claimed batch: marking the delivered
//! rows published and recording the failures, in the claim's own transaction.

use sqlx::{PgPool, Postgres, Transaction};

use super::lanes::{self, Claimable};
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
    /// The row version's physical address, stable while the claim's
    /// transaction holds the row lock: the mark finds the row by it.
    pub tid: String,
}

/// Rows claimed in one transaction; their row locks last until
/// [`Batch::finish`] commits.
pub(crate) struct Batch {
    pub tx: Transaction<'static, Postgres>,
    pub rows: Vec<Row>,
}

const CLAIM_COLUMNS: &str = "\
SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version, topic,
       partition_key, payload::text AS payload, headers::text AS headers, attempts,
       ctid::text AS tid
FROM outbox_event
WHERE published_at IS NULL AND parked_at IS NULL
  AND partition_key <> ALL($2::text[])
  AND topic <> ALL($3::text[])";

/// Without lanes: any row no other relay holds.
fn claim_any() -> String {
    format!("{CLAIM_COLUMNS}\nORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED")
}

/// With lanes: rows of the lanes this relay may claim from, i.e. none of
/// the lanes in `$5` (the others), and none the lane connection (pid `$6`)
/// does not own at this statement's start; lane count `$4`.
///
/// Both conditions are written as exclusions (`<> ALL`): the planner
/// estimates those as barely selective and keeps walking the partial index
/// in id order. Written as `lane = ANY(owned)` they look so selective that it
/// sorts the whole backlog on every claim instead (measured: 270 ms against
/// 4 ms per claim of 2,000 over a backlog of 200,000).
fn claim_lanes() -> String {
    let lane = lanes::lane_expr(4);
    format!(
        "{CLAIM_COLUMNS}
  AND {lane} <> ALL($5::int4[])
  AND {lane} <> ALL((
      SELECT coalesce(array_agg(l), '{{}}') FROM generate_series(0, $4 - 1) AS l
      WHERE NOT EXISTS (SELECT 1 FROM pg_locks
        WHERE locktype = 'advisory' AND granted AND objsubid = 2
          AND classid = {class} AND pid = $6 AND objid::int = l
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
      )::int4[])
ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        class = lanes::LANE_CLASS,
    )
}

/// Taken before the claim (in the `BEGIN` round trip): see the handover
/// notes in [`lanes`]. Lane numbers are integers, written into the text.
fn hold_in_use(owned: &[i32]) -> String {
    let list: Vec<String> = owned.iter().map(i32::to_string).collect();
    format!(
        "SELECT count(pg_advisory_xact_lock_shared({}, l)) FROM unnest('{{{}}}'::int4[]) AS l",
        lanes::IN_USE_CLASS,
        list.join(",")
    )
}

static CLAIM_ANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(claim_any);
static CLAIM_LANES: std::sync::LazyLock<String> = std::sync::LazyLock::new(claim_lanes);

/// `statement_timestamp()`: the time the deliveries were known, not the
/// claim's transaction start that `now()` would give. Rows are found by
/// their `ctid` (a TID scan): the claim's row locks keep every claimed row
/// where it was, and it saves a primary-key lookup per row.
const MARK_PUBLISHED: &str = "UPDATE outbox_event SET published_at = statement_timestamp()
     WHERE ctid = ANY($1::text[]::tid[])";

const RECORD_FAILURES: &str = "\
UPDATE outbox_event o
SET attempts = o.attempts + f.counted::int,
    last_error = f.error,
    last_attempt_at = now(),
    parked_at = CASE WHEN f.park THEN now() END
FROM UNNEST($1::bigint[], $2::text[], $3::bool[], $4::bool[]) AS f(id, error, counted, park)
WHERE o.id = f.id";

/// Opens a claim's transaction (one round trip, with the lanes' "in use"
/// locks when there are lanes). Its statements must never
/// scan the whole table: the mark's `ctid = ANY(…)` list as a seq-scan filter
/// costs rows × list length (measured: 80-170 ms per mark on a young table of
/// 6,500 rows whose statistics said 10, against ~1 ms as a TID scan), and the
/// claim must walk the partial index in id order.
const BEGIN: &str = "BEGIN; SET LOCAL enable_seqscan = off";

/// Claims up to `limit` unpublished rows, skipping rows other relays hold and
/// the keys and topics currently blocked by failures; with `lanes`, only rows
/// of those lanes (none when the relay owns no lane). Every statement of the
/// claim's transaction (the mark too) runs with `statement_timeout`.
pub(crate) async fn claim(
    pool: &PgPool,
    limit: i64,
    blocked_keys: &[String],
    blocked_topics: &[String],
    lanes: Option<&Claimable>,
    statement_timeout: std::time::Duration,
) -> Result<Batch> {
    let timeout = format!(
        "SET LOCAL statement_timeout = {}",
        statement_timeout.as_millis()
    );
    let begin = match lanes {
        Some(l) if !l.lanes.is_empty() => {
            format!("{BEGIN}; {timeout}; {}", hold_in_use(&l.lanes))
        }
        _ => format!("{BEGIN}; {timeout}"),
    };
    let mut tx = pool.begin_with(begin).await?;
    let rows = match lanes {
        None => {
            sqlx::query_as::<_, Row>(CLAIM_ANY.as_str())
                .bind(limit)
                .bind(blocked_keys)
                .bind(blocked_topics)
                .fetch_all(&mut *tx)
                .await?
        }
        Some(lanes) if lanes.lanes.is_empty() => Vec::new(),
        Some(lanes) => {
            let others: Vec<i32> = (0..lanes.count)
                .filter(|l| !lanes.lanes.contains(l))
                .collect();
            sqlx::query_as::<_, Row>(CLAIM_LANES.as_str())
                .bind(limit)
                .bind(blocked_keys)
                .bind(blocked_topics)
                .bind(lanes.count)
                .bind(&others)
                .bind(lanes.pid)
                .fetch_all(&mut *tx)
                .await?
        }
    };
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
            let published: std::collections::HashSet<i64> = published.iter().copied().collect();
            let tids: Vec<&str> = self
                .rows
                .iter()
                .filter(|r| published.contains(&r.id))
                .map(|r| r.tid.as_str())
                .collect();
            sqlx::query(MARK_PUBLISHED)
                .bind(&tids)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_use_locks_name_every_owned_lane() {
        assert_eq!(
            hold_in_use(&[0, 7, 15]),
            "SELECT count(pg_advisory_xact_lock_shared(1868721153, l)) FROM unnest('{0,7,15}'::int4[]) AS l"
        );
    }
}
