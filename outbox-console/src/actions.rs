//! The writes: requeue or drop parked rows, retry or drop dead letters.
//! Each is two POSTs: the first (from a list or a detail page) shows what
//! will be done and asks for a reason; the second, with `confirm=yes` and
//! the reason, does it — the change and its audit record (`outbox_audit`:
//! who, what, which rows, how many changed, why, when, from where) in one
//! transaction. Both check the write session and the form's token first
//! (403 otherwise: neither step can be forged by another site's form), then
//! the input (400: ids, the reason's length).

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Form};
use maud::html;
use outbox_runtime::inbox::dead_letter;
use outbox_runtime::ops;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::auth::{CSRF_FIELD, Session, require_writer, session};
use crate::error::{ConsoleError, Page};
use crate::guard::client_address;
use crate::html::{Nav, csrf_field, page};
use crate::rows::parse_id;
use crate::{Console, Shared};

/// The peer's address, when the server gives it.
type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

/// Most rows one write names.
pub const MAX_IDS: usize = 1000;

/// Longest reason (characters).
pub const MAX_REASON: usize = 1000;

/// What a write does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    ParkedRequeue,
    ParkedDrop,
    DeadLetterRetry,
    DeadLetterDrop,
}

impl Action {
    fn as_str(self) -> &'static str {
        match self {
            Self::ParkedRequeue => "parked_requeue",
            Self::ParkedDrop => "parked_drop",
            Self::DeadLetterRetry => "dead_letter_retry",
            Self::DeadLetterDrop => "dead_letter_drop",
        }
    }
    fn verb(self) -> &'static str {
        match self {
            Self::ParkedRequeue => "Requeue",
            Self::ParkedDrop | Self::DeadLetterDrop => "Drop",
            Self::DeadLetterRetry => "Retry",
        }
    }
    fn what(self) -> &'static str {
        match self {
            Self::ParkedRequeue | Self::ParkedDrop => "parked row",
            Self::DeadLetterRetry | Self::DeadLetterDrop => "dead letter",
        }
    }
    fn effect(self) -> &'static str {
        match self {
            Self::ParkedRequeue => {
                "The rows go back in the relays' queue (attempts reset) and are published again."
            }
            Self::ParkedDrop => {
                "The rows are marked dropped with your reason: kept, never published; a requeue undoes it."
            }
            Self::DeadLetterRetry => {
                "The consumer of each letter's group runs it again within its re-drive interval."
            }
            Self::DeadLetterDrop => {
                "The dead letters are deleted: their messages are gone from the database."
            }
        }
    }
    fn nav(self) -> Nav {
        match self {
            Self::ParkedRequeue | Self::ParkedDrop => Nav::Parked,
            Self::DeadLetterRetry | Self::DeadLetterDrop => Nav::DeadLetters,
        }
    }
    fn path(self) -> &'static str {
        match self {
            Self::ParkedRequeue | Self::ParkedDrop => "/parked",
            Self::DeadLetterRetry | Self::DeadLetterDrop => "/dead-letters",
        }
    }
}

/// A write's form, as pairs (the ids are repeated `id` fields).
struct Request {
    action: Action,
    ids: Vec<i64>,
    reason: Option<String>,
    confirmed: bool,
}

