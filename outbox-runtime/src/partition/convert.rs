//! The conversion to the partitioned layout ([`enable`]), which is also the
//! migration path of an installation holding rows: each table is renamed
//! `<table>_legacy` and attached, as it is, as the first partition of a new
//! partitioned parent of the same columns; its indexes, checks, triggers,
//! privileges and sequences are carried over generically (read from the
//! catalog), so that indexes added by later migrations come along too.

use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row as _};

use std::time::Instant;

use super::ahead::create_range;
use super::leader::as_leader;
use super::{
    KEY, PartitionPlan, TABLES, ident, locate, next_boundary, now_ms, qualified, record_plan,
    set_lock_timeout, storage_clause, uuid_at, with_suffix,
};
use crate::error::{Error, Result};
use crate::relay::lanes::SCOPE_LOCKS;
use crate::scope::{Lock, OutboxScope};

/// What [`enable`] did.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct EnableReport {
    /// Tables converted by this call.
    pub converted: Vec<String>,
    /// Tables that were already partitioned.
    pub already: Vec<String>,
    /// Rows moved out of the legacy partitions (ids at or past the first
    /// boundary: not UUIDv7, or from a clock ahead).
    pub moved_rows: u64,
    /// Partitions created (periods, default).
    pub created: u64,
    /// Per table converted, how long it was held exclusively (writers and
    /// readers waiting), in milliseconds.
    pub exclusive_ms: Vec<(String, u64)>,
}

/// Converts the tables of [`TABLES`] not yet partitioned to the partitioned
/// layout (see the module docs); the tables already partitioned are left
/// as they are. `plan.ahead` and `plan.lock_timeout` are recorded on every
/// partitioned table, for the cleanup jobs' maintenance. Refused while a
/// relay or a cleanup job of this outbox runs (they find the outbox by its
/// table's oid, which changes: restart them afterwards); writers in the
/// middle of a transaction are no relay (they hold the wake-up trigger's
/// probe lock, shared): the conversion waits for them. Consumers may keep
/// running: their statements wait for the conversion's locks.
///
/// Per table: a unique index with the partition key is built beforehand
/// without blocking writers when the primary key lacks it (the outbox's);
/// then, in one transaction holding the table exclusively, the table is
/// renamed `<table>_legacy`, its indexes (whatever their number), checks,
/// triggers, privileges and sequences are carried over to a new partitioned
/// parent of the same columns, and the old table becomes its first
/// partition. No row is copied, except the few whose ids lie past the first
/// boundary (they move to their partition, found through an index on the
/// partition key: the time under the lock does not grow with the table but
/// for the legacy range's validation, one sequential read).
pub async fn enable(pool: &PgPool, plan: &PartitionPlan) -> Result<EnableReport> {
    plan.validate()?;
    let mut report = EnableReport::default();
    let mut conn = pool.acquire().await?;
    let scope = OutboxScope::of(&mut *conn).await?;
    // This database's locks of this outbox, but the writers' probe of the
    // wake-up lock (shared, for the length of their transaction).
    let busy: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM pg_locks
         WHERE {SCOPE_LOCKS} AND pid <> pg_backend_pid()
           AND NOT (objid::int8 = $2 AND mode = 'ShareLock')"
    ))
    .bind(i64::from(scope.oid()))
    .bind(OutboxScope::objid(Lock::Wake))
    .fetch_one(&mut *conn)
    .await?;
    if busy > 0 {
        return Err(Error::Config(
            "relays or cleanup jobs of this outbox are running: stop them before `outbox \
             partitions enable` (they find the outbox by its table, which is replaced), and \
             start them again afterwards"
                .into(),
        ));
    }
    drop(conn);
    let leader = as_leader(pool, async |conn: &mut PgConnection| {
        for table in TABLES {
            match locate(conn, table).await? {
                None => {
                    return Err(Error::Config(format!(
                        "no `{table}` table in the connection's search_path: run `outbox migrate` first"
                    )));
                }
                Some((schema, true)) => {
                    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                    set_lock_timeout(&mut tx, plan.lock_timeout).await?;
                    record_plan(&mut tx, &schema, table, plan, false).await?;
                    tx.commit().await?;
                    report.already.push(table.to_owned());
                }
                Some((schema, false)) => {
                    convert(conn, &schema, table, plan, &mut report).await?;
                    report.converted.push(table.to_owned());
                }
            }
        }
        Ok(())
    })
    .await?;
    if leader.is_none() {
        return Err(Error::Config(
            "another partition maintenance of this outbox is running; try again".into(),
        ));
    }
    Ok(report)
}

