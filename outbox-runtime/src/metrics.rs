//! Metrics of the relay and the consumers, through the [`metrics`] facade
//! (any recorder the application installs receives them), and — with the
//! `prometheus` feature (default) — a Prometheus exporter: [`serve`]
//! installs the recorder and answers scrapes on the exporter's own HTTP
//! listener.
//!
//! No metric is touched per event: the relay and the consumers keep their
//! atomic counters ([`RelayCounts`], [`ConsumerCounts`]); a task per relay
//! or consumer copies their increments into the metrics every second, the
//! relay's task samples the outbox's backlog every 5 seconds (one query on
//! the partial indexes, see `BACKLOG`; in the progress mode also each
//! lane's lag, see `ops/lag.rs`), a consumer's its dead letters (an
//! index-only count, see `DEAD_LETTERS`). Latencies are recorded once per
//! batch (a consumer sums its handlers' time over the batch and records the
//! mean).
//!
//! The Grafana dashboard `deploy/grafana/outbox-dashboard.json` and the
//! Prometheus alert rules `deploy/prometheus/outbox-alerts.yml` use these
//! series (a test checks every name and label they use against a scrape).
//!
//! | metric | type | labels | meaning |
//! |---|---|---|---|
//! | `outbox_relay_published_total` | counter | | events published (acknowledged, marked) |
//! | `outbox_relay_failed_total` | counter | | failed delivery attempts |
//! | `outbox_relay_parked_total` | counter | | events parked |
//! | `outbox_relay_batches_total` | counter | | batches processed |
//! | `outbox_relay_batch_duration_seconds` | histogram | | a batch, from handing it to the producer to the last acknowledgement |
//! | `outbox_relay_up` | gauge | | relays running in this process (1 while its relay runs, 0 once it stopped) |
//! | `outbox_relay_consecutive_failures` | gauge | | failed rounds in a row: batches with failed deliveries and none delivered, claims or marks the database refused; 0 once a batch delivers or nothing is left to publish |
//! | `outbox_relay_refused` | gauge | | 1 while the database refuses a statement of the relay that retrying cannot cure (a missing privilege, table or column: see `RelayHealth::Refused`), else 0 |
//! | `outbox_relay_lanes_owned` | gauge | | lanes this relay claims from |
//! | `outbox_backlog_events` | gauge | | unpublished, not parked events (scheduled ones waiting for their time excluded) |
//! | `outbox_held_events` | gauge | | of those, events held back for a while (a missing topic, a failing key) |
//! | `outbox_oldest_unpublished_seconds` | gauge | | age of the oldest of them (0 when none) |
//! | `outbox_parked_events` | gauge | | parked events (dropped ones excluded) |
//! | `outbox_scheduled` | gauge | | scheduled events waiting for their time, not in the backlog (exact up to 10,000; 10,001: more) |
//! | `outbox_scheduled_overdue_seconds` | gauge | | how long ago the earliest of them was due (0 when none is overdue; growing: no relay releases them) |
//! | `outbox_lane_backlog_events` | gauge | `lane`, `lanes` | progress mode: events of the lane (`lane` of `lanes` lanes) its position has not passed, held and parked ones excluded (exact up to 1,000; 1,001: more) |
//! | `outbox_lane_oldest_unpublished_seconds` | gauge | `lane`, `lanes` | progress mode: age of the oldest of them (0 when none) |
//! | `outbox_progress_blocking_transaction_seconds` | gauge | | progress mode: age of the oldest transaction still open in the lanes' newest snapshots, which holds their windows back (0 when none; counted from the first sample that saw it when the relay's role may not see its start) |
//! | `outbox_consumer_received_total` | counter | `group` | messages received from Kafka |
//! | `outbox_consumer_processed_total` | counter | `group` | events whose handlers ran and committed |
//! | `outbox_consumer_duplicates_total` | counter | `group` | dedup hits: events skipped as already applied |
//! | `outbox_consumer_dead_lettered_total` | counter | `group` | messages and events dead-lettered |
//! | `outbox_consumer_handler_failures_total` | counter | `group` | failed handler attempts |
//! | `outbox_consumer_batch_duration_seconds` | histogram | `group` | one batch transaction (dedup mode: received messages; inbox mode: a processor's claimed rows) |
//! | `outbox_consumer_handler_seconds` | histogram | `group` | mean handler time per event, one sample per batch |
//! | `outbox_consumer_lag` | gauge | `group`, `topic`, `partition` | messages between the committed offset and the end of the partition (librdkafka statistics) |
//! | `outbox_consumer_up` | gauge | `group` | 1 while the consumer runs, 0 once it stopped or failed |
//! | `outbox_consumer_stalled` | gauge | `group` | 1 while the consumer receives nothing although there are messages to read (for longer than its stall timeout), else 0 |
//! | `outbox_consumer_rejoins_total` | counter | `group` | times the consumer rejoined its group after owning no partition, or none with messages left, while the group's offsets stood still with messages to read |
//! | `outbox_consumer_gaps_rechecked_total` | counter | `group` | times a message arrived past its partition's expected offset and the consumer read the partition again from there (a broker that showed an offset before its record, or a transaction marker or compacted record: see `ConsumerConfig::recheck_offset_gaps`) |
//! | `outbox_consumer_refused` | gauge | `group` | 1 while the database refuses one of the consumer's own statements that retrying cannot cure (see `ConsumerHealth::Refused`), else 0 |
//! | `outbox_dead_letters` | gauge | `group` | the group's dead letters awaiting an operator (status `dead`), sampled every 5 s |
//! | `outbox_replayed_total` | counter | | events sent again by `replay` |
//! | `outbox_saga_steps_total` | counter | `saga` | saga steps applied (state written back), in this process |
//! | `outbox_saga_started_total` | counter | `saga` | instances created by a start message |
//! | `outbox_saga_conflicts_total` | counter | `saga` | steps that failed on a conflict with another transaction (deadlock, serialization failure, lock not available): retried with the back-off |
//! | `outbox_sagas_stuck` | gauge | `saga` | running instances of the consumer's sagas without a step for longer than `ConsumerConfig::saga_stuck_after` and no timeout still to come (exact up to 10,000; 10,001: more), sampled every 5 s |
//! | `outbox_saga_ignored_total` | counter | `saga`, `reason` | messages that changed nothing: `missing` (no instance), `completed`, `other_stage`, `stale_timeout` |

