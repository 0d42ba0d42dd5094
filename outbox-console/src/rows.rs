//! Parked outbox rows and dead letters: the lists (filters, keyset pages of
//! at most [`MAX_PAGE`] rows) and the detail page of one row (error,
//! headers with secrets hidden, payload), each with the forms of the writes
//! it allows (carrying the session's form token).

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter, STATUSES};
use outbox_runtime::ops::{self, MAX_PAGE, ParkedFilter, check_filter_text};
use serde::Deserialize;

use crate::auth::session;
use crate::error::{ConsoleError, Page};
use crate::html::{
    Nav, csrf_field, error_block, headers_table, page, payload_block, query, scrub_urls,
};
use crate::{Console, Shared};

/// Rows per page unless asked otherwise.
pub const PAGE: i64 = 50;

fn render(console: &Console, result: Page) -> Response {
    result.unwrap_or_else(|e| e.render(console))
}

/// A filter value: `None` when empty, refused when too long.
pub(crate) fn filter_text(
    what: &str,
    value: &Option<String>,
) -> Result<Option<String>, ConsoleError> {
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

/// The first line of an error, at most 160 characters, secrets scrubbed.
fn first_line(error: &str) -> String {
    let line: String = error
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .take(160)
        .collect();
    scrub_urls(&line)
}

/// The link to the next page (when there is one): the list's path, the
/// position after `last`, the limit and the filters given.
fn next_link(
    console: &Console,
    path: &str,
    last: Option<i64>,
    limit: i64,
    filters: &[(&str, Option<&str>)],
) -> Markup {
    let Some(last) = last else {
        return html! {};
    };
    let (last, limit) = (last.to_string(), limit.to_string());
    let mut pairs = vec![("after", last.as_str()), ("limit", limit.as_str())];
    pairs.extend(filters.iter().filter_map(|(k, v)| Some((*k, (*v)?))));
    html! {
        div.pager { a #next href={ (console.link(path)) (query(&pairs)) } { "next page →" } }
    }
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
    let who = session(console, headers);
    let body = html! {
        h1 { "Parked rows" }
        p.muted { "Rows the relays gave up on after repeated failures (dropped ones are not \
            listed), oldest first. Requeue puts them back in the relays' queue; drop keeps them, \
            never published." }
        form.filters method="get" action=(console.link("/parked")) {
            label { "topic" input name="topic" value=(topic.as_deref().unwrap_or("")); }
            label { "key" input name="key" value=(key.as_deref().unwrap_or("")); }
            label { "error contains" input name="error" value=(error.as_deref().unwrap_or("")); }
            button.secondary type="submit" { "Filter" }
        }
        form method="post" action=(console.link("/parked/action")) {
            (csrf_field(who.as_ref()))
            table #parked {
                thead { tr {
                    th {} th { "id" } th { "topic" } th { "key" } th { "event type" }
                    th.num { "attempts" } th { "last error" }
                } }
                tbody {
                    @if rows.is_empty() {
                        tr { td.muted colspan="7" { "no parked rows match" } }
                    }
                    @for r in &rows {
                        tr data-id=(r.id) {
                            td { input type="checkbox" name="id" value=(r.id) aria-label={ "select row " (r.id) }; }
                            td { a href=(console.link(&format!("/parked/{}", r.id))) { (r.id) } }
                            td { (r.topic) }
                            td { code { (r.partition_key) } }
                            td { (r.event_type) }
                            td.num { (r.attempts) }
                            td.error { (first_line(r.last_error.as_deref().unwrap_or(""))) }
                        }
                    }
                }
            }
            div.actions {
                button type="submit" name="action" value="requeue" { "Requeue selected…" }
                button.danger type="submit" name="action" value="drop" { "Drop selected…" }
            }
        }
        (next_link(
            console,
            "/parked",
            rows.last().filter(|_| more).map(|r| r.id),
            limit,
            &[("topic", topic.as_deref()), ("key", key.as_deref()), ("error", error.as_deref())],
        ))
        @if after.is_some() {
            div.pager { a href=(console.link("/parked")) { "← first page" } }
        }
    };
    Ok(page(console, Nav::Parked, "Parked rows", who.as_ref(), body).into_response())
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
    let who = session(console, headers);
    let body = html! {
        h1 { "Outbox row " (id) " " span.badge.{"state-" (state.as_str())} #state { (state.as_str()) } }
        table.kv { tbody {
            tr { th { "event id" } td { code { (row.event_id) } } }
            tr { th { "event type" } td { (row.event_type) " (version " (row.event_version) ")" } }
            tr { th { "aggregate" } td { (row.aggregate_type) " " code { (row.aggregate_id) } } }
            tr { th { "topic" } td { (row.topic) } }
            tr { th { "partition key" } td { code { (row.partition_key) } } }
            tr { th { "attempts" } td { (row.attempts) } }
            tr { th { "created" } td { (row.created_at) } }
            @if row.passed {
                tr { th { "published" } td #passed {
                    @if let Some(by) = &row.published_by {
                        "by " (by) " (the first position recorded past it: at most a minute late for older events)"
                    } @else {
                        "yes: its lane's position passed it (before the oldest position kept)"
                    }
                } }
            }
            @for (label, value) in [
                ("published", &row.published_at),
                ("parked", &row.parked_at),
                ("held until", &row.held_until),
                ("dropped", &row.discarded_at),
                ("drop reason", &row.discard_reason),
            ] {
                @if let Some(value) = value { tr { th { (label) } td { (value) } } }
            }
        } }
        @if let Some(error) = &row.last_error {
            h2 { "Last error" }
            (error_block(error))
        }
        h2 { "Headers" }
        (headers_table(&row.headers))
        h2 { "Payload" }
        (payload_block(&payload))
        @if matches!(state, ops::RowState::Parked | ops::RowState::Discarded) {
            form.actions method="post" action=(console.link("/parked/action")) {
                (csrf_field(who.as_ref()))
                input type="hidden" name="id" value=(id);
                button #requeue type="submit" name="action" value="requeue" { "Requeue…" }
                @if state == ops::RowState::Parked {
                    button.danger #drop type="submit" name="action" value="drop" { "Drop…" }
                }
            }
        }
    };
    Ok(page(
        console,
        Nav::Parked,
        &format!("Outbox row {id}"),
        who.as_ref(),
        body,
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
    let current = status.as_deref().unwrap_or("open");
    let current_reason = reason.map_or("", |r| r.as_str());
    let statuses = [
        ("open", "dead or retry"),
        ("dead", "dead"),
        ("retry", "retry"),
        ("resolved", "resolved"),
        ("all", "all"),
    ];
    let who = session(console, headers);
    let body = html! {
        h1 { "Dead letters" }
        p.muted { "Messages consumers could not apply, oldest first. Retry marks them for their \
            group's consumer to run again; drop deletes them." }
        form.filters method="get" action=(console.link("/dead-letters")) {
            label { "consumer group" input name="consumer" value=(consumer.as_deref().unwrap_or("")); }
            label { "status" select name="status" {
                @for (value, label) in statuses {
                    option value=(value) selected[current == value] { (label) }
                }
            } }
            label { "reason" select name="reason" {
                option value="" selected[current_reason.is_empty()] { "any" }
                @for r in outbox_runtime::inbox::DeadLetterReason::ALL {
                    option value=(r.as_str()) selected[current_reason == r.as_str()] { (r.as_str()) }
                }
            } }
            button.secondary type="submit" { "Filter" }
        }
        form method="post" action=(console.link("/dead-letters/action")) {
            (csrf_field(who.as_ref()))
            table #dead-letters {
                thead { tr {
                    th {} th { "id" } th { "group" } th { "topic" } th.num { "partition" }
                    th.num { "offset" } th { "reason" } th { "status" } th { "error" }
                } }
                tbody {
                    @if rows.is_empty() {
                        tr { td.muted colspan="9" { "no dead letters match" } }
                    }
                    @for r in &rows {
                        tr data-id=(r.id) {
                            td { input type="checkbox" name="id" value=(r.id) aria-label={ "select dead letter " (r.id) }; }
                            td { a href=(console.link(&format!("/dead-letters/{}", r.id))) { (r.id) } }
                            td { (r.consumer) }
                            td { (r.topic) }
                            td.num { (r.partition) }
                            td.num { (r.offset) }
                            td { (r.reason) }
                            td { span.badge.{"state-" (r.status)} { (r.status) } }
                            td.error { (first_line(&r.error)) }
                        }
                    }
                }
            }
            div.actions {
                button type="submit" name="action" value="retry" { "Retry selected…" }
                button.danger type="submit" name="action" value="drop" { "Drop selected…" }
            }
        }
        (next_link(
            console,
            "/dead-letters",
            rows.last().filter(|_| more).map(|r| r.id),
            limit,
            &[
                ("consumer", consumer.as_deref()),
                ("status", status.as_deref()),
                ("reason", reason.map(|r| r.as_str())),
            ],
        ))
    };
    Ok(page(
        console,
        Nav::DeadLetters,
        "Dead letters",
        who.as_ref(),
        body,
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
    let who = session(console, headers);
    let body = html! {
        h1 { "Dead letter " (id) " " span.badge.{"state-" (d.status)} #state { (d.status) } }
        table.kv { tbody {
            tr { th { "consumer group" } td { (d.consumer) } }
            tr { th { "message" } td { (d.topic) " partition " (d.partition) " offset " (d.offset) } }
            tr { th { "key" } td { code { (d.key.as_deref().unwrap_or("–")) } } }
            tr { th { "event" } td {
                (d.event_type.as_deref().unwrap_or("–")) " "
                code { @if let Some(e) = d.event_id { (e) } }
            } }
            tr { th { "reason" } td { (d.reason) } }
            tr { th { "handler" } td { (d.handler.as_deref().unwrap_or("–")) } }
            tr { th { "attempts / retries" } td { (d.attempts) " / " (d.retries) } }
            tr { th { "first dead-lettered" } td { (d.created_at) } }
            tr { th { "last failed" } td { (d.last_failed_at) } }
        } }
        h2 { "Error" }
        (error_block(&d.error))
        h2 { "Headers" }
        (headers_table(&d.headers))
        h2 { "Payload" }
        @match &payload {
            None => p.muted { "no payload" },
            Some(p) => (payload_block(p)),
        }
        form.actions method="post" action=(console.link("/dead-letters/action")) {
            (csrf_field(who.as_ref()))
            input type="hidden" name="id" value=(id);
            @if d.status == "dead" {
                button #retry type="submit" name="action" value="retry" { "Retry…" }
            }
            button.danger #drop type="submit" name="action" value="drop" { "Drop…" }
        }
    };
    Ok(page(
        console,
        Nav::DeadLetters,
        &format!("Dead letter {id}"),
        who.as_ref(),
        body,
    )
    .into_response())
}
