//! Claiming unpublished rows (`FOR UPDATE SKIP LOCKED`, id order, only of the
//! lanes this relay owns, at most a row count and a byte budget) and closing
//! a claimed batch: marking the delivered rows published and recording the
//! failures, in the claim's own transaction (the failures in a savepoint:
//! a refused failure record costs the marks nothing).
//!
//! The byte budget: the claim's rows pass through two window functions over
//! the locking scan's output (a running sum of each row's bytes, then a
//! count of the rows that start past the budget, whose "run condition" stops
//! the scan). The scan stays lazy and index-driven: rows past the budget are
//! neither read nor converted to text. The window functions read at most a
//! couple of rows ahead, and those rows are locked by the claim without
//! being returned: see [`Batch::cut`].

use sqlx::{PgPool, Postgres, Transaction};

use super::lanes::{self, Claimable};
use crate::error::Result;
use crate::refusal::{Statement, Trouble};
use crate::scope::{Lock, OutboxScope};

/// The claim, as a refusal names it (`FOR UPDATE` needs an `UPDATE`
/// privilege on some column).
pub(crate) const CLAIM: Statement = Statement {
    name: "relay: claim rows",
    needs: "SELECT, UPDATE (published_at, …) ON outbox_event",
};

/// Marking rows published.
pub(crate) const MARK: Statement = Statement {
    name: "relay: mark rows published",
    needs: "UPDATE (published_at) ON outbox_event",
};

/// Recording delivery failures (and parking rows).
pub(crate) const RECORD: Statement = Statement {
    name: "relay: record failed deliveries",
    needs: "UPDATE (attempts, last_error, last_attempt_at, parked_at, held_until) ON outbox_event",
};

/// One claimed outbox row, ready to publish.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Row {
    /// The row's id (`id` order is commit order within a key).
    pub id: i64,
    /// The event's id.
    pub event_id: uuid::Uuid,
    /// The aggregate's type.
    pub aggregate_type: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The event's type.
    pub event_type: String,
    /// The event's schema version.
    pub event_version: i32,
    /// When the event was recorded (CloudEvents `time`).
    pub created_at: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    /// The Kafka topic.
    pub topic: String,
    /// The Kafka message key.
    pub partition_key: String,
    /// The payload (JSON text).
    pub payload: String,
    /// The headers (a JSON object's text).
    pub headers: String,
    /// Failed deliveries so far.
    pub attempts: i32,
    /// An earlier row of the row's key on its topic is held (see the
    /// relay's `held` module): seconds until that hold ends (negative once it has, until the row is
    /// released). The row must then wait too. Scheduled rows (with a
    /// `due_at`) are not among those probed: they hold no later row back.
    pub behind_held_secs: Option<f64>,
    /// The row version's physical address, stable while the claim's
    /// transaction holds the row lock: the mark finds the row by it. Empty
    /// in the progress mode's batches, which mark no row by it.
    pub tid: String,
}

impl Row {
    /// The bytes the byte budget counts: payload, headers and key, as the
    /// claim's running sum adds them up (`octet_length` of each).
    pub fn bytes(&self) -> usize {
        self.payload.len() + self.headers.len() + self.partition_key.len()
    }
}

/// Rows claimed in one transaction; their row locks last until
/// [`Batch::finish`] commits.
pub(crate) struct Batch {
    pub tx: Transaction<'static, Postgres>,
    pub rows: Vec<Row>,
    /// The claim stopped at the byte budget. The rows just past the last one
    /// returned may then be locked by this transaction too (read ahead by
    /// the window functions) without being in `rows`: until it ends, no
    /// other claim of this relay may run, or it would skip them and send
    /// later rows of their keys first.
    pub cut: bool,
    /// In the progress mode: where the batch leaves its lanes, and each
    /// row's lane (see [`progress::batch`](super::progress::batch)).
    pub progress: Option<super::progress::batch::Read>,
}

