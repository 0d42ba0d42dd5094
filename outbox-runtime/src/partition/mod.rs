//! The partitioned layout (opt-in): `outbox_event`, `processed_event` and
//! `inbox_event` split into time ranges, so that retention drops whole
//! partitions instead of deleting rows one by one (no dead rows, no vacuum
//! debt, writers untouched).
//!
//! This module owns the layout (bounds, names, the listing [`list`], the
//! plan); `convert` the conversion ([`enable`], also the migration path of
//! an installation holding rows); `ahead` the partitions created ahead
//! ([`maintain`]); `retention` the partition half of retention (called by
//! [`crate::cleanup`]); `leader` the maintenance lock (one maintainer at a
//! time).
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
//! boundary), one partition per period (`_pYYYYMMDD_HH24MI`, `…MISS` for periods
//! that are not whole minutes; epoch-aligned;
//! the period is fixed at [`enable`] and read back from the newest
//! partition), and a `_default` partition, so that no insert ever fails: an
//! id with no partition of its own (not a UUIDv7, or a time outside the
//! partitions, e.g. a clock far off) lands there. Creating a partition moves
//! the rows of its range out of the default partition first.
//!
//! **Retention** (`retention::drop_expired`): a partition whose whole
//! range is older than the retention is dropped once it holds no row still
//! needed: no unpublished or parked outbox row (a row an operator dropped
//! is parked: it keeps its partition; a scheduled event cancelled before
//! the window does not), no unprocessed inbox row, no row younger than
//! the retention by its own timestamps (`published_at`, `processed_at`,
//! and `created_at` for an outbox row: an id that is not a UUIDv7 may sit
//! in an old range). Otherwise it is kept, reported, and tried again at the
//! next pass. It is detached (renamed `…_retired`) under the parent's lock,
//! and its files removed after that lock is released.
//! The legacy and default partitions are cleaned row by row, as the
//! unpartitioned tables are.
//!
//! **Locks.** Writers and relays lock a parent table and then its
//! partitions (a relay's claim and marks every partition); maintenance takes
//! its locks in the same order, so that it never deadlocks with them, and
//! waits for each at most `lock_timeout`, a few attempts per pass. A
//! partition whose table stays busy is left for the next pass (counted as
//! busy), without failing the rest of it. Creating a partition locks the
//! parent exclusively, then moves the range's rows out of the default
//! partition (few, unless the partition fell behind) and creates it.
//! Dropping one first checks it holding nothing (a read of the partition
//! while writers and relays go on), then, with the parent locked
//! exclusively, checks again through indexes only what may have been
//! written since, and detaches it. The conversion holds each table
//! exclusively while it moves the rows past the first boundary out (found
//! through an index) and validates the legacy partition's range (one
//! sequential read of the table).
//!
//! **Plan.** [`enable`] records `ahead` and `lock_timeout` in the comment
//! of each partitioned table; the cleanup job's passes read them back
//! there.
//!
//! **Maintenance lock.** One maintainer at a time per outbox: a
//! session-level advisory lock on the connection doing the work. A pass
//! cancelled mid-way (its future dropped) closes that connection and
//! cancels its statement, so that the lock is free at once.

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::{Error, Result};

mod ahead;
mod convert;
mod leader;
mod retention;

