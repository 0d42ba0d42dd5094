//! The progress mode's round (see [`crate::inbox::progress`]): the next
//! rows of the windows of the partitions this processor locks, their
//! handlers run in segments as the default mode's, and one position per
//! partition appended instead of a mark per row, in one transaction.

use std::collections::HashMap;

use uuid::Uuid;

use super::super::apply::Failure;
use super::super::progress::{self, Listed, Window};
use super::super::txn::GuardedConn;
use super::{CLAIM, Item, LOCK_PARTITIONS, Processor, Round, Row, SETTLE, during};
use crate::refusal::Trouble;

/// A window's rows (`$1` their `ctid`s, `$3` their event ids, of consumer
/// `$2`) still without a state of their own, in received order: a TID
/// scan; [`BY_ID`] finds those that moved since they were listed.
static AT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{COLUMNS} WHERE e.ctid = ANY($1::text[]::tid[]) AND e.consumer = $2
           AND e.event_id = ANY($3) AND {} ORDER BY e.seq",
        progress::NO_STATE
    )
});

/// [`AT`] by event id (`$1`), for rows that moved.
static BY_ID: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{COLUMNS} WHERE e.consumer = $2 AND e.event_id = ANY($1) AND {} ORDER BY e.seq",
        progress::NO_STATE
    )
});

const COLUMNS: &str = r#"
SELECT e.seq, e.event_id, e.topic, e."partition" AS partition,
       COALESCE(e."offset", -1) AS offset, COALESCE(e.partition_key, '') AS partition_key,
       COALESCE(e.event_type, '') AS event_type, e.event_version,
       e.payload::text AS payload, e.headers::text AS headers, e.attempts, false AS unkeyed,
       (octet_length(e.payload::text) + octet_length(e.headers::text)
         + octet_length(COALESCE(e.partition_key, '')))::int8 AS bytes
FROM inbox_event e"#;

/// The keys with rows in the per-key claim's queue (set aside, failed and
/// waiting for a retry, or due): `topic/key` → their first row's `seq`, as
/// one `jsonb` object, over the small index of such rows. A window's row
/// of such a key is set aside behind them. (Not [`super::WAITING`]: it
/// leaves out a key whose first row is due and has not failed, a row set
/// aside behind a failure since dead-lettered, which must still go first.)
const WAITING_KEYS: &str = "
SELECT COALESCE(jsonb_object_agg(k, s), '{}')::text FROM (
    SELECT b.topic || '/' || b.partition_key AS k, min(b.seq) AS s FROM inbox_event b
    WHERE b.consumer = $1 AND NOT b.processed AND b.dead_lettered_at IS NULL
      AND b.next_attempt_at IS NOT NULL
    GROUP BY 1) x";

