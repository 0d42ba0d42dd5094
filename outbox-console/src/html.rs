//! HTML output: the page layout (maud templates, which escape every value
//! they are given), the stylesheet, the chart's script, how long texts are
//! cut, and how secrets are hidden (secret-looking header names as the CLI
//! judges Kafka settings, passwords in URLs and `password=` pairs).

use axum::http::header;
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use crate::Console;
use crate::auth::Session;

/// A query string of `pairs`, form-encoded (`?a=1&b=x+y`), or nothing.
pub fn query(pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let mut q = form_urlencoded::Serializer::for_suffix(String::from("?"), 1);
    q.extend_pairs(pairs);
    q.finish()
}

/// The text shown instead of a secret.
pub const REDACTED: &str = "***";

/// Whether a header's value is hidden: the names the CLI treats as secret
/// settings (password, secret, token, private key, ...) and the usual
/// credential headers.
pub fn secret_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    outbox_runtime::kafka::is_secret(&lower)
        || ["authorization", "cookie", "api-key", "apikey", "api_key"]
            .iter()
            .any(|s| lower.contains(s))
}

/// `text` with the password of every `scheme://user:password@host` in it
/// and every `password=value` (any case) replaced by `***` (as the CLI
/// shows database URLs). One pass over the text: each byte is looked at a
/// bounded number of times, whatever the text holds.
pub fn scrub_urls(text: &str) -> String {
    scrub_password_pairs(&scrub_url_passwords(text))
}

