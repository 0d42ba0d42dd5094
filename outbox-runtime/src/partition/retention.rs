//! The partition half of retention: dropping the partitions whose whole
//! range is past the window and that hold no row still needed (see the
//! module docs of [`super`]), and naming the partitions cleaned row by row.

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use super::ahead::create_ahead;
use super::leader::as_leader;
use super::{
    MaintainReport, PartitionKind, TABLES, enabled_plan, ident, is_busy, locate, partitions_of,
    qualified, set_lock_timeout, with_suffix,
};
use crate::error::{Error, Result};

/// What the partition half of a retention pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DropReport {
    /// Partitions dropped.
    pub dropped: u64,
    /// Partitions old enough that were kept: they hold a row still needed
    /// (see the module docs).
    pub kept: u64,
    /// Partitions old enough that were not dropped because their table
    /// stayed locked longer than `lock_timeout` (or a deadlock chose this
    /// pass to give way): dropped at a later pass.
    pub busy: u64,
}

/// What must still be kept in a partition of `table` (rows that the
/// retention `cutoff`, `$1`, does not cover), as `EXISTS` conditions on
/// the partition `p`. The outbox's and the inbox's checks for unfinished
/// rows walk their partial indexes; the outbox's check for rows published
/// within the window reads the partition (it is past the window: no writer
/// waits for it).
fn needed(table: &str, p: &str) -> Option<String> {
    Some(match table {
        "outbox_event" => format!(
            "{} OR EXISTS (SELECT 1 FROM {p} WHERE published_at >= $1)",
            unfinished(table, p)?
        ),
        "processed_event" => format!("EXISTS (SELECT 1 FROM {p} WHERE processed_at >= $1)"),
        "inbox_event" => format!(
            "{} OR EXISTS (SELECT 1 FROM {p} WHERE processed_at >= $1)
             OR EXISTS (SELECT 1 FROM {p} e WHERE e.processed AND e.processed_at IS NULL
                        AND (e.received_at >= $1 OR NOT {passed}))",
            unfinished(table, p)?,
            passed = crate::inbox::progress::passed("e"),
        ),
        _ => return None,
    })
}

/// A parked outbox row that keeps its partition (over the partial index of
/// parked rows; `$1`: the cutoff): any but a scheduled event cancelled
/// before the window (`discard_reason = 'cancelled'`: routine, unlike an
/// operator's drop, which is kept for the record).
const PARKED_KEPT: &str = "parked_at IS NOT NULL AND published_at IS NULL
                     AND (discard_reason IS DISTINCT FROM 'cancelled' OR discarded_at >= $1)";

/// The outbox's and the inbox's unfinished rows (over partial indexes).
fn unfinished(table: &str, p: &str) -> Option<String> {
    Some(match table {
        "outbox_event" => format!(
            "EXISTS (SELECT 1 FROM {p}
                     WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL)
             OR EXISTS (SELECT 1 FROM {p} WHERE held_until IS NOT NULL AND published_at IS NULL)
             OR EXISTS (SELECT 1 FROM {p} WHERE {PARKED_KEPT})"
        ),
        "inbox_event" => format!("EXISTS (SELECT 1 FROM {p} WHERE NOT processed)"),
        _ => return None,
    })
}

/// [`needed`] for the outbox in the progress mode (see
/// [`crate::relay::progress`]), a whole statement: rows are not marked
/// there, so a row without a state of its own is needed while the newest
/// position of its slot does not pass it (a read of the partition: it is
/// past the window, no writer waits for it). Rows published by the rare
/// paths within the window keep it too; those the positions passed are
/// taken as published when they were written (the window counts from
/// their creation).
fn progress_needed(p: &str) -> String {
    format!(
        "WITH RECURSIVE {positions}
SELECT EXISTS (SELECT 1 FROM {p} e
               WHERE num_nulls(e.published_at, e.parked_at, e.held_until) = 3
                 AND NOT EXISTS (SELECT 1 FROM pos WHERE pos.slot = e.lane_slot
                                 AND e.txid IS NOT NULL AND {passed}))
    OR EXISTS (SELECT 1 FROM {p} WHERE held_until IS NOT NULL AND published_at IS NULL)
    OR EXISTS (SELECT 1 FROM {p} WHERE {PARKED_KEPT})
    OR EXISTS (SELECT 1 FROM {p} WHERE published_at >= $1)",
        positions = crate::relay::progress::POSITIONS,
        passed = crate::relay::progress::passed("e"),
    )
}

/// [`written_since`] for the outbox in the progress mode, a whole
/// statement, through indexes only: a row becomes needed by an insert (the
/// BRIN index on `created_at`), a hold or a parking (their partial
/// indexes); no write makes a row the positions passed unpassed (the
/// positions only move on, and the default mode's index of unpublished
/// rows holds every row in this mode: it cannot tell).
fn progress_written_since(p: &str) -> String {
    format!(
        "SELECT EXISTS (SELECT 1 FROM {p} WHERE held_until IS NOT NULL AND published_at IS NULL)
    OR EXISTS (SELECT 1 FROM {p} WHERE {PARKED_KEPT})
    OR EXISTS (SELECT 1 FROM {p} WHERE created_at >= $1)"
    )
}