pub(super) const CLAIM_COLUMNS: &str = "\
SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version, created_at, topic,
       partition_key, payload::text AS payload, headers::text AS headers, attempts,
       ctid::text AS tid,
       CASE WHEN (SELECT EXISTS (SELECT 1 FROM outbox_event
                                 WHERE held_until IS NOT NULL AND published_at IS NULL
                                   AND due_at IS NULL))
            THEN (SELECT EXTRACT(EPOCH FROM h.held_until - statement_timestamp())::float8
                  FROM outbox_event h
                  WHERE h.held_until IS NOT NULL AND h.published_at IS NULL AND h.due_at IS NULL
                    AND h.topic = outbox_event.topic
                    AND h.partition_key = outbox_event.partition_key
                    AND h.id < outbox_event.id
                  ORDER BY h.topic, h.partition_key, h.id LIMIT 1)
       END AS behind_held_secs
FROM outbox_event
WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
  AND partition_key <> ALL($2::text[])";

/// The claim `locking` (a `SELECT … FOR UPDATE SKIP LOCKED` in id order)
/// cut at the byte budget `$budget`: rows are returned while the bytes
/// before them are under the budget, so the batch holds at most the budget
/// plus one row (a first row larger than the budget comes alone). No
/// `ORDER BY` in the windows: a sort would read every row of the claim; the
/// frames run over the locking scan's order, which is id order.
///
/// The statement starts with [`CLAIM_MARK`]: `pg_stat_activity` shows only
/// its first kilobyte.
fn bounded(locking: &str, budget: &str) -> String {
    format!(
        "{CLAIM_MARK} SELECT {RETURNED} FROM (
  SELECT b.*, count(*) FILTER (WHERE b.bytes_before >= {budget}::int8)
              OVER (ROWS UNBOUNDED PRECEDING) AS past_budget
  FROM (
    SELECT c.*, coalesce(sum(octet_length(c.payload) + octet_length(c.headers)
                             + octet_length(c.partition_key))
                         OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS bytes_before
    FROM ({locking}) c
  ) b
) w WHERE past_budget = 0"
    )
}

/// The comment that starts every claim, naming it in `pg_stat_activity`.
pub(crate) const CLAIM_MARK: &str = "/* outbox relay: claim */";

/// The columns of [`Row`], as the claim returns them.
const RETURNED: &str = "id, event_id, aggregate_type, aggregate_id, event_type, event_version, created_at, topic, \
partition_key, payload, headers, attempts, behind_held_secs, tid";

/// Without lanes: any row no other relay holds, while the relay's lock
/// session (pid `$5`) still holds its registration (lane count 0 of the
/// outbox `$3`, `pg_locks` objid `$4`) at this statement's start: a relay
/// whose session died claims nothing (a relay with lanes may have started
/// since).
fn claim_any() -> String {
    let locking = format!(
        "{CLAIM_COLUMNS}
  AND EXISTS (SELECT 1 FROM pg_locks WHERE {locks} AND pid = $5 AND objid::int8 = $4)
ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        locks = lanes::SCOPE_LOCKS.replace("$1", "$3"),
    );
    bounded(&locking, "$6")
}

/// With lanes, owning all of them: every row, walking the id index (as
/// without lanes), while the lane connection (pid `$5`) owns the row's lane
/// at this statement's start: none of the lanes in `$4` (the others; none
/// here but the statement serves any set) nor the lanes it does not own;
/// lane count `$3`, the outbox's oid `$6`, the `pg_locks` objid of lane 0
/// `$7`. A relay owning every lane has no other relay's rows to pass over,
/// and this walk reads each index and heap page once for many rows.
///
/// Both conditions are written as exclusions (`<> ALL`): the planner
/// estimates those as barely selective and keeps walking the partial index
/// in id order. Written as `lane = ANY(owned)` they look so selective that it
/// sorts the whole backlog on every claim instead (measured: 270 ms against
/// 4 ms per claim of 2,000 over a backlog of 200,000).
fn claim_every_lane() -> String {
    let lane = "(lane_slot % $3)";
    let locking = format!(
        "{CLAIM_COLUMNS}
  AND {lane} <> ALL($4::int4[])
  AND {lane} <> ALL((
      SELECT coalesce(array_agg(l), '{{}}') FROM generate_series(0, $3 - 1) AS l
      WHERE NOT EXISTS (SELECT 1 FROM pg_locks
        WHERE {locks} AND pid = $5 AND objid::int8 = $7 + l)
      )::int4[])
ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        locks = lanes::SCOPE_LOCKS.replace("$1", "$6"),
    );
    bounded(&locking, "$8")
}