use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{Counter, Histogram, counter, gauge, histogram};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::backoff::Health;
use crate::inbox::{ConsumerCounts, ConsumerHealth, ConsumerStats};
use crate::refusal::{Statement, Trouble};
use crate::relay::{RelayCounts, RelayHealth, RelayStats};

/// The relay's backlog sample, as a refusal names it.
const BACKLOG_SAMPLE: Statement = Statement {
    name: "relay: sample the backlog (metrics)",
    needs: "SELECT ON outbox_event",
};

/// A consumer's dead-letter sample.
const DEAD_LETTER_SAMPLE: Statement = Statement {
    name: "consumer: count dead letters (metrics)",
    needs: "SELECT ON dead_letter",
};

/// The stuck sagas' sample.
const STUCK_SAGA_SAMPLE: Statement = Statement {
    name: "consumer: count stuck saga instances (metrics)",
    needs: "SELECT ON outbox_saga, SELECT (event_id, due_at) ON outbox_event",
};

/// A sample's health: a refusal is reported (once, and in the process's
/// health), anything else only logged at debug level (the next sample
/// tries again).
fn sample_health<T>(
    health: &mut Health,
    result: Result<T, sqlx::Error>,
    statement: Statement,
) -> Option<T> {
    match result {
        Ok(value) => {
            health.up();
            Some(value)
        }
        Err(error) => {
            match Trouble::from(&error).during(statement) {
                refused @ Trouble::Refused(_) => {
                    health.down(refused);
                }
                Trouble::Outage(error) => tracing::debug!(%error, "{} failed", statement.name),
            }
            None
        }
    }
}

/// How often counters are copied into the metrics.
const COPY_INTERVAL: Duration = Duration::from_secs(1);

/// How often the relay samples the outbox's backlog.
pub const BACKLOG_INTERVAL: Duration = Duration::from_secs(5);

