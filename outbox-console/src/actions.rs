//! The writes: requeue or drop parked rows, retry or drop dead letters.
//! Each is two POSTs: the first (from a list or a detail page) shows what
//! will be done and asks for a reason; the second, with `confirm=yes` and
//! the reason, does it — the change and its audit record (`outbox_audit`:
//! who, what, which rows, how many changed, why, when, from where) in one
//! transaction. Both check the write session first (403 otherwise) and the
//! input (400: ids, the reason's length).

use std::fmt::Write as _;

use axum::Form;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use outbox_runtime::inbox::dead_letter;
use outbox_runtime::ops;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::auth::{Operator, operator, require_writer};
use crate::error::{ConsoleError, Page};
use crate::html::{Nav, esc, page};
use crate::rows::parse_id;
use crate::{Console, Shared};

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
    headers: HeaderMap,
    Form(pairs): Form<Vec<(String, String)>>,
) -> Response {
    action(&console, &headers, &pairs, true)
        .await
        .unwrap_or_else(|e| e.render(&console))
}

/// `POST /dead-letters/action`.
pub async fn dead_letter_action(
    State(console): State<Shared>,
    headers: HeaderMap,
    Form(pairs): Form<Vec<(String, String)>>,
) -> Response {
    action(&console, &headers, &pairs, false)
        .await
        .unwrap_or_else(|e| e.render(&console))
}

async fn action(
    console: &Console,
    headers: &HeaderMap,
    pairs: &[(String, String)],
    parked: bool,
) -> Page {
    // The session first: nothing about the rows is said without it.
    let who = require_writer(console, headers)?;
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
    let client = headers
        .get("x-forwarded-for")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.chars().take(200).collect::<String>());
    let affected = apply(
        &console.pool,
        &who,
        request.action,
        &request.ids,
        &reason,
        client,
    )
    .await?;
    tracing::info!(
        operator = %who.0,
        action = request.action.as_str(),
        ids = ?request.ids,
        affected,
        reason = %reason,
        "console write"
    );
    let a = request.action;
    let mut body = format!(
        "<h1>{} done</h1><div class=\"notice done\" id=\"outcome\">{} {affected} of {} {}(s) selected; \
         recorded in the audit trail.</div><ul>",
        a.verb(),
        match a {
            Action::ParkedRequeue => "Requeued",
            Action::ParkedDrop | Action::DeadLetterDrop => "Dropped",
            Action::DeadLetterRetry => "Marked for retry",
        },
        request.ids.len(),
        a.what(),
    );
    for id in request.ids.iter().take(20) {
        let _ = write!(
            body,
            "<li><a href=\"{}\" class=\"row-link\">{} {id}</a></li>",
            esc(&console.link(&format!("{}/{id}", a.path()))),
            a.what()
        );
    }
    let _ = write!(
        body,
        "</ul><p><a href=\"{}\">back to the list</a> · <a href=\"{}\">audit trail</a></p>",
        esc(&console.link(a.path())),
        esc(&console.link("/audit"))
    );
    Ok(page(console, a.nav(), "Done", Some(&who.0), &body).into_response())
}

/// The confirmation step: what will be done, and the reason to give.
fn confirmation(
    console: &Console,
    who: &Operator,
    request: &Request,
    problem: Option<&str>,
) -> Response {
    let a = request.action;
    let ids: Vec<String> = request.ids.iter().map(i64::to_string).collect();
    let mut hidden = String::new();
    for id in &ids {
        let _ = write!(hidden, "<input type=\"hidden\" name=\"id\" value=\"{id}\">");
    }
    let shown: Vec<&str> = ids.iter().take(50).map(String::as_str).collect();
    let body = format!(
        "<h1>{} {} {}(s)?</h1>{}<div class=\"notice\">{} {}: {}{}</div>\
         <form method=\"post\" action=\"{}\">{hidden}\
         <input type=\"hidden\" name=\"action\" value=\"{}\"><input type=\"hidden\" name=\"confirm\" value=\"yes\">\
         <p><label>Reason (required, kept in the audit trail with your name, {})\
         <textarea name=\"reason\" id=\"reason\" required maxlength=\"{MAX_REASON}\">{}</textarea></label></p>\
         <div class=\"actions\"><button type=\"submit\" id=\"confirm\"{}>{} {} {}(s)</button>\
         <a href=\"{}\">cancel</a></div></form>",
        a.verb(),
        ids.len(),
        a.what(),
        problem
            .map(|p| format!("<div class=\"notice bad\" id=\"problem\">{}</div>", esc(p)))
            .unwrap_or_default(),
        a.effect(),
        if ids.len() == 1 { "Row" } else { "Rows" },
        shown.join(", "),
        if ids.len() > shown.len() { ", …" } else { "" },
        esc(&console.link(&format!("{}/action", a.path()))),
        match a {
            Action::ParkedRequeue => "requeue",
            Action::ParkedDrop | Action::DeadLetterDrop => "drop",
            Action::DeadLetterRetry => "retry",
        },
        esc(&who.0),
        esc(request.reason.as_deref().unwrap_or("")),
        if matches!(a, Action::ParkedDrop | Action::DeadLetterDrop) {
            " class=\"danger\""
        } else {
            ""
        },
        a.verb(),
        ids.len(),
        a.what(),
        esc(&console.link(a.path())),
    );
    page(console, a.nav(), "Confirm", Some(&who.0), &body).into_response()
}

/// The change and its audit record, in one transaction.
async fn apply(
    pool: &PgPool,
    who: &Operator,
    action: Action,
    ids: &[i64],
    reason: &str,
    client: Option<String>,
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
    .bind(&who.0)
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
    /// The client's forwarded address, when a proxy said it.
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
    let mut body = String::from(
        "<h1>Audit trail</h1><p class=\"muted\">Every write made through the console, newest first.</p>\
         <table id=\"audit\"><thead><tr><th>when (UTC)</th><th>operator</th><th>action</th>\
         <th>rows</th><th class=\"num\">changed</th><th>reason</th></tr></thead><tbody>",
    );
    if records.is_empty() {
        body.push_str("<tr><td colspan=\"6\" class=\"muted\">nothing recorded yet</td></tr>");
    }
    for r in records.iter().take(LIMIT as usize) {
        let ids: Vec<String> = r.ids.iter().take(20).map(i64::to_string).collect();
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            esc(&r.at),
            esc(&r.operator),
            esc(&r.action),
            ids.join(", "),
            if r.ids.len() > ids.len() { ", …" } else { "" },
            r.affected,
            esc(&r.reason),
        );
    }
    body.push_str("</tbody></table>");
    if more && let Some(last) = records.get(LIMIT as usize - 1) {
        let _ = write!(
            body,
            "<div class=\"pager\"><a id=\"next\" href=\"{}?before={}\">older →</a></div>",
            esc(&console.link("/audit")),
            last.id
        );
    }
    let who = operator(console, headers);
    Ok(page(
        console,
        Nav::Audit,
        "Audit trail",
        who.as_ref().map(|o| o.0.as_str()),
        &body,
    )
    .into_response())
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
