//! Held rows: work the relay cannot publish for a while, kept out of the
//! claim's index so that no claim walks it.
//!
//! A row is held when its topic is missing on the broker (a topic-level
//! failure never parks a row), when its key is blocked after a failure, or
//! when an earlier row of its key is held. The relay that withholds such a
//! row in a batch sets its `held_until` (the end of the key's or topic's
//! back-off) in that batch's transaction: the row leaves the partial index
//! the claim walks (`ix_outbox_event_unpublished`, which has
//! `held_until IS NULL` in its predicate) and enters two small partial
//! indexes of held rows only. So rows of a blocked topic are each claimed
//! once per back-off, not walked by every claim: a claim's cost depends on
//! its batch, not on how many rows are held.
//!
//! Release: every relay, about once a second, sets `held_until` back to
//! NULL on rows whose hold has ended ([`RELEASE`], in `held_until` order
//! through `ix_outbox_event_held`, a bounded number at a time). Any relay may
//! release any lane's rows: releasing only puts a row back in the claim's
//! index, and the owner of its lane claims it.
//!
//! A missing topic's rows (see [`topics`](super::topics)) are held well
//! past the relay's next lookup; while the broker still lacks it, all its
//! held rows are held longer at once ([`EXTEND`]) before that runs out, so
//! they do not come back into claims a release at a time; once it has it,
//! their holds end at once ([`RELEASE_TOPIC`]).
//!
//! Per-key order: the claim returns, with each row, whether an earlier row
//! of its key is held on its topic (one probe of `ix_outbox_event_held_key`,
//! skipped altogether while nothing is held). Per topic, as Kafka orders a
//! key's messages per topic: a missing topic does not hold back the same
//! keys' events on other topics. Such a row is withheld and held in
//! turn, until the earlier one's hold ends. Held rows are released in
//! `held_until` order; a later row released while an earlier row of its key
//! is still held is held again by the claim that meets it, so a key's rows
//! come back in id order. The relay's in-memory view of blocked keys and
//! topics is not needed for order: a relay that took a lane over, or
//! restarted, finds the holds in the table.
//!
//! Scheduled rows (`UnitOfWork::record_at`): written with `held_until` at
//! their `due_at`, they are held rows until then and released like any
//! other. They are not ordered with their key's rows: the probe leaves
//! rows with a `due_at` out (its gate and its index too), so a scheduled
//! row never holds back its key's later rows, before or after it is due.
//! An idle relay sleeps at most until the next hold ends ([`NEXT_HOLD`],
//! asked by its waker), so that a row goes out within about a release
//! interval of its time, however long the poll interval.

use crate::refusal::{Statement, Trouble};

/// How long [`release`] waits for a lock on the outbox, in milliseconds.
const RELEASE_LOCK_WAIT_MS: u128 = 200;

/// [`HOLD`], as a refusal names it.
pub(crate) const HOLDING: Statement = Statement {
    name: "relay: hold rows back",
    needs: "UPDATE (held_until) ON outbox_event",
};

/// [`RELEASE`].
pub(crate) const RELEASING: Statement = Statement {
    name: "relay: release held rows",
    needs: "UPDATE (held_until) ON outbox_event",
};

/// [`EXTEND`] and [`RELEASE_TOPIC`].
pub(crate) const TOPIC_ROWS: Statement = Statement {
    name: "relay: hold or release a missing topic's rows",
    needs: "UPDATE (held_until) ON outbox_event (and, in the progress mode, \
            SELECT, DELETE ON outbox_held_topic)",
};

/// Holds claimed rows (`$1` ids) for `$2` seconds each, in the claim's
/// transaction.
pub(crate) const HOLD: &str = "\
UPDATE outbox_event o SET held_until = statement_timestamp() + make_interval(secs => h.secs)
FROM UNNEST($1::bigint[], $2::float8[]) AS h(id, secs)
WHERE o.id = h.id";

/// Releases up to `$1` rows whose hold has ended, oldest hold first; rows
/// another relay is releasing right now are skipped.
pub(crate) const RELEASE: &str = "\
UPDATE outbox_event SET held_until = NULL
WHERE id IN (SELECT id FROM outbox_event
             WHERE held_until <= statement_timestamp() AND published_at IS NULL
             ORDER BY held_until, id LIMIT $1
             FOR UPDATE SKIP LOCKED)";

