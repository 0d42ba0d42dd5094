//! Applying a message to a saga instance, in the consumer's transaction:
//! lock the instance's row (`FOR UPDATE`), create it for a start message,
//! drop what changes nothing (no instance, completed, a stale timeout,
//! another stage), run the step, write the state back (`version + 1`) and
//! what the step recorded into the outbox. [`SagaHandler`] is the inbox
//! handler of one message type of one saga. In a dedup batch, the
//! instances come from and go back to the batch's
//! [`Prefetched`](super::Prefetched), which the consumer writes once per
//! segment.

use std::any::Any;
use std::collections::BTreeMap;

use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::batch::{Instance, holds_nul};
use super::counts::bump;
use super::journal::{StepOutcome, note};
use super::{MessageSteps, OtherStage, Saga, SagaContext, SagaTimeout, StepFn, stage_name};
use crate::event::DomainEvent;
use crate::handler::{BoxError, HandlerContext, HandlerFuture, InboxHandler};

const LOCK: &str = "\
SELECT state, timeouts, completed_at IS NOT NULL AS completed
FROM outbox_saga WHERE saga_type = $1 AND saga_id = $2 FOR UPDATE";

const CREATE: &str = "\
INSERT INTO outbox_saga (saga_type, saga_id, state, stage, version)
VALUES ($1, $2, $3, $4, 0)
ON CONFLICT (saga_type, saga_id) DO NOTHING";

const WRITE: &str = "\
UPDATE outbox_saga
SET state = $3, stage = $4, version = version + 1, timeouts = $5, updated_at = now(),
    completed_at = CASE WHEN $6 THEN now() END
WHERE saga_type = $1 AND saga_id = $2";

/// The inbox handler of message type `M` in saga `S` (its name: the
/// saga's). Registered by `ConsumerBuilder::saga`.
pub struct SagaHandler<S: Saga, M> {
    steps: MessageSteps<S, M>,
}

impl<S: Saga, M: DomainEvent> SagaHandler<S, M> {
    /// The handler of these steps.
    pub fn new(steps: MessageSteps<S, M>) -> Self {
        Self { steps }
    }
}

/// Whether `error` is the database's answer to a conflict with another
/// transaction: a deadlock (`40P01`), a serialization failure (`40001`), a
/// lock not available (`55P03`).
fn conflict(error: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    error
        .downcast_ref::<sqlx::Error>()
        .and_then(|e| e.as_database_error())
        .and_then(|e| e.code())
        .is_some_and(|code| matches!(&*code, "40P01" | "40001" | "55P03"))
}

async fn lock(conn: &mut PgConnection, saga: &str, id: &str) -> sqlx::Result<Option<Instance>> {
    let row = sqlx::query(LOCK)
        .bind(saga)
        .bind(id)
        .fetch_optional(conn)
        .await?;
    row.map(|r| {
        Ok(Instance {
            state: r.try_get("state")?,
            timeouts: r.try_get("timeouts")?,
            completed: r.try_get("completed")?,
        })
    })
    .transpose()
}

impl<S: Saga, M: DomainEvent> SagaHandler<S, M> {
    /// The step for `stage` (and timeout `timeout`): the one of that stage,
    /// else a fallback (any stage).
    fn step(&self, stage: &S::Stage, timeout: Option<&str>) -> Option<StepFn<S, M>> {
        let of_timeout = |s: &&super::Step<S, M>| s.timeout == timeout;
        self.steps
            .steps
            .iter()
            .filter(of_timeout)
            .find(|s| s.from.as_ref() == Some(stage))
            .or_else(|| {
                self.steps
                    .steps
                    .iter()
                    .filter(of_timeout)
                    .find(|s| s.from.is_none())
            })
            .map(|s| s.run)
    }

