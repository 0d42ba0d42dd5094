//! What is known of the consumer groups: from the database (the groups
//! that left rows — dedup rows, inbox rows, dead letters — their inbox
//! backlog and their open dead letters, each read over an index), and,
//! when a broker is at hand, their lag (committed offsets against the end
//! of each partition's log).

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use sqlx::PgPool;

use crate::error::{Error, Result};
use crate::kafka;

/// A consumer group as the database knows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct GroupSummary {
    /// The group id.
    pub group: String,
    /// Inbox rows received and not yet processed (inbox mode).
    pub inbox_pending: i64,
    /// Age in seconds of the oldest of them.
    pub oldest_pending_secs: Option<f64>,
    /// Dead letters waiting for an operator.
    pub dead: i64,
    /// Dead letters marked for retry, not yet re-driven.
    pub retry: i64,
}

/// Distinct values of the leading column of an index: one index probe per
/// value (a loose index scan), not a scan of the table.
fn skip_scan(table: &str) -> String {
    format!(
        "WITH RECURSIVE c(consumer) AS (
             (SELECT consumer FROM {table} ORDER BY consumer LIMIT 1)
             UNION ALL
             SELECT (SELECT t.consumer FROM {table} t WHERE t.consumer > c.consumer
                     ORDER BY t.consumer LIMIT 1)
             FROM c WHERE c.consumer IS NOT NULL)
         SELECT consumer FROM c WHERE consumer IS NOT NULL"
    )
}

/// Inbox rows waiting, per group, over the pending rows' partial index.
pub const INBOX_PENDING: &str = "\
SELECT consumer, count(*)::int8,
       EXTRACT(EPOCH FROM now() - min(received_at))::float8
FROM inbox_event WHERE NOT processed AND dead_lettered_at IS NULL
GROUP BY consumer";

/// Open dead letters per group and status, over their partial index.
pub const OPEN_DEAD_LETTERS: &str = "\
SELECT consumer, status, count(*)::int8 FROM dead_letter
WHERE status <> 'resolved' GROUP BY consumer, status";

/// The consumer groups the database knows of (those with dedup rows, inbox
/// rows or dead letters), by name, with their inbox backlog and open dead
/// letters.
pub async fn groups(pool: &PgPool) -> Result<Vec<GroupSummary>> {
    let mut by_name: BTreeMap<String, GroupSummary> = BTreeMap::new();
    for table in ["processed_event", "inbox_event", "dead_letter"] {
        let names: Vec<String> = sqlx::query_scalar(&skip_scan(table))
            .fetch_all(pool)
            .await?;
        for name in names {
            by_name.entry(name.clone()).or_insert_with(|| GroupSummary {
                group: name,
                ..GroupSummary::default()
            });
        }
    }
    let pending: Vec<(String, i64, Option<f64>)> =
        sqlx::query_as(INBOX_PENDING).fetch_all(pool).await?;
    for (name, n, oldest) in pending {
        let g = by_name.entry(name.clone()).or_default();
        g.group = name;
        g.inbox_pending = n;
        g.oldest_pending_secs = oldest;
    }
    // The progress mode's pending rows are those its positions do not pass
    // (the query above counts only the rows set aside or failed there).
    for (name, n, oldest) in super::progress::pending(pool).await? {
        let g = by_name.entry(name.clone()).or_default();
        g.group = name;
        g.inbox_pending += n;
        g.oldest_pending_secs = match (g.oldest_pending_secs, oldest) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    let open: Vec<(String, String, i64)> =
        sqlx::query_as(OPEN_DEAD_LETTERS).fetch_all(pool).await?;
    for (name, status, n) in open {
        let g = by_name.entry(name.clone()).or_default();
        g.group = name;
        match status.as_str() {
            "retry" => g.retry = n,
            _ => g.dead = n,
        }
    }
    Ok(by_name.into_values().collect())
}

/// A group's position on one partition.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PartitionLag {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The group's committed offset (the next message it will read).
    pub committed: i64,
    /// The end of the partition's log (its high watermark): the larger of
    /// the broker's answer to an offsets request and the high watermark of
    /// a fetch from the committed offset (brokers have been seen to answer
    /// the first with an end below what they hold).
    pub log_end: i64,
    /// Messages not yet consumed: `log_end - committed`, or 0 when the end
    /// is unknown (see `end_unknown`).
    pub lag: i64,
    /// The broker's ends are both below the committed offset: the lag
    /// cannot be told (it is at least 0, and the group read that far).
    pub end_unknown: bool,
}

