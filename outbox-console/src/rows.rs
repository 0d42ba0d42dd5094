//! Parked outbox rows and dead letters: the lists (filters, keyset pages of
//! at most [`MAX_PAGE`] rows) and the detail page of one row (error,
//! headers with secrets hidden, payload), each with the forms of the writes
//! it allows.

use std::fmt::Write as _;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter, STATUSES};
use outbox_runtime::ops::{self, MAX_PAGE, ParkedFilter, check_filter_text};
use serde::Deserialize;

use crate::auth::operator;
use crate::error::{ConsoleError, Page};
use crate::html::{Nav, esc, headers_table, page, scrub_urls, shown, url_param};
use crate::{Console, Shared};

/// Rows per page unless asked otherwise.
pub const PAGE: i64 = 50;

fn render(console: &Console, result: Page) -> Response {
    result.unwrap_or_else(|e| e.render(console))
}

/// A filter value: `None` when empty, refused when too long.
fn filter_text(what: &str, value: &Option<String>) -> Result<Option<String>, ConsoleError> {
    match value.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(text) => {
            check_filter_text(what, text)?;
            Ok(Some(text.to_owned()))
        }
    }
}

/// A positive row id given as text.
pub fn parse_id(what: &str, text: &str) -> Result<i64, ConsoleError> {
    match text.trim().parse::<i64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(ConsoleError::BadInput(format!(
            "invalid {what} `{}`: a positive whole number",
            text.chars().take(40).collect::<String>()
        ))),
    }
}

fn page_params(
    after: &Option<String>,
    limit: &Option<String>,
) -> Result<(Option<i64>, i64), ConsoleError> {
    let after = match after.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(text) => Some(parse_id("page position (after)", text)?),
    };
    let limit = match limit.as_deref().map(str::trim) {
        None | Some("") => PAGE,
        Some(text) => match text.parse::<i64>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => {
                return Err(ConsoleError::BadInput(format!(
                    "invalid limit `{}`: between 1 and {MAX_PAGE}",
                    text.chars().take(40).collect::<String>()
                )));
            }
        },
    };
    Ok((after, limit))
}

fn who(console: &Console, headers: &HeaderMap) -> Option<String> {
    operator(console, headers).map(|o| o.0)
}

/// The parked list's query string.
#[derive(Deserialize, Default)]
pub struct ParkedQuery {
    topic: Option<String>,
    key: Option<String>,
    error: Option<String>,
    after: Option<String>,
    limit: Option<String>,
}

/// `GET /parked`.
pub async fn parked_list(
    State(console): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<ParkedQuery>,
) -> Response {
    render(&console, parked_list_page(&console, &headers, q).await)
}

async fn parked_list_page(console: &Console, headers: &HeaderMap, q: ParkedQuery) -> Page {
    let topic = filter_text("topic", &q.topic)?;
    let key = filter_text("key", &q.key)?;
    let error = filter_text("error text", &q.error)?;
    let (after, limit) = page_params(&q.after, &q.limit)?;
    let mut filter = ParkedFilter::new().limit(limit + 1);
    filter.topic = topic.clone();
    filter.key = key.clone();
    filter.error_contains = error.clone();
    filter.after_id = after;
    let mut rows = ops::parked_page(&console.pool, &filter).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let mut body = format!(
        "<h1>Parked rows</h1><p class=\"muted\">Rows the relays gave up on after repeated \
         failures (dropped ones are not listed), oldest first. Requeue puts them back in the \
         relays' queue; drop keeps them, never published.</p>\
         <form class=\"filters\" method=\"get\" action=\"{}\">\
         <label>topic<input name=\"topic\" value=\"{}\"></label>\
         <label>key<input name=\"key\" value=\"{}\"></label>\
         <label>error contains<input name=\"error\" value=\"{}\"></label>\
         <button type=\"submit\" class=\"secondary\">Filter</button></form>",
        esc(&console.link("/parked")),
        esc(topic.as_deref().unwrap_or("")),
        esc(key.as_deref().unwrap_or("")),
        esc(error.as_deref().unwrap_or("")),
    );
    let _ = write!(
        body,
        "<form method=\"post\" action=\"{}\"><table id=\"parked\"><thead><tr><th></th><th>id</th><th>topic</th>\
         <th>key</th><th>event type</th><th class=\"num\">attempts</th><th>last error</th></tr></thead><tbody>",
        esc(&console.link("/parked/action"))
    );
    if rows.is_empty() {
        body.push_str("<tr><td colspan=\"7\" class=\"muted\">no parked rows match</td></tr>");
    }
    for r in &rows {
        let error = r.last_error.as_deref().unwrap_or("");
        let first_line: String = error
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(160)
            .collect();
        let _ = write!(
            body,
            "<tr data-id=\"{id}\"><td><input type=\"checkbox\" name=\"id\" value=\"{id}\" aria-label=\"select row {id}\"></td>\
             <td><a href=\"{}\">{id}</a></td><td>{}</td><td><code>{}</code></td><td>{}</td>\
             <td class=\"num\">{}</td><td class=\"error\">{}</td></tr>",
            esc(&console.link(&format!("/parked/{}", r.id))),
            esc(&r.topic),
            esc(&r.partition_key),
            esc(&r.event_type),
            r.attempts,
            esc(&scrub_urls(&first_line)),
            id = r.id,
        );
    }
    body.push_str(
        "</tbody></table><div class=\"actions\">\
         <button type=\"submit\" name=\"action\" value=\"requeue\">Requeue selected…</button>\
         <button type=\"submit\" name=\"action\" value=\"drop\" class=\"danger\">Drop selected…</button></div></form>",
    );
    if more && let Some(last) = rows.last() {
        let mut next = format!(
            "{}?after={}&limit={limit}",
            console.link("/parked"),
            last.id
        );
        for (name, value) in [("topic", &topic), ("key", &key), ("error", &error)] {
            if let Some(v) = value {
                let _ = write!(next, "&{name}={}", url_param(v));
            }
        }
        let _ = write!(
            body,
            "<div class=\"pager\"><a id=\"next\" href=\"{}\">next page →</a></div>",
            esc(&next)
        );
    }
    if after.is_some() {
        let _ = write!(
            body,
            "<div class=\"pager\"><a href=\"{}\">← first page</a></div>",
            esc(&console.link("/parked"))
        );
    }
    let who = who(console, headers);
    Ok(page(console, Nav::Parked, "Parked rows", who.as_deref(), &body).into_response())
}