/// With lanes, owning some of them: rows of the slots `slots` (those of the
/// lanes this relay may claim from, for `count` lanes), of the lanes the
/// lane connection (pid `$4`) still owns at this statement's start; the
/// outbox's oid `$5`, the `pg_locks` objid of lane 0 `$6`, at most `$3` rows
/// read per slot, byte budget `$7`.
///
/// Each slot is one range of `ix_outbox_event_unpublished_slot`, walked in
/// id order (a subquery with its own `ORDER BY id LIMIT`: its slot is a
/// constant there, so the index gives id order); the ranges are merged in
/// id order (a Merge Append), so the claim reads about its batch, however
/// many rows other relays' lanes hold (measured: see BENCHMARKS.md). A
/// slot's condition is the index predicate's single expression, so that
/// only that index matches it (see the migration `lane_slot`).
///
/// Rows are locked only as the merge hands them out: each merged row is
/// looked up and locked by a `LATERAL` subquery (by `ctid`, and `event_id`,
/// which prunes the partitioned layout's partitions), one row at a time
/// whatever the statistics say (a join could be planned as a scan of every
/// unpublished row per merged row on a table not yet analyzed: measured,
/// 1.7 million rows compared for a claim of 1,000). Locking in each slot's subquery
/// would lock one row per slot read ahead by the merge without returning
/// it, and a claim running beside this one would skip it and could send a
/// later row of its key first. A row the lock skips (locked) or drops
/// (changed since: the conditions are checked again on the row locked) only
/// makes the batch smaller: a key's rows are all in one slot, read in id
/// order. `$3` bounds each slot's read past the rows this relay's own open
/// batches still hold locked.
///
/// Each slot's subquery runs only if its lane is still owned (the `owned`
/// list, read once from `pg_locks`).
pub(crate) fn claim_slots(count: i32, slots: &[i32]) -> String {
    let ranges: Vec<String> = slots
        .iter()
        .map(|slot| {
            format!(
                "(SELECT id AS slot_id, ctid AS slot_tid, event_id AS slot_event_id FROM outbox_event
  WHERE lane_slot = {slot} AND coalesce(published_at, parked_at, held_until) IS NULL
    AND partition_key <> ALL($2::text[]) AND EXISTS (SELECT 1 FROM owned WHERE lane = {lane})
  ORDER BY id LIMIT $3)",
                lane = slot % count.max(1)
            )
        })
        .collect();
    let locking = format!(
        "WITH owned AS MATERIALIZED (
  SELECT (objid::int8 - $6)::int4 AS lane FROM pg_locks
  WHERE {locks} AND pid = $4 AND objid::int8 >= $6 AND objid::int8 < $6 + {count})
SELECT o.* FROM (
{ranges}
) s CROSS JOIN LATERAL ({CLAIM_COLUMNS}
  AND ctid = s.slot_tid AND event_id = s.slot_event_id
  FOR UPDATE SKIP LOCKED) o
ORDER BY s.slot_id LIMIT $1",
        locks = lanes::SCOPE_LOCKS.replace("$1", "$5"),
        ranges = ranges.join("\nUNION ALL\n"),
    );
    bounded(&locking, "$7")
}

