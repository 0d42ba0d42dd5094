//! The read-only pages about the whole outbox: the overview (per topic
//! backlog, oldest unpublished age, throughput, the live chart and its JSON
//! endpoint; in the progress mode each lane's lag and the transaction
//! holding the lanes back), the relays and their lanes, the consumer groups (their lag
//! from [`crate::lag`]).

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox_runtime::inbox::groups;
use outbox_runtime::ops;
use serde_json::json;

use crate::auth::session;
use crate::error::{ConsoleError, Page};
use crate::html::{Nav, age, chart_script, next_due, page, query};
use crate::lag::{MAX_GROUPS, Reading};
use crate::{Console, Shared};

fn render(console: &Console, result: Page) -> Response {
    result.unwrap_or_else(|e| e.render(console))
}

/// `GET /`.
pub async fn overview(State(console): State<Shared>, headers: HeaderMap) -> Response {
    render(&console, overview_page(&console, &headers).await)
}

async fn overview_page(console: &Console, headers: &HeaderMap) -> Page {
    let snap = console.sampler.snapshot(&console.pool).await?;
    let s = &snap.status;
    let published = |n: i64| {
        if s.estimated {
            format!("~{n}")
        } else {
            n.to_string()
        }
    };
    let backlog = |n: i64| {
        if s.backlog_estimated {
            format!("~{n}")
        } else {
            n.to_string()
        }
    };
    let counts = match (s.backlog_estimated, s.estimated) {
        (false, false) => "Every count is exact.",
        (false, true) => {
            "Published counts are estimates from the table's statistics; every other count is exact."
        }
        (true, false) => {
            "Counts marked ~ are estimates (a backlog of more than 10,000 rows of a kind; topics \
             whose rows all lie beyond the first 10,000 are not listed); published counts are exact."
        }
        (true, true) => {
            "Counts marked ~ are estimates (a backlog of more than 10,000 rows of a kind; topics \
             whose rows all lie beyond the first 10,000 are not listed, and published counts come \
             from the table's statistics)."
        }
    };
    let body = html! {
        h1 { "Overview" }
        div.cards {
            div.card { b data-total="unpublished" { (backlog(s.unpublished)) } span { "unpublished" } }
            div.card { b data-total="age" { (age(s.oldest_unpublished_secs)) } span { "oldest unpublished" } }
            div.card { b data-total="held" { (backlog(s.held)) } span { "held" } }
            div.card {
                b data-total="scheduled" { (backlog(s.scheduled.total)) }
                span { "scheduled, next " span data-total="next_due" { (next_due(s.scheduled.next_due_secs)) } }
            }
            div.card { b { a href=(console.link("/parked")) data-total="parked" { (backlog(s.parked)) } } span { "parked" } }
            div.card { b data-total="discarded" { (backlog(s.discarded)) } span { "dropped" } }
            div.card {
                b data-total="published" { (published(s.published)) }
                span { "published" @if s.estimated { " (estimate)" } }
            }
            div.card { b { a href=(console.link("/relays")) data-total="relays" { (s.relays.len()) } } span { "relays" } }
        }
        h2 { "Throughput" }
        svg #chart role="img" aria-label="rows written and published per second" {}
        div.legend {
            span { i style="background:#2f5fd0" {} "published/s" }
            span { i style="background:#9aa6b8" {} "written/s" }
            span { "updated " span #updated { "–" } }
        }
        h2 { "Topics" }
        table #topics {
            thead { tr {
                th { "topic" } th.num { "unpublished" } th.num { "held" } th.num { "scheduled" }
                th.num { "oldest unpublished" }
                th.num { "published/s" } th.num { "parked" } th.num { "dropped" } th.num { "published" }
            } }
            tbody {
                @if s.topics.is_empty() {
                    tr { td.muted colspan="9" { "the outbox is empty" } }
                }
                @for t in &s.topics {
                    @let topic = t.topic.as_str();
                    @let rate = snap.rates.get(topic).map_or_else(|| "–".to_owned(), |r| format!("{r:.1}/s"));
                    tr {
                        td { (topic) }
                        td.num data-topic=(topic) data-field="unpublished" { (backlog(t.unpublished)) }
                        td.num data-topic=(topic) data-field="held" { (backlog(t.held)) }
                        td.num data-topic=(topic) data-field="scheduled" { (backlog(t.scheduled)) }
                        td.num data-topic=(topic) data-field="age" { (age(t.oldest_unpublished_secs)) }
                        td.num data-topic=(topic) data-field="rate" { (rate) }
                        td.num {
                            a href={ (console.link("/parked")) (query(&[("topic", topic)])) }
                              data-topic=(topic) data-field="parked" { (backlog(t.parked)) }
                        }
                        td.num data-topic=(topic) data-field="discarded" { (backlog(t.discarded)) }
                        td.num data-topic=(topic) data-field="published" { (published(t.published)) }
                    }
                }
            }
        }
        @if let Some(p) = &s.progress { (progress_section(p)) }
        p.muted {
            "Outbox table in schema " code { (s.schema) } "; commit-time NOTIFY "
            (if s.notify_enabled { "on" } else { "off" })
            " (channel " code { (s.channel) } "). " (counts)
        }
        (chart_script(&console.link("/api/overview")))
    };
    let who = session(console, headers);
    Ok(page(console, Nav::Overview, "Overview", who.as_ref(), body).into_response())
}

