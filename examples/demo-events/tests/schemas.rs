//! The demo's event schemas against the committed snapshot in `schemas/`:
//! fails on a change that would break a consumer without a new version, and
//! when the snapshot is out of date. `UPDATE_SCHEMAS=1 cargo test -p
//! demo-events --test schemas` rewrites the snapshot, but never over a
//! breaking change.

use std::path::{Path, PathBuf};

use outbox::contracts::check_dirs;

fn snapshot() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas")
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every file below `dir`, relative, with its text.
fn files(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path.strip_prefix(dir).unwrap().to_owned(), text));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_event_schemas_match_the_committed_snapshot() {
    let current = TempDir(std::env::temp_dir().join(format!(
        "demo-events-schemas-{}",
        uuid::Uuid::new_v4().simple()
    )));
    demo_events::catalogue().export(&current.0).unwrap();
    let report = check_dirs(&snapshot(), &current.0).unwrap();
    assert!(
        report.is_compatible(),
        "the demo's events changed incompatibly:\n{report}"
    );
    if std::env::var_os("UPDATE_SCHEMAS").is_some() {
        demo_events::catalogue().export(snapshot()).unwrap();
        return;
    }
    assert!(
        files(&snapshot()) == files(&current.0),
        "the schema snapshot is out of date (the changes are compatible):\n{report}\
         update it with `UPDATE_SCHEMAS=1 cargo test -p demo-events --test schemas` and commit it"
    );
}
