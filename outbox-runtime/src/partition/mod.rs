//! The partitioned layout (opt-in): `outbox_event`, `processed_event` and
//! `inbox_event` split into time ranges, so that retention drops whole
//! partitions instead of deleting rows one by one (no dead rows, no vacuum
//! debt, writers untouched).
//!
//! This module owns the conversion ([`enable`], also the migration path of
//! an installation holding rows), the partitions created ahead
//! ([`maintain`], one leader at a time), the listing ([`list`]) and the
//! partition half of retention (called by [`crate::cleanup`]).
//!
//! **Partition key: `event_id`.** Event ids are UUIDv7 (the outbox assigns
//! `Uuid::now_v7()` unless an event brings its own): their first 48 bits
//! are the creation time in milliseconds, so a range of ids is a range of
//! time. Keying on the id keeps every uniqueness guarantee exact — a
//! partitioned table's unique constraints must contain the partition key,
//! and `outbox_event (event_id)` and the dedup key `(consumer, event_id)`
//! do. The outbox's primary key becomes `(id, event_id)` (ids still come
//! from one sequence, above every id of before).
//!
//! **Partitions.** Each table gets: a `_legacy` partition (the table as it
//! was, attached without copying a row, covering every id below the first
//! boundary), one partition per period (`_pYYYYMMDD_HH24MI`, epoch-aligned;
//! the period is fixed at [`enable`] and read back from the newest
//! partition), and a `_default` partition, so that no insert ever fails: an
//! id with no partition of its own (not a UUIDv7, or a time outside the
//! partitions, e.g. a clock far off) lands there. Creating a partition moves
//! the rows of its range out of the default partition first.
//!
//! **Retention** ([`drop_expired`]): a partition whose whole range is older
//! than the retention is dropped once it holds no row still needed: no
//! unpublished or parked outbox row (a discarded row is parked: it keeps its
//! partition), no unprocessed inbox row, no row younger than the retention
//! by its own timestamp (`published_at`, `processed_at`: an id that is not
//! a UUIDv7 may sit in an old range). Otherwise it is kept, reported, and
//! tried again at the next pass. It is detached (renamed `…_retired`) under
//! the parent's lock, and its files removed after that lock is released.
//! The legacy and default partitions are cleaned row by row, as the
//! unpartitioned tables are.
//!
//! **Locks.** Creating and dropping a partition takes a short exclusive lock
//! on the parent table, each attempt bounded by `lock_timeout`; the checks
//! that scan a partition hold only that partition. The conversion holds
//! each table exclusively while it validates the legacy partition's range
//! (one sequential read of the table).

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::scope::OutboxScope;

mod convert;

pub use convert::{EnableReport, enable};

/// The tables the partitioned layout covers, in conversion order.
pub const TABLES: [&str; 3] = ["outbox_event", "processed_event", "inbox_event"];

/// The columns of `table` (qualified) an insert may write, as a list for
/// SQL: every column but the generated ones (`outbox_event.lane_slot`),
/// which the insert computes again.
async fn stored_columns(conn: &mut PgConnection, table: &str) -> Result<String> {
    Ok(sqlx::query_scalar(
        "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute
         WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped AND attgenerated = ''",
    )
    .bind(table)
    .fetch_one(&mut *conn)
    .await?)
}

/// The partition key of every partitioned table.
const KEY: &str = "event_id";

/// How the partitions are laid out and kept ahead.
#[derive(Debug, Clone)]
pub struct PartitionPlan {
    /// The time range of one partition (whole minutes; epoch-aligned). Read
    /// back from the newest partition once enabled.
    pub period: Duration,
    /// Partitions kept ready ahead of now.
    pub ahead: u32,
    /// How long one attempt waits for a table lock.
    pub lock_timeout: Duration,
}

impl Default for PartitionPlan {
    /// One partition per day, three days ahead, locks waited for 2 s.
    fn default() -> Self {
        Self {
            period: Duration::from_secs(86_400),
            ahead: 3,
            lock_timeout: Duration::from_secs(2),
        }
    }
}

