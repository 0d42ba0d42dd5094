//! The `outbox` command lines the guide and the README show, checked
//! against the binary: each names a subcommand that exists, and every flag
//! it uses is one that subcommand (or one of its own subcommands, or the
//! global options) takes. The guide's synopses are not runnable as they
//! stand (they need a database, a broker, secrets), so this is what keeps
//! them true: a renamed or removed flag fails here.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// `outbox <args> --help`, or `None` if the command does not exist.
fn help(args: &[&str]) -> Option<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .arg("--help")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run outbox");
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The subcommands a help text lists (its `Commands:` section).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// Every line of a fenced block of `text` that runs `outbox` (after a
/// prompt or environment assignments), with its file and line number.
fn command_lines(root: &Path, file: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(file).unwrap();
    let mut fenced = false;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            continue;
        }
        let words: Vec<&str> = line
            .split_whitespace()
            .skip_while(|w| *w == "$" || (w.contains('=') && !w.starts_with('-')))
            .collect();
        if words.first() == Some(&"outbox") {
            out.push((
                format!(
                    "{}:{}",
                    file.strip_prefix(root).unwrap_or(file).display(),
                    n + 1
                ),
                words[1..].join(" "),
            ));
        }
    }
    out
}

#[test]
fn the_guides_command_lines_name_existing_subcommands_and_flags() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs/src")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files.sort();
    let global = help(&[]).expect("outbox --help");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for file in &files {
        for (at, line) in command_lines(&root, file) {
            // Text after two spaces or a `#` is the line's comment.
            let command = line.split("  ").next().unwrap_or_default();
            let command = command.split(" #").next().unwrap_or_default();
            let first = command.split_whitespace().next().unwrap_or_default();
            // The subcommand and, where it has some, its own subcommands
            // (`a|b|c` names several).
            let mut texts = vec![global.clone()];
            if first.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                let Some(top) = help(&[first]) else {
                    wrong.push(format!("{at}: no subcommand `outbox {first}`"));
                    continue;
                };
                for sub in subcommands(&top) {
                    texts.push(help(&[first, &sub]).unwrap_or_default());
                }
                let named: Vec<&str> = command
                    .split_whitespace()
                    .nth(1)
                    .map(|w| w.split('|').collect())
                    .unwrap_or_default();
                let subs = subcommands(&top);
                for name in named {
                    if !subs.is_empty()
                        && name.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                        && !name.is_empty()
                        && !subs.iter().any(|s| s == name)
                    {
                        wrong.push(format!("{at}: no subcommand `outbox {first} {name}`"));
                    }
                }
                texts.push(top);
            }
            let flags: BTreeSet<&str> = command
                .split(|c: char| c.is_whitespace() || "[]()|…".contains(c))
                .filter(|w| w.starts_with("--") && w.len() > 2)
                .map(|w| w.split('=').next().unwrap_or(w))
                .collect();
            for flag in flags {
                let known = texts.iter().any(|t| {
                    t.split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[')
                        .any(|w| w == flag)
                });
                if !known {
                    wrong.push(format!("{at}: `outbox {first}` takes no `{flag}`"));
                }
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 20,
        "only {checked} command lines found: is the guide still there?"
    );
    assert!(
        wrong.is_empty(),
        "command lines of the guide that the binary refutes:\n{}",
        wrong.join("\n")
    );
}
