//! The Prometheus alert rules (`deploy/prometheus/outbox-alerts.yml`):
//! `promtool check rules` accepts them, and `promtool test rules` runs their
//! unit tests (`outbox-alerts.test.yml`: input series shaped as the
//! services emit them, each alert pending, firing and not firing). promtool
//! comes with Debian's `prometheus` package, which `scripts/services.sh`
//! installs. That every series and label they use is really emitted is
//! `metrics_series.rs`.

mod deploy;

use std::process::{Command, Output};

/// The alerts the rules must have.
const ALERTS: &[&str] = &[
    "OutboxBacklogAge",
    "OutboxParkedEvents",
    "OutboxDeadLetters",
    "OutboxConsumerLag",
    "OutboxRelayDown",
    "OutboxRelayFailing",
    "OutboxConsumerDown",
    "OutboxStatementRefused",
    "OutboxConsumerStalled",
    "OutboxScheduledOverdue",
    "OutboxProgressHeldBack",
];

fn promtool(args: &[&str]) -> Output {
    Command::new("promtool")
        .args(args)
        .current_dir(deploy::path("prometheus"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): it comes with Debian's prometheus package, \
                 which scripts/services.sh installs"
            )
        })
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn promtool_accepts_the_alert_rules() {
    let output = promtool(&["check", "rules", "outbox-alerts.yml"]);
    let shown = text(&output);
    assert!(output.status.success(), "{shown}");
    let found = format!("SUCCESS: {} rules found", deploy::rules().len());
    assert!(shown.contains(&found), "{shown}");
}

#[test]
fn the_alerts_fire_as_their_unit_tests_expect() {
    let output = promtool(&["test", "rules", "outbox-alerts.test.yml"]);
    let shown = text(&output);
    assert!(output.status.success(), "{shown}");
    assert!(shown.contains("SUCCESS"), "{shown}");
}

/// Each alert: a severity, a `for:` duration, a summary and a description
/// with a runbook line, and unit tests where it fires and where it does
/// not.
#[test]
fn every_alert_is_complete_and_unit_tested() {
    let rules = deploy::rules();
    let names: Vec<&str> = rules.iter().map(|r| r.alert.as_str()).collect();
    for alert in ALERTS {
        assert!(names.contains(alert), "no alert {alert} in {names:?}");
    }
    let tests = std::fs::read_to_string(deploy::path("prometheus/outbox-alerts.test.yml")).unwrap();
    for rule in &rules {
        let alert = &rule.alert;
        assert!(!rule.expr.is_empty(), "{alert}: no expr");
        assert!(
            matches!(rule.severity.as_deref(), Some("warning" | "critical")),
            "{alert}: severity {:?}",
            rule.severity
        );
        assert!(rule.has_for, "{alert}: no `for:`");
        assert!(rule.summary, "{alert}: no summary");
        assert!(
            rule.description.contains("Runbook:"),
            "{alert}: no runbook line in {:?}",
            rule.description
        );
        // The evaluations of this alert in the unit tests.
        let cases: Vec<&str> = tests
            .split("- eval_time:")
            .filter(|case| case.contains(&format!("alertname: {alert}\n")))
            .collect();
        assert!(
            cases.iter().any(|c| c.contains("exp_alerts: []")),
            "{alert}: no unit test where it does not fire"
        );
        assert!(
            cases.iter().any(|c| c.contains("- exp_labels:")),
            "{alert}: no unit test where it fires"
        );
    }
}