impl PartitionPlan {
    /// Refuses a period that is not whole minutes (at least one) and no
    /// partition ahead.
    pub fn validate(&self) -> Result<()> {
        let secs = self.period.as_secs();
        if secs < 60 || secs % 60 != 0 || self.period.subsec_nanos() != 0 {
            return Err(Error::Config(format!(
                "partition period must be whole minutes (at least 1m), got {}s",
                self.period.as_secs_f64()
            )));
        }
        if !(1..=366).contains(&self.ahead) {
            return Err(Error::Config(format!(
                "partitions ahead must be 1..=366, got {}",
                self.ahead
            )));
        }
        if self.lock_timeout.is_zero() {
            return Err(Error::Config("lock timeout must be > 0".into()));
        }
        Ok(())
    }

    fn period_ms(&self) -> i64 {
        self.period.as_millis() as i64
    }
}

/// The lowest UUID of millisecond `ms` (the start of a range).
pub fn uuid_at(ms: i64) -> Uuid {
    Uuid::from_u128((ms.max(0) as u128 & 0xFFFF_FFFF_FFFF) << 80)
}

/// The millisecond a UUID's first 48 bits stand for (its creation time if
/// it is a UUIDv7).
pub fn ms_of(id: Uuid) -> i64 {
    (id.as_u128() >> 80) as i64
}

/// What a partition is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionKind {
    /// The table as it was before [`enable`]: every id below the first
    /// boundary.
    Legacy,
    /// One period.
    Range,
    /// Ids no other partition covers.
    Default,
}

/// One partition of a partitioned table.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct PartitionInfo {
    /// The partitioned table.
    pub table: String,
    /// The partition's name.
    pub name: String,
    /// What it is.
    pub kind: PartitionKind,
    /// First id of the range (`None`: from the lowest, or the default).
    pub from: Option<Uuid>,
    /// End of the range, excluded (`None`: the default).
    pub to: Option<Uuid>,
    /// Rows, as the planner estimates them (-1: never analyzed).
    pub rows_estimate: i64,
}

impl PartitionInfo {
    /// The range's end as milliseconds since the epoch.
    pub fn to_ms(&self) -> Option<i64> {
        self.to.map(ms_of)
    }
}

/// What [`maintain`] did.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct MaintainReport {
    /// Partitions created ahead.
    pub created: u64,
    /// Rows moved from a default partition into a created one.
    pub moved_rows: u64,
}

/// What the partition half of a retention pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DropReport {
    /// Partitions dropped.
    pub dropped: u64,
    /// Partitions old enough that were kept: they hold a row still needed
    /// (see the module docs), or their lock was not granted in time.
    pub kept: u64,
}

/// `"schema"."name"`.
fn qualified(schema: &str, name: &str) -> String {
    format!("{}.{}", ident(schema), ident(name))
}

fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A Postgres identifier of at most 63 bytes: `base` cut, then `suffix`.
fn with_suffix(base: &str, suffix: &str) -> String {
    let mut cut = 63 - suffix.len();
    while !base.is_char_boundary(cut.min(base.len())) {
        cut -= 1;
    }
    format!("{}{suffix}", &base[..cut.min(base.len())])
}

/// The schema and relkind of `table` as the `search_path` finds it.
async fn locate(conn: &mut PgConnection, table: &str) -> Result<Option<(String, bool)>> {
    let row: Option<(String, bool)> = sqlx::query_as(
        "SELECT n.nspname::text, c.relkind = 'p'
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.oid = to_regclass($1)",
    )
    .bind(table)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row)
}

/// Whether `table` (found through the `search_path`) is partitioned.
pub async fn is_partitioned(pool: &PgPool, table: &str) -> Result<bool> {
    let mut conn = pool.acquire().await?;
    Ok(locate(&mut conn, table).await?.is_some_and(|(_, p)| p))
}

/// Parses `FOR VALUES FROM (…) TO (…)` / `DEFAULT`.
fn parse_bound(bound: &str) -> (PartitionKind, Option<Uuid>, Option<Uuid>) {
    if bound.trim() == "DEFAULT" {
        return (PartitionKind::Default, None, None);
    }
    let value = |part: &str| -> Option<Uuid> {
        let start = part.find('\'')?;
        let rest = &part[start + 1..];
        let end = rest.find('\'')?;
        rest[..end].parse().ok()
    };
    let (from, to) = match bound.split_once(" TO ") {
        Some((from, to)) => (value(from), value(to)),
        None => (None, None),
    };
    let kind = if from.is_none() {
        PartitionKind::Legacy
    } else {
        PartitionKind::Range
    };
    (kind, from, to)
}