/// The backlog gauges, each over a partial index (the claim's queue, held
/// rows, parked rows), each reading at most 10,001 of its rows: exact up to
/// 10,000 rows of a kind, estimated beyond as `ops::status` estimates them
/// (the queue from the span of its ids and the density of the ids read;
/// held and parked rows from their index's entries at the last analyze,
/// parked ones less the dropped share of the rows read), so that a sample
/// costs about the same whatever the backlog. The oldest row of the queue
/// is its index's first entry (the lowest id: rows are numbered as they
/// are written, so that is the oldest but for transactions that stayed
/// open around it).
pub(crate) const BACKLOG: &str = "\
WITH q AS (SELECT count(*) AS n, min(id) AS first, max(id) AS upto
           FROM (SELECT id FROM outbox_event
                 WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
                 ORDER BY id LIMIT 10001) s),
     h AS (SELECT count(*) AS n, min(id) AS first
           FROM (SELECT id FROM outbox_event
                 WHERE held_until IS NOT NULL AND published_at IS NULL
                   AND held_until IS DISTINCT FROM due_at
                 ORDER BY held_until, id LIMIT 10001) s),
     p AS (SELECT count(*) AS n, count(*) FILTER (WHERE discarded_at IS NULL) AS kept
           FROM (SELECT discarded_at FROM outbox_event
                 WHERE parked_at IS NOT NULL AND published_at IS NULL
                 ORDER BY id LIMIT 10001) s),
     e AS (SELECT
             CASE WHEN q.n <= 10000 THEN q.n
                  ELSE greatest(q.n, round(q.n::float8 * (
                      (SELECT id FROM outbox_event
                       WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
                       ORDER BY id DESC LIMIT 1) - q.first + 1) / (q.upto - q.first + 1))::int8)
             END AS queue,
             CASE WHEN h.n <= 10000 THEN h.n
                  ELSE greatest(h.n, (SELECT sum(greatest(c.reltuples, 0))::int8 FROM pg_class c
                      WHERE c.oid = to_regclass('ix_outbox_event_held')
                         OR c.oid IN (SELECT relid FROM pg_partition_tree(
                          to_regclass('ix_outbox_event_held')))))
             END AS held,
             CASE WHEN p.n <= 10000 THEN p.kept
                  ELSE round(p.kept::float8 / p.n * greatest(p.n, (
                      SELECT sum(greatest(c.reltuples, 0))::int8 FROM pg_class c
                      WHERE c.oid = to_regclass('ix_outbox_event_parked')
                         OR c.oid IN (SELECT relid FROM pg_partition_tree(
                          to_regclass('ix_outbox_event_parked'))))))::int8
             END AS parked
           FROM q, h, p)
SELECT e.queue + e.held,
       EXTRACT(EPOCH FROM now() - least(
           (SELECT created_at FROM outbox_event WHERE id = q.first),
           (SELECT created_at FROM outbox_event WHERE id = h.first)))::float8,
       e.parked,
       e.held
FROM q, h, e";

/// Scheduled rows waiting for their time (held until their `due_at`, see
/// `UnitOfWork::record_at`), which the backlog gauges leave out: how many
/// (at most 10,001: more than 10,000), and how long ago the earliest was
/// due (0 if none is overdue; more than a release interval or two: no relay
/// releases them). Over the held rows' index, in its order.
pub(crate) const SCHEDULED: &str = "\
SELECT count(*)::int8,
       coalesce(greatest(EXTRACT(EPOCH FROM now() - min(held_until)), 0), 0)::float8
FROM (SELECT held_until FROM outbox_event
      WHERE held_until IS NOT NULL AND published_at IS NULL AND held_until = due_at
      ORDER BY held_until, id LIMIT 10001) s";

/// [`BACKLOG`] in the progress mode (see [`crate::relay::progress`]): the
/// queue is the rows in the windows after the slots' positions, counted as
/// `ops::status` counts them (see `ops::backlog`'s `progress_queue`): each
/// slot's first rows (its share of 10,000, + 1), a slot read to the end
/// counted exactly; past 10,000 rows read, each truncated slot estimated
/// from the span of its ids and the density of the ids read; within them,
/// the truncated slots read again in one scan up to 10,001 rows in all.
pub(crate) static PROGRESS_BACKLOG: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let q_start = BACKLOG.find("WITH q AS (").expect("q");
    let q_end = BACKLOG.find("     h AS (").expect("h");
    let e_start = BACKLOG
        .find("CASE WHEN q.n <= 10000 THEN q.n")
        .expect("queue");
    let e_end = e_start
        + BACKLOG[e_start..]
            .find("END AS queue,")
            .expect("queue's end");
    assert!(BACKLOG[q_start..q_end].contains("LIMIT 10001) s),"));
    let (k1, bound) = (
        crate::ops::backlog::PROGRESS_SLOT_READ,
        crate::ops::BACKLOG_EXACT_UP_TO,
    );
    let rows = crate::ops::backlog::progress_slot_rows(&crate::relay::progress::reached("e"));
    // A truncated slot's estimate (`ops::backlog::slot_estimate`), over
    // `rs`.
    let estimate = format!(
        "CASE WHEN rs.n < {k1} THEN rs.n::float8
              ELSE greatest(rs.n, rs.n::float8 * (greatest(rs.upto, (
                  SELECT l.id FROM outbox_event l WHERE l.lane_slot = rs.slot
                    AND l.txid IS NOT NULL ORDER BY l.txid DESC LIMIT 1)) - rs.first + 1)
                  / (rs.upto - rs.first + 1)) END"
    );
    let queue = format!(
        "WITH RECURSIVE {positions}, t AS (SELECT coalesce(sum(rows), 0)::int8 AS rows,
                                             min(held_at) AS since FROM outbox_held_topic),
     r AS MATERIALIZED (
         SELECT pos.slot, e.id FROM pos
         CROSS JOIN LATERAL (SELECT u.id FROM ({rows}) u LIMIT {k1}) e),
     rs AS MATERIALIZED (SELECT slot, count(*) AS n, min(id) AS first, max(id) AS upto
                         FROM r GROUP BY slot),
     x AS (SELECT coalesce(sum(n), 0) AS read,
                  coalesce(sum(n) FILTER (WHERE n < {k1}), 0) AS exact,
                  min(first) AS first, count(*) FILTER (WHERE n >= {k1}) AS truncated
           FROM rs),
     q AS (SELECT x.first,
             (CASE WHEN x.truncated = 0 THEN x.read
                  WHEN x.read > {bound} THEN (SELECT round(sum({estimate}))::int8 FROM rs)
                  ELSE (SELECT CASE WHEN x.exact + c.n <= {bound} THEN x.exact + c.n
                                    ELSE greatest({bound} + 1,
                                                  (SELECT round(sum({estimate}))::int8 FROM rs))
                               END
                        FROM (SELECT count(*) AS n FROM (
                                  SELECT 1 FROM pos CROSS JOIN LATERAL ({rows}) e
                                  WHERE pos.slot IN (SELECT slot FROM rs WHERE n >= {k1})
                                  LIMIT {bound} + 1) s) c)
             END)::int8 AS n
           FROM x),