/// `GET /parked/{id}`.
pub async fn parked_detail(
    State(console): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    render(&console, parked_detail_page(&console, &headers, &id).await)
}

async fn parked_detail_page(console: &Console, headers: &HeaderMap, id: &str) -> Page {
    let id = parse_id("row id", id)?;
    let Some(row) = ops::outbox_row(&console.pool, id).await? else {
        return Err(ConsoleError::NotFound(format!("no outbox row {id}")));
    };
    let state = row.state();
    let payload = serde_json::to_string_pretty(&row.payload).unwrap_or_default();
    let (payload, cut) = shown(&payload);
    let mut body = format!(
        "<h1>Outbox row {id} <span class=\"badge state-{s}\" id=\"state\">{s}</span></h1>\
         <table class=\"kv\"><tbody>\
         <tr><th>event id</th><td><code>{}</code></td></tr>\
         <tr><th>event type</th><td>{} (version {})</td></tr>\
         <tr><th>aggregate</th><td>{} <code>{}</code></td></tr>\
         <tr><th>topic</th><td>{}</td></tr><tr><th>partition key</th><td><code>{}</code></td></tr>\
         <tr><th>attempts</th><td>{}</td></tr>\
         <tr><th>created</th><td>{}</td></tr>",
        row.event_id,
        esc(&row.event_type),
        row.event_version,
        esc(&row.aggregate_type),
        esc(&row.aggregate_id),
        esc(&row.topic),
        esc(&row.partition_key),
        row.attempts,
        esc(&row.created_at),
        s = state.as_str(),
    );
    for (label, value) in [
        ("published", &row.published_at),
        ("parked", &row.parked_at),
        ("held until", &row.held_until),
        ("dropped", &row.discarded_at),
        ("drop reason", &row.discard_reason),
    ] {
        if let Some(value) = value {
            let _ = write!(body, "<tr><th>{label}</th><td>{}</td></tr>", esc(value));
        }
    }
    body.push_str("</tbody></table>");
    if let Some(error) = &row.last_error {
        let _ = write!(
            body,
            "<h2>Last error</h2><pre class=\"error\" id=\"error\">{}</pre>",
            esc(&scrub_urls(error))
        );
    }
    let _ = write!(
        body,
        "<h2>Headers</h2>{}<h2>Payload</h2>{}<pre id=\"payload\">{}</pre>",
        headers_table(&row.headers),
        cut.map(|c| format!("<p class=\"muted\">{}</p>", esc(&c)))
            .unwrap_or_default(),
        esc(&payload)
    );
    if matches!(state, ops::RowState::Parked | ops::RowState::Discarded) {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}\" class=\"actions\"><input type=\"hidden\" name=\"id\" value=\"{id}\">\
             <button type=\"submit\" name=\"action\" value=\"requeue\" id=\"requeue\">Requeue…</button>{}</form>",
            esc(&console.link("/parked/action")),
            if state == ops::RowState::Parked {
                "<button type=\"submit\" name=\"action\" value=\"drop\" class=\"danger\" id=\"drop\">Drop…</button>"
            } else {
                ""
            }
        );
    }
    let who = who(console, headers);
    Ok(page(
        console,
        Nav::Parked,
        &format!("Outbox row {id}"),
        who.as_deref(),
        &body,
    )
    .into_response())
}