    async fn apply(&self, ctx: &mut HandlerContext<'_>, event: M) -> Result<StepOutcome, BoxError> {
        let timeout = (&event as &dyn Any)
            .downcast_ref::<SagaTimeout<S>>()
            .map(|t| (t.saga_type.clone(), t.name.clone(), t.timeout_id));
        if let Some((saga_type, _, _)) = &timeout
            && saga_type != S::NAME
        {
            return Ok(StepOutcome::Missing); // another saga's timeout on a shared topic
        }
        let saga_id = (self.steps.correlate)(&event);
        let batch = ctx.prefetched();
        let conn = ctx.connection();
        let mut instance = match batch.and_then(|b| b.get(S::NAME, &saga_id)) {
            Some(instance) => Some(instance),
            None => lock(conn, S::NAME, &saga_id).await?,
        };
        let mut created = false;
        if instance.is_none()
            && let Some((init, _)) = &self.steps.start
        {
            let initial = init(&event);
            let stage = stage_name(initial.stage());
            let state = serde_json::to_value(&initial)?;
            created = sqlx::query(CREATE)
                .bind(S::NAME)
                .bind(&saga_id)
                .bind(&state)
                .bind(stage)
                .execute(&mut *conn)
                .await?
                .rows_affected()
                == 1;
            instance = match created {
                // As inserted (and locked by the insert).
                true => Some(Instance {
                    state,
                    timeouts: serde_json::json!({}),
                    completed: false,
                }),
                // Another transaction's insert won: read what it wrote.
                false => lock(conn, S::NAME, &saga_id).await?,
            };
        }
        let Some(instance) = instance else {
            bump(S::NAME, |c| c.missing += 1);
            return Ok(StepOutcome::Missing);
        };
        if instance.completed {
            bump(S::NAME, |c| c.completed += 1);
            return Ok(StepOutcome::Completed);
        }
        let state: S = serde_json::from_value(instance.state)?;
        let mut timeouts: BTreeMap<String, Uuid> = serde_json::from_value(instance.timeouts)?;
        let run = match (&self.steps.start, created) {
            (Some((_, start)), true) => *start,
            _ => {
                if let Some((_, name, id)) = &timeout
                    && timeouts.get(name) != Some(id)
                {
                    bump(S::NAME, |c| c.stale_timeouts += 1);
                    return Ok(StepOutcome::StaleTimeout);
                }
                let name = timeout.as_ref().map(|(_, name, _)| name.as_str());
                match self.step(state.stage(), name) {
                    Some(run) => {
                        if let Some(name) = name {
                            timeouts.remove(name); // it fires once
                        }
                        run
                    }
                    None => {
                        bump(S::NAME, |c| c.other_stage += 1);
                        return match S::other_stage() {
                            OtherStage::Ignore => Ok(StepOutcome::OtherStage),
                            OtherStage::DeadLetter => Err(format!(
                                "saga `{}` instance `{saga_id}` in stage `{}` has no step for `{}`",
                                S::NAME,
                                stage_name(state.stage()),
                                event.event_type()
                            )
                            .into()),
                        };
                    }
                }
            }
        };
        if created {
            bump(S::NAME, |c| c.started += 1);
        }
        let mut step = SagaContext::new(saga_id, state, timeouts);
        let next = run(&mut step, event).await?;
        step.take_error()?;
        step.state.set_stage(next);
        if step.completed {
            // Nothing pending fires after completion: cancel their rows too.
            let pending = std::mem::take(&mut step.timeouts);
            step.cancelled.extend(pending.into_values());
        }
        let conn = ctx.connection();
        let state = serde_json::to_value(&step.state)?;
        if holds_nul(&state) {
            return Err(format!(
                "saga `{}` instance `{}`: its state holds the character NUL, which PostgreSQL's \
                 jsonb cannot store",
                S::NAME,
                step.saga_id
            )
            .into());
        }
        let timeouts = serde_json::to_value(&step.timeouts)?;
        let stage = stage_name(step.state.stage());
        match batch {
            // Written with the segment's other steps (`Prefetched::flush`).
            Some(batch) => batch.stepped(
                (S::NAME.to_owned(), step.saga_id.clone()),
                Instance {
                    state,
                    timeouts,
                    completed: step.completed,
                },
                stage,
            ),
            None => {
                sqlx::query(WRITE)
                    .bind(S::NAME)
                    .bind(&step.saga_id)
                    .bind(&state)
                    .bind(stage)
                    .bind(&timeouts)
                    .bind(step.completed)
                    .execute(&mut *conn)
                    .await?;
            }
        }
        for id in &step.cancelled {
            crate::uow::cancel_scheduled(&mut *conn, *id).await?;
        }
        crate::uow::insert_scheduled_after(&mut *conn, std::mem::take(&mut step.scheduled)).await?;
        for message in std::mem::take(&mut step.recorded) {
            ctx.record_message(message);
        }
        bump(S::NAME, |c| c.steps += 1);
        Ok(match created {
            true => StepOutcome::Started,
            false => StepOutcome::Applied,
        })
    }
}

impl<S: Saga, M: DomainEvent> InboxHandler for SagaHandler<S, M> {
    type Event = M;
    const NAME: &'static str = S::NAME;

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: M) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            // The instance's id, for the testing kit's journal only.
            let noted = super::journal::active()
                .then(|| self.saga_instance(&event).map(|(_, id)| id))
                .flatten();
            let event_id = ctx.incoming().event_id;
            match self.apply(ctx, event).await {
                Ok(outcome) => {
                    if let Some(saga_id) = noted {
                        note(S::NAME, saga_id, event_id, outcome);
                    }
                    Ok(())
                }
                Err(error) => {
                    if conflict(error.as_ref()) {
                        bump(S::NAME, |c| c.conflicts += 1);
                    }
                    Err(error)
                }
            }
        })
    }

    fn saga_instance(&self, event: &M) -> Option<(&'static str, String)> {
        if let Some(t) = (event as &dyn Any).downcast_ref::<SagaTimeout<S>>()
            && t.saga_type != S::NAME
        {
            return None;
        }
        Some((S::NAME, (self.steps.correlate)(event)))
    }
}
