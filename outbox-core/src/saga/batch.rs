//! A dedup batch's saga instances ([`Prefetched`]): read ahead by the
//! batch's lock plan, kept as each step leaves them, and written back in
//! one statement per segment ([`Prefetched::flush`]) instead of one per
//! step.

use std::collections::HashMap;

use sqlx::PgConnection;

/// An instance as the transaction holds it.
#[derive(Debug, Clone)]
pub(super) struct Instance {
    pub state: serde_json::Value,
    pub timeouts: serde_json::Value,
    pub completed: bool,
}

/// An instance kept for the batch, with the steps taken since its row was
/// last written (`stage`: the stage to write; `None`: nothing to write).
#[derive(Debug)]
struct Kept {
    instance: Instance,
    stage: Option<String>,
    steps: i64,
}

/// Writes the steps a segment took, one row per instance.
const FLUSH: &str = "\
UPDATE outbox_saga s
SET state = u.state, stage = u.stage, version = s.version + u.steps, timeouts = u.timeouts,
    updated_at = now(), completed_at = CASE WHEN u.completed THEN now() END
FROM UNNEST($1::text[], $2::text[], $3::jsonb[], $4::text[], $5::jsonb[], $6::bool[], $7::int8[])
     AS u(saga_type, saga_id, state, stage, timeouts, completed, steps)
WHERE s.saga_type = u.saga_type AND s.saga_id = u.saga_id";

/// Saga instances as a consumer's batch transaction holds them: locked
/// (`FOR UPDATE`, in the batch's lock plan) and read at once before its
/// handlers ran, then each one as its last step left it. A step reads its
/// instance from here instead of locking and reading the row (a round trip
/// per step), and leaves its result here instead of writing the row: the
/// consumer [`flush`](Self::flush)es the segment's steps in one statement
/// before the segment ends. A step that finds nothing here locks and reads
/// the row. The rows stay locked until the transaction ends, so nothing
/// else changes them meanwhile; the consumer [`clear`](Self::clear)s this
/// whenever it takes back part of the transaction (a rollback to a
/// savepoint), whose steps then run again.
#[derive(Debug, Default)]
pub struct Prefetched(std::sync::Mutex<HashMap<(String, String), Kept>>);

impl Prefetched {
    /// Keeps instance `saga_id` of saga type `saga_type` as read.
    pub fn insert(
        &self,
        key: (String, String),
        state: serde_json::Value,
        timeouts: serde_json::Value,
        completed: bool,
    ) {
        let kept = Kept {
            instance: Instance {
                state,
                timeouts,
                completed,
            },
            stage: None,
            steps: 0,
        };
        self.lock().insert(key, kept);
    }

    /// Forgets every instance, and the steps not written yet: part of the
    /// transaction was taken back.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// How many instances are kept.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes the instances steps left here since the last flush, in one
    /// statement.
    pub async fn flush(&self, conn: &mut PgConnection) -> sqlx::Result<()> {
        let mut columns = FlushColumns::default();
        {
            let mut kept = self.lock();
            for ((saga_type, saga_id), k) in kept.iter_mut() {
                let Some(stage) = k.stage.take() else {
                    continue;
                };
                columns.types.push(saga_type.clone());
                columns.ids.push(saga_id.clone());
                columns.states.push(k.instance.state.clone());
                columns.stages.push(stage);
                columns.timeouts.push(k.instance.timeouts.clone());
                columns.completed.push(k.instance.completed);
                columns.steps.push(std::mem::take(&mut k.steps));
            }
        }
        if columns.ids.is_empty() {
            return Ok(());
        }
        sqlx::query(FLUSH)
            .bind(&columns.types)
            .bind(&columns.ids)
            .bind(&columns.states)
            .bind(&columns.stages)
            .bind(&columns.timeouts)
            .bind(&columns.completed)
            .bind(&columns.steps)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// The instance as kept, if it is.
    pub(super) fn get(&self, saga_type: &str, saga_id: &str) -> Option<Instance> {
        self.lock()
            .get(&(saga_type.to_owned(), saga_id.to_owned()))
            .map(|k| k.instance.clone())
    }

    /// Keeps what a step left, to be written by the next flush.
    pub(super) fn stepped(&self, key: (String, String), instance: Instance, stage: String) {
        let mut kept = self.lock();
        let k = kept.entry(key).or_insert(Kept {
            instance: instance.clone(),
            stage: None,
            steps: 0,
        });
        k.instance = instance;
        k.stage = Some(stage);
        k.steps += 1;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Kept>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
struct FlushColumns {
    types: Vec<String>,
    ids: Vec<String>,
    states: Vec<serde_json::Value>,
    stages: Vec<String>,
    timeouts: Vec<serde_json::Value>,
    completed: Vec<bool>,
    steps: Vec<i64>,
}

/// Whether `value` holds the character NUL (in a string or a key), which
/// `jsonb` cannot store: a step whose state holds one fails at once, as
/// its write would, rather than fail the segment's flush.
pub(super) fn holds_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(holds_nul),
        serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}