/// Seconds until the earliest hold ends (negative if it has; NULL: no row
/// is held): the first entry of `ix_outbox_event_held`.
pub(crate) const NEXT_HOLD: &str = "\
SELECT EXTRACT(EPOCH FROM held_until - statement_timestamp())::float8 FROM outbox_event
WHERE held_until IS NOT NULL AND published_at IS NULL
ORDER BY held_until, id LIMIT 1";

/// How often a relay releases rows whose hold has ended (sooner while each
/// release finds a full batch).
pub(crate) const RELEASE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Releases up to `limit` rows whose hold has ended; returns how many. The
/// statement runs under the relay's `statement_timeout` (0: none), like its
/// claims: behind a lock held on the table it gives up instead of holding
/// the relay's loop.
///
/// It runs only on a connection the pool has free at once (none: nothing
/// released this round, `None`). The relay may call it while a batch of its holds a
/// connection: waiting for one there could deadlock relays sharing a small
/// pool (each holding a batch's connection, each waiting for another).
pub(crate) async fn release(
    pool: &sqlx::PgPool,
    limit: i64,
    statement_timeout: std::time::Duration,
) -> Result<Option<u64>, Trouble> {
    use sqlx::Connection as _;
    let Some(mut conn) = pool.try_acquire() else {
        return Ok(None);
    };
    let result = async {
        let mut tx = conn.begin().await?;
        // A short lock wait: this runs while the relay's batch in flight
        // holds its claim's row locks. Behind a table lock requested
        // meanwhile (a partition detached, a migration), which itself waits
        // for that claim to end, this statement would wait until the
        // request times out — and the relay with it, its claim open: a
        // cycle PostgreSQL cannot see. Giving up lets the relay go on,
        // finish its batch and free the way; it releases at its next turn.
        let lock_wait = match statement_timeout.as_millis() {
            0 => RELEASE_LOCK_WAIT_MS,
            ms => ms.min(RELEASE_LOCK_WAIT_MS),
        };
        sqlx::query(&format!(
            "SET LOCAL statement_timeout = {}",
            statement_timeout.as_millis(),
        ))
        .execute(&mut *tx)
        .await?;
        sqlx::query(&format!("SET LOCAL lock_timeout = {lock_wait}"))
            .execute(&mut *tx)
            .await?;
        let released = sqlx::query(RELEASE)
            .bind(limit)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok::<_, sqlx::Error>(Some(released))
    }
    .await;
    result.map_err(|e| Trouble::from(e).during(RELEASING))
}

/// Holds every held row of topic `$1` until `$2` seconds from now, those
/// held for less (a missing topic still missing: see
/// [`topics`](super::topics)), through `ix_outbox_event_held_key`.
///
/// Scheduled rows (with a `due_at`) are left alone, here and in
/// [`RELEASE_TOPIC`]: one waiting for its time must not be released early
/// (nor a million of them walked), and one that is due and met the missing
/// topic comes back at the end of the hold the claim gave it.
pub(crate) const EXTEND: &str = "\
UPDATE outbox_event SET held_until = statement_timestamp() + make_interval(secs => $2)
WHERE topic = $1 AND held_until IS NOT NULL AND published_at IS NULL AND due_at IS NULL
  AND held_until < statement_timestamp() + make_interval(secs => $2)";

/// Ends the holds of topic `$1`'s held rows (a missing topic created): one
/// `held_until` for all, so they are released in id order.
pub(crate) const RELEASE_TOPIC: &str = "\
UPDATE outbox_event SET held_until = statement_timestamp()
WHERE topic = $1 AND held_until > statement_timestamp() AND published_at IS NULL
  AND due_at IS NULL";

/// In the progress mode, ends the hold of topic `$1` (a row of
/// `outbox_held_topic`), returning its `since`.
const END_TOPIC_HOLD: &str = "DELETE FROM outbox_held_topic WHERE topic = $1 RETURNING since::text";