async fn partitions_of(conn: &mut PgConnection, table: &str) -> Result<Vec<PartitionInfo>> {
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid), c.reltuples::int8
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = to_regclass($1)",
    )
    .bind(table)
    .fetch_all(&mut *conn)
    .await?;
    let mut parts: Vec<PartitionInfo> = rows
        .into_iter()
        .map(|(name, bound, rows)| {
            let (kind, from, to) = parse_bound(&bound);
            PartitionInfo {
                table: table.to_owned(),
                name,
                kind,
                from,
                to,
                rows_estimate: rows,
            }
        })
        .collect();
    parts.sort_by_key(|p| (p.kind == PartitionKind::Default, p.from, p.to));
    Ok(parts)
}

/// The partitions of every partitioned table of [`TABLES`] (an empty list
/// for an unpartitioned one), in range order, the default last.
pub async fn list(pool: &PgPool) -> Result<Vec<PartitionInfo>> {
    let mut conn = pool.acquire().await?;
    let mut all = Vec::new();
    for table in TABLES {
        if locate(&mut conn, table).await?.is_some_and(|(_, p)| p) {
            all.extend(partitions_of(&mut conn, table).await?);
        }
    }
    Ok(all)
}

/// The database's clock, in milliseconds since the epoch.
async fn now_ms(conn: &mut PgConnection) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8")
            .fetch_one(&mut *conn)
            .await?,
    )
}

/// The first period boundary strictly after `ms`.
fn next_boundary(ms: i64, period_ms: i64) -> i64 {
    (ms.div_euclid(period_ms) + 1) * period_ms
}