",
        positions = crate::relay::progress::POSITIONS,
    );
    // Topics held as missing: their rows passed over by the windows
    // (counted when passed) are held rows, the oldest waiting since the
    // topic was held.
    let age = "(SELECT created_at FROM outbox_event WHERE id = h.first)))::float8";
    assert!(BACKLOG.contains(age) && BACKLOG.contains("SELECT e.queue + e.held,"));
    assert!(BACKLOG.ends_with("       e.held\nFROM q, h, e"));
    let backlog = format!(
        "{queue}{}q.n{}",
        &BACKLOG[q_end..e_start],
        &BACKLOG[e_end + "END".len()..]
    );
    backlog
        .replace(
            age,
            "(SELECT created_at FROM outbox_event WHERE id = h.first), t.since))::float8",
        )
        .replace(
            "SELECT e.queue + e.held,",
            "SELECT e.queue + e.held + t.rows,",
        )
        .replace(
            "       e.held\nFROM q, h, e",
            "       e.held + t.rows\nFROM q, h, e, t",
        )
});

/// A consumer group's dead letters awaiting an operator: an index-only
/// count over `ix_dead_letter_dead` (rows of status `dead`), so its cost
/// follows the number of dead letters, not the table.
pub(crate) const DEAD_LETTERS: &str =
    "SELECT count(*) FROM dead_letter WHERE consumer = $1 AND status = 'dead'";

/// Running instances of each saga type `$1` without a step for longer than
/// `$2` seconds and with no timeout still to come (a pending timeout whose
/// outbox row is due later), at most 10,001 per type: a range scan of
/// `ix_outbox_saga_running` per type, the timeouts probed only for the
/// instances idle that long.
pub(crate) const STUCK_SAGAS: &str = concat!(
    "
SELECT t.saga_type, (
    SELECT count(*) FROM (
        SELECT 1 FROM outbox_saga s
        WHERE s.saga_type = t.saga_type AND s.completed_at IS NULL
          AND s.updated_at < now() - make_interval(secs => $2)
          AND ",
    crate::ops::sagas::waits_for_no_timeout!(),
    "
        LIMIT 10001) AS c) AS stuck
FROM unnest($1::text[]) AS t(saga_type)"
);

/// What a consumer's metrics task samples beside its counters.
pub(crate) struct Sampled {
    pub group: String,
    /// The consumer's saga types.
    pub sagas: Vec<&'static str>,
    pub saga_stuck_after: Duration,
}

/// Samples the `outbox_sagas_stuck` gauge of each of `sagas`.
async fn sample_stuck_sagas(
    pool: PgPool,
    sagas: Vec<&'static str>,
    stuck_after: Duration,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin_with(sample_begin()).await?;
    let counts: Vec<(String, i64)> = sqlx::query_as(STUCK_SAGAS)
        .bind(&sagas)
        .bind(stuck_after.as_secs_f64())
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    for (saga, n) in counts {
        gauge!("outbox_sagas_stuck", "saga" => saga).set(n as f64);
    }
    Ok(())
}