/// One index of the table being converted.
struct IndexDef {
    name: String,
    definition: String,
    constraint: Option<(String, String)>,
    primary: bool,
    columns: Vec<String>,
    /// A valid B-tree over plain columns and every row (no predicate): its
    /// first column's ranges can be read through it.
    ordered: bool,
}

async fn convert(
    conn: &mut PgConnection,
    schema: &str,
    table: &str,
    plan: &PartitionPlan,
    report: &mut EnableReport,
) -> Result<()> {
    let old = qualified(schema, table);
    let legacy_name = format!("{table}_legacy");
    let legacy = qualified(schema, &legacy_name);
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&legacy)
        .fetch_one(&mut *conn)
        .await?;
    if exists {
        return Err(Error::Config(format!(
            "{legacy_name} already exists: rename or drop it before converting {table}"
        )));
    }
    let indexes = index_defs(conn, &old).await?;
    let Some(pk) = indexes.iter().find(|i| i.primary) else {
        return Err(Error::Config(format!("{table} has no primary key")));
    };
    // A unique index with the partition key, built first without blocking
    // writers: it becomes the legacy partition's primary key.
    let new_pk: Vec<String> = if pk.columns.iter().any(|c| c == KEY) {
        pk.columns.clone()
    } else {
        let mut cols = pk.columns.clone();
        cols.push(KEY.into());
        cols
    };
    let pk_index = with_suffix(&format!("{table}_pkey"), "_part");
    let column_list = new_pk
        .iter()
        .map(|c| ident(c))
        .collect::<Vec<_>>()
        .join(", ");
    if new_pk != pk.columns {
        sqlx::query(&format!(
            "DROP INDEX CONCURRENTLY IF EXISTS {}",
            qualified(schema, &pk_index)
        ))
        .execute(&mut *conn)
        .await?;
        sqlx::query(&format!(
            "CREATE UNIQUE INDEX CONCURRENTLY {} ON {old} ({column_list})",
            ident(&pk_index)
        ))
        .execute(&mut *conn)
        .await?;
    }

    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    set_lock_timeout(&mut tx, plan.lock_timeout).await?;
    sqlx::query(&format!("LOCK TABLE {old} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *tx)
        .await
        .map_err(|e| match e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03") => {
                Error::Config(format!(
                    "{table} stayed busy longer than the lock timeout ({} ms): nothing changed in \
                     it; run the command again (the tables already converted stay so), at a \
                     quieter time or with a longer --lock-timeout-ms",
                    plan.lock_timeout.as_millis()
                ))
            }
            e => e.into(),
        })?;
    let locked = Instant::now();
    // Read again under the lock: the definitions carried over (the index
    // built above becomes the legacy's primary key, not one of them).
    let indexes: Vec<IndexDef> = index_defs(&mut tx, &old)
        .await?
        .into_iter()
        .filter(|i| i.name != pk_index)
        .collect();
    let triggers: Vec<(String, String)> = sqlx::query_as(
        "SELECT tgname::text, pg_get_triggerdef(oid) FROM pg_trigger
         WHERE tgrelid = $1::regclass AND NOT tgisinternal",
    )
    .bind(&old)
    .fetch_all(&mut *tx)
    .await?;
    let grants: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT a.privilege_type,
                CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                a.is_grantable
         FROM pg_class c, aclexplode(c.relacl) a
         WHERE c.oid = $1::regclass AND a.grantee <> c.relowner",
    )
    .bind(&old)
    .fetch_all(&mut *tx)
    .await?;
    let column_grants: Vec<(String, String, String, bool)> = sqlx::query_as(
        "SELECT a.privilege_type, quote_ident(t.attname::text),
                CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                a.is_grantable
         FROM pg_attribute t, aclexplode(t.attacl) a
         WHERE t.attrelid = $1::regclass AND t.attacl IS NOT NULL AND NOT t.attisdropped",
    )
    .bind(&old)
    .fetch_all(&mut *tx)
    .await?;
    // Identity columns become sequence defaults (no identity on a
    // partitioned table); each sequence goes on past the last value given.
    let identities: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT attname::text, pg_get_serial_sequence($1, attname)
         FROM pg_attribute WHERE attrelid = $1::regclass AND attidentity <> '' AND NOT attisdropped",
    )
    .bind(&old)
    .fetch_all(&mut *tx)
    .await?;
    let mut sequences = Vec::new();
    for (column, sequence) in &identities {
        let next: i64 =
            match sequence {
                Some(seq) => sqlx::query_scalar(&format!(
                    "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM {seq}"
                ))
                .fetch_one(&mut *tx)
                .await?,
                None => 1,
            };
        sequences.push((column.clone(), next));
    }

    let boundary = next_boundary(now_ms(&mut tx).await?, plan.period_ms());
    let first = uuid_at(boundary);

    // Rows past the boundary (ids that are not UUIDv7, or from a clock
    // ahead) cannot stay in the legacy range: set aside, put back through
    // the parent at the end.
    let filter = set_aside_filter(&indexes, pk, &old);
    let moved = sqlx::query(&format!(
        "CREATE TEMP TABLE outbox_partition_set_aside ON COMMIT DROP AS
         WITH d AS (DELETE FROM {old} WHERE {filter} RETURNING *) SELECT * FROM d"
    ))
    .bind(first)
    .execute(&mut *tx)
    .await?
    .rows_affected();

    let mut statements = vec![format!(
        "ALTER TABLE {old} RENAME TO {}",
        ident(&legacy_name)
    )];
    // Free the names of the indexes and constraints for the parent's own.
    for index in &indexes {
        if index.primary && new_pk != pk.columns {
            statements.push(format!(
                "ALTER TABLE {legacy} DROP CONSTRAINT {}",
                ident(index.constraint.as_ref().map_or(&index.name, |c| &c.0))
            ));
        } else if let Some((constraint, _)) = &index.constraint {
            statements.push(format!(
                "ALTER TABLE {legacy} RENAME CONSTRAINT {} TO {}",
                ident(constraint),
                ident(&with_suffix(constraint, "_legacy"))
            ));
        } else {
            statements.push(format!(
                "ALTER INDEX {} RENAME TO {}",
                qualified(schema, &index.name),
                ident(&with_suffix(&index.name, "_legacy"))
            ));
        }
    }
    let pk_name = pk
        .constraint
        .as_ref()
        .map_or(format!("{table}_pkey"), |c| c.0.clone());
    if new_pk != pk.columns {
        statements.push(format!(
            "ALTER TABLE {legacy} ADD CONSTRAINT {} PRIMARY KEY USING INDEX {}",
            ident(&with_suffix(&pk_name, "_legacy")),
            ident(&pk_index)
        ));
    }
    for (column, _) in &identities {
        statements.push(format!(
            "ALTER TABLE {legacy} ALTER COLUMN {} DROP IDENTITY",
            ident(column)
        ));
    }
    for (name, _) in &triggers {
        statements.push(format!("DROP TRIGGER {} ON {legacy}", ident(name)));
    }
    statements.push(format!(
        "CREATE TABLE {old} (LIKE {legacy} INCLUDING DEFAULTS INCLUDING CONSTRAINTS \
         INCLUDING GENERATED INCLUDING STORAGE INCLUDING COMMENTS) PARTITION BY RANGE ({KEY})"
    ));
    for (column, next) in &sequences {
        let seq = qualified(schema, &with_suffix(&format!("{table}_{column}"), "_seq"));
        statements.push(format!(
            "CREATE SEQUENCE {seq} START WITH {next} OWNED BY {old}.{}",
            ident(column)
        ));
        statements.push(format!(
            "ALTER TABLE {old} ALTER COLUMN {} SET DEFAULT nextval('{}'::regclass)",
            ident(column),
            seq.replace('\'', "''")
        ));
        for (privilege, grantee, _) in &grants {
            if privilege == "INSERT" {
                statements.push(format!("GRANT USAGE ON SEQUENCE {seq} TO {grantee}"));
            }
        }
    }
    statements.push(format!(
        "ALTER TABLE {old} ADD CONSTRAINT {} PRIMARY KEY ({column_list})",
        ident(&pk_name)
    ));
    for index in indexes.iter().filter(|i| !i.primary) {
        match &index.constraint {
            Some((name, definition)) => statements.push(format!(
                "ALTER TABLE {old} ADD CONSTRAINT {} {definition}",
                ident(name)
            )),
            None => statements.push(index.definition.clone()),
        }
    }
    for (_, definition) in &triggers {
        statements.push(definition.clone());
    }
    for (privilege, grantee, grantable) in &grants {
        statements.push(format!(
            "GRANT {privilege} ON {old} TO {grantee}{}",
            if *grantable { " WITH GRANT OPTION" } else { "" }
        ));
    }
    for (privilege, column, grantee, grantable) in &column_grants {
        statements.push(format!(
            "GRANT {privilege} ({column}) ON {old} TO {grantee}{}",
            if *grantable { " WITH GRANT OPTION" } else { "" }
        ));
    }
    // The range check, validated under the lock: ATTACH then needs no scan.
    statements.push(format!(
        "ALTER TABLE {legacy} ADD CONSTRAINT {} CHECK ({KEY} < '{first}')",
        ident(&with_suffix(&legacy_name, "_range"))
    ));
    statements.push(format!(
        "ALTER TABLE {old} ATTACH PARTITION {legacy} FOR VALUES FROM (MINVALUE) TO ('{first}')"
    ));
    for statement in &statements {
        sqlx::query(statement)
            .execute(&mut *tx)
            .await
            .map_err(|e| {
                Error::Config(format!(
                    "converting {table} failed (nothing changed) at `{statement}`: {e}"
                ))
            })?;
    }
    let storage = storage_clause(&mut tx, &legacy).await?;
    sqlx::query(&format!(
        "CREATE TABLE {} PARTITION OF {old} DEFAULT{storage}",
        qualified(schema, &format!("{table}_default"))
    ))
    .execute(&mut *tx)
    .await?;
    report.created += 1;
    let mut hi = boundary;
    for _ in 0..plan.ahead {
        let to = next_boundary(hi, plan.period_ms());
        create_range(&mut tx, schema, table, hi, to).await?;
        report.created += 1;
        hi = to;
    }
    if moved > 0 {
        let columns = super::stored_columns(&mut tx, &old).await?;
        sqlx::query(&format!(
            "INSERT INTO {old} ({columns}) SELECT {columns} FROM outbox_partition_set_aside"
        ))
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query("DROP TABLE outbox_partition_set_aside")
        .execute(&mut *tx)
        .await?;
    record_plan(&mut tx, schema, table, plan, true).await?;
    tx.commit().await?;
    let exclusive_ms = locked.elapsed().as_millis() as u64;
    report.exclusive_ms.push((table.to_owned(), exclusive_ms));
    report.moved_rows += moved;
    tracing::info!(
        table,
        moved_rows = moved,
        exclusive_ms,
        "table converted to the partitioned layout"
    );
    Ok(())
}

