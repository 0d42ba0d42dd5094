//! Saga instances for operators (`outbox sagas`, the console): how many
//! instances of each type are in each stage, running or completed, and how
//! many are stuck (running, no step for longer than a given time, and no
//! timeout still to come: one waiting for its payment timeout is not); lists of
//! instances by type, stage and idleness; one instance with its state and
//! its pending timeouts (their due time, from the outbox rows that carry
//! them). Reads only; over `outbox_saga`'s index of running instances by
//! their last step, and its primary key. The summary reads the whole
//! table: the running instances and the completed ones the retention keeps
//! ([`Retention::completed_sagas`](crate::cleanup::Retention::completed_sagas)).

use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;

use crate::error::Result;

/// The instances of one saga type in one stage.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SagaStage {
    /// The saga type (`Saga::NAME`).
    pub saga_type: String,
    /// The stage's name.
    pub stage: String,
    /// Running instances.
    pub running: i64,
    /// Completed instances (kept until the retention deletes them).
    pub completed: i64,
    /// Running instances without a step for longer than the stuck time and
    /// no pending timeout due later (they wait for nothing that will come).
    pub stuck: i64,
    /// Seconds since the least recent step of a running instance.
    pub oldest_step_secs: Option<f64>,
}

/// Which instances a list shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SagaState {
    /// Running instances (the default).
    #[default]
    Running,
    /// Completed instances.
    Completed,
    /// Both.
    All,
}

/// What [`list`] selects.
#[derive(Debug, Clone, Default)]
pub struct SagaFilter {
    /// Of this saga type only.
    pub saga_type: Option<String>,
    /// In this stage only.
    pub stage: Option<String>,
    /// Running, completed or both.
    pub state: SagaState,
    /// Only instances without a step for longer than this (stuck ones).
    pub idle_longer_than: Option<Duration>,
    /// At most this many (the least recently moved first).
    pub limit: i64,
}

/// One saga instance.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SagaInstance {
    /// The saga type.
    pub saga_type: String,
    /// The instance's id (its messages' correlation value).
    pub saga_id: String,
    /// The stage's name.
    pub stage: String,
    /// Steps applied.
    pub version: i64,
    /// When the start message created it (ISO 8601, UTC).
    pub started_at: String,
    /// Its last step.
    pub updated_at: String,
    /// When a step completed it.
    pub completed_at: Option<String>,
    /// Pending timeouts.
    pub timeouts: i64,
}

/// A pending timeout of an instance.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SagaTimeoutRow {
    /// Its name (`SagaContext::schedule_timeout`).
    pub name: String,
    /// Its id (the event id of the message that fires it).
    pub timeout_id: String,
    /// When it is due (ISO 8601, UTC; `None`: its outbox row is gone).
    pub due_at: Option<String>,
}

/// One instance, whole.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SagaDetail {
    /// The instance.
    #[serde(flatten)]
    pub instance: SagaInstance,
    /// Its state, as stored (JSON).
    pub state: serde_json::Value,
    /// Its pending timeouts, the soonest due first.
    pub pending_timeouts: Vec<SagaTimeoutRow>,
}

/// The condition "no timeout still to come" on a row of `outbox_saga`: no
/// pending timeout whose outbox row is due later. With an idle time, it
/// makes an instance stuck (here and in the `outbox_sagas_stuck` gauge).
macro_rules! waits_for_no_timeout {
    () => {
        "NOT EXISTS (
                              SELECT 1 FROM jsonb_each_text(timeouts) p
                              JOIN outbox_event o ON o.event_id = p.value::uuid
                              WHERE o.due_at > now())"
    };
}
pub(crate) use waits_for_no_timeout;