/// Taken before the claim (in the `BEGIN` round trip): see the handover
/// notes in [`lanes`]. Keys and lane numbers are integers, written into the
/// text.
pub(crate) fn hold_in_use(scope: OutboxScope, owned: &[i32]) -> String {
    let list: Vec<String> = owned.iter().map(i32::to_string).collect();
    format!(
        "SELECT count(pg_advisory_xact_lock_shared({}::int8 | l)) FROM unnest('{{{}}}'::int4[]) AS l",
        scope.base(Lock::InUse),
        list.join(",")
    )
}

pub(crate) static CLAIM_ANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(claim_any);
static CLAIM_EVERY_LANE: std::sync::LazyLock<String> = std::sync::LazyLock::new(claim_every_lane);

/// How many rows a claim with lanes reads at most per slot, for a batch of
/// `limit`: the batch, plus the rows of this relay's two open batches (the
/// one in flight, the one being marked) that it skips.
pub(crate) fn per_slot(limit: i64) -> i64 {
    limit.saturating_mul(3)
}

/// `statement_timestamp()`: the time the deliveries were known, not the
/// claim's transaction start that `now()` would give. Rows are found by
/// their `ctid` (a TID scan): the claim's row locks keep every claimed row
/// where it was, and it saves a primary-key lookup per row. A `ctid` is
/// unique only within one table: with the partitioned layout the same one
/// exists in several partitions, so the row's `event_id` (unique) must be
/// in the list too; its range (`$3`, `$4`) limits the TID scans to the
/// partitions the batch's rows are in.
const MARK_PUBLISHED: &str = "UPDATE outbox_event SET published_at = statement_timestamp()
     WHERE ctid = ANY($1::text[]::tid[]) AND event_id = ANY($2::uuid[])
       AND event_id BETWEEN $3 AND $4";

/// Marks delivered rows published by event id (`$1`), outside the claim
/// that delivered them: see [`record_published`].
pub(crate) const MARK_DELIVERED: &str =
    "UPDATE outbox_event SET published_at = statement_timestamp()
     WHERE event_id = ANY($1::uuid[]) AND published_at IS NULL";

const RECORD_FAILURES: &str = "\
UPDATE outbox_event o
SET attempts = o.attempts + f.counted::int,
    last_error = f.error,
    last_attempt_at = now(),
    parked_at = CASE WHEN f.park THEN now() END,
    held_until = statement_timestamp() + make_interval(secs => f.hold)
FROM UNNEST($1::bigint[], $2::text[], $3::bool[], $4::bool[], $5::float8[])
    AS f(id, error, counted, park, hold)
WHERE o.id = f.id";

/// Opens a claim's transaction (one round trip, with the lanes' "in use"
/// locks when there are lanes). Its statements must never
/// scan the whole table: the mark's `ctid = ANY(…)` list as a seq-scan filter
/// costs rows × list length (measured: 80-170 ms per mark on a young table of
/// 6,500 rows whose statistics said 10, against ~1 ms as a TID scan), and the
/// claim must walk the partial index in id order. No JIT: with the
/// seq-scan penalty and a large table the estimates pass JIT's thresholds,
/// and a claim of the progress mode spent hundreds of milliseconds
/// compiling its window's list on an outbox of 1M rows.
///
/// The transaction ends itself if it stays idle longer than `idle` (a relay
/// frozen mid-batch must not hold its rows and its lanes' "in use" locks for
/// ever: see [`lanes`]); `idle` exceeds the longest a working relay keeps a
/// batch open between statements. Every statement of it (the mark too) runs
/// with `statement_timeout` (0: none).
pub(crate) fn begin(idle: std::time::Duration, statement_timeout: std::time::Duration) -> String {
    format!(
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL jit = off; \
         SET LOCAL idle_in_transaction_session_timeout = {}; \
         SET LOCAL statement_timeout = {}",
        idle.as_millis().max(1),
        statement_timeout.as_millis()
    )
}