/// Copies a relay's counters into the metrics and samples the backlog,
/// until `shutdown`; then copies once more. `outbox_relay_up` counts the
/// relay from its first copy to its last.
pub(crate) async fn relay_task(pool: PgPool, stats: Arc<RelayStats>, shutdown: CancellationToken) {
    let published = counter!("outbox_relay_published_total");
    let failed = counter!("outbox_relay_failed_total");
    let parked = counter!("outbox_relay_parked_total");
    let batches = counter!("outbox_relay_batches_total");
    let lanes = gauge!("outbox_relay_lanes_owned");
    let failing = gauge!("outbox_relay_consecutive_failures");
    let refused = gauge!("outbox_relay_refused");
    let up = gauge!("outbox_relay_up");
    up.increment(1.0);
    let mut health = Health::new(
        "database (backlog sample)",
        BACKLOG_INTERVAL,
        BACKLOG_INTERVAL,
    )
    .reporting(stats.problems());
    let mut last = RelayCounts::default();
    let mut copy = |now: RelayCounts| {
        lanes.set(stats.lanes().len() as f64);
        failing.set(stats.consecutive_failures() as f64);
        let is_refused = matches!(stats.health(), RelayHealth::Refused { .. });
        refused.set(if is_refused { 1.0 } else { 0.0 });
        published.increment(now.published - last.published);
        failed.increment(now.failed - last.failed);
        parked.increment(now.parked - last.parked);
        batches.increment(now.batches - last.batches);
        last = now;
    };
    let mut sampled: Option<Instant> = None;
    loop {
        copy(stats.snapshot());
        if sampled.is_none_or(|t| t.elapsed() >= BACKLOG_INTERVAL) {
            sampled = Some(Instant::now());
            // Never holds the relay's shutdown up (e.g. during an outage).
            // The sample runs as a task of its own: a sample given up on
            // here still ends its transaction (by its statement timeout at
            // the latest) before its connection goes back to the pool;
            // dropped in the middle of its `BEGIN`, it would hand the pool a
            // connection inside a read-only transaction.
            let sample = tokio::spawn(sample_backlog(pool.clone()));
            tokio::select! {
                done = tokio::time::timeout(BACKLOG_INTERVAL, sample) => {
                    let backlog = match done {
                        Ok(Ok(result)) => sample_health(&mut health, result, BACKLOG_SAMPLE),
                        _ => None,
                    };
                    // Nothing left to publish: no delivery can be failing
                    // (the failing rows were parked, or published by
                    // another relay).
                    if backlog == Some(0) {
                        stats.failing_over();
                        copy(stats.snapshot());
                    }
                }
                _ = shutdown.cancelled() => break,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(COPY_INTERVAL) => {}
            _ = shutdown.cancelled() => break,
        }
    }
    copy(stats.snapshot());
    up.decrement(1.0);
}

/// The `BEGIN` of a sample's read-only transaction: its query gives up
/// (`statement_timeout`) when the next sample is due. No sequential scan
/// (as the claims): the sample's statements are prepared and, without
/// parameters, keep the plan of their first execution; on a young outbox,
/// planned while the table was empty, the progress mode's scanned the
/// table once per lane slot from then on (380–540 ms a sample at 14,000
/// rows, found under the latency benchmark).
fn sample_begin() -> String {
    format!(
        "BEGIN READ ONLY; SET LOCAL statement_timeout = {}; SET LOCAL jit = off; \
         SET LOCAL enable_seqscan = off",
        BACKLOG_INTERVAL.as_millis()
    )
}

/// Samples the backlog gauges; returns the backlog.
async fn sample_backlog(pool: PgPool) -> Result<i64, sqlx::Error> {
    type Backlog = (i64, Option<f64>, i64, i64);
    type Sample = (Backlog, (i64, f64), Option<crate::ops::ProgressLag>);
    let row: Result<Sample, sqlx::Error> = async {
        let mut tx = pool.begin_with(sample_begin()).await?;
        let progress: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_progress)")
            .fetch_one(&mut *tx)
            .await?;
        let sql = if progress {
            PROGRESS_BACKLOG.as_str()
        } else {
            BACKLOG
        };
        let row = sqlx::query_as(sql).fetch_one(&mut *tx).await?;
        let scheduled: (i64, f64) = sqlx::query_as(SCHEDULED).fetch_one(&mut *tx).await?;
        let lag = if progress {
            Some(crate::ops::lag::read(&mut tx).await?)
        } else {
            None
        };
        tx.commit().await?;
        Ok((row, scheduled, lag))
    }
    .await;
    match row {
        Ok(((backlog, oldest, parked, held), (scheduled, overdue), lag)) => {
            if let Some(lag) = lag {
                set_progress_lag(&lag);
            }
            gauge!("outbox_scheduled").set(scheduled as f64);
            gauge!("outbox_scheduled_overdue_seconds").set(overdue);
            gauge!("outbox_held_events").set(held as f64);
            gauge!("outbox_backlog_events").set(backlog as f64);
            gauge!("outbox_oldest_unpublished_seconds").set(oldest.unwrap_or(0.0));
            gauge!("outbox_parked_events").set(parked as f64);
            Ok(backlog)
        }
        Err(error) => Err(error),
    }
}