/// The condition selecting the rows of `old` whose ids lie at or past the
/// first boundary (`$1`), read through an index so that the time it takes
/// under the conversion's lock grows with the rows selected, not with the
/// table: a range of a B-tree led by the partition key (the outbox's
/// `UNIQUE (event_id)`); else, when the key comes second in the primary
/// key (`(consumer, event_id)`), one range per value of its first column,
/// found by a skip scan (a few consumers); else a sequential read.
fn set_aside_filter(indexes: &[IndexDef], pk: &IndexDef, old: &str) -> String {
    if indexes
        .iter()
        .any(|i| i.ordered && i.columns.first().is_some_and(|c| c == KEY))
    {
        return format!("{KEY} >= $1");
    }
    match pk.columns.as_slice() {
        [prefix, second, ..] if second == KEY && pk.ordered => format!(
            "{p} = ANY(ARRAY(
                WITH RECURSIVE v AS (
                    (SELECT {p} FROM {old} ORDER BY {p} LIMIT 1)
                    UNION ALL
                    SELECT (SELECT {p} FROM {old} WHERE {p} > v.{p} ORDER BY {p} LIMIT 1)
                    FROM v WHERE v.{p} IS NOT NULL)
                SELECT {p} FROM v WHERE {p} IS NOT NULL)) AND {KEY} >= $1",
            p = ident(prefix)
        ),
        _ => format!("{KEY} >= $1"),
    }
}

