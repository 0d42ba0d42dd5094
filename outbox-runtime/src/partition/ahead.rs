//! Partitions ahead: creating the partitions missing up to `ahead` periods
//! past now ([`maintain`], and the cleanup job at each pass), moving the
//! rows of their ranges out of the default partition.

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use super::leader::as_leader;
use super::{
    KEY, PartitionInfo, PartitionKind, PartitionPlan, TABLES, is_busy, locate, ms_of,
    next_boundary, now_ms, partitions_of, qualified, set_lock_timeout, storage_clause,
    stored_columns, uuid_at,
};
use crate::error::{Error, Result};

/// What [`maintain`] did.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct MaintainReport {
    /// Partitions created ahead.
    pub created: u64,
    /// Rows moved from a default partition into a created one.
    pub moved_rows: u64,
    /// Partitions not created: their table stayed locked longer than
    /// `lock_timeout` at each attempt. Created at a later pass; meanwhile
    /// their rows go to the default partition.
    pub busy: u64,
}

/// Creates the partition of `[from_ms, to_ms)` of `schema.table` inside the
/// caller's transaction (which bounds its lock waits), moving the rows of
/// that range out of the default partition into it. Returns the rows moved.
///
/// The parent is locked first, as writers and relays lock it (then its
/// partitions), exclusively as creating a partition needs it: from then on
/// no row can land in the default partition between the move and the
/// creation (which checks that none of the range is left there), and every
/// insert waiting for the lock is routed afterwards to the new partition.
/// Writers wait while the rows move: few, unless the partition fell behind.
pub(super) async fn create_range(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    from_ms: i64,
    to_ms: i64,
) -> Result<u64> {
    let name: String = sqlx::query_scalar(
        "SELECT $1 || '_p' || to_char(to_timestamp($2 / 1000.0) AT TIME ZONE 'UTC', $3)",
    )
    .bind(table)
    .bind(from_ms as f64)
    // Seconds in the name only where a range may start within a minute.
    .bind(
        if from_ms % 60_000 == 0 && (to_ms - from_ms) % 60_000 == 0 {
            "YYYYMMDD_HH24MI"
        } else {
            "YYYYMMDD_HH24MISS"
        },
    )
    .fetch_one(&mut *conn)
    .await?;
    let parent = qualified(schema, table);
    let default = qualified(schema, &format!("{table}_default"));
    let (from, to) = (uuid_at(from_ms), uuid_at(to_ms));
    sqlx::query(&format!(
        "LOCK TABLE ONLY {parent} IN ACCESS EXCLUSIVE MODE"
    ))
    .execute(&mut *conn)
    .await?;
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
pub(super) fn period_of(parts: &[PartitionInfo]) -> Option<i64> {
    parts
        .iter()
        .filter(|p| p.kind == PartitionKind::Range)
        .filter_map(|p| Some((ms_of(p.from?), ms_of(p.to?))))
        .max()
        .map(|(from, to)| to - from)
        .filter(|w| *w > 0)
}

/// Attempts at one partition per pass (each waits `lock_timeout` at most).
const ATTEMPTS: u32 = 3;

/// The pause after a busy attempt, times the attempt's number.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The ranges `[from, to)` to create so that partitions cover `ahead`
/// periods past `now`: the gaps between the existing partitions (`covered`,
/// the legacy's start as `i64::MIN`) from the newest one's end if it fell
/// behind, else from the current period's start (a range a pass could not
/// create is created later as long as it is current or ahead), period by
/// period up to the horizon.
fn missing_ranges(covered: &[(i64, i64)], now: i64, period: i64, ahead: u32) -> Vec<(i64, i64)> {
    let Some(newest) = covered.iter().map(|c| c.1).max() else {
        return Vec::new();
    };
    let horizon = now + i64::from(ahead) * period;
    let mut at = newest.min(now.div_euclid(period) * period);
    let mut missing = Vec::new();
    while at < horizon {
        if let Some(&(_, end)) = covered.iter().find(|(from, to)| *from <= at && at < *to) {
            at = end;
            continue;
        }
        let next = covered
            .iter()
            .map(|c| c.0)
            .filter(|from| *from > at)
            .min()
            .unwrap_or(i64::MAX);
        let to = next_boundary(at, period).min(next);
        missing.push((at, to));
        at = to;
    }
    missing
}

/// Creates the missing partitions of `table` up to `ahead` periods past
/// now (see [`missing_ranges`]), one transaction each, a few attempts each;
/// one left busy does not stop the others. The caller holds the
/// maintenance lock.
pub(super) async fn create_ahead(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    plan: &PartitionPlan,
    report: &mut MaintainReport,
) -> Result<()> {
    let parts = partitions_of(conn, table).await?;
    let period = period_of(&parts).unwrap_or(plan.period_ms());
    let covered: Vec<(i64, i64)> = parts
        .iter()
        .filter(|p| p.kind != PartitionKind::Default)
        .filter_map(|p| Some((p.from.map_or(i64::MIN, ms_of), p.to_ms()?)))
        .collect();
    if covered.is_empty() {
        return Err(Error::Config(format!(
            "{table} is partitioned but has no range partition: not a layout of `outbox partitions enable`"
        )));
    }
    let now = now_ms(conn).await?;
    for (from, to) in missing_ranges(&covered, now, period, plan.ahead) {
        let waits = lock_waits(plan.lock_timeout, urgent(from, now, period));
        match create_with_retries(conn, schema, table, (from, to), &waits).await? {
            Some(moved) => {
                report.created += 1;
                report.moved_rows += moved;
            }
            None => report.busy += 1,
        }
    }
    Ok(())
}

/// Whether the range from `from` is needed within a period: it covers now
/// or the next period, so that rows of its ids land in the default
/// partition (and must be moved out of it later) as long as it is missing.
fn urgent(from: i64, now: i64, period: i64) -> bool {
    from <= now.saturating_add(period)
}

/// How long each attempt at a partition waits for its table lock: the
/// plan's `lock_timeout` each time; for an urgent one (see [`urgent`]),
/// doubling from it at each attempt (writers then queue behind the attempt
/// that long at most, rather than the maintainer falling behind for good on
/// a table whose claims and writers always hold it).
fn lock_waits(lock_timeout: Duration, urgent: bool) -> Vec<Duration> {
    (0..ATTEMPTS)
        .map(|i| {
            if urgent {
                lock_timeout * 2u32.pow(i)
            } else {
                lock_timeout
            }
        })
        .collect()
}

/// [`create_range`] in a transaction of its own, an attempt per lock wait
/// of `waits` while the tables stay busy; `None` if they did at every
/// attempt.
async fn create_with_retries(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    (from, to): (i64, i64),
    waits: &[Duration],
) -> Result<Option<u64>> {
    for (attempt, lock_timeout) in (1..).zip(waits.iter().copied()) {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        set_lock_timeout(&mut tx, lock_timeout).await?;
        match create_range(&mut tx, schema, table, from, to).await {
            Ok(moved) => {
                tx.commit().await?;
                return Ok(Some(moved));
            }
            Err(error) if is_busy(&error) => {
                tx.rollback().await?;
                tracing::debug!(table, attempt, %error, "partition not created yet: table busy");
                if attempt < waits.len() as u32 {
                    tokio::time::sleep(RETRY_PAUSE * attempt).await;
                }
            }
            Err(error) => return Err(error),
        }
    }
    tracing::warn!(
        table,
        from = %uuid_at(from),
        "partition not created: its table stayed busy; tried again at the next pass \
         (meanwhile its rows go to the default partition)"
    );
    Ok(None)
}

/// Creates the partitions missing ahead of now (up to `plan.ahead` periods)
/// in every partitioned table, as the single maintainer of this outbox
/// (advisory lock); `None` when another maintainer is at work. The period
/// is each table's own (its newest partition's). A partition whose table
/// stays busy is counted ([`MaintainReport::busy`]) and left for the next
/// call.
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
                busy = report.busy,
                "partitions created ahead"
            );
        }
        Ok(report)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_urgent_partition_waits_longer_for_its_lock_at_each_attempt() {
        let period = 10_000;
        // The partition of now, of the next period: urgent; later: not.
        assert!(urgent(0, 5_000, period) && urgent(10_000, 5_000, period));
        assert!(!urgent(20_000, 5_000, period));
        let ms = |waits: Vec<Duration>| waits.iter().map(|d| d.as_millis()).collect::<Vec<_>>();
        assert_eq!(
            ms(lock_waits(Duration::from_millis(500), true)),
            [500, 1000, 2000]
        );
        assert_eq!(
            ms(lock_waits(Duration::from_millis(500), false)),
            [500, 500, 500]
        );
    }

    #[test]
    fn missing_ranges_fill_gaps_from_now_and_catch_up_from_the_newest() {
        let p = 100;
        // Legacy up to 300, ranges 300..400 and 500..600; now 350, 4 ahead:
        // the gap 400..500 and 600..750 (the last one up to the horizon's
        // period).
        let covered = [(i64::MIN, 300), (300, 400), (500, 600)];
        assert_eq!(
            missing_ranges(&covered, 350, p, 4),
            [(400, 500), (600, 700), (700, 800)]
        );
        // Fell behind: the newest ends at 400, now is 650: from 400 on.
        assert_eq!(
            missing_ranges(&[(i64::MIN, 300), (300, 400)], 650, p, 1),
            [(400, 500), (500, 600), (600, 700), (700, 800)]
        );
        // A gap wholly past (a partition dropped by retention, or one not
        // created in time) is left to the default partition.
        assert_eq!(
            missing_ranges(&[(i64::MIN, 100), (300, 400)], 350, p, 1),
            [(400, 500)]
        );
        // Misaligned neighbours: a range stops at the next partition.
        assert_eq!(
            missing_ranges(&[(0, 150), (180, 300)], 100, p, 2),
            [(150, 180)]
        );
        assert!(missing_ranges(&[], 0, p, 3).is_empty());
    }
}