/// Most topics [`lag`] asks about (the broker's first ones by name).
pub const MAX_LAG_TOPICS: usize = 5000;

/// The lag of `group` on every partition it has committed an offset on:
/// one metadata request, one offset fetch for the partitions of (at most
/// [`MAX_LAG_TOPICS`]) topics, and a watermark query per partition with a
/// committed offset. Blocking calls, each bounded by `timeout`: run on a
/// blocking thread. Does not join the group.
pub fn lag(
    brokers: &str,
    settings: &[(String, String)],
    group: &str,
    timeout: Duration,
) -> Result<Vec<PartitionLag>> {
    lag_of(
        kafka::client_config(brokers, settings),
        group,
        None,
        timeout,
    )
}

/// [`lag`] with a client configuration of the caller's, on `topics` only
/// (`None`: every topic); partitions without a committed offset are read
/// from their start (the low watermark).
pub(crate) fn lag_of(
    mut config: rdkafka::ClientConfig,
    group: &str,
    only: Option<&[String]>,
    timeout: Duration,
) -> Result<Vec<PartitionLag>> {
    config.set("group.id", group);
    config.set("enable.auto.commit", "false");
    // The fetches that read the log ends: quick and small, their
    // statistics soon.
    config.set("statistics.interval.ms", "100");
    config.set("fetch.wait.max.ms", "10");
    config.set("max.partition.fetch.bytes", "65536");
    config.set("fetch.max.bytes", "1048576");
    let consumer: BaseConsumer<FetchedEnds> =
        kafka::create_with_context(&config, FetchedEnds::default())?;
    let metadata = consumer
        .fetch_metadata(None, timeout)
        .map_err(|e| Error::Config(format!("broker metadata: {e}")))?;
    let mut topics: Vec<(&str, Vec<i32>)> = metadata
        .topics()
        .iter()
        .filter(|t| !t.name().starts_with("__"))
        .filter(|t| only.is_none_or(|only| only.iter().any(|o| o == t.name())))
        .map(|t| (t.name(), t.partitions().iter().map(|p| p.id()).collect()))
        .collect();
    topics.sort_by(|a, b| a.0.cmp(b.0));
    topics.truncate(MAX_LAG_TOPICS);
    let mut tpl = TopicPartitionList::new();
    for (topic, partitions) in &topics {
        for p in partitions {
            tpl.add_partition(topic, *p);
        }
    }
    if tpl.count() == 0 {
        return Ok(Vec::new());
    }
    let committed = consumer
        .committed_offsets(tpl, timeout)
        .map_err(|e| Error::Config(format!("committed offsets of group `{group}`: {e}")))?;
    let mut positions: Vec<(String, i32, i64)> = Vec::new();
    for e in committed.elements() {
        match e.offset() {
            Offset::Offset(o) => positions.push((e.topic().to_owned(), e.partition(), o)),
            // Nothing committed: the group starts at the log's start.
            _ if only.is_some() => {
                let (low, _) = consumer
                    .fetch_watermarks(e.topic(), e.partition(), timeout)
                    .map_err(|err| Error::Config(format!("log start of {}: {err}", e.topic())))?;
                positions.push((e.topic().to_owned(), e.partition(), low));
            }
            _ => {}
        }
    }
    let fetched = fetched_ends(&consumer, &positions, timeout);
    let mut out = Vec::new();
    for (topic, partition, committed) in positions {
        let (_, listed) = consumer
            .fetch_watermarks(&topic, partition, timeout)
            .map_err(|err| Error::Config(format!("log end of {topic}: {err}")))?;
        let log_end = fetched
            .iter()
            .find(|(t, p, _)| *t == topic && *p == partition)
            .map_or(listed, |(_, _, end)| listed.max(*end));
        out.push(PartitionLag {
            topic,
            partition,
            committed,
            log_end,
            lag: (log_end - committed).max(0),
            end_unknown: log_end < committed,
        });
    }
    Ok(out)
}