/// Claims up to `limit` unpublished rows and about `max_bytes` (see
/// [`bounded`]), skipping rows other relays hold, held rows (see
/// [`held`](super::held)) and the keys in `held_keys` (those with a row in
/// a batch of this relay still open); only rows of the lanes in `lanes` (none
/// when the relay owns no lane or has no lock session). `begin` opens the
/// transaction ([`begin`]).
pub(crate) async fn claim(
    pool: &PgPool,
    begin: &str,
    limit: i64,
    max_bytes: i64,
    held_keys: &[String],
    lanes: &Claimable,
) -> Result<Batch> {
    let every_lane = lanes.lanes.len() == usize::try_from(lanes.count).unwrap_or(0);
    let begin: std::borrow::Cow<'_, str> = if lanes.count > 0 && !lanes.lanes.is_empty() {
        format!("{begin}; {}", hold_in_use(lanes.scope, &lanes.lanes)).into()
    } else {
        begin.into()
    };
    let mut tx = pool.begin_with(begin.into_owned()).await?;
    let rows = if !lanes.any() {
        Vec::new()
    } else if lanes.count == 0 {
        sqlx::query_as::<_, Row>(CLAIM_ANY.as_str())
            .bind(limit)
            .bind(held_keys)
            .bind(i64::from(lanes.scope.oid()))
            .bind(OutboxScope::objid(Lock::Count))
            .bind(lanes.pid)
            .bind(max_bytes)
            .fetch_all(&mut *tx)
            .await?
    } else if every_lane {
        sqlx::query_as::<_, Row>(CLAIM_EVERY_LANE.as_str())
            .bind(limit)
            .bind(held_keys)
            .bind(lanes.count)
            .bind(Vec::<i32>::new())
            .bind(lanes.pid)
            .bind(i64::from(lanes.scope.oid()))
            .bind(OutboxScope::objid(Lock::Lane))
            .bind(max_bytes)
            .fetch_all(&mut *tx)
            .await?
    } else {
        let sql = claim_slots(lanes.count, &lanes::slots_of(lanes.count, &lanes.lanes));
        sqlx::query_as::<_, Row>(&sql)
            .bind(limit)
            .bind(held_keys)
            .bind(per_slot(limit))
            .bind(lanes.pid)
            .bind(i64::from(lanes.scope.oid()))
            .bind(OutboxScope::objid(Lock::Lane))
            .bind(max_bytes)
            .fetch_all(&mut *tx)
            .await?
    };
    let bytes: usize = rows.iter().map(Row::bytes).sum();
    let cut = usize::try_from(max_bytes).is_ok_and(|max| bytes >= max);
    Ok(Batch {
        tx,
        rows,
        cut,
        progress: None,
    })
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
    /// Holds the row for this many seconds (see [`held`](super::held)).
    pub hold: Option<f64>,
}

/// How a batch's transaction ended, when its marks committed.
#[derive(Debug, Default)]
pub(crate) struct Finished {
    /// The statements that went through.
    pub ran: Vec<Statement>,
    /// The database refused to record the failures or holds: rolled back
    /// to before them, the marks committed; the rows they were about go back
    /// to the claim's queue as they were.
    pub refused: Option<Trouble>,
    /// In the progress mode, after such a refusal: the lanes whose positions
    /// stopped before a row that needed a state (read again from there).
    pub short: Vec<super::progress::batch::Stand>,
}

/// A batch whose marks did not commit: its delivered rows stay unpublished
/// in the table.
#[derive(Debug)]
pub(crate) struct Unfinished {
    pub trouble: Trouble,
    /// The rows delivered: id, event id.
    pub delivered: Vec<(i64, uuid::Uuid)>,
    /// In the progress mode: what the finish would have written (carried
    /// work included), to carry on.
    pub work: Option<Box<super::progress::batch::Work>>,
}

