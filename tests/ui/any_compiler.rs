//! The compile-fail check that holds on any compiler: each case must fail to
//! compile, and every error its `.stderr` names (an `error[E…]:` or
//! `error:` line and the ` --> file:line:col` under it) must be reported
//! again with the same code, or none, at the same line of the case — the
//! wording, notes, help and columns are the compiler's own and not compared.
//!
//! The cases are built like trybuild builds them: as binaries of a project
//! of their own (in the target directory) that depends on this crate, its
//! dependencies and dev-dependencies, with this workspace's `Cargo.lock`.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// An error a case is expected to produce, or produced.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Expected {
    code: Option<String>,
    line: u64,
}

/// Builds every `*.rs` in `cases` and panics with a list of the cases that
/// compiled or missed an error their `.stderr` names.
pub fn check(root: &Path, cases: &Path) {
    let mut files: Vec<PathBuf> = fs::read_dir(cases)
        .expect("the fail cases")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no cases in {}", cases.display());

    let (reported, compiled) = build(root, &files);

    let mut failures = Vec::new();
    for file in &files {
        let name = stem(file);
        if compiled.contains(&name) {
            failures.push(format!("{name}: compiled, but must not"));
            continue;
        }
        let stderr = file.with_extension("stderr");
        let text = fs::read_to_string(&stderr)
            .unwrap_or_else(|_| panic!("{} is missing", stderr.display()));
        let actual = reported.get(&name).cloned().unwrap_or_default();
        if actual.is_empty() {
            failures.push(format!("{name}: no error located in the case"));
        }
        for wanted in expected(&text, file.file_name().unwrap().to_str().unwrap()) {
            if !actual.contains(&wanted) {
                failures.push(format!(
                    "{name}: expected error {} at line {}; reported: {}",
                    wanted.code.as_deref().unwrap_or("(no code)"),
                    wanted.line,
                    describe(&actual)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} fail cases:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}

/// The errors a `.stderr` file names in `case` (its file name).
fn expected(stderr: &str, case: &str) -> BTreeSet<Expected> {
    let lines: Vec<&str> = stderr.lines().collect();
    let mut wanted = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.strip_prefix("error") else {
            continue;
        };
        let code = match rest.strip_prefix('[') {
            Some(r) => match r.split_once("]:") {
                Some((code, _)) => Some(code.to_owned()),
                None => continue,
            },
            None if rest.starts_with(':') => None,
            None => continue,
        };
        // ` --> tests/ui/fail/case.rs:12:5` under the header.
        let Some(location) = lines
            .get(i + 1)
            .and_then(|l| l.trim_start().strip_prefix("--> "))
        else {
            continue;
        };
        let mut parts = location.rsplitn(3, ':');
        let (_column, line, file) = (parts.next(), parts.next(), parts.next());
        if file.is_some_and(|f| f.ends_with(case))
            && let Some(line) = line.and_then(|l| l.parse().ok())
        {
            wanted.insert(Expected { code, line });
        }
    }
    wanted
}

/// Builds the cases; returns each case's errors located in its own file,
/// and the cases that compiled.
fn build(
    root: &Path,
    files: &[PathBuf],
) -> (BTreeMap<String, BTreeSet<Expected>>, BTreeSet<String>) {
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .join("tests")
        .join("ui-any-compiler");
    let project = target.join("project");
    fs::create_dir_all(&project).expect("the project directory");
    fs::write(project.join("Cargo.toml"), manifest(root, files)).expect("Cargo.toml written");
    fs::copy(root.join("Cargo.lock"), project.join("Cargo.lock")).expect("Cargo.lock copied");
    fs::write(project.join("main.rs"), "fn main() {}\n").expect("main.rs written");

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(&project)
        .env("CARGO_TARGET_DIR", target.join("target"))
        .args(["check", "--offline", "--quiet", "--color=never"])
        .args(["--message-format=json", "--keep-going", "--bins"])
        .output()
        .expect("cargo runs");

    let mut reported: BTreeMap<String, BTreeSet<Expected>> = BTreeMap::new();
    let mut compiled = BTreeSet::new();
    let mut ran = false;
    for message in String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
    {
        ran = true;
        // Only the cases' own binaries; their file is the target's source.
        let Some(source) = message["target"]["src_path"].as_str().map(Path::new) else {
            continue;
        };
        if !files.iter().any(|f| f == source) {
            continue;
        }
        let name = stem(source);
        match message["reason"].as_str() {
            Some("compiler-artifact") => {
                compiled.insert(name);
            }
            Some("compiler-message") if message["message"]["level"] == "error" => {
                let code = message["message"]["code"]["code"]
                    .as_str()
                    .map(str::to_owned);
                let errors = reported.entry(name).or_default();
                for span in message["message"]["spans"].as_array().into_iter().flatten() {
                    let file = span["file_name"].as_str().map(|f| root.join(f));
                    let in_case = file.is_some_and(|f| f == source);
                    if span["is_primary"] == true
                        && in_case
                        && let Some(line) = span["line_start"].as_u64()
                    {
                        errors.insert(Expected {
                            code: code.clone(),
                            line,
                        });
                    }
                }
            }
            _ => {}
        }
    }
    // A project that cargo could not even start on (a manifest or lock
    // problem) reports no case at all.
    assert!(
        ran,
        "cargo check of the fail cases did not run:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    (reported, compiled)
}

/// A manifest with a binary per case and the dependencies trybuild gives the
/// cases: this crate, its dependencies and dev-dependencies (workspace
/// inheritance resolved, paths made absolute).
fn manifest(root: &Path, files: &[PathBuf]) -> String {
    let text = fs::read_to_string(root.join("Cargo.toml")).expect("the root manifest");
    let root_manifest: toml::Table = text.parse().expect("the root manifest parses");
    let workspace = root_manifest["workspace"].as_table().expect("[workspace]");
    let inherited = workspace["dependencies"]
        .as_table()
        .expect("[workspace.dependencies]");
    let edition = workspace["package"]["edition"]
        .as_str()
        .expect("the edition");

    let mut dependencies = toml::Table::new();
    for section in ["dependencies", "dev-dependencies"] {
        let Some(table) = root_manifest.get(section).and_then(toml::Value::as_table) else {
            continue;
        };
        for (name, spec) in table {
            dependencies.insert(name.clone(), resolve(root, spec, inherited.get(name)));
        }
    }
    let mut outbox = toml::Table::new();
    outbox.insert("path".into(), root.display().to_string().into());
    dependencies.insert("outbox".into(), outbox.into());

    let mut package = toml::Table::new();
    package.insert("name".into(), "outbox-ui-fail-cases".into());
    package.insert("version".into(), "0.0.0".into());
    package.insert("edition".into(), edition.into());
    package.insert("publish".into(), false.into());

    let mut bins = vec![bin("outbox-ui-fail-cases", Path::new("main.rs"))];
    bins.extend(files.iter().map(|file| bin(&stem(file), file)));

    let mut manifest = toml::Table::new();
    manifest.insert("package".into(), package.into());
    manifest.insert("dependencies".into(), dependencies.into());
    manifest.insert("bin".into(), toml::Value::Array(bins));
    // A workspace of its own, not a member of this one.
    manifest.insert("workspace".into(), toml::Table::new().into());
    toml::to_string(&manifest).expect("the manifest serializes")
}

/// A dependency as the cases' project declares it.
fn resolve(root: &Path, spec: &toml::Value, inherited: Option<&toml::Value>) -> toml::Value {
    let mut table = as_table(spec);
    if table.remove("workspace").and_then(|v| v.as_bool()) == Some(true) {
        let mut base = as_table(inherited.expect("a workspace dependency"));
        // Features add up; everything else is the member's to override.
        let mut features: Vec<toml::Value> = base
            .remove("features")
            .and_then(|f| f.as_array().cloned())
            .unwrap_or_default();
        if let Some(more) = table.remove("features").and_then(|f| f.as_array().cloned()) {
            features.extend(more);
        }
        base.extend(table);
        if !features.is_empty() {
            base.insert("features".into(), features.into());
        }
        table = base;
    }
    table.remove("optional");
    if let Some(path) = table.get("path").and_then(toml::Value::as_str) {
        let path = root.join(path).display().to_string();
        table.insert("path".into(), path.into());
    }
    table.into()
}

fn as_table(spec: &toml::Value) -> toml::Table {
    match spec {
        toml::Value::String(version) => {
            let mut table = toml::Table::new();
            table.insert("version".into(), version.clone().into());
            table
        }
        toml::Value::Table(table) => table.clone(),
        other => panic!("unexpected dependency specification {other}"),
    }
}

fn bin(name: &str, path: &Path) -> toml::Value {
    let mut table = toml::Table::new();
    table.insert("name".into(), name.into());
    table.insert("path".into(), path.display().to_string().into());
    table.into()
}

fn stem(file: &Path) -> String {
    file.file_stem().unwrap().to_string_lossy().into_owned()
}

fn describe(errors: &BTreeSet<Expected>) -> String {
    if errors.is_empty() {
        return "nothing".into();
    }
    errors
        .iter()
        .map(|e| {
            format!(
                "{} at line {}",
                e.code.as_deref().unwrap_or("(no code)"),
                e.line
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
