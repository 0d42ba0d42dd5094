//! The files of `deploy/` as the tests read them: the alert rules
//! (`deploy/prometheus/outbox-alerts.yml`) and the Grafana dashboard
//! (`deploy/grafana/outbox-dashboard.json`), the PromQL expressions they
//! hold, the series names and labels those use, and a scrape of the
//! Prometheus text format to check them against.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Labels Prometheus adds to every series of a target at scrape time.
pub const TARGET_LABELS: &[&str] = &["job", "instance"];

/// Series only a relay in the progress mode emits: the rules that use them
/// are checked against a scrape in that mode (`progress_lag.rs`), not in
/// `metrics_series.rs`.
pub const PROGRESS_SERIES: &[&str] = &[
    "outbox_lane_backlog_events",
    "outbox_lane_oldest_unpublished_seconds",
    "outbox_progress_blocking_transaction_seconds",
];

/// A file of the repository's `deploy/` directory.
pub fn path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(relative)
}

fn read(relative: &str) -> String {
    let path = path(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One alerting rule, as the rules file writes it.
#[derive(Debug, Clone, Default)]
pub struct Rule {
    pub alert: String,
    pub expr: String,
    pub severity: Option<String>,
    pub has_for: bool,
    pub summary: bool,
    pub description: String,
}

/// The alerting rules of `deploy/prometheus/outbox-alerts.yml`: a reader of
/// the subset of YAML the file uses (`- alert:` items with `expr:` on one
/// line or as a `|` block, `for:`, `labels:`, `annotations:`).
pub fn rules() -> Vec<Rule> {
    parse_rules(&read("prometheus/outbox-alerts.yml"))
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The block scalar (`key: |`) starting after line `i`, or the rest of the
/// line; and the index of the next line to read.
fn value(lines: &[&str], i: usize, rest: &str) -> (String, usize) {
    let rest = rest.trim();
    if rest != "|" && rest != ">" {
        return (rest.trim_matches('"').to_owned(), i + 1);
    }
    let base = indent(lines[i]);
    let mut j = i + 1;
    let mut text = Vec::new();
    while j < lines.len() && (lines[j].trim().is_empty() || indent(lines[j]) > base) {
        text.push(lines[j].trim());
        j += 1;
    }
    (text.join("\n").trim().to_owned(), j)
}

pub fn parse_rules(yaml: &str) -> Vec<Rule> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut rules: Vec<Rule> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        if line.starts_with('#') {
            i += 1;
            continue;
        }
        if let Some(name) = line.strip_prefix("- alert:") {
            rules.push(Rule {
                alert: name.trim().to_owned(),
                ..Rule::default()
            });
            i += 1;
            continue;
        }
        let Some(rule) = rules.last_mut() else {
            i += 1;
            continue;
        };
        let Some((key, rest)) = line.split_once(':') else {
            i += 1;
            continue;
        };
        let (text, next) = value(&lines, i, rest);
        match key {
            "expr" => rule.expr = text,
            "for" => rule.has_for = true,
            "severity" => rule.severity = Some(text),
            "summary" => rule.summary = !text.is_empty(),
            "description" => rule.description = text,
            _ => {}
        }
        i = next;
    }
    rules
}

/// Every PromQL query of the dashboard: the panels' `expr` and the template
/// variables' queries, with where each comes from.
pub fn dashboard_queries() -> Vec<(String, String)> {
    let json: serde_json::Value =
        serde_json::from_str(&read("grafana/outbox-dashboard.json")).expect("dashboard JSON");
    let mut out = Vec::new();
    fn panels(value: &serde_json::Value, out: &mut Vec<(String, String)>) {
        for panel in value.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?");
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push((format!("panel {title:?}"), expr.to_owned()));
                }
            }
            panels(&panel["panels"], out);
        }
    }
    panels(&json["panels"], &mut out);
    for variable in json["templating"]["list"].as_array().into_iter().flatten() {
        if variable["type"] != "query" {
            continue;
        }
        let name = variable["name"].as_str().unwrap_or("?");
        let query = match &variable["query"] {
            serde_json::Value::String(q) => q.clone(),
            q => q["query"].as_str().unwrap_or_default().to_owned(),
        };
        out.push((format!("variable {name:?}"), query));
    }
    out
}