fn parse(pairs: &[(String, String)], parked: bool) -> Result<Request, ConsoleError> {
    let field = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let action = match (parked, field("action")) {
        (true, Some("requeue")) => Action::ParkedRequeue,
        (true, Some("drop")) => Action::ParkedDrop,
        (false, Some("retry")) => Action::DeadLetterRetry,
        (false, Some("drop")) => Action::DeadLetterDrop,
        (_, other) => {
            return Err(ConsoleError::BadInput(format!(
                "unknown action `{}`: {}",
                other.unwrap_or("").chars().take(40).collect::<String>(),
                if parked {
                    "requeue or drop"
                } else {
                    "retry or drop"
                }
            )));
        }
    };
    let mut ids = Vec::new();
    for (k, v) in pairs {
        if k == "id" {
            for part in v.split(',').filter(|p| !p.trim().is_empty()) {
                ids.push(parse_id("row id", part)?);
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return Err(ConsoleError::BadInput(
            "no rows selected: tick one or more rows".into(),
        ));
    }
    if ids.len() > MAX_IDS {
        return Err(ConsoleError::BadInput(format!(
            "too many rows at once: at most {MAX_IDS}"
        )));
    }
    let reason = field("reason").map(str::to_owned);
    Ok(Request {
        action,
        ids,
        reason,
        confirmed: field("confirm") == Some("yes"),
    })
}

/// A reason: required, at most [`MAX_REASON`] characters, no NUL.
pub fn check_reason(reason: Option<&str>) -> Result<String, ConsoleError> {
    let reason = reason.unwrap_or("").trim();
    if reason.is_empty() {
        return Err(ConsoleError::BadInput(
            "a reason is required (it is stored in the audit trail)".into(),
        ));
    }
    if reason.chars().count() > MAX_REASON {
        return Err(ConsoleError::BadInput(format!(
            "the reason is too long: at most {MAX_REASON} characters"
        )));
    }
    if reason.contains('\0') {
        return Err(ConsoleError::BadInput(
            "the reason holds a NUL character".into(),
        ));
    }
    Ok(reason.to_owned())
}

/// `POST /parked/action`.
pub async fn parked_action(
    State(console): State<Shared>,
    peer: Peer,
    headers: HeaderMap,
    Form(pairs): Form<Vec<(String, String)>>,
) -> Response {
    action(&console, peer, &headers, &pairs, true)
        .await
        .unwrap_or_else(|e| e.render(&console))
}

/// `POST /dead-letters/action`.
pub async fn dead_letter_action(
    State(console): State<Shared>,
    peer: Peer,
    headers: HeaderMap,
    Form(pairs): Form<Vec<(String, String)>>,
) -> Response {
    action(&console, peer, &headers, &pairs, false)
        .await
        .unwrap_or_else(|e| e.render(&console))
}

async fn action(
    console: &Console,
    peer: Peer,
    headers: &HeaderMap,
    pairs: &[(String, String)],
    parked: bool,
) -> Page {
    // The session and the form's token first: nothing about the rows is
    // said without them.
    let csrf = pairs
        .iter()
        .find(|(k, _)| k == CSRF_FIELD)
        .map(|(_, v)| v.as_str());
    let who = require_writer(console, headers, csrf)?;
    let request = parse(pairs, parked)?;
    if !request.confirmed {
        return Ok(confirmation(console, &who, &request, None));
    }
    let reason = match check_reason(request.reason.as_deref()) {
        Ok(reason) => reason,
        Err(ConsoleError::BadInput(problem)) => {
            return Ok((
                axum::http::StatusCode::BAD_REQUEST,
                confirmation(console, &who, &request, Some(&problem)),
            )
                .into_response());
        }
        Err(other) => return Err(other),
    };
    let client = client_address(&console.config, peer.map(|Extension(p)| p), headers);
    let affected = apply(
        &console.pool,
        &who,
        request.action,
        &request.ids,
        &reason,
        client.as_deref(),
    )
    .await?;
    tracing::info!(
        operator = %who.operator,
        action = request.action.as_str(),
        ids = ?request.ids,
        affected,
        reason = %reason,
        client = client.as_deref().unwrap_or("unknown"),
        "console write"
    );
    let a = request.action;
    let done = match a {
        Action::ParkedRequeue => "Requeued",
        Action::ParkedDrop | Action::DeadLetterDrop => "Dropped",
        Action::DeadLetterRetry => "Marked for retry",
    };
    let body = html! {
        h1 { (a.verb()) " done" }
        div.notice.done #outcome {
            (done) " " (affected) " of " (request.ids.len()) " " (a.what())
            "(s) selected; recorded in the audit trail."
        }
        ul {
            @for id in request.ids.iter().take(20) {
                li { a.row-link href=(console.link(&format!("{}/{id}", a.path()))) { (a.what()) " " (id) } }
            }
        }
        p {
            a href=(console.link(a.path())) { "back to the list" }
            " · "
            a href=(console.link("/audit")) { "audit trail" }
        }
    };
    Ok(page(console, a.nav(), "Done", Some(&who), body).into_response())
}

/// The confirmation step: what will be done, and the reason to give.
fn confirmation(
    console: &Console,
    who: &Session,
    request: &Request,
    problem: Option<&str>,
) -> Response {
    let a = request.action;
    let shown: Vec<String> = request.ids.iter().take(50).map(i64::to_string).collect();
    let value = match a {
        Action::ParkedRequeue => "requeue",
        Action::ParkedDrop | Action::DeadLetterDrop => "drop",
        Action::DeadLetterRetry => "retry",
    };
    let danger = matches!(a, Action::ParkedDrop | Action::DeadLetterDrop);
    let n = request.ids.len();
    let body = html! {
        h1 { (a.verb()) " " (n) " " (a.what()) "(s)?" }
        @if let Some(p) = problem { div.notice.bad #problem { (p) } }
        div.notice {
            (a.effect()) " " (if n == 1 { "Row" } else { "Rows" }) ": " (shown.join(", "))
            @if n > shown.len() { ", …" }
        }
        form method="post" action=(console.link(&format!("{}/action", a.path()))) {
            (csrf_field(Some(who)))
            @for id in &request.ids { input type="hidden" name="id" value=(id); }
            input type="hidden" name="action" value=(value);
            input type="hidden" name="confirm" value="yes";
            p { label {
                "Reason (required, kept in the audit trail with your name, " (who.operator) ")"
                textarea #reason name="reason" required maxlength=(MAX_REASON) {
                    (request.reason.as_deref().unwrap_or(""))
                }
            } }
            div.actions {
                button.danger[danger] #confirm type="submit" { (a.verb()) " " (n) " " (a.what()) "(s)" }
                a href=(console.link(a.path())) { "cancel" }
            }
        }
    };
    page(console, a.nav(), "Confirm", Some(who), body).into_response()
}

/// The change and its audit record, in one transaction.
async fn apply(
    pool: &PgPool,
    who: &Session,
    action: Action,
    ids: &[i64],
    reason: &str,
    client: Option<&str>,
) -> Result<u64, ConsoleError> {
    let mut tx = pool.begin().await?;
    let affected = match action {
        Action::ParkedRequeue => ops::requeue_parked(&mut *tx, Some(ids)).await?,
        Action::ParkedDrop => ops::discard_parked(&mut *tx, Some(ids), reason).await?,
        Action::DeadLetterRetry => dead_letter::retry(&mut *tx, None, Some(ids)).await?,
        Action::DeadLetterDrop => dead_letter::discard(&mut *tx, None, Some(ids)).await?,
    };
    sqlx::query(
        "INSERT INTO outbox_audit (operator, action, ids, affected, reason, client)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&who.operator)
    .bind(action.as_str())
    .bind(ids)
    .bind(affected as i64)
    .bind(reason)
    .bind(client)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(affected)
}

/// One write made through the console.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct AuditRecord {
    /// Record id.
    pub id: i64,
    /// When (UTC, RFC 3339).
    pub at: String,
    /// Who: the name given at login.
    pub operator: String,
    /// `parked_requeue`, `parked_drop`, `dead_letter_retry` or `dead_letter_drop`.
    pub action: String,
    /// The rows named (outbox row ids or dead-letter ids).
    pub ids: Vec<i64>,
    /// How many of them changed.
    pub affected: i64,
    /// Why.
    pub reason: String,
    /// The client's address: the peer's, or the one a trusted proxy
    /// forwarded (`None` when the server gave no peer address).
    pub client: Option<String>,
}

/// The audit trail, newest first: at most `limit` records with ids below
/// `before` (keyset pages over the primary key).
pub async fn audit_log(
    pool: &PgPool,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<AuditRecord>, outbox_runtime::Error> {
    Ok(sqlx::query_as(
        r#"SELECT id, to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS at,
                  operator, action, ids, affected, reason, client
           FROM outbox_audit WHERE id < $1 ORDER BY id DESC LIMIT $2"#,
    )
    .bind(before.unwrap_or(i64::MAX))
    .bind(limit.clamp(1, ops::MAX_PAGE))
    .fetch_all(pool)
    .await?)
}

/// The audit page's query string.
#[derive(Deserialize)]
pub struct AuditQuery {
    before: Option<String>,
}

/// `GET /audit`.
pub async fn audit_page(
    State(console): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<AuditQuery>,
) -> Response {
    audit(&console, &headers, q)
        .await
        .unwrap_or_else(|e| e.render(&console))
}

async fn audit(console: &Console, headers: &HeaderMap, q: AuditQuery) -> Page {
    const LIMIT: i64 = 50;
    let before = match q.before.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(text) => Some(parse_id("page position (before)", text)?),
    };
    let records = audit_log(&console.pool, before, LIMIT + 1).await?;
    let more = records.len() as i64 > LIMIT;
    let next = records.get(LIMIT as usize - 1).filter(|_| more);
    let body = html! {
        h1 { "Audit trail" }
        p.muted { "Every write made through the console, newest first." }
        table #audit {
            thead { tr {
                th { "when (UTC)" } th { "operator" } th { "action" } th { "rows" }
                th.num { "changed" } th { "reason" } th { "client" }
            } }
            tbody {
                @if records.is_empty() {
                    tr { td.muted colspan="7" { "nothing recorded yet" } }
                }
                @for r in records.iter().take(LIMIT as usize) {
                    @let ids: Vec<String> = r.ids.iter().take(20).map(i64::to_string).collect();
                    tr {
                        td { (r.at) }
                        td { (r.operator) }
                        td { (r.action) }
                        td { (ids.join(", ")) @if r.ids.len() > ids.len() { ", …" } }
                        td.num { (r.affected) }
                        td { (r.reason) }
                        td { (r.client.as_deref().unwrap_or("–")) }
                    }
                }
            }
        }
        @if let Some(last) = next {
            div.pager { a #next href={ (console.link("/audit")) "?before=" (last.id) } { "older →" } }
        }
    };
    let who = session(console, headers);
    Ok(page(console, Nav::Audit, "Audit trail", who.as_ref(), body).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn requests_are_checked() {
        let r = parse(
            &pairs(&[("action", "requeue"), ("id", "3"), ("id", "1,3")]),
            true,
        )
        .unwrap();
        assert_eq!(
            (r.action, r.ids, r.confirmed),
            (Action::ParkedRequeue, vec![1, 3], false)
        );
        assert!(parse(&pairs(&[("action", "retry"), ("id", "1")]), true).is_err());
        assert!(parse(&pairs(&[("action", "drop")]), false).is_err());
        for bad in ["0", "-1", "x", "1.5", "99999999999999999999"] {
            assert!(
                parse(&pairs(&[("action", "drop"), ("id", bad)]), false).is_err(),
                "{bad}"
            );
        }
        let many: Vec<(String, String)> = (1..=MAX_IDS + 1)
            .map(|i| ("id".to_string(), i.to_string()))
            .chain([("action".to_string(), "drop".to_string())])
            .collect();
        assert!(parse(&many, false).is_err());
    }

    #[test]
    fn reasons_are_checked() {
        assert_eq!(
            check_reason(Some("  broker was down ")).unwrap(),
            "broker was down"
        );
        assert!(check_reason(None).is_err());
        assert!(check_reason(Some("   ")).is_err());
        assert!(check_reason(Some(&"x".repeat(MAX_REASON + 1))).is_err());
        assert!(check_reason(Some("a\0b")).is_err());
    }
}