/// What may have made a partition needed since [`needed`] found nothing
/// in it, checked under the parent's exclusive lock, through indexes only
/// (`$1`: the cutoff): an unfinished row (partial indexes), a row written
/// within the window (the BRIN indexes on `created_at` and
/// `processed_at`). A row can only become needed by a write: an insert
/// (created or processed now), or an update that leaves it unfinished;
/// publishing concerns unpublished rows, which the first check kept.
fn written_since(table: &str, p: &str) -> Option<String> {
    Some(match table {
        "outbox_event" => format!(
            "{} OR EXISTS (SELECT 1 FROM {p} WHERE created_at >= $1)",
            unfinished(table, p)?
        ),
        "processed_event" => format!("EXISTS (SELECT 1 FROM {p} WHERE processed_at >= $1)"),
        "inbox_event" => format!(
            "{} OR EXISTS (SELECT 1 FROM {p} WHERE processed_at >= $1)
             OR EXISTS (SELECT 1 FROM {p} WHERE received_at >= $1)",
            unfinished(table, p)?
        ),
        _ => return None,
    })
}

/// Summarizes the page ranges of the BRIN indexes of partition `p` that
/// are not yet, so that the check under the parent's lock reads only the
/// pages written since. Best effort (the owner's right; a lock wait
/// bounded by `lock_timeout`): without it, the check reads more.
async fn summarize_brin(conn: &mut PgConnection, p: &str, lock_timeout: Duration) {
    let summarized: Result<()> = async {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        set_lock_timeout(&mut tx, lock_timeout).await?;
        sqlx::query(
            "SELECT brin_summarize_new_values(i.indexrelid)
             FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             JOIN pg_am a ON a.oid = c.relam
             WHERE i.indrelid = $1::regclass AND a.amname = 'brin'",
        )
        .bind(p)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
    .await;
    if let Err(error) = summarized {
        tracing::debug!(partition = p, %error, "BRIN summary not brought up to date");
    }
}

/// Drops the partitions of `table` (if partitioned) whose whole range ends
/// at or before `cutoff` and that hold no row still needed (see the module
/// docs). Per partition: the check, holding nothing writers or relays
/// wait for; then one transaction that locks the parent exclusively (its
/// wait bounded by `lock_timeout`), checks through indexes what may have
/// been written since, and detaches the partition; its files are removed
/// after the commit. A partition whose table stayed busy is counted busy
/// and tried again at the next pass. The caller holds the maintenance
/// lock.
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
    let (Some(_), Some(_)) = (needed(table, ""), written_since(table, "")) else {
        return Ok(report);
    };
    // Left by a pass that stopped between the detach and the drop.
    drop_retired(conn, &schema, table).await?;
    let progress = table == "outbox_event"
        && sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM outbox_progress)")
            .fetch_one(&mut *conn)
            .await?;
    let cutoff_ms = cutoff.timestamp_millis();
    for part in partitions_of(conn, table).await? {
        let Some(to_ms) = part.to_ms() else { continue };
        if to_ms > cutoff_ms {
            continue;
        }
        let outcome = match keep_or_detach(
            conn,
            &schema,
            (table, progress),
            &part.name,
            cutoff,
            lock_timeout,
        )
        .await
        {
            Err(error) if is_busy(&error) => {
                report.busy += 1;
                tracing::warn!(table, partition = %part.name, %error, "partition busy: dropped at a later pass");
                continue;
            }
            outcome => outcome?,
        };
        match outcome {
            Some(retired) => {
                drop_table(conn, &schema, &retired).await?;
                report.dropped += 1;
                tracing::info!(table, partition = %part.name, "partition dropped by retention");
            }
            None => {
                report.kept += 1;
                tracing::warn!(
                    table,
                    partition = %part.name,
                    "old partition kept: it holds rows still needed (unpublished, parked, \
                     unprocessed, or younger than the retention by their own timestamp)"
                );
            }
        }
    }
    Ok(report)
}