/// The dead-letter list's query string.
#[derive(Deserialize, Default)]
pub struct DeadLetterQuery {
    consumer: Option<String>,
    status: Option<String>,
    reason: Option<String>,
    after: Option<String>,
    limit: Option<String>,
}

/// `GET /dead-letters`.
pub async fn dead_letter_list(
    State(console): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<DeadLetterQuery>,
) -> Response {
    render(&console, dead_letter_list_page(&console, &headers, q).await)
}

async fn dead_letter_list_page(console: &Console, headers: &HeaderMap, q: DeadLetterQuery) -> Page {
    let consumer = filter_text("consumer", &q.consumer)?;
    let status = match q.status.as_deref().map(str::trim) {
        None | Some("") | Some("open") => None,
        Some("all") => Some("all".to_owned()),
        Some(s) if STATUSES.contains(&s) => Some(s.to_owned()),
        Some(s) => {
            return Err(ConsoleError::BadInput(format!(
                "unknown status `{}`: open, dead, retry, resolved or all",
                s.chars().take(40).collect::<String>()
            )));
        }
    };
    let reason = match q.reason.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(r) => Some(r.parse::<outbox_runtime::inbox::DeadLetterReason>()?),
    };
    let (after, limit) = page_params(&q.after, &q.limit)?;
    let mut filter = DeadLetterFilter::new().limit(limit + 1);
    if let Some(c) = &consumer {
        filter = filter.consumer(c.clone());
    }
    match status.as_deref() {
        None => {}
        Some("all") => filter = filter.statuses(STATUSES),
        Some(s) => filter = filter.statuses([s]),
    }
    if let Some(r) = reason {
        filter = filter.reason(r);
    }
    if let Some(a) = after {
        filter = filter.after_id(a);
    }
    let mut rows = dead_letter::list(&console.pool, &filter).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let option = |value: &str, label: &str, current: Option<&str>| {
        format!(
            "<option value=\"{value}\"{}>{label}</option>",
            if current == Some(value) {
                " selected"
            } else {
                ""
            }
        )
    };
    let current = status.as_deref().or(Some("open"));
    let mut reasons = option("", "any", reason.map(|r| r.as_str()).or(Some("")));
    for r in outbox_runtime::inbox::DeadLetterReason::ALL {
        reasons.push_str(&option(r.as_str(), r.as_str(), reason.map(|r| r.as_str())));
    }
    let mut body = format!(
        "<h1>Dead letters</h1><p class=\"muted\">Messages consumers could not apply, oldest first. \
         Retry marks them for their group's consumer to run again; drop deletes them.</p>\
         <form class=\"filters\" method=\"get\" action=\"{}\">\
         <label>consumer group<input name=\"consumer\" value=\"{}\"></label>\
         <label>status<select name=\"status\">{}{}{}{}{}</select></label>\
         <label>reason<select name=\"reason\">{reasons}</select></label>\
         <button type=\"submit\" class=\"secondary\">Filter</button></form>",
        esc(&console.link("/dead-letters")),
        esc(consumer.as_deref().unwrap_or("")),
        option("open", "dead or retry", current),
        option("dead", "dead", current),
        option("retry", "retry", current),
        option("resolved", "resolved", current),
        option("all", "all", current),
    );
    let _ = write!(
        body,
        "<form method=\"post\" action=\"{}\"><table id=\"dead-letters\"><thead><tr><th></th><th>id</th>\
         <th>group</th><th>topic</th><th class=\"num\">partition</th><th class=\"num\">offset</th>\
         <th>reason</th><th>status</th><th>error</th></tr></thead><tbody>",
        esc(&console.link("/dead-letters/action"))
    );
    if rows.is_empty() {
        body.push_str("<tr><td colspan=\"9\" class=\"muted\">no dead letters match</td></tr>");
    }
    for r in &rows {
        let first_line: String = r
            .error
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(160)
            .collect();
        let _ = write!(
            body,
            "<tr data-id=\"{id}\"><td><input type=\"checkbox\" name=\"id\" value=\"{id}\" aria-label=\"select dead letter {id}\"></td>\
             <td><a href=\"{}\">{id}</a></td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td>{}</td><td><span class=\"badge state-{}\">{}</span></td><td class=\"error\">{}</td></tr>",
            esc(&console.link(&format!("/dead-letters/{}", r.id))),
            esc(&r.consumer),
            esc(&r.topic),
            r.partition,
            r.offset,
            esc(&r.reason),
            esc(&r.status),
            esc(&r.status),
            esc(&scrub_urls(&first_line)),
            id = r.id,
        );
    }
    body.push_str(
        "</tbody></table><div class=\"actions\">\
         <button type=\"submit\" name=\"action\" value=\"retry\">Retry selected…</button>\
         <button type=\"submit\" name=\"action\" value=\"drop\" class=\"danger\">Drop selected…</button></div></form>",
    );
    if more && let Some(last) = rows.last() {
        let mut next = format!(
            "{}?after={}&limit={limit}",
            console.link("/dead-letters"),
            last.id
        );
        if let Some(c) = &consumer {
            let _ = write!(next, "&consumer={}", url_param(c));
        }
        if let Some(s) = &status {
            let _ = write!(next, "&status={}", url_param(s));
        }
        if let Some(r) = reason {
            let _ = write!(next, "&reason={}", r.as_str());
        }
        let _ = write!(
            body,
            "<div class=\"pager\"><a id=\"next\" href=\"{}\">next page →</a></div>",
            esc(&next)
        );
    }
    let who = who(console, headers);
    Ok(page(
        console,
        Nav::DeadLetters,
        "Dead letters",
        who.as_deref(),
        &body,
    )
    .into_response())
}