impl Batch {
    /// Marks `published` rows, records `failures`, holds the withheld rows
    /// in `holds` (id, seconds), commits. Other rows are only unlocked.
    ///
    /// A refusal of the failures or holds (a role that may not write
    /// `held_until`, say) does not cost the marks: they are recorded in a
    /// savepoint, rolled back alone, and the marks commit.
    pub async fn finish(
        mut self,
        published: &[i64],
        failures: &[Failure],
        holds: &[(i64, f64)],
    ) -> std::result::Result<Finished, Unfinished> {
        let published: std::collections::HashSet<i64> = published.iter().copied().collect();
        let marked: Vec<&Row> = self
            .rows
            .iter()
            .filter(|r| published.contains(&r.id))
            .collect();
        let delivered: Vec<(i64, uuid::Uuid)> = marked.iter().map(|r| (r.id, r.event_id)).collect();
        let unfinished = |trouble: Trouble| Unfinished {
            trouble,
            delivered: delivered.clone(),
            work: None,
        };
        let mut finished = Finished::default();
        if !marked.is_empty() {
            let tids: Vec<&str> = marked.iter().map(|r| r.tid.as_str()).collect();
            let event_ids: Vec<uuid::Uuid> = marked.iter().map(|r| r.event_id).collect();
            let (first, last) = (event_ids.iter().min(), event_ids.iter().max());
            sqlx::query(MARK_PUBLISHED)
                .bind(&tids)
                .bind(&event_ids)
                .bind(first)
                .bind(last)
                .execute(&mut *self.tx)
                .await
                .map_err(|e| unfinished(Trouble::from(e).during(MARK)))?;
            finished.ran.push(MARK);
        }
        if !failures.is_empty() || !holds.is_empty() {
            sqlx::query("SAVEPOINT outbox_relay_failures")
                .execute(&mut *self.tx)
                .await
                .map_err(|e| unfinished(e.into()))?;
            match record(&mut self.tx, failures, holds, &mut finished.ran).await {
                Ok(()) => {}
                Err(trouble @ Trouble::Refused(_)) => {
                    sqlx::query("ROLLBACK TO SAVEPOINT outbox_relay_failures")
                        .execute(&mut *self.tx)
                        .await
                        .map_err(|e| unfinished(e.into()))?;
                    finished.refused = Some(trouble);
                }
                Err(outage) => return Err(unfinished(outage)),
            }
        }
        self.tx.commit().await.map_err(|e| unfinished(e.into()))?;
        Ok(finished)
    }
}

/// Records `failures` and `holds` on `tx`, adding the statements that went
/// through to `ran`.
pub(crate) async fn record(
    tx: &mut Transaction<'static, Postgres>,
    failures: &[Failure],
    holds: &[(i64, f64)],
    ran: &mut Vec<Statement>,
) -> std::result::Result<(), Trouble> {
    if !failures.is_empty() {
        let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let counted: Vec<bool> = failures.iter().map(|f| f.counted).collect();
        let park: Vec<bool> = failures.iter().map(|f| f.park).collect();
        let hold: Vec<Option<f64>> = failures.iter().map(|f| f.hold).collect();
        sqlx::query(RECORD_FAILURES)
            .bind(&ids)
            .bind(&errors)
            .bind(&counted)
            .bind(&park)
            .bind(&hold)
            .execute(&mut **tx)
            .await
            .map_err(|e| Trouble::from(e).during(RECORD))?;
        ran.push(RECORD);
    }
    if !holds.is_empty() {
        let ids: Vec<i64> = holds.iter().map(|h| h.0).collect();
        let secs: Vec<f64> = holds.iter().map(|h| h.1).collect();
        sqlx::query(super::held::HOLD)
            .bind(&ids)
            .bind(&secs)
            .execute(&mut **tx)
            .await
            .map_err(|e| Trouble::from(e).during(super::held::HOLDING))?;
        ran.push(super::held::HOLDING);
    }
    Ok(())
}