async fn index_defs(conn: &mut PgConnection, table: &str) -> Result<Vec<IndexDef>> {
    let rows = sqlx::query(
        "SELECT c.relname::text AS name, pg_get_indexdef(i.indexrelid) AS definition,
                con.conname::text AS constraint_name,
                pg_get_constraintdef(con.oid) AS constraint_def,
                i.indisprimary AS is_primary,
                (a.amname = 'btree' AND i.indisvalid AND i.indpred IS NULL
                 AND i.indexprs IS NULL) AS ordered,
                ARRAY(SELECT a.attname::text
                      FROM unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, ord)
                      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                      ORDER BY k.ord) AS columns
         FROM pg_index i
         JOIN pg_class c ON c.oid = i.indexrelid
         JOIN pg_am a ON a.oid = c.relam
         LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
         WHERE i.indrelid = $1::regclass
         ORDER BY c.relname",
    )
    .bind(table)
    .fetch_all(&mut *conn)
    .await?;
    let mut defs = Vec::with_capacity(rows.len());
    for row in rows {
        let constraint: Option<String> = row.try_get("constraint_name")?;
        let constraint_def: Option<String> = row.try_get("constraint_def")?;
        defs.push(IndexDef {
            name: row.try_get("name")?,
            definition: row.try_get("definition")?,
            constraint: constraint.zip(constraint_def),
            primary: row.try_get("is_primary")?,
            columns: row.try_get("columns")?,
            ordered: row.try_get("ordered")?,
        });
    }
    Ok(defs)
}