/// The lanes whose gauges were set (`lane`, `lanes` labels), so that a
/// lane no position stands at any more is set to 0 rather than left at its
/// last value; and the transaction last seen holding windows back, with
/// when this process first saw it (its age when `pg_stat_activity` does not
/// show it).
static PROGRESS_SEEN: std::sync::Mutex<(LaneLabels, Option<(i64, Instant)>)> =
    std::sync::Mutex::new((std::collections::BTreeSet::new(), None));

/// The `lane` and `lanes` labels of the lanes' gauges.
type LaneLabels = std::collections::BTreeSet<(String, String)>;

/// Sets the progress mode's gauges: each lane's lag and oldest event, and
/// the age of the transaction holding windows back (0 when none). When
/// this role may not see the transaction's start (another role's session,
/// without `pg_read_all_stats`), its age is counted from the first sample
/// that saw it: a lower bound.
fn set_progress_lag(lag: &crate::ops::ProgressLag) {
    let mut seen = PROGRESS_SEEN.lock().unwrap_or_else(|p| p.into_inner());
    let (lanes, holder) = &mut *seen;
    let mut now = std::collections::BTreeSet::new();
    for l in &lag.lanes {
        let count = l.lane_count.map_or_else(|| "-".into(), |c| c.to_string());
        now.insert((l.lane.clone(), count.clone()));
        let labels = [("lane", l.lane.clone()), ("lanes", count)];
        gauge!("outbox_lane_backlog_events", &labels).set(l.events as f64);
        gauge!("outbox_lane_oldest_unpublished_seconds", &labels).set(l.oldest_secs.unwrap_or(0.0));
    }
    for (lane, count) in lanes.difference(&now) {
        let labels = [("lane", lane.clone()), ("lanes", count.clone())];
        gauge!("outbox_lane_backlog_events", &labels).set(0.0);
        gauge!("outbox_lane_oldest_unpublished_seconds", &labels).set(0.0);
    }
    *lanes = now;
    let age = match &lag.holding {
        None => {
            *holder = None;
            0.0
        }
        Some(h) => {
            let first = match holder {
                Some((xid, at)) if *xid == h.xid => *at,
                _ => {
                    *holder = Some((h.xid, Instant::now()));
                    Instant::now()
                }
            };
            h.age_secs.unwrap_or_else(|| first.elapsed().as_secs_f64())
        }
    };
    gauge!("outbox_progress_blocking_transaction_seconds").set(age);
}

/// Samples the `outbox_dead_letters` gauge of `group`.
async fn sample_dead_letters(pool: PgPool, group: String) -> Result<(), sqlx::Error> {
    let count: Result<i64, sqlx::Error> = async {
        let mut tx = pool.begin_with(sample_begin()).await?;
        let n = sqlx::query_scalar(DEAD_LETTERS)
            .bind(&group)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(n)
    }
    .await;
    count.map(|n| gauge!("outbox_dead_letters", "group" => group).set(n as f64))
}