/// Marks rows delivered by batches whose marks did not commit (`event_ids`)
/// published, in a transaction of its own under `statement_timeout` (0:
/// none). The relay claims nothing until they are: it never sends a row
/// it knows it delivered again (see the relay's `Loop::unrecorded`).
pub(crate) async fn record_published(
    pool: &PgPool,
    event_ids: &[uuid::Uuid],
    statement_timeout: std::time::Duration,
) -> std::result::Result<(), Trouble> {
    let result = async {
        let mut tx = pool.begin().await?;
        sqlx::query(&format!(
            "SET LOCAL statement_timeout = {}",
            statement_timeout.as_millis()
        ))
        .execute(&mut *tx)
        .await?;
        sqlx::query(MARK_DELIVERED)
            .bind(event_ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }
    .await;
    result.map_err(|e| Trouble::from(e).during(MARK))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::Connection;

    /// 20,000 held rows of a blocked topic ahead of 10 claimable ones: the
    /// claim returns the 10 and its index scan never meets a held row (it
    /// would remove them all by its filter if they were in its index).
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn the_claim_never_walks_held_rows(pool: PgPool) {
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key, held_until)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{}',
                    CASE WHEN g <= 20000 THEN 'blocked' ELSE 'good' END, 'k' || (g % 100),
                    CASE WHEN g <= 20000 THEN now() + interval '1 hour' END
             FROM generate_series(1, 20010) AS g",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
        // A lock session registered as a relay without lanes.
        let scope = OutboxScope::of(&pool).await.unwrap();
        let mut session = pool.acquire().await.unwrap();
        let pid: i32 = sqlx::query_scalar(
            "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock_shared($1)) AS l",
        )
        .bind(scope.key(Lock::Count, 0))
        .fetch_one(&mut *session)
        .await
        .unwrap();
        let claimable = Claimable {
            scope,
            count: 0,
            lanes: Vec::new(),
            pid,
        };
        let timeout = std::time::Duration::from_secs(10);
        let begin = begin(timeout, timeout);
        let batch = claim(&pool, &begin, 100, 1 << 20, &[], &claimable)
            .await
            .unwrap();
        assert_eq!(batch.rows.len(), 10);
        assert!(batch.rows.iter().all(|r| r.topic == "good"));
        // Their keys have held rows, all earlier, but on another topic.
        assert!(batch.rows.iter().all(|r| r.behind_held_secs.is_none()));
        drop(batch);

        let mut conn = pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        sqlx::query("SET LOCAL enable_seqscan = off")
            .execute(&mut *tx)
            .await
            .unwrap();
        let plan: Vec<String> =
            sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, COSTS OFF) {}", *CLAIM_ANY))
                .bind(100_i64)
                .bind(Vec::<String>::new())
                .bind(i64::from(scope.oid()))
                .bind(OutboxScope::objid(Lock::Count))
                .bind(pid)
                .bind(1_i64 << 20)
                .fetch_all(&mut *tx)
                .await
                .unwrap();
        let plan = plan.join("\n");
        assert!(
            plan.contains("Index Scan using ix_outbox_event_unpublished"),
            "{plan}"
        );
        let removed: Vec<u64> = plan
            .lines()
            .filter_map(|l| l.split("Rows Removed by Filter: ").nth(1))
            .filter_map(|n| n.trim().parse().ok())
            .collect();
        assert!(removed.iter().all(|n| *n < 1000), "{plan}");
    }

    /// 64,000 rows over 16 lanes; a relay owning lane 3 claims the first 100 of its
    /// rows, and its plan walks only lane 3's four slots of the slot index,
    /// merged in id order, reading about the batch (the lane filter over the
    /// id index read the other 15 lanes' rows too: ~1,600 for 100).
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn a_claim_with_lanes_reads_only_its_slots(pool: PgPool) {
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k' || (g % 5000)
             FROM generate_series(1, 64000) AS g",
        )
        .execute(&pool)
        .await
        .unwrap();
        let scope = OutboxScope::of(&pool).await.unwrap();
        let mut session = pool.acquire().await.unwrap();
        let pid: i32 = sqlx::query_scalar(
            "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock_shared($1), pg_advisory_lock($2)) AS l",
        )
        .bind(scope.key(Lock::Count, 16))
        .bind(scope.base(Lock::Lane) | 3)
        .fetch_one(&mut *session)
        .await
        .unwrap();
        let claimable = Claimable {
            scope,
            count: 16,
            lanes: vec![3],
            pid,
        };
        let timeout = std::time::Duration::from_secs(10);
        let begin = begin(timeout, timeout);
        let batch = claim(&pool, &begin, 100, 1 << 20, &[], &claimable)
            .await
            .unwrap();
        assert_eq!(batch.rows.len(), 100);
        assert!(batch.rows.windows(2).all(|w| w[0].id < w[1].id));
        let keys: Vec<&str> = batch
            .rows
            .iter()
            .map(|r| r.partition_key.as_str())
            .collect();
        let lanes: Vec<i32> =
            sqlx::query_scalar("SELECT (hashtext(k) & 2147483647) % 16 FROM unnest($1::text[]) k")
                .bind(&keys)
                .fetch_all(&pool)
                .await
                .unwrap();
        assert!(lanes.iter().all(|l| *l == 3), "{lanes:?}");
        // The first 100 rows of lane 3, in id order.
        let first: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM outbox_event WHERE (hashtext(partition_key) & 2147483647) % 16 = 3
             ORDER BY id LIMIT 100",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(batch.rows.iter().map(|r| r.id).collect::<Vec<_>>(), first);
        batch.tx.rollback().await.unwrap();

        // On a young table (no statistics: few rows per slot estimated),
        // and analyzed.
        assert_reads_only_its_slots(&pool, scope, pid).await;
        sqlx::query("ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
        assert_reads_only_its_slots(&pool, scope, pid).await;
    }

    /// Asserts that the claim of lane 3 of 16 (lock session `pid`) walks
    /// only that lane's slots, reading about its batch of 100.
    async fn assert_reads_only_its_slots(pool: &PgPool, scope: OutboxScope, pid: i32) {
        let mut conn = pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        sqlx::query("SET LOCAL enable_seqscan = off")
            .execute(&mut *tx)
            .await
            .unwrap();
        let sql = claim_slots(16, &lanes::slots_of(16, &[3]));
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, COSTS OFF) {sql}"))
            .bind(100_i64)
            .bind(Vec::<String>::new())
            .bind(per_slot(100))
            .bind(pid)
            .bind(i64::from(scope.oid()))
            .bind(OutboxScope::objid(Lock::Lane))
            .bind(1_i64 << 20)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains("Merge Append"), "{plan}");
        let scans: Vec<&str> = plan
            .lines()
            .filter(|l| l.contains("Scan using ix_outbox_event_unpublished_slot"))
            .collect();
        assert_eq!(scans.len(), 4, "{plan}");
        let conds: Vec<&str> = plan
            .lines()
            .filter_map(|l| l.split("Index Cond: ").nth(1))
            .filter(|c| c.contains("lane_slot"))
            .collect();
        assert_eq!(
            conds,
            [
                "(lane_slot = 3)",
                "(lane_slot = 19)",
                "(lane_slot = 35)",
                "(lane_slot = 51)"
            ],
            "{plan}"
        );
        let read: u64 = scans
            .iter()
            .filter_map(|l| l.split(" rows=").nth(1))
            .filter_map(|n| n.split(' ').next()?.parse::<u64>().ok())
            .sum();
        // The batch, one row read ahead per slot, the byte budget's window
        // reading a couple ahead.
        assert!((100..=110).contains(&read), "{read} rows read: {plan}");
        assert!(!plan.contains("Seq Scan"), "{plan}");
        assert!(
            !plan.contains("-> Sort") && !plan.contains("->  Sort"),
            "{plan}"
        );
    }

    #[test]
    fn in_use_locks_name_every_owned_lane() {
        assert_eq!(
            hold_in_use(OutboxScope::from_oid(16_384), &[0, 7, 15]),
            "SELECT count(pg_advisory_xact_lock_shared(70368777732096::int8 | l)) FROM unnest('{0,7,15}'::int4[]) AS l"
        );
    }
}
