//! Compile-time behaviour of `#[derive(DomainEvent)]`, `#[aggregate]`,
//! `#[inbox_handler]`, `#[command_handler]` and `#[saga]`: inputs that must
//! compile, and the error each mistake produces, among them the ways of
//! reaching a Kafka producer from a handler that the handler macros reject.
//!
//! The `.stderr` files hold one compiler's wording, that of the rustc named
//! in `tests/ui/stderr-rustc.txt`. With that compiler every fail case must
//! match its file exactly. With another, the exact comparison is skipped
//! (the test says so) and each fail case must still fail to compile with
//! the errors its `.stderr` names — the same error code, or none, at the same
//! line — whatever their wording. `TRYBUILD=overwrite cargo test --test ui`
//! rewrites the `.stderr` files and the pin for the compiler at hand.

#[path = "ui/any_compiler.rs"]
mod any_compiler;

use std::io::Write;
use std::path::Path;
use std::process::Command;

const PIN: &str = "tests/ui/stderr-rustc.txt";
const FAIL_CASES: &str = "tests/ui/fail";

#[test]
fn ui() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rustc = rustc_version();
    let pinned = std::fs::read_to_string(root.join(PIN)).expect("the pinned rustc version");
    let pinned = pinned.trim();
    let overwrite = std::env::var_os("TRYBUILD").is_some_and(|v| v == "overwrite");
    let forced = std::env::var_os("OUTBOX_UI_ANY_COMPILER").is_some_and(|v| v == "1");
    let exact = overwrite || (rustc == pinned && !forced);

    {
        let t = trybuild::TestCases::new();
        t.pass("tests/ui/pass/*.rs");
        if exact {
            t.compile_fail("tests/ui/fail/*.rs");
        }
        // The cases run when `t` is dropped.
    }

    if overwrite {
        std::fs::write(root.join(PIN), format!("{rustc}\n")).expect("the pin is written");
    } else if !exact {
        // Not captured by the test harness, like trybuild's own report.
        let why = if forced {
            "OUTBOX_UI_ANY_COMPILER=1".to_owned()
        } else {
            format!("the .stderr files hold the wording of {pinned}; this is {rustc}")
        };
        let _ = writeln!(
            std::io::stderr(),
            "\nui: exact error messages NOT compared ({why}). Checking instead that each fail \
             case fails to compile with the errors its .stderr names (code and line). \
             `TRYBUILD=overwrite cargo test --test ui` regenerates the files for this \
             compiler.\n"
        );
        any_compiler::check(root, &root.join(FAIL_CASES));
    }
}

/// `rustc --version` of the compiler cargo runs (rustup passes the
/// toolchain on to the test through the environment).
fn rustc_version() -> String {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let output = Command::new(rustc)
        .arg("--version")
        .output()
        .expect("rustc runs");
    assert!(output.status.success(), "rustc --version failed");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}