pub use ahead::{MaintainReport, maintain};
pub use convert::{EnableReport, enable};
pub use retention::DropReport;
pub(crate) use retention::{retention_pass, row_cleaned};

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
    /// The time range of one partition (whole seconds; epoch-aligned). Read
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
    /// Refuses a period that is not whole seconds (at least one) and no
    /// partition ahead. (Periods of seconds are for tests that roll
    /// partitions within minutes; production periods are hours or days.)
    pub fn validate(&self) -> Result<()> {
        let secs = self.period.as_secs();
        if secs < 1 || self.period.subsec_nanos() != 0 {
            return Err(Error::Config(format!(
                "partition period must be whole seconds (at least 1s), got {}s",
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

/// Whether `error` says a table stayed busy: a lock not granted within
/// `lock_timeout` (55P03), or a deadlock that chose this statement to give
/// way (40P01). The work is tried again later.
fn is_busy(error: &Error) -> bool {
    matches!(
        error,
        Error::Database(sqlx::Error::Database(db))
            if matches!(db.code().as_deref(), Some("55P03" | "40P01"))
    )
}

/// The mark of the comment in which [`enable`] records its plan on each
/// partitioned table.
const PLAN_MARK: &str = "outbox partitions:";

fn plan_comment(plan: &PartitionPlan) -> String {
    format!(
        "{PLAN_MARK} ahead={} lock_timeout_ms={}",
        plan.ahead,
        plan.lock_timeout.as_millis()
    )
}

/// `ahead` and `lock_timeout` of a comment [`plan_comment`] wrote.
fn parse_plan(comment: &str) -> Option<(u32, Duration)> {
    let rest = comment.strip_prefix(PLAN_MARK)?;
    let (mut ahead, mut lock_timeout) = (None, None);
    for setting in rest.split_whitespace() {
        match setting.split_once('=')? {
            ("ahead", n) => ahead = n.parse().ok(),
            ("lock_timeout_ms", ms) => lock_timeout = ms.parse().ok().map(Duration::from_millis),
            _ => {}
        }
    }
    Some((ahead?, lock_timeout?))
}

/// Records `plan` on the partitioned table `schema.table` (its comment),
/// for the maintainers that run without one: replacing a plan recorded
/// before only if `replace`. A comment that is not this module's is left as
/// it is (the maintainers then use the defaults).
async fn record_plan(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    plan: &PartitionPlan,
    replace: bool,
) -> Result<()> {
    let table = qualified(schema, table);
    let comment: Option<String> =
        sqlx::query_scalar("SELECT obj_description($1::regclass, 'pg_class')")
            .bind(&table)
            .fetch_one(&mut *conn)
            .await?;
    match comment {
        Some(c) if !c.starts_with(PLAN_MARK) => {
            tracing::warn!(
                %table,
                "the table has a comment of its own: the partition plan is not recorded; \
                 cleanup jobs keep the default number of partitions ahead"
            );
            return Ok(());
        }
        Some(_) if !replace => return Ok(()),
        _ => {}
    }
    sqlx::query(&format!(
        "COMMENT ON TABLE {table} IS '{}'",
        plan_comment(plan)
    ))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The plan [`enable`] recorded on `table` (the defaults for what it did
/// not record); the period is the table's own (its newest partition's).
async fn enabled_plan(conn: &mut PgConnection, table: &str) -> Result<PartitionPlan> {
    let comment: Option<String> =
        sqlx::query_scalar("SELECT obj_description(to_regclass($1), 'pg_class')")
            .bind(table)
            .fetch_one(&mut *conn)
            .await?;
    let mut plan = PartitionPlan::default();
    if let Some((ahead, lock_timeout)) = comment.as_deref().and_then(parse_plan) {
        plan.ahead = ahead;
        plan.lock_timeout = lock_timeout;
    }
    if let Some(period) = ahead::period_of(&partitions_of(conn, table).await?) {
        plan.period = Duration::from_millis(period as u64);
    }
    Ok(plan)
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

    #[test]
    fn the_plan_round_trips_through_its_comment() {
        let plan = PartitionPlan {
            ahead: 7,
            lock_timeout: Duration::from_millis(350),
            ..PartitionPlan::default()
        };
        assert_eq!(
            parse_plan(&plan_comment(&plan)),
            Some((7, Duration::from_millis(350)))
        );
        assert_eq!(parse_plan("orders of the shop"), None);
        assert_eq!(
            parse_plan("outbox partitions: ahead=x lock_timeout_ms=1"),
            None
        );
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
        use crate::scope::{Lock, OutboxScope};
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
