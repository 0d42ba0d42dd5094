//! Rebuilds the crate when a migration is added or changed: `MIGRATOR`
//! embeds `migrations/` at compile time, and without this a new file there
//! would not be picked up by an incremental build.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
