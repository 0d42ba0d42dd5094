//! The read-only pages about the whole outbox: the overview (per topic
//! backlog, oldest unpublished age, throughput, the live chart and its JSON
//! endpoint), the relays and their lanes, the consumer groups.

use std::fmt::Write as _;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use outbox_runtime::inbox::groups::{self, PartitionLag};
use outbox_runtime::ops;
use serde_json::json;

use crate::auth::operator;
use crate::error::{ConsoleError, Page};
use crate::html::{Nav, age, chart_script, esc, page, url_param};
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
    let mut body = format!(
        "<h1>Overview</h1><div class=\"cards\">\
         <div class=\"card\"><b data-total=\"unpublished\">{}</b><span>unpublished</span></div>\
         <div class=\"card\"><b data-total=\"age\">{}</b><span>oldest unpublished</span></div>\
         <div class=\"card\"><b data-total=\"held\">{}</b><span>held</span></div>\
         <div class=\"card\"><b><a href=\"{}\" data-total=\"parked\">{}</a></b><span>parked</span></div>\
         <div class=\"card\"><b data-total=\"discarded\">{}</b><span>dropped</span></div>\
         <div class=\"card\"><b data-total=\"published\">{}</b><span>published{}</span></div>\
         <div class=\"card\"><b><a href=\"{}\" data-total=\"relays\">{}</a></b><span>relays</span></div></div>",
        backlog(s.unpublished),
        age(s.oldest_unpublished_secs),
        backlog(s.held),
        esc(&console.link("/parked")),
        backlog(s.parked),
        backlog(s.discarded),
        published(s.published),
        if s.estimated { " (estimate)" } else { "" },
        esc(&console.link("/relays")),
        s.relays.len(),
    );
    body.push_str(
        "<h2>Throughput</h2><svg id=\"chart\" role=\"img\" aria-label=\"rows written and published per second\"></svg>\
         <div class=\"legend\"><span><i style=\"background:#2f5fd0\"></i>published/s</span>\
         <span><i style=\"background:#9aa6b8\"></i>written/s</span><span>updated <span id=\"updated\">–</span></span></div>",
    );
    body.push_str(
        "<h2>Topics</h2><table id=\"topics\"><thead><tr><th>topic</th><th class=\"num\">unpublished</th>\
         <th class=\"num\">held</th><th class=\"num\">oldest unpublished</th><th class=\"num\">published/s</th>\
         <th class=\"num\">parked</th><th class=\"num\">dropped</th><th class=\"num\">published</th></tr></thead><tbody>",
    );
    if s.topics.is_empty() {
        body.push_str("<tr><td colspan=\"8\" class=\"muted\">the outbox is empty</td></tr>");
    }
    for t in &s.topics {
        let topic = esc(&t.topic);
        let rate = snap
            .rates
            .get(&t.topic)
            .map_or_else(|| "–".to_owned(), |r| format!("{r:.1}/s"));
        let _ = write!(
            body,
            "<tr><td>{topic}</td>\
             <td class=\"num\" data-topic=\"{topic}\" data-field=\"unpublished\">{}</td>\
             <td class=\"num\" data-topic=\"{topic}\" data-field=\"held\">{}</td>\
             <td class=\"num\" data-topic=\"{topic}\" data-field=\"age\">{}</td>\
             <td class=\"num\" data-topic=\"{topic}\" data-field=\"rate\">{rate}</td>\
             <td class=\"num\"><a href=\"{}?topic={}\" data-topic=\"{topic}\" data-field=\"parked\">{}</a></td>\
             <td class=\"num\" data-topic=\"{topic}\" data-field=\"discarded\">{}</td>\
             <td class=\"num\" data-topic=\"{topic}\" data-field=\"published\">{}</td></tr>",
            backlog(t.unpublished),
            backlog(t.held),
            age(t.oldest_unpublished_secs),
            esc(&console.link("/parked")),
            url_param(&t.topic),
            backlog(t.parked),
            backlog(t.discarded),
            published(t.published),
        );
    }
    body.push_str("</tbody></table>");
    let _ = write!(
        body,
        "<p class=\"muted\">Outbox table in schema <code>{}</code>; commit-time NOTIFY {} \
         (channel <code>{}</code>). {}</p>",
        esc(&s.schema),
        if s.notify_enabled { "on" } else { "off" },
        esc(&s.channel),
        match (s.backlog_estimated, s.estimated) {
            (false, false) => "Every count is exact.",
            (false, true) =>
                "Published counts are estimates from the table's statistics; every other count is exact.",
            (true, false) =>
                "Counts marked ~ are estimates (a backlog of more than 10,000 rows of a kind; topics whose rows all lie beyond the first 10,000 are not listed); published counts are exact.",
            (true, true) =>
                "Counts marked ~ are estimates (a backlog of more than 10,000 rows of a kind; topics whose rows all lie beyond the first 10,000 are not listed, and published counts come from the table's statistics).",
        },
    );
    body.push_str(&chart_script(&console.link("/api/overview")));
    let who = operator(console, headers);
    Ok(page(
        console,
        Nav::Overview,
        "Overview",
        who.as_ref().map(|o| o.0.as_str()),
        &body,
    )
    .into_response())
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
                "parked": backlog(s.parked),
                "discarded": backlog(s.discarded),
                "backlog_estimated": s.backlog_estimated,
                "published": published(s.published),
                "published_estimated": s.estimated,
                "oldest_unpublished_secs": s.oldest_unpublished_secs,
                "oldest_unpublished": age(s.oldest_unpublished_secs),
                "relays": s.relays.len(),
                "topics": topics,
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
    let mut body = String::from(
        "<h1>Relays</h1><p class=\"muted\">The relays running on this outbox, read from the \
         advisory locks they hold: a relay that stops answering loses its lanes to the others.</p>\
         <table id=\"relays\"><thead><tr><th>relay (backend pid)</th><th>client</th>\
         <th class=\"num\">lane count</th><th>lanes owned</th></tr></thead><tbody>",
    );
    if relays.is_empty() {
        body.push_str("<tr><td colspan=\"4\" class=\"muted\">no relay is running</td></tr>");
    }
    for r in &relays {
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            r.pid,
            esc(r.client.as_deref().unwrap_or("local")),
            r.lane_count.map_or_else(|| "–".into(), |c| c.to_string()),
            if r.lane_count == Some(0) {
                "all (no lanes)".to_owned()
            } else {
                esc(&lane_list(&r.lanes))
            },
        );
    }
    body.push_str("</tbody></table>");
    let who = operator(console, headers);
    Ok(page(
        console,
        Nav::Relays,
        "Relays",
        who.as_ref().map(|o| o.0.as_str()),
        &body,
    )
    .into_response())
}

