//! The saga pages: instances per saga type and stage (running, completed,
//! stuck), a list of instances filtered by type, stage, state and
//! idleness, and one instance with its state and pending timeouts. Read
//! only (from [`outbox_runtime::ops::sagas`]).

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox_runtime::ops::{self, sagas};
use serde::Deserialize;

use crate::auth::session;
use crate::error::{ConsoleError, Page};
use crate::html::{Nav, age, page, query};
use crate::rows::filter_text;
use crate::{Console, Shared};

/// Instances listed at most.
const LIST: i64 = 200;

/// The saga page's query string.
#[derive(Deserialize, Default)]
pub struct SagasQuery {
    #[serde(rename = "type")]
    saga_type: Option<String>,
    stage: Option<String>,
    state: Option<String>,
    /// A running instance without a step for this long is stuck (`1h`).
    stuck: Option<String>,
    /// List only instances idle this long.
    idle: Option<String>,
}

fn duration(
    what: &str,
    text: &Option<String>,
) -> Result<Option<std::time::Duration>, ConsoleError> {
    match text.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(text) => ops::parse_duration(text).map(Some).map_err(|_| {
            ConsoleError::BadInput(format!(
                "invalid {what} `{}`: a duration such as 30m, 1h or 2d",
                text.chars().take(40).collect::<String>()
            ))
        }),
    }
}

fn when(t: Option<&str>) -> &str {
    t.unwrap_or("–")
}

/// `GET /sagas`.
pub async fn sagas_page(
    State(console): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<SagasQuery>,
) -> Response {
    let result = list_page(&console, &headers, q).await;
    result.unwrap_or_else(|e| e.render(&console))
}

async fn list_page(console: &Console, headers: &HeaderMap, q: SagasQuery) -> Page {
    let saga_type = filter_text("saga type", &q.saga_type)?;
    let stage = filter_text("stage", &q.stage)?;
    let stuck = duration("stuck time", &q.stuck)?.unwrap_or(std::time::Duration::from_secs(3600));
    let idle = duration("idle time", &q.idle)?;
    let state = match q.state.as_deref().map(str::trim) {
        None | Some("") | Some("running") => sagas::SagaState::Running,
        Some("completed") => sagas::SagaState::Completed,
        Some("all") => sagas::SagaState::All,
        Some(other) => {
            return Err(ConsoleError::BadInput(format!(
                "invalid state `{}`: running, completed or all",
                other.chars().take(40).collect::<String>()
            )));
        }
    };
    let summary = sagas::summary(&console.pool, stuck).await?;
    let filter = sagas::SagaFilter {
        saga_type: saga_type.clone(),
        stage: stage.clone(),
        state,
        idle_longer_than: idle,
        limit: LIST + 1,
    };
    let mut rows = sagas::list(&console.pool, &filter).await?;
    let more = rows.len() as i64 > LIST;
    rows.truncate(LIST as usize);
    let stuck_text = ops::format_duration(stuck);
    let state_text = match state {
        sagas::SagaState::Running => "running",
        sagas::SagaState::Completed => "completed",
        sagas::SagaState::All => "all",
    };
    let body = html! {
        h1 { "Sagas" }
        p.muted { "Saga instances by type and stage. A running instance without a step for longer \
            than " (stuck_text) " is counted as stuck: it waits for a message or a timeout that \
            has not come. Completed instances are kept until the retention deletes them." }
        table #summary {
            thead { tr {
                th { "saga type" } th { "stage" } th.num { "running" } th.num { "completed" }
                th.num { "stuck" } th.num { "oldest step" }
            } }
            tbody {
                @if summary.is_empty() {
                    tr { td.muted colspan="6" { "no saga instance in this database" } }
                }
                @for s in &summary {
                    tr data-saga=(s.saga_type) data-stage=(s.stage) {
                        td { (s.saga_type) }
                        td {
                            a href={ (console.link("/sagas")) (query(&[("type", &s.saga_type), ("stage", &s.stage), ("state", "all")])) } { (s.stage) }
                        }
                        td.num data-field="running" { (s.running) }
                        td.num data-field="completed" { (s.completed) }
                        td.num data-field="stuck" {
                            @if s.stuck > 0 {
                                a href={ (console.link("/sagas")) (query(&[("type", &s.saga_type), ("stage", &s.stage), ("idle", &stuck_text)])) } { (s.stuck) }
                            } @else { "0" }
                        }
                        td.num { (age(s.oldest_step_secs)) }
                    }
                }
            }
        }
        h2 { "Instances" }
        form.filters method="get" action=(console.link("/sagas")) {
            label { "saga type" input name="type" value=(saga_type.as_deref().unwrap_or("")); }
            label { "stage" input name="stage" value=(stage.as_deref().unwrap_or("")); }
            label { "state"
                select name="state" {
                    @for s in ["running", "completed", "all"] {
                        option value=(s) selected[s == state_text] { (s) }
                    }
                }
            }
            label { "idle longer than" input name="idle" placeholder="e.g. 1h" value=(q.idle.as_deref().unwrap_or("")); }
            button.secondary type="submit" { "Filter" }
        }
        table #instances {
            thead { tr {
                th { "saga type" } th { "id" } th { "stage" } th.num { "steps" }
                th { "last step" } th { "completed" } th.num { "pending timeouts" }
            } }
            tbody {
                @if rows.is_empty() {
                    tr { td.muted colspan="7" { "no instance matches" } }
                }
                @for r in &rows {
                    tr data-id=(r.saga_id) {
                        td { (r.saga_type) }
                        td { a href={ (console.link("/sagas/show")) (query(&[("type", &r.saga_type), ("id", &r.saga_id)])) } { code { (r.saga_id) } } }
                        td { (r.stage) }
                        td.num { (r.version) }
                        td { (r.updated_at) }
                        td { (when(r.completed_at.as_deref())) }
                        td.num { (r.timeouts) }
                    }
                }
            }
        }
        @if more {
            p.notice #capped { "The " (LIST) " least recently moved instances; filter to see others." }
        }
    };
    let who = session(console, headers);
    Ok(page(console, Nav::Sagas, "Sagas", who.as_ref(), body).into_response())
}