impl Processor {
    /// One round of the progress mode over `start` (where partitions
    /// without a position start).
    pub(super) async fn window_round(
        &self,
        conn: &mut GuardedConn,
        careful: bool,
        start: &str,
    ) -> Result<Round, Trouble> {
        let group = &self.config.group;
        let limit = self.config.processor_batch_size.max(1);
        let budget = i64::try_from(self.config.max_batch_bytes).unwrap_or(i64::MAX);
        let claim_started = std::time::Instant::now();
        let mut tx = conn
            .begin()
            .await
            .map_err(during(super::super::dedup::TX_GUARD))?;
        let partitions: Vec<String> = sqlx::query_scalar(progress::PARTITIONS)
            .bind(group)
            .bind(self.workers as i64)
            .bind(self.worker as i64)
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        if partitions.is_empty() {
            return Ok(Round::Settled(0));
        }
        let locked: Vec<String> = sqlx::query_scalar(LOCK_PARTITIONS)
            .bind(group)
            .bind(&partitions)
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        if locked.is_empty() {
            return Ok(Round::Settled(0));
        }
        let waiting: String = sqlx::query_scalar(WAITING_KEYS)
            .bind(group)
            .fetch_one(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        let waiting: HashMap<String, i64> = serde_json::from_str(&waiting).unwrap_or_default();
        let mut cache =
            std::mem::take(&mut *self.windows.lock().unwrap_or_else(|p| p.into_inner()));
        // The windows read, the rows to run (and each one's window), the
        // rows set aside because their key waits, and how far each window's
        // listed rows were handed over.
        let mut windows: Vec<Window> = Vec::new();
        let mut handed: Vec<Option<i64>> = Vec::new();
        let mut rows: Vec<Row> = Vec::new();
        let mut owner: Vec<usize> = Vec::new();
        let mut aside: Vec<Uuid> = Vec::new();
        let mut bytes = 0_i64;
        for p in &locked {
            if rows.len() + aside.len() >= limit || bytes >= budget {
                break;
            }
            let Some((topic, partition)) = progress::partition_of(p) else {
                continue;
            };
            let cached = cache.remove(&(topic.clone(), partition));
            let mut window = Window::load(&mut tx, group, start, (&topic, partition), cached)
                .await
                .map_err(|e| Trouble::from(e).during(POSITION))?;
            let listed = window
                .next(&mut tx, group, limit - rows.len() - aside.len())
                .await
                .map_err(|e| Trouble::from(e).during(CLAIM))?;
            let at = windows.len();
            let mut upto = None;
            let fetched = self.fetch(&mut tx, &listed).await?;
            let mut cut = false;
            for row in fetched {
                if bytes >= budget && !(rows.is_empty() && aside.is_empty()) {
                    cut = true;
                    break;
                }
                bytes += row.bytes;
                upto = Some(row.seq);
                let key = format!("{}/{}", row.topic, row.partition_key);
                if waiting.contains_key(&key) {
                    aside.push(row.event_id);
                } else {
                    rows.push(row);
                    owner.push(at);
                }
            }
            // Listed rows not fetched (given a state, or deleted, since)
            // are passed with the rest.
            if !cut && let Some(last) = listed.last() {
                upto = Some(last.0);
            }
            windows.push(window);
            handed.push(upto);
        }
        let moved = windows.iter().any(|w| w.moved);
        if rows.is_empty() && aside.is_empty() && !moved {
            // Nothing stored since: no position to record.
            self.keep(cache, windows);
            return Ok(Round::Settled(0));
        }
        let claim_time = claim_started.elapsed();
        let started = std::time::Instant::now();
        let mut items: Vec<Item> = rows.iter().map(|r| self.item(r)).collect();
        let work = match self
            .segments(&mut tx, &rows, &mut items, careful, false)
            .await
        {
            Ok(work) => work,
            Err(Failure::Outage(error)) => return Err(error),
            Err(Failure::Suspect(error)) if careful => return Err(error.into()),
            Err(Failure::Suspect(error)) => {
                tracing::info!(%error, "a handler broke the transaction: checking event by event");
                return Ok(Round::Suspect);
            }
            // As in the default mode: the round rolls back (no position
            // recorded; the windows are read again from the recorded ones)
            // and the failure is settled alone, giving its row a state.
            Err(Failure::Handler {
                at, handler, error, ..
            }) => {
                drop(tx);
                conn.settle().await;
                self.stats
                    .handler_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.settle_alone(&rows[at], &items[at], handler, &error)
                    .await?;
                return Ok(Round::Settled(1));
            }
            Err(Failure::Rejected { at, rejected }) => {
                drop(tx);
                conn.settle().await;
                self.dead_letter(&rows[at], &rejected, 0).await?;
                super::super::dedup::log_rejected(
                    group,
                    &[(rejected.reason, rejected.error.clone())],
                );
                return Ok(Round::Settled(1));
            }
        };
        // Rows left behind a failure of their key, and those whose key
        // waits, go to the per-key claim.
        aside.extend(
            rows.iter()
                .zip(&work.left)
                .filter(|(_, left)| **left)
                .map(|(r, _)| r.event_id),
        );
        if !aside.is_empty() {
            sqlx::query(progress::SET_ASIDE)
                .bind(group)
                .bind(&aside)
                .execute(&mut *tx)
                .await
                .map_err(during(SETTLE))?;
        }
        // Each window passes its rows up to the first not reached.
        for (i, row) in rows.iter().enumerate().skip(work.reached) {
            let h = &mut handed[owner[i]];
            if h.is_none_or(|h| h >= row.seq) {
                *h = Some(row.seq - 1);
            }
        }
        for (window, upto) in windows.iter_mut().zip(&handed) {
            if let Some(seq) = upto {
                window.pass(*seq);
            }
        }
        let moved: Vec<usize> = (0..windows.len()).filter(|&i| windows[i].moved).collect();
        if !moved.is_empty() {
            let mut topics: Vec<&str> = Vec::new();
            let mut partitions: Vec<i32> = Vec::new();
            let mut dones: Vec<String> = Vec::new();
            let mut uptos: Vec<Option<String>> = Vec::new();
            let mut afters: Vec<Option<i64>> = Vec::new();
            for &i in &moved {
                let (done, upto, after) = windows[i].position();
                topics.push(&windows[i].topic);
                partitions.push(windows[i].partition);
                dones.push(done);
                uptos.push(upto);
                afters.push(after);
            }
            let ids: Vec<i64> = sqlx::query_scalar(progress::RECORD)
                .bind(group)
                .bind(&topics)
                .bind(&partitions)
                .bind(&dones)
                .bind(&uptos)
                .bind(&afters)
                .fetch_all(&mut *tx)
                .await
                .map_err(during(RECORD))?;
            tx.commit().await?;
            for (&i, id) in moved.iter().zip(ids) {
                windows[i].recorded = Some(id);
                windows[i].moved = false;
            }
        } else {
            tx.commit().await?;
        }
        self.keep(cache, windows);
        let set_aside = aside.len();
        let settled = self.committed(work, &rows, started, claim_time, locked.len());
        Ok(Round::Settled(settled + set_aside))
    }

    /// Keeps the windows of a committed round (and those not read) for the
    /// next.
    fn keep(&self, mut cache: HashMap<(String, i32), Window>, windows: Vec<Window>) {
        for w in windows {
            cache.insert((w.topic.clone(), w.partition), w);
        }
        *self.windows.lock().unwrap_or_else(|p| p.into_inner()) = cache;
    }

    /// The listed rows still without a state, in received order.
    async fn fetch(
        &self,
        tx: &mut sqlx::PgConnection,
        listed: &[Listed],
    ) -> Result<Vec<Row>, Trouble> {
        if listed.is_empty() {
            return Ok(Vec::new());
        }
        let tids: Vec<&str> = listed.iter().map(|(_, _, t)| t.as_str()).collect();
        let ids: Vec<Uuid> = listed.iter().map(|(_, id, _)| *id).collect();
        let mut rows: Vec<Row> = sqlx::query_as(&AT)
            .bind(&tids)
            .bind(&self.config.group)
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(during(CLAIM))?;
        if rows.len() < listed.len() {
            let found: std::collections::HashSet<Uuid> = rows.iter().map(|r| r.event_id).collect();
            let moved: Vec<Uuid> = ids.into_iter().filter(|id| !found.contains(id)).collect();
            let more: Vec<Row> = sqlx::query_as(&BY_ID)
                .bind(&moved)
                .bind(&self.config.group)
                .fetch_all(&mut *tx)
                .await
                .map_err(during(CLAIM))?;
            if !more.is_empty() {
                rows.extend(more);
                rows.sort_by_key(|r| r.seq);
            }
        }
        Ok(rows)
    }
}

/// Reading a partition's position.
const POSITION: crate::refusal::Statement = crate::refusal::Statement {
    name: "consumer (inbox): read the processed position",
    needs: "SELECT, INSERT ON inbox_progress",
};

/// Recording the progress mode's positions.
const RECORD: crate::refusal::Statement = crate::refusal::Statement {
    name: "consumer (inbox): record the processed position",
    needs: "SELECT, INSERT ON inbox_progress",
};