/// For the rest of the transaction, bitmap scans of indexes only (partial
/// and BRIN), whatever the planner thinks of a partition's statistics.
async fn index_scans_only(conn: &mut PgConnection) -> Result<()> {
    for setting in ["enable_seqscan", "enable_indexscan", "enable_indexonlyscan"] {
        sqlx::query(&format!("SET LOCAL {setting} = off"))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// One partition of [`drop_expired`]: `None` if it holds a row still
/// needed, else the name it was detached under.
async fn keep_or_detach(
    conn: &mut PgConnection,
    schema: &str,
    (table, progress): (&str, bool),
    name: &str,
    cutoff: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    lock_timeout: Duration,
) -> Result<Option<String>> {
    let p = qualified(schema, name);
    // The whole check, as any reader: writers and relays go on.
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    set_lock_timeout(&mut tx, lock_timeout).await?;
    let check = if progress {
        progress_needed(&p)
    } else {
        format!("SELECT {}", needed(table, &p).unwrap_or_default())
    };
    let keep: bool = sqlx::query_scalar(&check)
        .bind(cutoff)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    if keep {
        return Ok(None);
    }
    summarize_brin(conn, &p, lock_timeout).await;

    // The parent first, as writers and relays lock it (then its
    // partitions): whoever holds a partition holds the parent, so the wait
    // here cannot close a cycle with them.
    let retired = with_suffix(name, RETIRED);
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    set_lock_timeout(&mut tx, lock_timeout).await?;
    index_scans_only(&mut tx).await?;
    sqlx::query(&format!(
        "LOCK TABLE ONLY {} IN ACCESS EXCLUSIVE MODE",
        qualified(schema, table)
    ))
    .execute(&mut *tx)
    .await?;
    let check = if progress {
        progress_written_since(&p)
    } else {
        format!("SELECT {}", written_since(table, &p).unwrap_or_default())
    };
    let written: bool = sqlx::query_scalar(&check)
        .bind(cutoff)
        .fetch_one(&mut *tx)
        .await?;
    if written {
        tx.rollback().await?;
        return Ok(None);
    }
    // Detached here, dropped after the commit: removing the files of a
    // large partition takes a while (measured 1.3 s for 10 M rows), which
    // must not happen under the parent's lock, where it would hold every
    // writer up.
    sqlx::query(&format!(
        "ALTER TABLE {} DETACH PARTITION {p}",
        qualified(schema, table)
    ))
    .execute(&mut *tx)
    .await?;
    sqlx::query(&format!("ALTER TABLE {p} RENAME TO {}", ident(&retired)))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(retired))
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

/// As the maintainer when nobody else is: creates the partitions ahead and
/// runs `drop_expired` on every partitioned table, each with the plan
/// [`enable`] recorded on it. A table that stays busy leaves its
/// partitions for the next pass (counted), not the rest of the pass.
pub(crate) async fn retention_pass(
    pool: &PgPool,
    cutoff: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
) -> Result<DropReport> {
    let mut total = DropReport::default();
    let outcome = as_leader(pool, async |conn: &mut PgConnection| {
        let mut ahead = MaintainReport::default();
        for table in TABLES {
            if let Some((schema, true)) = locate(conn, table).await? {
                let plan = enabled_plan(conn, table).await?;
                // A partition not created now is created at the next pass;
                // meanwhile its rows go to the default.
                if let Err(error) = create_ahead(conn, &schema, table, &plan, &mut ahead).await {
                    tracing::warn!(table, %error, "partitions ahead not created: retried at the next pass");
                }
                let r = drop_expired(conn, table, cutoff, plan.lock_timeout).await?;
                total.dropped += r.dropped;
                total.kept += r.kept;
                total.busy += r.busy;
            }
        }
        if ahead.created + ahead.busy > 0 {
            tracing::info!(
                created = ahead.created,
                moved_rows = ahead.moved_rows,
                busy = ahead.busy,
                "partitions created ahead"
            );
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
    use super::super::{PartitionPlan, enable};
    use super::*;

    /// The check under the parent's exclusive lock reads indexes only
    /// (partial and BRIN), whatever the partition's size or statistics.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn the_check_under_the_parents_lock_reads_no_whole_partition(pool: PgPool) {
        enable(&pool, &PartitionPlan::default()).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key, published_at, created_at)
             SELECT ('0' || lpad(to_hex(g), 11, '0') || '-7000-8000-000000000000')::uuid,
                    'a', 'k', 'e', '{}', 't', 'k', now() - interval '40 days',
                    now() - interval '40 days'
             FROM generate_series(1, 5000) g",
        )
        .execute(&pool)
        .await
        .unwrap();
        let cutoff: sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc> =
            sqlx::query_scalar("SELECT now() - interval '30 days'")
                .fetch_one(&pool)
                .await
                .unwrap();
        for (table, analyze) in [
            ("outbox_event", true),
            ("processed_event", false),
            ("inbox_event", false),
        ] {
            if analyze {
                sqlx::query(&format!("ANALYZE {table}"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            let p = format!("{table}_legacy");
            let mut conn = pool.acquire().await.unwrap();
            summarize_brin(&mut conn, &p, Duration::from_secs(2)).await;
            let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
            index_scans_only(&mut tx).await.unwrap();
            let plan: Vec<String> = sqlx::query_scalar(&format!(
                "EXPLAIN SELECT {}",
                written_since(table, &p).unwrap()
            ))
            .bind(cutoff)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
            let plan = plan.join("\n");
            assert!(!plan.contains("Seq Scan"), "{table}:\n{plan}");
            assert!(plan.contains("Bitmap Index Scan"), "{table}:\n{plan}");
        }
    }
}