/// The instance page's query string.
#[derive(Deserialize, Default)]
pub struct InstanceQuery {
    #[serde(rename = "type")]
    saga_type: Option<String>,
    id: Option<String>,
}

/// `GET /sagas/show?type=…&id=…`.
pub async fn instance_page(
    State(console): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<InstanceQuery>,
) -> Response {
    let result = instance(&console, &headers, q).await;
    result.unwrap_or_else(|e| e.render(&console))
}

async fn instance(console: &Console, headers: &HeaderMap, q: InstanceQuery) -> Page {
    let (Some(saga_type), Some(id)) = (
        filter_text("saga type", &q.saga_type)?,
        filter_text("saga id", &q.id)?,
    ) else {
        return Err(ConsoleError::BadInput(
            "a saga type and an id are needed".into(),
        ));
    };
    let Some(saga) = sagas::show(&console.pool, &saga_type, &id).await? else {
        return Err(ConsoleError::NotFound(format!(
            "no saga instance {saga_type}/{id} (never started, or completed and deleted by the \
             retention)"
        )));
    };
    let i = &saga.instance;
    let state = serde_json::to_string_pretty(&saga.state).unwrap_or_default();
    let body = html! {
        h1 { "Saga " (i.saga_type) " " code { (i.saga_id) } }
        dl {
            dt { "stage" } dd #stage { (i.stage) }
            dt { "steps applied" } dd { (i.version) }
            dt { "started" } dd { (i.started_at) }
            dt { "last step" } dd { (i.updated_at) }
            dt { "completed" } dd #completed { (when(i.completed_at.as_deref())) }
        }
        h2 { "Pending timeouts" }
        table #timeouts {
            thead { tr { th { "name" } th { "timeout id" } th { "due" } } }
            tbody {
                @if saga.pending_timeouts.is_empty() {
                    tr { td.muted colspan="3" { "none pending" } }
                }
                @for t in &saga.pending_timeouts {
                    tr {
                        td { (t.name) }
                        td { code { (t.timeout_id) } }
                        td { (when(t.due_at.as_deref())) }
                    }
                }
            }
        }
        h2 { "State" }
        pre #state { (state) }
    };
    let who = session(console, headers);
    Ok(page(console, Nav::Sagas, "Saga", who.as_ref(), body).into_response())
}