async fn set_lock_timeout(conn: &mut PgConnection, timeout: Duration) -> Result<()> {
    sqlx::query(&format!(
        "SET LOCAL lock_timeout = {}",
        timeout.as_millis().max(1)
    ))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The storage parameters of `relation` as a `WITH (…)` clause (empty
/// without any).
async fn storage_clause(conn: &mut PgConnection, relation: &str) -> Result<String> {
    let options: Option<Vec<String>> =
        sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE oid = to_regclass($1)")
            .bind(relation)
            .fetch_optional(&mut *conn)
            .await?
            .flatten();
    Ok(match options {
        Some(o) if !o.is_empty() => format!(" WITH ({})", o.join(", ")),
        _ => String::new(),
    })
}

/// Creates the partition of `[from_ms, to_ms)` of `schema.table` inside the
/// caller's transaction, moving the rows of that range out of the default
/// partition first. Returns the rows moved.
async fn create_range(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    from_ms: i64,
    to_ms: i64,
) -> Result<u64> {
    let name: String = sqlx::query_scalar(
        "SELECT $1 || '_p' || to_char(to_timestamp($2 / 1000.0) AT TIME ZONE 'UTC', 'YYYYMMDD_HH24MI')",
    )
    .bind(table)
    .bind(from_ms as f64)
    .fetch_one(&mut *conn)
    .await?;
    let parent = qualified(schema, table);
    let default = qualified(schema, &format!("{table}_default"));
    let (from, to) = (uuid_at(from_ms), uuid_at(to_ms));
    let storage = storage_clause(conn, &default).await?;
    let moved = sqlx::query(&format!(
        "CREATE TEMP TABLE outbox_partition_moved ON COMMIT DROP AS
         WITH d AS (DELETE FROM {default} WHERE {KEY} >= $1 AND {KEY} < $2 RETURNING *)
         SELECT * FROM d"
    ))
    .bind(from)
    .bind(to)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    sqlx::query(&format!(
        "CREATE TABLE {} PARTITION OF {parent} FOR VALUES FROM ('{from}') TO ('{to}'){storage}",
        qualified(schema, &name)
    ))
    .execute(&mut *conn)
    .await?;
    if moved > 0 {
        let columns = stored_columns(conn, &parent).await?;
        sqlx::query(&format!(
            "INSERT INTO {parent} ({columns}) SELECT {columns} FROM outbox_partition_moved"
        ))
        .execute(&mut *conn)
        .await?;
        tracing::info!(table, partition = %name, rows = moved, "rows moved from the default partition");
    }
    sqlx::query("DROP TABLE outbox_partition_moved")
        .execute(&mut *conn)
        .await?;
    Ok(moved)
}

/// The period of a partitioned table: the width of its newest range.
fn period_of(parts: &[PartitionInfo]) -> Option<i64> {
    parts
        .iter()
        .filter(|p| p.kind == PartitionKind::Range)
        .filter_map(|p| Some((ms_of(p.from?), ms_of(p.to?))))
        .max()
        .map(|(from, to)| to - from)
        .filter(|w| *w > 0)
}

/// Creates the missing partitions of `table` up to `ahead` periods past
/// now, one transaction each. The caller holds the maintenance lock.
async fn create_ahead(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    plan: &PartitionPlan,
    report: &mut MaintainReport,
) -> Result<()> {
    let parts = partitions_of(conn, table).await?;
    let period = period_of(&parts).unwrap_or(plan.period_ms());
    let Some(mut hi) = parts.iter().filter_map(PartitionInfo::to_ms).max() else {
        return Err(Error::Config(format!(
            "{table} is partitioned but has no range partition: not a layout of `outbox partitions enable`"
        )));
    };
    let horizon = now_ms(conn).await? + i64::from(plan.ahead) * period;
    while hi < horizon {
        let to = next_boundary(hi, period);
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        set_lock_timeout(&mut tx, plan.lock_timeout).await?;
        let moved = create_range(&mut tx, schema, table, hi, to).await?;
        tx.commit().await?;
        report.created += 1;
        report.moved_rows += moved;
        hi = to;
    }
    Ok(())
}

/// The key of the maintenance lock of the outbox `scope`.
async fn maintenance_lock(conn: &mut PgConnection) -> Result<i64> {
    let scope = OutboxScope::of(&mut *conn).await?;
    Ok(
        sqlx::query_scalar("SELECT hashtextextended('outbox partitions ' || $1::text, 0)")
            .bind(i64::from(scope.oid()))
            .fetch_one(&mut *conn)
            .await?,
    )
}

/// Runs `work` holding the maintenance lock (session-level, on a connection
/// of its own); `None` when another maintainer holds it.
async fn as_leader<T>(
    pool: &PgPool,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T>,
) -> Result<Option<T>> {
    let mut conn = pool.acquire().await?;
    let lock = maintenance_lock(&mut conn).await?;
    let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(lock)
        .fetch_one(&mut *conn)
        .await?;
    if !taken {
        return Ok(None);
    }
    let result = work(&mut conn).await;
    let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(lock)
        .execute(&mut *conn)
        .await;
    if unlocked.is_err() {
        // A connection in an unknown state must not go back to the pool
        // holding the lock.
        drop(conn.detach());
    }
    result.map(Some)
}

/// Creates the partitions missing ahead of now (up to `plan.ahead` periods)
/// in every partitioned table, as the single maintainer of this outbox
/// (advisory lock); `None` when another maintainer is at work. The period
/// is each table's own (its newest partition's).
pub async fn maintain(pool: &PgPool, plan: &PartitionPlan) -> Result<Option<MaintainReport>> {
    plan.validate()?;
    as_leader(pool, async |conn: &mut PgConnection| {
        let mut report = MaintainReport::default();
        for table in TABLES {
            if let Some((schema, true)) = locate(conn, table).await? {
                create_ahead(conn, &schema, table, plan, &mut report).await?;
            }
        }
        if report.created > 0 {
            tracing::info!(
                created = report.created,
                moved_rows = report.moved_rows,
                "partitions created ahead"
            );
        }
        Ok(report)
    })
    .await
}

/// What must still be kept in a partition of `table` (rows that the
/// retention `cutoff`, `$1`, does not cover), as `EXISTS` conditions on
/// the partition `p`. The outbox's and the inbox's checks for unfinished
/// rows walk their partial indexes; the checks for young rows read the
/// partition once (it is past the window: no writer waits for it).
fn needed(table: &str, p: &str) -> Option<String> {
    Some(match table {
        "outbox_event" => format!(
            "EXISTS (SELECT 1 FROM {p}
                     WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL)
             OR EXISTS (SELECT 1 FROM {p} WHERE held_until IS NOT NULL AND published_at IS NULL)
             OR EXISTS (SELECT 1 FROM {p} WHERE parked_at IS NOT NULL AND published_at IS NULL)
             OR EXISTS (SELECT 1 FROM {p} WHERE published_at >= $1)"
        ),
        "processed_event" => format!("EXISTS (SELECT 1 FROM {p} WHERE processed_at >= $1)"),
        "inbox_event" => format!(
            "EXISTS (SELECT 1 FROM {p} WHERE NOT processed)
             OR EXISTS (SELECT 1 FROM {p} WHERE processed_at >= $1)"
        ),
        _ => return None,
    })
}

/// Drops the partitions of `table` (if partitioned) whose whole range ends
/// at or before `cutoff` and that hold no row still needed (see the module
/// docs); one transaction per partition, the partition locked against
/// writes while it is checked, each lock wait bounded by `lock_timeout`.
/// The caller holds the maintenance lock.
pub(crate) async fn drop_expired(
    conn: &mut PgConnection,
    table: &str,
    cutoff: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    lock_timeout: Duration,
) -> Result<DropReport> {
    let mut report = DropReport::default();
    let Some((schema, true)) = locate(conn, table).await? else {
        return Ok(report);
    };
    if needed(table, "").is_none() {
        return Ok(report);
    }
    // Left by a pass that stopped between the detach and the drop.
    drop_retired(conn, &schema, table).await?;
    let cutoff_ms = cutoff.timestamp_millis();
    for part in partitions_of(conn, table).await? {
        let Some(to_ms) = part.to_ms() else { continue };
        if to_ms > cutoff_ms {
            continue;
        }
        let p = qualified(&schema, &part.name);
        let retired = with_suffix(&part.name, RETIRED);
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        set_lock_timeout(&mut tx, lock_timeout).await?;
        let outcome: std::result::Result<bool, sqlx::Error> = async {
            sqlx::query(&format!("LOCK TABLE {p} IN EXCLUSIVE MODE"))
                .execute(&mut *tx)
                .await?;
            let keep: bool =
                sqlx::query_scalar(&format!("SELECT {}", needed(table, &p).unwrap_or_default()))
                    .bind(cutoff)
                    .fetch_one(&mut *tx)
                    .await?;
            if !keep {
                // Detached here, dropped after the commit: removing the
                // files of a large partition takes a while (measured 1.3 s
                // for 10 M rows), which must not happen under the parent's
                // lock, where it would hold every writer up.
                sqlx::query(&format!(
                    "ALTER TABLE {} DETACH PARTITION {p}",
                    qualified(&schema, table)
                ))
                .execute(&mut *tx)
                .await?;
                sqlx::query(&format!("ALTER TABLE {p} RENAME TO {}", ident(&retired)))
                    .execute(&mut *tx)
                    .await?;
            }
            Ok(!keep)
        }
        .await;
        match outcome {
            Ok(true) => {
                tx.commit().await?;
                drop_table(conn, &schema, &retired).await?;
                report.dropped += 1;
                tracing::info!(table, partition = %part.name, "partition dropped by retention");
            }
            Ok(false) => {
                tx.rollback().await?;
                report.kept += 1;
                tracing::warn!(
                    table,
                    partition = %part.name,
                    "old partition kept: it holds rows still needed (unpublished, parked, \
                     unprocessed, or younger than the retention by their own timestamp)"
                );
            }
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
                tx.rollback().await?;
                report.kept += 1;
                tracing::warn!(table, partition = %part.name, "partition busy: dropped at a later pass");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(report)
}

/// The suffix of a partition detached by retention, until it is dropped.
const RETIRED: &str = "_retired";

/// Drops the partitions of `table` that retention detached and did not
/// drop (a pass stopped in between): tables named as this module names
/// partitions, with the `_retired` suffix, that are no partition.
async fn drop_retired(conn: &mut PgConnection, schema: &str, table: &str) -> Result<()> {
    let retired: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.relkind = 'r' AND NOT c.relispartition
           AND (c.relname::text LIKE replace($2, '_', '\\_') || '\\_p%\\_retired'
                OR c.relname::text = $2 || '_legacy_retired')",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(&mut *conn)
    .await?;
    for name in retired {
        drop_table(conn, schema, &name).await?;
    }
    Ok(())
}

async fn drop_table(conn: &mut PgConnection, schema: &str, name: &str) -> Result<()> {
    sqlx::query(&format!("DROP TABLE IF EXISTS {}", qualified(schema, name)))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The legacy and default partitions of `table` (cleaned row by row), or
/// `[table]` itself when it is not partitioned; schema-qualified.
pub(crate) async fn row_cleaned(pool: &PgPool, table: &str) -> Result<Vec<String>> {
    let mut conn = pool.acquire().await?;
    match locate(&mut conn, table).await? {
        Some((schema, true)) => Ok(partitions_of(&mut conn, table)
            .await?
            .into_iter()
            .filter(|p| p.kind != PartitionKind::Range)
            .map(|p| qualified(&schema, &p.name))
            .collect()),
        Some((schema, false)) => Ok(vec![qualified(&schema, table)]),
        None => Err(Error::Config(format!(
            "no `{table}` table in the connection's search_path: run `outbox migrate`"
        ))),
    }
}

/// Runs `drop_expired` on every table and, as the maintainer when nobody
/// else is, creates the partitions ahead (`plan.ahead`).
pub(crate) async fn retention_pass(
    pool: &PgPool,
    cutoff: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    plan: &PartitionPlan,
) -> Result<DropReport> {
    let mut total = DropReport::default();
    let outcome = as_leader(pool, async |conn: &mut PgConnection| {
        let mut ahead = MaintainReport::default();
        for table in TABLES {
            if let Some((schema, true)) = locate(conn, table).await? {
                // A partition not created now (its lock was busy) is created
                // at the next pass; meanwhile its rows go to the default.
                if let Err(error) = create_ahead(conn, &schema, table, plan, &mut ahead).await {
                    tracing::warn!(table, %error, "partitions ahead not created: retried at the next pass");
                }
                let r = drop_expired(conn, table, cutoff, plan.lock_timeout).await?;
                total.dropped += r.dropped;
                total.kept += r.kept;
            }
        }
        Ok(())
    })
    .await?;
    if outcome.is_none() {
        tracing::debug!("partition maintenance busy elsewhere: partitions left for the next pass");
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_round_trip_and_parse() {
        let ms = 1_764_460_800_000; // 2025-11-30 00:00 UTC
        assert_eq!(ms_of(uuid_at(ms)), ms);
        assert_eq!(
            uuid_at(ms).to_string(),
            "019ad20f-2800-0000-0000-000000000000"
        );
        let v7 = Uuid::now_v7();
        assert!(uuid_at(ms_of(v7)) <= v7 && v7 < uuid_at(ms_of(v7) + 1));
        assert_eq!(next_boundary(ms, 86_400_000), ms + 86_400_000);
        assert_eq!(next_boundary(ms + 1, 86_400_000), ms + 86_400_000);
        let (kind, from, to) = parse_bound(
            "FOR VALUES FROM ('019ad23e-9800-0000-0000-000000000000') TO ('019ad764-f400-0000-0000-000000000000')",
        );
        assert_eq!(kind, PartitionKind::Range);
        assert!(from.is_some() && to > from);
        let (kind, from, to) =
            parse_bound("FOR VALUES FROM (MINVALUE) TO ('019ad23e-9800-0000-0000-000000000000')");
        assert_eq!((kind, from), (PartitionKind::Legacy, None));
        assert!(to.is_some());
        assert_eq!(parse_bound("DEFAULT").0, PartitionKind::Default);
        assert_eq!(with_suffix(&"x".repeat(70), "_legacy").len(), 63);
        assert_eq!(with_suffix("ix_a", "_legacy"), "ix_a_legacy");
    }

    /// The relay's claim, on the partitioned layout with rows in the
    /// legacy, dated and default partitions, walks the partial index of
    /// every partition (in id order, merged): no sequential scan.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn the_claim_walks_an_index_in_every_partition(pool: PgPool) {
        enable(&pool, &PartitionPlan::default()).await.unwrap();
        let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::int8")
            .fetch_one(&pool)
            .await
            .unwrap();
        for id in [
            Uuid::now_v7(),
            uuid_at(now + 86_400_000 + 5),
            uuid_at(now + 1000 * 86_400_000),
        ] {
            sqlx::query(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key)
                 VALUES ($1, 'a', 'k', 'e', '{}', 't', 'k')",
            )
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
        }
        sqlx::query("ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
        let mut tx = pool
            .begin_with(crate::relay::claim::begin(
                Duration::from_secs(10),
                Duration::ZERO,
            ))
            .await
            .unwrap();
        let plan: Vec<String> = sqlx::query_scalar(&format!(
            "EXPLAIN {}",
            crate::relay::claim::CLAIM_ANY.as_str()
        ))
        .bind(100_i64)
        .bind(Vec::<String>::new())
        .bind(0_i64)
        .bind(0_i64)
        .bind(0_i32)
        .bind(1_000_000_i64)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        let plan = plan.join("\n");
        assert!(!plan.contains("Seq Scan"), "{plan}");
        let parts = list(&pool).await.unwrap();
        let outbox: Vec<_> = parts.iter().filter(|p| p.table == "outbox_event").collect();
        assert_eq!(outbox.len(), 5);
        for p in outbox {
            assert!(
                plan.lines()
                    .any(|l| l.contains("Index Scan") && l.contains(&format!(" on {} ", p.name))),
                "{} on an index: {plan}",
                p.name
            );
        }
    }

    /// A relay owning one lane of 16, on the partitioned layout with rows in
    /// the legacy, dated and default partitions: the slot column survived the
    /// conversion (rows inserted since have their slot), the claim walks the
    /// slot index of every partition, locks each row by a TID lookup in its
    /// own partition only, and returns the lane's rows in id order.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn the_claim_of_some_lanes_walks_the_slot_index_of_every_partition(pool: PgPool) {
        use crate::relay::claim::{claim_slots, per_slot};
        use crate::relay::lanes::slots_of;
        use crate::scope::Lock;
        let insert = "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id,
                                                event_type, payload, topic, partition_key)
                      VALUES ($1, 'a', 'k', 'e', '{}', 't', $2)";
        // Rows before the conversion: the legacy partition.
        for g in 0..40 {
            sqlx::query(insert)
                .bind(Uuid::now_v7())
                .bind(format!("k{g}"))
                .execute(&pool)
                .await
                .unwrap();
        }
        enable(&pool, &PartitionPlan::default()).await.unwrap();
        let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::int8")
            .fetch_one(&pool)
            .await
            .unwrap();
        for g in 0..40 {
            for id in [
                Uuid::now_v7(),
                uuid_at(now + 86_400_000 + 5 + g),
                uuid_at(now + 1000 * 86_400_000 + g),
            ] {
                sqlx::query(insert)
                    .bind(id)
                    .bind(format!("k{g}"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
        let wrong: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_event
             WHERE lane_slot IS DISTINCT FROM (hashtext(partition_key) & 2147483647) % 64",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(wrong, 0, "every row has its slot");
        let lane3: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM outbox_event WHERE (hashtext(partition_key) & 2147483647) % 16 = 3
             ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert!(!lane3.is_empty());

        let scope = OutboxScope::of(&pool).await.unwrap();
        let mut session = pool.acquire().await.unwrap();
        let pid: i32 =
            sqlx::query_scalar("SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock($1)) AS l")
                .bind(scope.base(Lock::Lane) | 3)
                .fetch_one(&mut *session)
                .await
                .unwrap();
        let mut tx = pool
            .begin_with(crate::relay::claim::begin(
                Duration::from_secs(10),
                Duration::ZERO,
            ))
            .await
            .unwrap();
        let sql = claim_slots(16, &slots_of(16, &[3]));
        let claimed: Vec<i64> = sqlx::query_scalar(&format!("SELECT id FROM ({sql}) c"))
            .bind(1000_i64)
            .bind(Vec::<String>::new())
            .bind(per_slot(1000))
            .bind(pid)
            .bind(i64::from(scope.oid()))
            .bind(OutboxScope::objid(Lock::Lane))
            .bind(1_000_000_i64)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        assert_eq!(claimed, lane3);
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {sql}"))
            .bind(1000_i64)
            .bind(Vec::<String>::new())
            .bind(per_slot(1000))
            .bind(pid)
            .bind(i64::from(scope.oid()))
            .bind(OutboxScope::objid(Lock::Lane))
            .bind(1_000_000_i64)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        let plan = plan.join("\n");
        assert!(!plan.contains("Seq Scan"), "{plan}");
        assert!(plan.contains("Tid Scan"), "{plan}");
        let parts = list(&pool).await.unwrap();
        for p in parts.iter().filter(|p| p.table == "outbox_event") {
            assert!(
                plan.lines().any(|l| l.contains("Index Scan")
                    && l.contains("slot")
                    && l.contains(&format!(" on {} ", p.name))),
                "{} on its slot index: {plan}",
                p.name
            );
        }
    }
}