#[cfg(test)]
mod tests {
    use sqlx::PgPool;

    use super::*;

    /// The rows past the boundary are found through an index, by work that
    /// grows with the rows found and the consumers, not with the table: no
    /// step of the plan runs once per row (a walk over the primary key did,
    /// under the conversion's exclusive lock).
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn rows_past_the_boundary_are_found_without_a_walk_over_the_table(pool: PgPool) {
        // 20,000 rows per table, 3 consumers; one id in a hundred random.
        let id = "CASE WHEN g % 100 = 0 THEN gen_random_uuid()
                       ELSE ('0' || lpad(to_hex(g), 11, '0') || '-7000-8000-000000000000')::uuid END";
        for sql in [
            format!(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                           payload, topic, partition_key)
                 SELECT {id}, 'a', 'k', 'e', '{{}}', 't', 'k' FROM generate_series(1, 20000) g"
            ),
            format!(
                "INSERT INTO processed_event (consumer, event_id)
                 SELECT 'c' || g % 3, {id} FROM generate_series(1, 20000) g"
            ),
            format!(
                "INSERT INTO inbox_event (consumer, event_id, payload)
                 SELECT 'c' || g % 3, {id}, '{{}}' FROM generate_series(1, 20000) g"
            ),
        ] {
            sqlx::query(&sql).execute(&pool).await.unwrap();
        }
        let mut conn = pool.acquire().await.unwrap();
        let boundary = uuid_at(now_ms(&mut conn).await.unwrap() + 86_400_000);
        for table in TABLES {
            sqlx::query(&format!("ANALYZE {table}"))
                .execute(&mut *conn)
                .await
                .unwrap();
            let indexes = index_defs(&mut conn, table).await.unwrap();
            let pk = indexes.iter().find(|i| i.primary).unwrap();
            let filter = set_aside_filter(&indexes, pk, table);
            let plan: Vec<String> = sqlx::query_scalar(&format!(
                "EXPLAIN (ANALYZE, TIMING OFF) SELECT count(*) FROM {table} WHERE {filter}"
            ))
            .bind(boundary)
            .fetch_all(&mut *conn)
            .await
            .unwrap();
            let plan = plan.join("\n");
            let loops = plan
                .split("loops=")
                .skip(1)
                .filter_map(|s| s.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
                .max()
                .unwrap_or(0_u64);
            assert!(loops <= 10, "{table}: a step runs {loops} times:\n{plan}");
            assert!(!plan.contains("Seq Scan"), "{table}:\n{plan}");
        }
    }
}