/// `GET /api/overview`: the status, the rates and the chart's points.
pub async fn overview_json(State(console): State<Shared>) -> Response {
    match console.sampler.snapshot(&console.pool).await {
        Ok(snap) => {
            let backlog_estimated = snap.status.backlog_estimated;
            let backlog = |n: i64| {
                if backlog_estimated {
                    json!(format!("~{n}"))
                } else {
                    json!(n)
                }
            };
            let topics: Vec<_> = snap
                .status
                .topics
                .iter()
                .map(|t| {
                    json!({
                        "topic": t.topic,
                        "unpublished": backlog(t.unpublished),
                        "held": backlog(t.held),
                        "scheduled": backlog(t.scheduled),
                        "parked": backlog(t.parked),
                        "discarded": backlog(t.discarded),
                        "published": if snap.status.estimated { format!("~{}", t.published) } else { t.published.to_string() },
                        "oldest_unpublished_secs": t.oldest_unpublished_secs,
                        "oldest_unpublished": age(t.oldest_unpublished_secs),
                        "published_per_sec": snap.rates.get(&t.topic),
                    })
                })
                .collect();
            let s = &snap.status;
            let published = |n: i64| {
                if s.estimated {
                    format!("~{n}")
                } else {
                    n.to_string()
                }
            };
            Json(json!({
                "unpublished": backlog(s.unpublished),
                "held": backlog(s.held),
                "scheduled": backlog(s.scheduled.total),
                "next_due_secs": s.scheduled.next_due_secs,
                "next_due": next_due(s.scheduled.next_due_secs),
                "parked": backlog(s.parked),
                "discarded": backlog(s.discarded),
                "backlog_estimated": s.backlog_estimated,
                "published": published(s.published),
                "published_estimated": s.estimated,
                "oldest_unpublished_secs": s.oldest_unpublished_secs,
                "oldest_unpublished": age(s.oldest_unpublished_secs),
                "relays": s.relays.len(),
                "topics": topics,
                "progress": s.progress,
                "points": snap.points,
            }))
            .into_response()
        }
        Err(error) => {
            let (status, _, text) = ConsoleError::from(error).parts();
            (status, Json(json!({ "error": text }))).into_response()
        }
    }
}

/// The progress mode's lanes (events their position has not passed, the
/// oldest one's age, the position) and the transaction holding them back.
fn progress_section(p: &ops::ProgressLag) -> maud::Markup {
    let more = |n: i64| {
        if n > ops::LAG_EXACT_UP_TO {
            format!("more than {}", ops::LAG_EXACT_UP_TO)
        } else {
            n.to_string()
        }
    };
    html! {
        h2 { "Lanes (progress mode)" }
        p #holding {
            @match &p.holding {
                None => { "No transaction holds the lanes' windows back." }
                Some(h) => {
                    b { "Held back by transaction " (h.xid) }
                    " (" (h.pid.map_or_else(|| "no backend: prepared?".to_owned(), |p| format!("pid {p}")))
                    ", " (h.age_secs.map_or_else(
                        || "open for an unknown time: its age needs pg_read_all_stats".to_owned(),
                        |a| format!("open for {}", age(Some(a)))))
                    @if let Some(state) = &h.state { ", " (state) }
                    @if let Some(app) = h.application_name.as_deref().filter(|a| !a.is_empty()) {
                        ", application " (app)
                    }
                    @if let Some(user) = &h.user { ", role " (user) }
                    "), in the snapshots of " (h.lanes) " lane(s): its events, if any, go out                      once it commits."
                }
            }
        }
        table #lanes {
            thead { tr {
                th { "lane" } th.num { "lag (events)" } th.num { "oldest" } th.num { "after id" }
                th.num { "recorded" } th { "position (done .. window)" }
            } }
            tbody {
                @for l in &p.lanes {
                    tr {
                        td {
                            @match l.lane_count {
                                Some(1) => { "all slots" }
                                Some(count) => { (l.lane) " of " (count) }
                                None => { (l.slots) }
                            }
                        }
                        td.num data-lane=(l.lane) data-field="events" { (more(l.events)) }
                        td.num { (age(l.oldest_secs)) }
                        td.num { (l.after_id.map_or_else(|| "–".into(), |a| a.to_string())) }
                        td.num { (age(Some(l.recorded_secs_ago))) " ago" }
                        td { code { (l.done) " .. " (l.upto.as_deref().unwrap_or("(next)")) } }
                    }
                }
            }
        }
    }
}

/// `0-5,9,12-13`, or "none yet".
fn lane_list(lanes: &[i32]) -> String {
    if lanes.is_empty() {
        "none yet".into()
    } else {
        ops::lane_ranges(lanes)
    }
}

/// `GET /relays`.
pub async fn relays(State(console): State<Shared>, headers: HeaderMap) -> Response {
    render(&console, relays_page(&console, &headers).await)
}