/// In the progress mode, gives the rows of topic `$1` that the hold's
/// `since` (`$2`) does not see and that have no state of their own a hold
/// that has ended: the windows passed over them while the topic was held;
/// the held rows' path publishes them now, in id order, each key's later
/// rows behind them. Read over the progress index, from `since`'s `xmin`
/// in every slot.
const RELEASE_PASSED: &str = "\
UPDATE outbox_event SET held_until = statement_timestamp()
WHERE lane_slot = ANY(ARRAY(SELECT generate_series(0, 63))::int2[])
  AND txid >= pg_snapshot_xmin($2::pg_snapshot) AND txid IS NOT NULL AND topic = $1
  AND NOT pg_visible_in_snapshot(txid, $2::pg_snapshot)
  AND num_nulls(published_at, parked_at, held_until) = 3";

/// Holds a topic's held rows longer, or ends their holds ([`EXTEND`],
/// [`RELEASE_TOPIC`]), under the relay's `statement_timeout`; returns how
/// many rows. Rows a claim holds right now are not among them (their hold
/// is cleared): the claim holds them itself.
///
/// In the progress mode (`progress`: the outbox), a release also ends the
/// topic's hold in `outbox_held_topic` and holds the rows the windows
/// passed over until now ([`RELEASE_PASSED`]), in one transaction, under
/// the held topics' lock taken exclusively: every claim that read the hold
/// has let go of it, so this statement's snapshot sees every row a window
/// passed over (see `progress::Skip`). Claims wait for it meanwhile.
pub(crate) async fn topic_rows(
    pool: &sqlx::PgPool,
    action: &super::topics::Action,
    statement_timeout: std::time::Duration,
    progress: Option<crate::scope::OutboxScope>,
) -> Result<u64, Trouble> {
    use super::topics::Action;
    let result = async {
        let mut tx = pool.begin().await?;
        sqlx::query(&format!(
            "SET LOCAL statement_timeout = {}",
            statement_timeout.as_millis()
        ))
        .execute(&mut *tx)
        .await?;
        let mut rows = 0;
        if let (Action::Release { topic }, Some(scope)) = (action, progress) {
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(scope.key(crate::scope::Lock::HeldTopics, 0))
                .execute(&mut *tx)
                .await?;
            let since: Option<String> = sqlx::query_scalar(END_TOPIC_HOLD)
                .bind(topic)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(since) = since {
                rows += sqlx::query(RELEASE_PASSED)
                    .bind(topic)
                    .bind(&since)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                tracing::info!(%topic, rows, "a held topic's events passed over are released");
            }
        }
        let query = match action {
            Action::Extend { topic, secs } => sqlx::query(EXTEND).bind(topic).bind(*secs),
            Action::Release { topic } => sqlx::query(RELEASE_TOPIC).bind(topic),
        };
        rows += query.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok::<_, sqlx::Error>(rows)
    }
    .await;
    result.map_err(|e| Trouble::from(e).during(TOPIC_ROWS))
}

#[cfg(test)]
mod tests {
    use sqlx::{Connection, PgPool};

    use super::super::claim::{CLAIM_ANY, begin, claim};
    use super::super::lanes::Claimable;
    use crate::scope::{Lock, OutboxScope};

    /// 20,000 scheduled rows a week ahead, earlier than 10 claimable rows of
    /// the same keys and topic: the claim returns the 10, none behind a
    /// held row, and its probe for held rows of their keys never runs (its
    /// gate sees no held row that is not scheduled).
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn scheduled_rows_neither_hold_back_nor_cost_the_claim(pool: PgPool) {
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key, due_at, held_until)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k' || (g % 100),
                    CASE WHEN g <= 20000 THEN now() + interval '7 days' END,
                    CASE WHEN g <= 20000 THEN now() + interval '7 days' END
             FROM generate_series(1, 20010) AS g",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
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
        assert!(batch.rows.iter().all(|r| r.behind_held_secs.is_none()));
        drop(batch);

        let mut conn = pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
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
        // The gate reads an empty index; the probe never runs.
        let gate = plan
            .lines()
            .find(|l| l.contains("Index Only Scan using ix_outbox_event_held_key"))
            .unwrap_or_default();
        assert!(gate.contains("rows=0 loops=1"), "{plan}");
        let probe = plan
            .lines()
            .find(|l| l.contains("Index Scan using ix_outbox_event_held_key on outbox_event h"))
            .unwrap_or_default();
        assert!(probe.contains("never executed"), "{plan}");
    }
}