const SUMMARY: &str = concat!(
    "
SELECT saga_type, stage,
       count(*) FILTER (WHERE completed_at IS NULL) AS running,
       count(*) FILTER (WHERE completed_at IS NOT NULL) AS completed,
       count(*) FILTER (WHERE completed_at IS NULL
                          AND updated_at < now() - make_interval(secs => $1)
                          AND ",
    waits_for_no_timeout!(),
    ") AS stuck,
       EXTRACT(EPOCH FROM now() - min(updated_at) FILTER (WHERE completed_at IS NULL))::float8
         AS oldest_step_secs
FROM outbox_saga
GROUP BY saga_type, stage
ORDER BY saga_type, stage"
);

/// A time as the other operations print it (ISO 8601, UTC, milliseconds).
macro_rules! iso {
    ($column:literal) => {
        concat!(
            "to_char(",
            $column,
            " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
        )
    };
}

/// The columns of a [`SagaInstance`].
macro_rules! instance_columns {
    () => {
        concat!(
            "saga_type, saga_id, stage, version, ",
            iso!("started_at"),
            " AS started_at, ",
            iso!("updated_at"),
            " AS updated_at, ",
            iso!("completed_at"),
            " AS completed_at, ",
            "(SELECT count(*) FROM jsonb_object_keys(timeouts)) AS timeouts"
        )
    };
}

const LIST: &str = concat!(
    "SELECT ",
    instance_columns!(),
    "
FROM outbox_saga
WHERE ($1::text IS NULL OR saga_type = $1)
  AND ($2::text IS NULL OR stage = $2)
  AND CASE $3 WHEN 'running' THEN completed_at IS NULL
              WHEN 'completed' THEN completed_at IS NOT NULL
              ELSE true END
  AND ($4::float8 IS NULL OR updated_at < now() - make_interval(secs => $4))
ORDER BY outbox_saga.updated_at, saga_type, saga_id
LIMIT $5"
);

const ONE: &str = concat!(
    "SELECT ",
    instance_columns!(),
    ", state FROM outbox_saga WHERE saga_type = $1 AND saga_id = $2"
);

/// The pending timeouts' due times: each timeout's outbox row, by event id.
const TIMEOUTS: &str = concat!(
    "SELECT t.key AS name, t.value AS timeout_id, ",
    iso!("e.due_at"),
    " AS due_at
FROM outbox_saga s
CROSS JOIN LATERAL jsonb_each_text(s.timeouts) t
LEFT JOIN LATERAL (
    SELECT o.due_at FROM outbox_event o WHERE o.event_id = t.value::uuid LIMIT 1
) e ON true
WHERE s.saga_type = $1 AND s.saga_id = $2
ORDER BY e.due_at NULLS LAST, t.key"
);

/// The instances per saga type and stage; running ones without a step for
/// longer than `stuck_after`, and no pending timeout due later, are counted
/// as stuck (the `outbox_sagas_stuck` gauge counts the same).
pub async fn summary(pool: &PgPool, stuck_after: Duration) -> Result<Vec<SagaStage>> {
    Ok(sqlx::query_as(SUMMARY)
        .bind(stuck_after.as_secs_f64())
        .fetch_all(pool)
        .await?)
}

/// The instances `filter` selects, the least recently moved first.
pub async fn list(pool: &PgPool, filter: &SagaFilter) -> Result<Vec<SagaInstance>> {
    let state = match filter.state {
        SagaState::Running => "running",
        SagaState::Completed => "completed",
        SagaState::All => "all",
    };
    Ok(sqlx::query_as(LIST)
        .bind(filter.saga_type.as_deref())
        .bind(filter.stage.as_deref())
        .bind(state)
        .bind(filter.idle_longer_than.map(|d| d.as_secs_f64()))
        .bind(filter.limit.max(0))
        .fetch_all(pool)
        .await?)
}

/// One instance with its state and pending timeouts, if it exists.
pub async fn show(pool: &PgPool, saga_type: &str, saga_id: &str) -> Result<Option<SagaDetail>> {
    #[derive(sqlx::FromRow)]
    struct One {
        #[sqlx(flatten)]
        instance: SagaInstance,
        state: serde_json::Value,
    }
    let Some(one): Option<One> = sqlx::query_as(ONE)
        .bind(saga_type)
        .bind(saga_id)
        .fetch_optional(pool)
        .await?
    else {
        return Ok(None);
    };
    let pending_timeouts = sqlx::query_as(TIMEOUTS)
        .bind(saga_type)
        .bind(saga_id)
        .fetch_all(pool)
        .await?;
    Ok(Some(SagaDetail {
        instance: one.instance,
        state: one.state,
        pending_timeouts,
    }))
}