/// `GET /dead-letters/{id}`.
pub async fn dead_letter_detail(
    State(console): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    render(
        &console,
        dead_letter_detail_page(&console, &headers, &id).await,
    )
}

async fn dead_letter_detail_page(console: &Console, headers: &HeaderMap, id: &str) -> Page {
    let id = parse_id("dead-letter id", id)?;
    let Some(d) = dead_letter::get(&console.pool, id).await? else {
        return Err(ConsoleError::NotFound(format!("no dead letter {id}")));
    };
    let payload = d.payload.as_deref().map(|p| {
        serde_json::from_str::<serde_json::Value>(p)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| p.to_owned())
    });
    let mut body = format!(
        "<h1>Dead letter {id} <span class=\"badge state-{s}\" id=\"state\">{s}</span></h1>\
         <table class=\"kv\"><tbody>\
         <tr><th>consumer group</th><td>{}</td></tr>\
         <tr><th>message</th><td>{} partition {} offset {}</td></tr>\
         <tr><th>key</th><td><code>{}</code></td></tr>\
         <tr><th>event</th><td>{} <code>{}</code></td></tr>\
         <tr><th>reason</th><td>{}</td></tr><tr><th>handler</th><td>{}</td></tr>\
         <tr><th>attempts / retries</th><td>{} / {}</td></tr>\
         <tr><th>first dead-lettered</th><td>{}</td></tr><tr><th>last failed</th><td>{}</td></tr>\
         </tbody></table>\
         <h2>Error</h2><pre class=\"error\" id=\"error\">{}</pre>",
        esc(&d.consumer),
        esc(&d.topic),
        d.partition,
        d.offset,
        esc(d.key.as_deref().unwrap_or("–")),
        esc(d.event_type.as_deref().unwrap_or("–")),
        d.event_id.map(|e| e.to_string()).unwrap_or_default(),
        esc(&d.reason),
        esc(d.handler.as_deref().unwrap_or("–")),
        d.attempts,
        d.retries,
        esc(&d.created_at),
        esc(&d.last_failed_at),
        esc(&scrub_urls(&d.error)),
        s = esc(&d.status),
    );
    let _ = write!(
        body,
        "<h2>Headers</h2>{}<h2>Payload</h2>",
        headers_table(&d.headers)
    );
    match payload {
        None => body.push_str("<p class=\"muted\">no payload</p>"),
        Some(p) => {
            let (p, cut) = shown(&p);
            if let Some(c) = cut {
                let _ = write!(body, "<p class=\"muted\">{}</p>", esc(&c));
            }
            let _ = write!(body, "<pre id=\"payload\">{}</pre>", esc(&p));
        }
    }
    let _ = write!(
        body,
        "<form method=\"post\" action=\"{}\" class=\"actions\"><input type=\"hidden\" name=\"id\" value=\"{id}\">{}\
         <button type=\"submit\" name=\"action\" value=\"drop\" class=\"danger\" id=\"drop\">Drop…</button></form>",
        esc(&console.link("/dead-letters/action")),
        if d.status == "dead" {
            "<button type=\"submit\" name=\"action\" value=\"retry\" id=\"retry\">Retry…</button>"
        } else {
            ""
        },
    );
    let who = who(console, headers);
    Ok(page(
        console,
        Nav::DeadLetters,
        &format!("Dead letter {id}"),
        who.as_deref(),
        &body,
    )
    .into_response())
}
