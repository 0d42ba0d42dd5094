//! `outbox schema export|check`: the event contracts from the command line.
//!
//! The plain `outbox` binary knows no application's types: it checks two
//! exported directories. An application that wants `schema export` (and a
//! check against its own types) builds its own `outbox` binary around its
//! catalogue with [`run_with`](crate::run_with).

use std::path::Path;
use std::process::ExitCode;

use outbox_core::contracts::{Catalogue, check_dirs};

use crate::args::SchemaCommand;

/// Runs a schema subcommand; prints its result.
pub(crate) fn run(command: SchemaCommand, catalogue: Option<&Catalogue>) -> ExitCode {
    match command {
        SchemaCommand::Export { dir } => {
            let Some(catalogue) = catalogue else {
                eprintln!("{NO_CATALOGUE}");
                return ExitCode::from(2);
            };
            match catalogue.export(&dir) {
                Ok(exported) => {
                    for file in &exported.written {
                        println!("wrote {}", dir.join(file).display());
                    }
                    for file in &exported.removed {
                        println!(
                            "removed {} (no longer registered)",
                            dir.join(file).display()
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("error: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        SchemaCommand::Check {
            against,
            current,
            json,
        } => {
            if !against.is_dir() {
                eprintln!(
                    "error: the snapshot {} is not a directory (write one with `outbox schema export`)",
                    against.display()
                );
                return ExitCode::from(2);
            }
            let scratch;
            let current = match (current, catalogue) {
                (Some(dir), _) => dir,
                (None, Some(catalogue)) => {
                    scratch = Scratch::new();
                    if let Err(error) = catalogue.export(&scratch.0) {
                        eprintln!("error: {error}");
                        return ExitCode::FAILURE;
                    }
                    scratch.0.clone()
                }
                (None, None) => {
                    eprintln!("error: give --current DIR (this binary has no catalogue)");
                    return ExitCode::from(2);
                }
            };
            check(&against, &current, json)
        }
    }
}

const NO_CATALOGUE: &str = "error: this `outbox` binary knows no event types. Export them from \
     the application: build its own `outbox` binary with `outbox_cli::run_with(catalogue)`, or \
     call `Catalogue::export(dir)` from a test or a build script; `outbox schema check --against \
     SNAPSHOT --current DIR` then compares directories.";

fn check(against: &Path, current: &Path, json: bool) -> ExitCode {
    let report = match check_dirs(against, current) {
        Ok(report) => report,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    if json {
        let changes: Vec<serde_json::Value> = report
            .changes
            .iter()
            .map(|c| {
                serde_json::json!({
                    "topic": c.key.topic,
                    "event_type": c.key.event_type,
                    "version": c.key.version,
                    "field": c.path,
                    "breaking": c.is_breaking(),
                    "kind": match c.kind {
                        Ok(kind) => format!("{kind:?}"),
                        Err(kind) => format!("{kind:?}"),
                    },
                    "detail": c.detail,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"compatible": report.is_compatible(), "changes": changes})
        );
    } else {
        print!("{report}");
    }
    if report.is_compatible() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A temporary directory for the catalogue's export, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Self(std::env::temp_dir().join(format!("outbox-schema-{}-{nanos}", std::process::id())))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