async fn relays_page(console: &Console, headers: &HeaderMap) -> Page {
    let relays = ops::relays(&console.pool).await?;
    let body = html! {
        h1 { "Relays" }
        p.muted { "The relays running on this outbox, read from the advisory locks they hold: \
            a relay that stops answering loses its lanes to the others." }
        table #relays {
            thead { tr {
                th { "relay (backend pid)" } th { "client" } th.num { "lane count" } th { "lanes owned" }
            } }
            tbody {
                @if relays.is_empty() {
                    tr { td.muted colspan="4" { "no relay is running" } }
                }
                @for r in &relays {
                    tr {
                        td { (r.pid) }
                        td { (r.client.as_deref().unwrap_or("local")) }
                        td.num { (r.lane_count.map_or_else(|| "–".into(), |c| c.to_string())) }
                        td {
                            @if r.lane_count == Some(0) { "all (no lanes)" } @else { (lane_list(&r.lanes)) }
                        }
                    }
                }
            }
        }
    };
    let who = session(console, headers);
    Ok(page(console, Nav::Relays, "Relays", who.as_ref(), body).into_response())
}

/// `GET /consumers`.
pub async fn consumers(State(console): State<Shared>, headers: HeaderMap) -> Response {
    render(&console, consumers_page(&console, &headers).await)
}

async fn consumers_page(console: &Console, headers: &HeaderMap) -> Page {
    let mut groups = groups::groups(&console.pool).await?;
    let total = groups.len();
    groups.truncate(MAX_GROUPS);
    let names: Vec<String> = groups.iter().map(|g| g.group.clone()).collect();
    let lag = match &console.lag {
        Some(lag) => Some(lag.read(&names).await),
        None => None,
    };
    let reading = |group: &str| lag.as_ref().and_then(|l| l.groups.get(group));
    let body = html! {
        h1 { "Consumer groups" }
        @if let Some(lag) = &lag {
            p.muted {
                "Groups this database has rows of (dedup rows, inbox rows, dead letters). Lag: the \
                 group's committed offsets against the end of each partition's log, read from the \
                 broker in the background at most every " (lag.refresh.as_secs()) " s"
                @if let Some(ago) = lag.last_read { " (last read " (age(Some(ago.as_secs_f64()))) " ago)" }
                "."
            }
        } @else {
            p.muted { "Groups this database has rows of (dedup rows, inbox rows, dead letters). No \
                broker is configured, so the lag is not shown: what the database knows is the inbox \
                backlog (inbox mode) and the open dead letters. Start the console with brokers to \
                see the lag." }
        }
        @if total > groups.len() {
            p.notice #capped { "The first " (groups.len()) " of " (total) " groups, by name." }
        }
        table #groups {
            thead { tr {
                th { "group" } th.num { "inbox pending" } th.num { "oldest pending" }
                th.num { "dead letters" } th.num { "marked for retry" } th.num { "lag" }
            } }
            tbody {
                @if groups.is_empty() {
                    tr { td.muted colspan="6" { "no consumer group has left rows in this database" } }
                }
                @for g in &groups {
                    tr {
                        td { (g.group) }
                        td.num { (g.inbox_pending) }
                        td.num { (age(g.oldest_pending_secs)) }
                        td.num {
                            a href={ (console.link("/dead-letters")) (query(&[("consumer", &g.group)])) } { (g.dead) }
                        }
                        td.num { (g.retry) }
                        td.num {
                            @match (lag.is_some(), reading(&g.group)) {
                                (false, _) => "–",
                                (true, None) => span.muted { "reading…" },
                                (true, Some(Reading::Failed(text))) => span.error { (text) },
                                (true, Some(Reading::Read(parts))) if parts.is_empty() => "no committed offsets",
                                (true, Some(Reading::Read(parts))) if parts.iter().any(|p| p.end_unknown) => {
                                    span title="the broker reports a log end below the committed offset on some partition" {
                                        "≥ " (parts.iter().map(|p| p.lag).sum::<i64>()) " ?"
                                    }
                                }
                                (true, Some(Reading::Read(parts))) => (parts.iter().map(|p| p.lag).sum::<i64>()),
                            }
                        }
                    }
                }
            }
        }
        @for g in &groups {
            @if let Some(Reading::Read(parts)) = reading(&g.group) {
                @if !parts.is_empty() {
                    h2 { (g.group) }
                    table {
                        thead { tr {
                            th { "topic" } th.num { "partition" } th.num { "committed" }
                            th.num { "log end" } th.num { "lag" }
                        } }
                        tbody {
                            @for p in parts {
                                tr {
                                    td { (p.topic) } td.num { (p.partition) } td.num { (p.committed) }
                                    td.num { (p.log_end) }
                                    td.num {
                                        @if p.end_unknown {
                                            span title="the broker reports a log end below the committed offset: the lag is unknown" { "?" }
                                        } @else {
                                            (p.lag)
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    let who = session(console, headers);
    Ok(page(
        console,
        Nav::Consumers,
        "Consumer groups",
        who.as_ref(),
        body,
    )
    .into_response())
}
