//! The compile-time guarantee's last layer, as an application gets it: the
//! crate `tests/guarantee-app` is set up as the README says
//! (`examples/clippy.toml` as its clippy configuration, `disallowed_types`
//! and `disallowed_methods` at `deny` in its `Cargo.toml`), and `cargo
//! clippy` must refuse the Kafka producer its handler reaches through a
//! helper and a newtype — naming the type and the methods — and accept the
//! same crate without it.
//!
//! Clippy runs in the workspace's target directory, so it reuses what the
//! test command already built (among them librdkafka, built by a build
//! script); the first run checks the application's dependencies once.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const APP: &str = "guarantee-app";
const APP_SOURCE: &str = "tests/guarantee-app/src/lib.rs";

/// One diagnostic clippy reported for the application crate.
#[derive(Debug)]
struct Diagnostic {
    level: String,
    lint: Option<String>,
    message: String,
    line: Option<u64>,
}

struct ClippyRun {
    success: bool,
    diagnostics: Vec<Diagnostic>,
    /// What clippy printed, diagnostics as rendered for a terminal.
    output: String,
}

impl ClippyRun {
    fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics.iter().filter(|d| d.level == "error")
    }

    /// Whether clippy reported `lint` at `level` naming `path`, on `line`
    /// if given.
    fn reported(&self, level: &str, lint: &str, path: &str, line: Option<u64>) -> bool {
        self.diagnostics.iter().any(|d| {
            d.level == level
                && d.lint.as_deref() == Some(lint)
                && d.message.contains(&format!("`{path}`"))
                && (line.is_none() || d.line == line)
        })
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `cargo clippy -p guarantee-app` with the template as its configuration,
/// the feature set given, and extra arguments for clippy.
fn clippy(features: &[&str], clippy_args: &[&str]) -> ClippyRun {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(root())
        .env("CLIPPY_CONF_DIR", root().join("examples"))
        .args(["clippy", "--offline", "--quiet", "--color=never"])
        .args(["--message-format=json", "--no-deps", "-p", APP]);
    if !features.is_empty() {
        command.arg("--features").arg(features.join(","));
    }
    command.arg("--").args(clippy_args);
    let output = command.output().expect("cargo runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !stderr.contains("no such command"),
        "this test needs clippy (`rustup component add clippy`): {stderr}"
    );
    let messages: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-message" && m["target"]["name"] == "guarantee_app")
        .collect();
    let rendered: String = messages
        .iter()
        .filter_map(|m| m["message"]["rendered"].as_str())
        .collect();
    ClippyRun {
        success: output.status.success(),
        diagnostics: messages.iter().map(|m| diagnostic(&m["message"])).collect(),
        output: format!("{rendered}{stderr}"),
    }
}

fn diagnostic(message: &Value) -> Diagnostic {
    let primary = message["spans"]
        .as_array()
        .and_then(|spans| spans.iter().find(|s| s["is_primary"] == true));
    Diagnostic {
        level: message["level"].as_str().unwrap_or_default().to_owned(),
        lint: message["code"]["code"].as_str().map(str::to_owned),
        message: message["message"].as_str().unwrap_or_default().to_owned(),
        line: primary
            .filter(|s| {
                Path::new(s["file_name"].as_str().unwrap_or_default()).ends_with(APP_SOURCE)
            })
            .and_then(|s| s["line_start"].as_u64()),
    }
}

/// The line of the application's source that contains `text`.
fn line_of(text: &str) -> u64 {
    let source =
        std::fs::read_to_string(root().join(APP_SOURCE)).expect("the application's source");
    let index = source
        .lines()
        .position(|l| l.contains(text))
        .unwrap_or_else(|| panic!("`{text}` is not in {APP_SOURCE}"));
    index as u64 + 1
}

#[test]
fn a_producer_hidden_behind_a_newtype_and_a_helper_fails_clippy() {
    let run = clippy(&["hidden-producer"], &[]);
    assert!(
        !run.success,
        "clippy accepted a handler that reaches a producer:\n{}",
        run.output
    );
    let checks = [
        (
            "clippy::disallowed_types",
            "rdkafka::producer::FutureProducer",
            line_of("pub struct Bus(FutureProducer);"),
        ),
        (
            "clippy::disallowed_methods",
            "rdkafka::config::ClientConfig::create",
            line_of(".create()"),
        ),
        (
            "clippy::disallowed_methods",
            "rdkafka::producer::FutureProducer::send",
            line_of("self.0.send("),
        ),
    ];
    for (lint, path, line) in checks {
        assert!(
            run.reported("error", lint, path, Some(line)),
            "no {lint} error naming `{path}` at {APP_SOURCE}:{line}; clippy said:\n{}",
            run.output
        );
    }
    // It fails for these reasons only: the crate itself compiles.
    let others: Vec<_> = run
        .errors()
        .filter(|d| {
            !matches!(
                d.lint.as_deref(),
                Some("clippy::disallowed_types" | "clippy::disallowed_methods")
            )
        })
        .collect();
    assert!(others.is_empty(), "other errors: {others:#?}");
}

#[test]
fn the_same_crate_without_the_producer_passes_clippy() {
    let run = clippy(&[], &[]);
    assert!(
        run.success,
        "clippy refused the application:\n{}",
        run.output
    );
    assert!(
        run.diagnostics.is_empty(),
        "clippy reported: {:#?}",
        run.diagnostics
    );
}

/// Why the `deny` levels are part of the set-up: at clippy's own level the
/// template reports the producer as a warning, and the crate builds.
#[test]
fn without_the_deny_levels_the_template_only_warns() {
    let run = clippy(
        &["hidden-producer"],
        &[
            "-W",
            "clippy::disallowed_types",
            "-W",
            "clippy::disallowed_methods",
        ],
    );
    assert!(
        run.success,
        "the application does not build:\n{}",
        run.output
    );
    assert!(
        run.reported(
            "warning",
            "clippy::disallowed_types",
            "rdkafka::producer::FutureProducer",
            None
        ),
        "no warning naming the producer:\n{}",
        run.output
    );
    assert_eq!(run.errors().count(), 0, "{:#?}", run.diagnostics);
}