/// The series names and labels one expression uses.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Uses {
    /// `outbox_*` names, wherever they appear (selectors, `__name__`
    /// matchers, `label_values(...)`).
    pub names: BTreeSet<String>,
    /// Labels matched in a selector, by the series name before it.
    pub matched: BTreeMap<String, BTreeSet<String>>,
    /// Labels of `by`, `without`, `on`, `ignoring`, `group_left`,
    /// `group_right` and of `label_values(series, label)`: each must exist
    /// on one of the series the expression uses.
    pub grouping: BTreeSet<String>,
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The identifiers of `s` (quoted text included: a `__name__` regex names
/// series there), with their byte offsets.
fn identifiers(s: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in s.char_indices().chain([(s.len(), ' ')]) {
        match (start, is_ident(c)) {
            (None, true) => start = Some(i),
            (Some(b), false) => {
                out.push((b, &s[b..i]));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// The text between the parenthesis at `open` and its match.
fn parenthesised(s: &str, open: usize) -> Option<&str> {
    let mut depth = 0;
    for (i, c) in s[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[open + 1..open + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The label names of a selector's matchers (`a="x", b=~"y|z"`), quotes
/// respected.
fn matcher_labels(body: &str) -> Vec<String> {
    let mut labels = Vec::new();
    let mut quoted = false;
    let mut part = String::new();
    for c in body.chars().chain([',']) {
        match c {
            '"' => {
                quoted = !quoted;
                part.push(c);
            }
            ',' if !quoted => {
                let name: String = part.trim().chars().take_while(|&c| is_ident(c)).collect();
                if !name.is_empty() {
                    labels.push(name);
                }
                part.clear();
            }
            _ => part.push(c),
        }
    }
    labels
}

/// Reads the series names and labels `expr` uses (PromQL, or Grafana's
/// `label_values(series, label)` and `query_result(promql)`).
pub fn uses(expr: &str) -> Uses {
    let mut uses = Uses::default();
    for (_, ident) in identifiers(expr) {
        if ident.starts_with("outbox_") {
            uses.names.insert(ident.to_owned());
        }
    }
    // Selectors: `name{...}` (or `{...}` alone, named by `__name__`).
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(open) = expr[i..].find('{').map(|o| o + i) {
        let close = expr[open..]
            .find('}')
            .map(|c| c + open)
            .expect("unclosed selector");
        let before = expr[..open].trim_end();
        let name: String = before
            .chars()
            .rev()
            .take_while(|&c| is_ident(c))
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let labels = matcher_labels(&expr[open + 1..close]);
        let entry = uses.matched.entry(name).or_default();
        entry.extend(labels.into_iter().filter(|l| l != "__name__"));
        i = close + 1;
        debug_assert!(i <= bytes.len());
    }
    uses.matched.retain(|_, labels| !labels.is_empty());
    // Grouping clauses and label_values' label.
    for (at, ident) in identifiers(expr) {
        let after = &expr[at + ident.len()..];
        let open = at + ident.len() + (after.len() - after.trim_start().len());
        if !expr[open..].starts_with('(') {
            continue;
        }
        let Some(inner) = parenthesised(expr, open) else {
            continue;
        };
        match ident {
            "by" | "without" | "on" | "ignoring" | "group_left" | "group_right" => {
                for (_, label) in identifiers(inner) {
                    uses.grouping.insert(label.to_owned());
                }
            }
            "label_values" => {
                if let Some((_, label)) = inner.rsplit_once(',') {
                    uses.grouping.insert(label.trim().to_owned());
                }
            }
            _ => {}
        }
    }
    uses
}

/// A scrape in the Prometheus text format: every sample's name (histogram
/// samples with their `_bucket`, `_sum`, `_count` suffixes, as they are
/// stored) and the labels seen on it.
#[derive(Debug, Default)]
pub struct Scrape {
    pub series: BTreeMap<String, BTreeSet<String>>,
}

impl Scrape {
    pub fn parse(body: &str) -> Self {
        let mut series: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for line in body.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let end = line.find(|c: char| !is_ident(c)).unwrap_or(line.len());
            let (name, rest) = line.split_at(end);
            if name.is_empty() || name.starts_with("HTTP") {
                continue;
            }
            let labels = series.entry(name.to_owned()).or_default();
            if let Some(body) = rest.strip_prefix('{') {
                let body = body.rsplit_once('}').map_or(body, |(b, _)| b);
                labels.extend(matcher_labels(body));
            }
        }
        Self { series }
    }

    /// What `expr` uses that this scrape lacks: series names, and labels
    /// not on the series they are matched on or grouped by.
    pub fn missing(&self, expr: &str) -> Vec<String> {
        let uses = uses(expr);
        let mut missing = Vec::new();
        let known = |label: &str| TARGET_LABELS.contains(&label);
        for name in &uses.names {
            if !self.series.contains_key(name) {
                missing.push(format!("series {name}"));
            }
        }
        for (name, labels) in &uses.matched {
            let on = self.series.get(name);
            for label in labels {
                if known(label) || name.is_empty() {
                    continue;
                }
                if on.is_some_and(|l| !l.contains(label)) {
                    missing.push(format!("label {label} on {name}"));
                }
            }
        }
        let all: BTreeSet<&String> = uses
            .names
            .iter()
            .filter_map(|n| self.series.get(n))
            .flatten()
            .collect();
        for label in &uses.grouping {
            if !known(label) && !all.iter().any(|l| *l == label) {
                missing.push(format!("label {label} (grouping) on {:?}", uses.names));
            }
        }
        missing
    }
}