/// The partitions' high watermarks as librdkafka's statistics report them
/// from its fetches.
#[derive(Default)]
struct FetchedEnds(std::sync::Mutex<Vec<(String, i32, i64)>>);

impl rdkafka::ClientContext for FetchedEnds {
    fn stats(&self, statistics: rdkafka::Statistics) {
        let mut ends = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition >= 0 && p.hi_offset >= 0 {
                    ends.retain(|(t, q, _)| !(t == topic && q == partition));
                    ends.push((topic.clone(), *partition, p.hi_offset));
                }
            }
        }
    }
}

impl rdkafka::consumer::ConsumerContext for FetchedEnds {}

/// The high watermarks of fetches from the committed offsets `positions`
/// (topic, partition, offset): what a consumer reading there is told. One
/// short round of small fetches (at most a second, or `timeout`); the
/// partitions not answered in time are left out.
fn fetched_ends(
    consumer: &BaseConsumer<FetchedEnds>,
    positions: &[(String, i32, i64)],
    timeout: Duration,
) -> Vec<(String, i32, i64)> {
    let mut tpl = TopicPartitionList::new();
    for (topic, partition, offset) in positions {
        if tpl
            .add_partition_offset(topic, *partition, Offset::Offset(*offset))
            .is_err()
        {
            return Vec::new();
        }
    }
    if tpl.count() == 0 || consumer.assign(&tpl).is_err() {
        return Vec::new();
    }
    let until = std::time::Instant::now() + timeout.min(Duration::from_secs(1));
    let answered = || {
        consumer
            .context()
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    };
    while std::time::Instant::now() < until && answered().len() < positions.len() {
        let _ = consumer.poll(Duration::from_millis(20));
    }
    let _ = consumer.unassign();
    answered()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The groups' queries read indexes: 30,000 dedup rows of three groups,
    /// 3,000 processed inbox rows, resolved dead letters, fresh statistics;
    /// no sequential scan in their plans, and the summary is right.
    #[sqlx::test(migrator = "outbox_core::MIGRATOR")]
    async fn group_queries_never_scan_the_tables(pool: PgPool) {
        for sql in [
            "INSERT INTO processed_event (consumer, event_id)
             SELECT 'g' || (g % 3), gen_random_uuid() FROM generate_series(1, 30000) AS g",
            "INSERT INTO inbox_event (consumer, event_id, payload, processed)
             SELECT 'g1', gen_random_uuid(), '{}', g > 5 FROM generate_series(1, 3000) AS g",
            r#"INSERT INTO dead_letter (consumer, topic, "partition", "offset", reason, error, status)
               SELECT 'g' || (g % 4), 't', 0, g, 'handler_failed', 'boom',
                      CASE WHEN g <= 3 THEN 'dead' WHEN g = 4 THEN 'retry' ELSE 'resolved' END
               FROM generate_series(1, 20000) AS g"#,
            "VACUUM ANALYZE processed_event",
            "VACUUM ANALYZE inbox_event",
            "VACUUM ANALYZE dead_letter",
        ] {
            sqlx::query(sql).execute(&pool).await.unwrap();
        }
        let queries = [
            skip_scan("processed_event"),
            skip_scan("inbox_event"),
            skip_scan("dead_letter"),
            INBOX_PENDING.to_owned(),
            OPEN_DEAD_LETTERS.to_owned(),
        ];
        for sql in &queries {
            let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {sql}"))
                .fetch_all(&pool)
                .await
                .unwrap();
            let plan = plan.join("\n");
            assert!(!plan.contains("Seq Scan"), "{sql}\n{plan}");
        }
        let summary = groups(&pool).await.unwrap();
        let seen: Vec<(&str, i64, i64, i64)> = summary
            .iter()
            .map(|g| (g.group.as_str(), g.inbox_pending, g.dead, g.retry))
            .collect();
        assert_eq!(
            seen,
            vec![
                ("g0", 0, 0, 1),
                ("g1", 5, 1, 0),
                ("g2", 0, 1, 0),
                ("g3", 0, 1, 0)
            ]
        );
    }
}