fn scrub_url_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (before, after) = rest.split_at(pos + 3);
        out.push_str(before);
        // The authority ends at the first '/', '?', '#' or whitespace.
        let end = after
            .find(|c: char| c == '/' || c == '?' || c == '#' || c.is_whitespace())
            .unwrap_or(after.len());
        let authority = &after[..end];
        match (authority.rfind('@'), authority.find(':')) {
            (Some(at), Some(colon)) if colon < at => {
                out.push_str(&authority[..colon + 1]);
                out.push_str(REDACTED);
                out.push_str(&authority[at..]);
            }
            _ => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// `password=...` in a query string or key-value text. The text is
/// lower-cased once (ASCII only, so offsets are the same in both).
fn scrub_password_pairs(text: &str) -> String {
    const KEY: &str = "password=";
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut from = 0;
    while let Some(pos) = lower[from..].find(KEY) {
        let value = from + pos + KEY.len();
        out.push_str(&text[from..value]);
        let end = text[value..]
            .find(|c: char| c == '&' || c == ';' || c.is_whitespace())
            .map_or(text.len(), |e| value + e);
        if end > value {
            out.push_str(REDACTED);
        }
        from = end;
    }
    out.push_str(&text[from..]);
    out
}

/// Most characters of a payload a detail page shows.
pub const MAX_SHOWN: usize = 256 * 1024;

/// Most characters of an error a detail page shows (the consumers store at
/// most 16 KiB of it; rows written before that may hold more).
pub const MAX_ERROR_SHOWN: usize = 16 * 1024;

/// `text` cut to `max` characters, with a note when cut.
pub fn shown(text: &str, max: usize) -> (&str, Option<String>) {
    match text.char_indices().nth(max) {
        None => (text, None),
        Some((at, _)) => (
            &text[..at],
            Some(format!(
                "shown: the first {max} of {} characters",
                text.chars().count()
            )),
        ),
    }
}

/// An error as a detail page shows it: cut to [`MAX_ERROR_SHOWN`]
/// characters, secrets scrubbed.
pub fn error_block(error: &str) -> Markup {
    let (text, cut) = shown(error, MAX_ERROR_SHOWN);
    html! {
        @if let Some(cut) = cut { p.muted { (cut) } }
        pre.error #error { (scrub_urls(text)) }
    }
}

/// A payload as a detail page shows it: cut to [`MAX_SHOWN`] characters.
pub fn payload_block(payload: &str) -> Markup {
    let (text, cut) = shown(payload, MAX_SHOWN);
    html! {
        @if let Some(cut) = cut { p.muted { (cut) } }
        pre #payload { (text) }
    }
}

/// A table of headers (a JSON object), secret-looking ones redacted.
pub fn headers_table(headers: &serde_json::Value) -> Markup {
    let Some(map) = headers.as_object().filter(|m| !m.is_empty()) else {
        return html! { p.muted { "no headers" } };
    };
    html! {
        table.kv { tbody {
            @for (name, value) in map {
                @let value = match value {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                tr {
                    th { (name) }
                    td { code {
                        @if secret_header(name) { (REDACTED) } @else { (scrub_urls(&value)) }
                    } }
                }
            }
        } }
    }
}

/// An age in seconds for people: `42s`, `3m 20s`, `5h 2m`, `2d 4h`.
pub fn age(secs: Option<f64>) -> String {
    let Some(secs) = secs else {
        return "–".into();
    };
    let s = secs.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// When the next scheduled event is due, for people: `in 3m 20s`,
/// `overdue 5s` (no relay released it yet), `–` (none scheduled).
pub fn next_due(secs: Option<f64>) -> String {
    match secs {
        None => "–".into(),
        Some(s) if s >= 0.0 => format!("in {}", age(Some(s))),
        Some(s) => format!("overdue {}", age(Some(-s))),
    }
}

/// The hidden field that carries the session's form token: every form
/// that POSTs has it (a write without it is refused).
pub fn csrf_field(session: Option<&Session>) -> Markup {
    html! {
        @if let Some(s) = session {
            input type="hidden" name=(crate::auth::CSRF_FIELD) value=(s.csrf);
        }
    }
}

/// Which page is current in the navigation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Nav {
    Overview,
    Relays,
    Consumers,
    Parked,
    DeadLetters,
    Sagas,
    Audit,
    Login,
}

/// A whole page: head, navigation, the write state, `body`.
pub fn page(
    console: &Console,
    nav: Nav,
    title: &str,
    session: Option<&Session>,
    body: Markup,
) -> Markup {
    let items = [
        (Nav::Overview, "/", "Overview"),
        (Nav::Relays, "/relays", "Relays"),
        (Nav::Consumers, "/consumers", "Consumer groups"),
        (Nav::Parked, "/parked", "Parked"),
        (Nav::DeadLetters, "/dead-letters", "Dead letters"),
        (Nav::Sagas, "/sagas", "Sagas"),
        (Nav::Audit, "/audit", "Audit"),
    ];
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox console" }
                link rel="stylesheet" href=(console.link("/console.css"));
            }
            body {
                header {
                    strong.brand { "outbox" }
                    nav {
                        @for (item, path, label) in items {
                            a.current[item == nav] href=(console.link(path)) { (label) }
                        }
                    }
                    div.who {
                        @if !console.config.writable() {
                            span.badge #mode { "read-only" }
                        } @else if let Some(s) = session {
                            span.badge.write #mode { "writing as " (s.operator) }
                            form.inline method="post" action=(console.link("/logout")) {
                                (csrf_field(Some(s)))
                                button.link type="submit" { "log out" }
                            }
                        } @else {
                            span.badge #mode { "not logged in" }
                            " "
                            a.current[nav == Nav::Login] href=(console.link("/login")) { "log in to write" }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// The stylesheet (cached by browsers for an hour).
pub async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        CSS,
    )
        .into_response()
}

const CSS: &str = r#"
:root { --fg:#1d2430; --muted:#6b7585; --line:#e2e6ec; --bg:#f6f7f9; --accent:#2f5fd0; --bad:#b3261e; --ok:#1c7c3a; --warn:#a15c00; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color:var(--fg); background:var(--bg); }
header { display:flex; align-items:center; gap:24px; padding:10px 24px; background:#fff; border-bottom:1px solid var(--line); }
.brand { font-size:16px; letter-spacing:.02em; }
nav { display:flex; gap:4px; flex-wrap:wrap; }
nav a { padding:6px 10px; border-radius:6px; color:var(--fg); text-decoration:none; }
nav a.current, nav a:hover { background:var(--bg); color:var(--accent); }
.who { margin-left:auto; display:flex; gap:8px; align-items:center; }
main { padding:20px 24px; max-width:1280px; }
h1 { font-size:20px; margin:0 0 14px; } h2 { font-size:16px; margin:22px 0 8px; }
a { color:var(--accent); }
table { border-collapse:collapse; width:100%; background:#fff; border:1px solid var(--line); border-radius:6px; }
th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); vertical-align:top; }
th { font-weight:600; color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.03em; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; }
table.kv th { width:200px; text-transform:none; font-size:13px; }
tr:last-child td, tr:last-child th { border-bottom:0; }
code, pre { font:12.5px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; }
pre { background:#fff; border:1px solid var(--line); border-radius:6px; padding:10px; overflow:auto; max-height:480px; white-space:pre-wrap; word-break:break-all; }
.error { color:var(--bad); white-space:pre-wrap; word-break:break-word; }
.muted { color:var(--muted); }
.badge { display:inline-block; padding:2px 8px; border-radius:10px; background:var(--line); font-size:12px; }
.badge.write { background:#fde7c8; color:var(--warn); }
.state-published { background:#d8f1df; color:var(--ok); } .state-parked, .state-dead { background:#f9dcda; color:var(--bad); }
.state-discarded { background:#eee; color:var(--muted); } .state-retry, .state-held { background:#fde7c8; color:var(--warn); }
.cards { display:flex; gap:12px; flex-wrap:wrap; margin-bottom:16px; }
.card { background:#fff; border:1px solid var(--line); border-radius:6px; padding:10px 14px; min-width:150px; }
.card b { display:block; font-size:20px; font-variant-numeric:tabular-nums; }
.card span { color:var(--muted); font-size:12px; }
form.filters { display:flex; gap:8px; flex-wrap:wrap; align-items:end; margin-bottom:12px; }
label { display:flex; flex-direction:column; gap:2px; font-size:12px; color:var(--muted); }
input, select, textarea { font:inherit; padding:5px 8px; border:1px solid #c9d0da; border-radius:5px; background:#fff; color:var(--fg); }
textarea { width:100%; max-width:640px; min-height:70px; }
button { font:inherit; padding:5px 12px; border-radius:5px; border:1px solid var(--accent); background:var(--accent); color:#fff; cursor:pointer; }
button.secondary { background:#fff; color:var(--accent); } button.danger { background:var(--bad); border-color:var(--bad); }
button.link { background:none; border:0; color:var(--accent); padding:0; text-decoration:underline; }
form.inline { display:inline; }
.actions { display:flex; gap:8px; margin:10px 0; flex-wrap:wrap; }
.notice { padding:10px 14px; border-radius:6px; margin-bottom:14px; background:#fff; border:1px solid var(--line); }
.notice.refused, .notice.bad { border-color:#f0b8b3; background:#fdf0ef; color:var(--bad); }
.notice.done { border-color:#b7e0c3; background:#eef9f1; color:var(--ok); }
.pager { margin:12px 0; display:flex; gap:12px; }
#chart { background:#fff; border:1px solid var(--line); border-radius:6px; width:100%; height:220px; }
.legend { display:flex; gap:14px; font-size:12px; color:var(--muted); margin:6px 0 0; }
.legend i { display:inline-block; width:12px; height:3px; vertical-align:middle; margin-right:4px; }
"#;

/// The overview's live chart: polls `url` every 2 s, redraws the SVG and
/// the per-topic cells (by `data-topic` and `data-field`).
pub fn chart_script(url: &str) -> Markup {
    // The URL is the console's own path, JSON-encoded for the script.
    let url = serde_json::to_string(url).unwrap_or_else(|_| "\"\"".into());
    // `</` cannot occur in the JSON string of a path made of safe characters,
    // and is escaped anyway.
    let url = url.replace("</", "<\\/");
    PreEscaped(format!(
        r#"<script>
(function () {{
  var url = {url}, svg = document.getElementById('chart'), NS = 'http://www.w3.org/2000/svg';
  function line(points, key, max, color, w, h) {{
    if (points.length < 2) return null;
    var t0 = points[0].t, t1 = points[points.length - 1].t, span = Math.max(t1 - t0, 1);
    var d = points.map(function (p, i) {{
      var x = 40 + (p.t - t0) / span * (w - 50), y = h - 20 - (p[key] / max) * (h - 40);
      return (i ? 'L' : 'M') + x.toFixed(1) + ' ' + y.toFixed(1);
    }}).join(' ');
    var path = document.createElementNS(NS, 'path');
    path.setAttribute('d', d); path.setAttribute('fill', 'none');
    path.setAttribute('stroke', color); path.setAttribute('stroke-width', '2');
    return path;
  }}
  function text(x, y, s) {{
    var t = document.createElementNS(NS, 'text');
    t.setAttribute('x', x); t.setAttribute('y', y); t.setAttribute('font-size', '11');
    t.setAttribute('fill', '#6b7585'); t.textContent = s; return t;
  }}
  function draw(points) {{
    var w = svg.clientWidth || 800, h = svg.clientHeight || 220;
    svg.setAttribute('viewBox', '0 0 ' + w + ' ' + h);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var max = 1;
    points.forEach(function (p) {{ max = Math.max(max, p.published, p.written); }});
    svg.appendChild(text(4, 14, Math.round(max) + '/s'));
    svg.appendChild(text(4, h - 22, '0'));
    if (points.length < 2) {{ svg.appendChild(text(w / 2 - 60, h / 2, 'collecting samples…')); return; }}
    [['written', '#9aa6b8'], ['published', '#2f5fd0']].forEach(function (s) {{
      var p = line(points, s[0], max, s[1], w, h); if (p) svg.appendChild(p);
    }});
  }}
  function set(topic, field, value) {{
    document.querySelectorAll('[data-topic]').forEach(function (el) {{
      if (el.getAttribute('data-topic') === topic && el.getAttribute('data-field') === field) el.textContent = value;
    }});
  }}
  function tick() {{
    fetch(url, {{ headers: {{ 'Accept': 'application/json' }} }}).then(function (r) {{ return r.json(); }}).then(function (o) {{
      draw(o.points || []);
      [['unpublished', o.unpublished], ['age', o.oldest_unpublished], ['held', o.held], ['scheduled', o.scheduled],
       ['next_due', o.next_due], ['parked', o.parked], ['discarded', o.discarded], ['published', o.published], ['relays', o.relays]].forEach(function (f) {{
        var el = document.querySelector('[data-total="' + f[0] + '"]'); if (el) el.textContent = f[1];
      }});
      (o.topics || []).forEach(function (t) {{
        set(t.topic, 'unpublished', t.unpublished); set(t.topic, 'age', t.oldest_unpublished);
        set(t.topic, 'held', t.held); set(t.topic, 'scheduled', t.scheduled);
        set(t.topic, 'parked', t.parked);
        set(t.topic, 'discarded', t.discarded); set(t.topic, 'published', t.published);
        set(t.topic, 'rate', t.published_per_sec == null ? '–' : t.published_per_sec.toFixed(1) + '/s');
      }});
      var u = document.getElementById('updated'); if (u) u.textContent = new Date().toLocaleTimeString();
    }}).catch(function () {{}});
  }}
  draw([]); tick(); setInterval(tick, 2000);
}})();
</script>"#
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_escape_every_value() {
        let hostile = r#"<script>alert("x&y")</script>"#;
        assert_eq!(
            html! { td title=(hostile) { (hostile) } }.into_string(),
            "<td title=\"&lt;script&gt;alert(&quot;x&amp;y&quot;)&lt;/script&gt;\">\
             &lt;script&gt;alert(&quot;x&amp;y&quot;)&lt;/script&gt;</td>"
        );
    }

    #[test]
    fn query_strings_are_form_encoded() {
        assert_eq!(
            query(&[("a", "x y&c=\"<"), ("b", "1")]),
            "?a=x+y%26c%3D%22%3C&b=1"
        );
        assert_eq!(query(&[]), "");
    }

    #[test]
    fn secrets_are_hidden() {
        assert!(secret_header("Authorization"));
        assert!(secret_header("x-api-key"));
        assert!(secret_header("sasl.password"));
        assert!(secret_header("refresh_token"));
        assert!(!secret_header("traceparent"));
        assert_eq!(
            scrub_urls("connect postgres://u:s3cret@db:5432/x failed"),
            "connect postgres://u:***@db:5432/x failed"
        );
        assert_eq!(
            scrub_urls("host=db password=s3cret user=u"),
            "host=db password=*** user=u"
        );
        assert_eq!(scrub_urls("http://example/x"), "http://example/x");
    }

    /// A megabyte of hostile text (thousands of `password=` and URLs with
    /// credentials) is scrubbed in one pass: no quadratic blow-up.
    #[test]
    fn scrubbing_a_megabyte_is_linear() {
        let unit = "password=sekrit x postgres://u:sekrit@db/ PASSWORD=sekrit;";
        let text = unit.repeat((1 << 20) / unit.len());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(scrub_urls(&text));
        });
        let scrubbed = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("a megabyte scrubbed in 20 s (a linear pass takes milliseconds)");
        assert!(!scrubbed.contains("sekrit"));
        assert!(scrubbed.starts_with("password=*** x postgres://u:***@db/ PASSWORD=***;"));
    }

    #[test]
    fn long_texts_are_cut() {
        let long = "é".repeat(MAX_SHOWN + 5);
        let (text, note) = shown(&long, MAX_SHOWN);
        assert_eq!(text.chars().count(), MAX_SHOWN);
        assert!(note.unwrap().contains(&(MAX_SHOWN + 5).to_string()));
        assert_eq!(shown("short", 10), ("short", None));
    }
}