/// Copies a consumer's counters into the metrics and samples its dead
/// letters, until `shutdown`; then copies once more.
pub(crate) async fn consumer_task(
    pool: PgPool,
    what: Sampled,
    stats: Arc<ConsumerStats>,
    shutdown: CancellationToken,
) {
    let Sampled {
        group,
        sagas: saga_types,
        saga_stuck_after,
    } = what;
    let labels = [("group", group.clone())];
    let received = counter!("outbox_consumer_received_total", &labels);
    let processed = counter!("outbox_consumer_processed_total", &labels);
    let duplicates = counter!("outbox_consumer_duplicates_total", &labels);
    let dead = counter!("outbox_consumer_dead_lettered_total", &labels);
    let failures = counter!("outbox_consumer_handler_failures_total", &labels);
    let refused = gauge!("outbox_consumer_refused", &labels);
    let mut health = Health::new(
        "database (dead-letter sample)",
        BACKLOG_INTERVAL,
        BACKLOG_INTERVAL,
    )
    .reporting(stats.problems());
    let mut saga_health = Health::new(
        "database (stuck sagas sample)",
        BACKLOG_INTERVAL,
        BACKLOG_INTERVAL,
    )
    .reporting(stats.problems());
    let mut last = ConsumerCounts::default();
    let mut copy = |now: ConsumerCounts| {
        let is_refused = matches!(stats.health(), ConsumerHealth::Refused { .. });
        refused.set(if is_refused { 1.0 } else { 0.0 });
        let add = |c: &Counter, n: u64, l: u64| c.increment(n.saturating_sub(l));
        add(&received, now.received, last.received);
        add(&processed, now.processed, last.processed);
        add(&duplicates, now.duplicates, last.duplicates);
        add(&dead, now.dead_lettered, last.dead_lettered);
        add(&failures, now.handler_failures, last.handler_failures);
        last = now;
        sagas();
    };
    let mut sampled: Option<Instant> = None;
    loop {
        copy(stats.snapshot());
        if sampled.is_none_or(|t| t.elapsed() >= BACKLOG_INTERVAL) {
            sampled = Some(Instant::now());
            // On a task of its own, as the relay's backlog sample.
            let sample = tokio::spawn(sample_dead_letters(pool.clone(), group.clone()));
            tokio::select! {
                done = tokio::time::timeout(BACKLOG_INTERVAL, sample) => {
                    if let Ok(Ok(result)) = done {
                        sample_health(&mut health, result, DEAD_LETTER_SAMPLE);
                    }
                }
                _ = shutdown.cancelled() => break,
            }
            if !saga_types.is_empty() {
                let sample = tokio::spawn(sample_stuck_sagas(
                    pool.clone(),
                    saga_types.clone(),
                    saga_stuck_after,
                ));
                tokio::select! {
                    done = tokio::time::timeout(BACKLOG_INTERVAL, sample) => {
                        if let Ok(Ok(result)) = done {
                            sample_health(&mut saga_health, result, STUCK_SAGA_SAMPLE);
                        }
                    }
                    _ = shutdown.cancelled() => break,
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(COPY_INTERVAL) => {}
            _ = shutdown.cancelled() => break,
        }
    }
    copy(stats.snapshot());
}

/// Sets the saga counters from the process's counts (absolute values:
/// every consumer's copy task may set them, to the same values).
fn sagas() {
    for (saga, c) in outbox_core::saga::all_saga_counts() {
        let of = |name: &'static str| counter!(name, "saga" => saga);
        of("outbox_saga_steps_total").absolute(c.steps);
        of("outbox_saga_started_total").absolute(c.started);
        of("outbox_saga_conflicts_total").absolute(c.conflicts);
        for (reason, n) in [
            ("missing", c.missing),
            ("completed", c.completed),
            ("other_stage", c.other_stage),
            ("stale_timeout", c.stale_timeouts),
        ] {
            counter!("outbox_saga_ignored_total", "saga" => saga, "reason" => reason).absolute(n);
        }
    }
}

/// Sets the `outbox_consumer_up` gauge of `group`: 1 while its consumer
/// runs, 0 once it stopped (or failed).
pub(crate) fn consumer_up(group: &str, up: bool) {
    gauge!("outbox_consumer_up", "group" => group.to_owned()).set(if up { 1.0 } else { 0.0 });
}

/// Sets the `outbox_consumer_stalled` gauge of `group`.
pub(crate) fn consumer_stalled(group: &str, stalled: bool) {
    gauge!("outbox_consumer_stalled", "group" => group.to_owned()).set(if stalled {
        1.0
    } else {
        0.0
    });
}

/// Counts a rejoin of `group`'s consumer (rare: not through the counters'
/// copy task).
pub(crate) fn consumer_rejoined(group: &str) {
    counter!("outbox_consumer_rejoins_total", "group" => group.to_owned()).increment(1);
}

/// Counts a gap of `group`'s consumer read again (rare: not through the
/// counters' copy task).
pub(crate) fn consumer_gap_rechecked(group: &str) {
    counter!("outbox_consumer_gaps_rechecked_total", "group" => group.to_owned()).increment(1);
}

/// The per-batch latency histograms of one consumer.
#[derive(Clone)]
pub(crate) struct ConsumerLatency {
    pub batch: Histogram,
    pub handler: Histogram,
}

impl ConsumerLatency {
    pub fn new(group: &str) -> Self {
        let labels = [("group", group.to_owned())];
        Self {
            batch: histogram!("outbox_consumer_batch_duration_seconds", &labels),
            handler: histogram!("outbox_consumer_handler_seconds", &labels),
        }
    }
}

/// The relay's batch latency histogram.
pub(crate) fn relay_batch_latency() -> Histogram {
    histogram!("outbox_relay_batch_duration_seconds")
}

/// Records the consumer lag per partition from librdkafka's statistics.
pub(crate) fn record_lag(group: &str, statistics: &rdkafka::Statistics) {
    for (topic, t) in &statistics.topics {
        for (partition, p) in &t.partitions {
            if *partition < 0 || p.consumer_lag < 0 {
                continue;
            }
            gauge!(
                "outbox_consumer_lag",
                "group" => group.to_owned(),
                "topic" => topic.clone(),
                "partition" => partition.to_string()
            )
            .set(p.consumer_lag as f64);
        }
    }
}

#[cfg(feature = "prometheus")]
pub use self::exporter::{MetricsServer, serve};

#[cfg(feature = "prometheus")]
mod exporter {
    use std::net::SocketAddr;
    use std::sync::Mutex;

    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    use tokio::task::JoinHandle;

    use crate::error::{Error, Result};

    /// Where this process serves its metrics, once [`serve`] succeeded.
    static SERVED_AT: Mutex<Option<SocketAddr>> = Mutex::new(None);

    /// Latency buckets, in seconds (1 ms to 30 s).
    const BUCKETS: &[f64] = &[
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];

    /// A running metrics endpoint; stops listening when dropped (the
    /// recorder stays installed).
    #[derive(Debug)]
    pub struct MetricsServer {
        addr: SocketAddr,
        task: JoinHandle<()>,
    }

    impl MetricsServer {
        /// The address it listens on (the actual port when 0 was asked).
        pub fn local_addr(&self) -> SocketAddr {
            self.addr
        }
    }

    impl Drop for MetricsServer {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// Installs the Prometheus recorder as the process's `metrics` recorder
    /// and serves the text exposition format over HTTP at `addr` (e.g.
    /// `127.0.0.1:9464`; port 0 picks a free port), on every path
    /// (`/metrics` by convention; `/health` answers `OK`).
    ///
    /// The listener is the exporter's own (`metrics-exporter-prometheus`,
    /// on hyper): each connection is served on a task of its own, so a
    /// client that connects and sends nothing, or reads its answer slowly,
    /// holds only its own connection. Once per process: a second call, or
    /// another `metrics` recorder installed before, is an error.
    pub async fn serve(addr: SocketAddr) -> Result<MetricsServer> {
        let mut served = SERVED_AT.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = *served {
            return Err(Error::Config(format!(
                "metrics are already served by this process (at {at}): one endpoint per process"
            )));
        }
        let addr = with_free_port(addr)?;
        let (recorder, exporter) = PrometheusBuilder::new()
            .with_http_listener(addr)
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
            .map_err(|e| Error::Config(format!("metrics buckets: {e}")))?
            .build()
            .map_err(|e| Error::Config(format!("cannot listen for metrics on {addr}: {e}")))?;
        metrics::set_global_recorder(recorder)
            .map_err(|_| Error::Config("another metrics recorder is already installed".into()))?;
        let task = tokio::spawn(async move {
            if let Err(error) = exporter.await {
                tracing::error!(?error, "the metrics endpoint stopped");
            }
        });
        *served = Some(addr);
        tracing::info!(%addr, "metrics at http://{addr}/metrics");
        Ok(MetricsServer { addr, task })
    }

    /// `addr`, or with port 0 the same address on a port free right now
    /// (the exporter binds the address it is given and does not tell which
    /// port it got).
    fn with_free_port(addr: SocketAddr) -> Result<SocketAddr> {
        if addr.port() != 0 {
            return Ok(addr);
        }
        std::net::TcpListener::bind(addr)
            .and_then(|listener| listener.local_addr())
            .map_err(|e| Error::Config(format!("cannot listen for metrics on {addr}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use sqlx::PgPool;

    /// The sample's statements are prepared once per connection and, taking
    /// no parameters, keep the plan of their first execution: on a young
    /// outbox, one made while the table was empty. Once the table has grown
    /// (9,000 events in the progress mode), that plan still reads the lane
    /// slots through their indexes (it scanned the table once per slot:
    /// 380–540 ms a sample at 14,000 rows, every 5 s, beside the relay).
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn a_young_outbox_keeps_being_sampled_through_its_indexes(pool: PgPool) {
        crate::relay::progress::enable(&pool).await.unwrap();
        sqlx::query("VACUUM ANALYZE outbox_event")
            .execute(&pool)
            .await
            .unwrap();
        let mut conn = pool.acquire().await.unwrap();
        let statements = [
            super::PROGRESS_BACKLOG.as_str(),
            crate::ops::lag::LANES.as_str(),
            super::SCHEDULED,
        ];
        // The first sample, on the empty table: each statement planned and
        // its plan kept, as sqlx's statement cache keeps it.
        sqlx::raw_sql(&super::sample_begin())
            .execute(&mut *conn)
            .await
            .unwrap();
        for (i, sql) in statements.iter().enumerate() {
            sqlx::raw_sql(&format!("PREPARE sample_{i} AS {sql}"))
                .execute(&mut *conn)
                .await
                .unwrap();
            sqlx::raw_sql(&format!("EXECUTE sample_{i}"))
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                       payload, topic, partition_key)
             SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k' || g
             FROM generate_series(1, 9000) AS g",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::raw_sql(&super::sample_begin())
            .execute(&mut *conn)
            .await
            .unwrap();
        for i in 0..statements.len() {
            let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN EXECUTE sample_{i}"))
                .persistent(false)
                .fetch_all(&mut *conn)
                .await
                .unwrap();
            let plan = plan.join("\n");
            assert!(!plan.contains("Seq Scan on outbox_event"), "{plan}");
        }
        let (backlog, _, _, _): (i64, Option<f64>, i64, i64) = sqlx::query_as("EXECUTE sample_0")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(backlog, 9000, "counted exactly up to 10,000");
        sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
    }
}
