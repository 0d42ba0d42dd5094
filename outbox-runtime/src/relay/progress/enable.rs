//! Turning the progress mode on: the index the windows are read through,
//! a first position for every slot, and the default mode's indexes of
//! unpublished rows dropped (every row would stay in them).

use super::INDEX;
use crate::error::Result;

/// Enables the progress mode on this outbox (relays stopped):
/// [`switch_on`], then the default mode's indexes of unpublished rows go
/// ([`drop_marks_indexes`]: the drop waits for the transactions open on
/// the table). Calling it again changes nothing but for dropping those
/// indexes if they are still there.
pub async fn enable(pool: &sqlx::PgPool) -> Result<()> {
    switch_on(pool).await?;
    drop_marks_indexes(pool).await
}

/// The mode's switch, without [`drop_marks_indexes`]: the index
/// the windows are read through, and a position for every slot whose `done`
/// leaves out every event not yet published, those of transactions still in
/// flight included. Events published before stay skipped (`published_at`)
/// and parked ones stay parked. In the same transaction, on the first call
/// only: rows written before the `txid` column existed and not published
/// are given this transaction's id, and rows held back are released (the
/// windows read them in id order with the rest), but for scheduled rows
/// still waiting for their time (`held_until = due_at`), read when due by
/// the held rows' path. Calling it again changes nothing. Returns at once
/// whatever transactions are open on the table.
pub async fn switch_on(pool: &sqlx::PgPool) -> Result<()> {
    create_index(pool).await?;
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE outbox_progress IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    let enabled: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_progress)")
        .fetch_one(&mut *tx)
        .await?;
    if enabled {
        return Ok(());
    }
    sqlx::query(
        "UPDATE outbox_event SET txid = coalesce(txid, pg_current_xact_id()),
                                 held_until = CASE WHEN held_until = due_at THEN held_until END
         WHERE (txid IS NULL OR held_until IS NOT NULL) AND published_at IS NULL",
    )
    .execute(&mut *tx)
    .await?;
    // `m:m:` is a snapshot in which exactly the transactions before `m` are
    // visible: `m` is at most the oldest unpublished row's transaction and
    // the oldest transaction in flight now (whose rows this statement
    // cannot see).
    sqlx::query(
        "INSERT INTO outbox_progress (slots, done)
         SELECT ARRAY(SELECT generate_series(0, 63))::int2[], (m || ':' || m || ':')::pg_snapshot
         FROM (SELECT least(pg_snapshot_xmin(pg_current_snapshot()),
                            (SELECT min(txid) FROM outbox_event
                             WHERE published_at IS NULL AND parked_at IS NULL)) AS m) b",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The default mode's indexes of unpublished rows (`published_at IS
/// NULL`, the claim's): in the progress mode no row is marked, so every
/// row would stay in them until retention, each insert writing two index
/// entries nothing reads. No query of the progress mode reads them (the
/// windows go through [`INDEX`]; held and parked rows have indexes of their
/// own).
pub const MARKS_INDEXES: [&str; 2] = [
    "ix_outbox_event_unpublished",
    "ix_outbox_event_unpublished_slot",
];

/// Drops [`MARKS_INDEXES`] (those still there), after the mode is on.
/// On a plain table, `DROP INDEX CONCURRENTLY`: writers go on, the drop
/// waits for the transactions open on the table. On the partitioned layout
/// (where a partitioned index cannot be dropped concurrently), a `DROP
/// INDEX`, which needs the table's exclusive lock: each attempt waits for
/// it at most [`LockPolicy`]'s `lock_timeout`, so writers never queue
/// behind it for longer, and is tried again for up to its `max_wait`. An
/// error leaves the mode on (switched on before); calling [`enable`] again
/// finishes the drop.
///
/// [`LockPolicy`]: outbox_core::LockPolicy
pub async fn drop_marks_indexes(pool: &sqlx::PgPool) -> Result<()> {
    let policy = outbox_core::LockPolicy::default();
    for index in MARKS_INDEXES {
        let kind: Option<String> =
            sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
                .bind(index)
                .fetch_optional(pool)
                .await?
                .flatten();
        let sql = match kind.as_deref() {
            None => continue,
            Some("I") => format!("DROP INDEX IF EXISTS {index}"),
            Some(_) => format!("DROP INDEX CONCURRENTLY IF EXISTS {index}"),
        };
        policy
            .retry(&format!("drop {index}"), || async {
                let mut conn = policy.connect(pool).await?;
                sqlx::query(&sql).execute(&mut conn).await?;
                let _ = sqlx::Connection::close(conn).await;
                Ok(())
            })
            .await?;
    }
    Ok(())
}

/// Builds the index the windows are read through, if it is missing. The
/// build waits for the writers' open transactions, and the writers wait for
/// it (one read of the table).
pub async fn create_index(pool: &sqlx::PgPool) -> Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(INDEX)
        .fetch_one(pool)
        .await?;
    if !exists {
        sqlx::query(&format!(
            "CREATE INDEX IF NOT EXISTS {INDEX} ON outbox_event (lane_slot, txid)
             WHERE txid IS NOT NULL"
        ))
        .execute(pool)
        .await?;
    }
    Ok(())
}