/// How long the lag of one group may take to read from the broker.
const LAG_TIMEOUT: Duration = Duration::from_secs(3);

/// `GET /consumers`.
pub async fn consumers(State(console): State<Shared>, headers: HeaderMap) -> Response {
    render(&console, consumers_page(&console, &headers).await)
}

async fn consumers_page(console: &Console, headers: &HeaderMap) -> Page {
    let groups = groups::groups(&console.pool).await?;
    let mut body = String::from("<h1>Consumer groups</h1>");
    body.push_str(if console.config.brokers.is_some() {
        "<p class=\"muted\">Groups this database has rows of (dedup rows, inbox rows, dead \
         letters). Lag: the group's committed offsets against the end of each partition's log, \
         read from the broker.</p>"
    } else {
        "<p class=\"muted\">Groups this database has rows of (dedup rows, inbox rows, dead \
         letters). No broker is configured, so the lag is not shown: what the database knows is \
         the inbox backlog (inbox mode) and the open dead letters. Start the console with \
         brokers to see the lag.</p>"
    });
    body.push_str(
        "<table id=\"groups\"><thead><tr><th>group</th><th class=\"num\">inbox pending</th>\
         <th class=\"num\">oldest pending</th><th class=\"num\">dead letters</th>\
         <th class=\"num\">marked for retry</th><th class=\"num\">lag</th></tr></thead><tbody>",
    );
    if groups.is_empty() {
        body.push_str("<tr><td colspan=\"6\" class=\"muted\">no consumer group has left rows in this database</td></tr>");
    }
    let mut details = String::new();
    for g in &groups {
        let lag = match &console.config.brokers {
            None => "–".to_owned(),
            Some(brokers) => match group_lag(console, brokers, &g.group).await {
                Ok(parts) => {
                    let total: i64 = parts.iter().map(|p| p.lag).sum();
                    if !parts.is_empty() {
                        let _ = write!(
                            details,
                            "<h2>{}</h2><table><thead><tr><th>topic</th><th class=\"num\">partition</th>\
                             <th class=\"num\">committed</th><th class=\"num\">log end</th><th class=\"num\">lag</th>\
                             </tr></thead><tbody>",
                            esc(&g.group)
                        );
                        for p in &parts {
                            let _ = write!(
                                details,
                                "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
                                 <td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                                esc(&p.topic),
                                p.partition,
                                p.committed,
                                p.log_end,
                                p.lag
                            );
                        }
                        details.push_str("</tbody></table>");
                        total.to_string()
                    } else {
                        "no committed offsets".to_owned()
                    }
                }
                Err(text) => format!("<span class=\"error\">{}</span>", esc(&text)),
            },
        };
        let _ = write!(
            body,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td class=\"num\"><a href=\"{}?consumer={}\">{}</a></td><td class=\"num\">{}</td>\
             <td class=\"num\">{lag}</td></tr>",
            esc(&g.group),
            g.inbox_pending,
            age(g.oldest_pending_secs),
            esc(&console.link("/dead-letters")),
            url_param(&g.group),
            g.dead,
            g.retry,
        );
    }
    body.push_str("</tbody></table>");
    body.push_str(&details);
    let who = operator(console, headers);
    Ok(page(
        console,
        Nav::Consumers,
        "Consumer groups",
        who.as_ref().map(|o| o.0.as_str()),
        &body,
    )
    .into_response())
}

/// The lag of `group`, read on a blocking thread; an error as text.
async fn group_lag(
    console: &Console,
    brokers: &str,
    group: &str,
) -> Result<Vec<PartitionLag>, String> {
    let brokers = brokers.to_owned();
    let settings = console.config.kafka_settings.clone();
    let group = group.to_owned();
    let task =
        tokio::task::spawn_blocking(move || groups::lag(&brokers, &settings, &group, LAG_TIMEOUT));
    match tokio::time::timeout(LAG_TIMEOUT * 4, task).await {
        Ok(Ok(Ok(parts))) => Ok(parts),
        Ok(Ok(Err(error))) => Err(crate::html::scrub_urls(&error.to_string())),
        Ok(Err(_)) => Err("the lag query failed".into()),
        Err(_) => Err("the broker did not answer in time".into()),
    }
}
