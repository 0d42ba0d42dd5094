//! The embedded schema migrations (`migrations/` at the workspace root).
//!
//! They live in sqlx's `_sqlx_migrations` table under timestamped versions.
//! [`MIGRATOR`] ignores versions it does not know, so an application may keep
//! its own sqlx migrations in the same database; the application's migrator
//! needs `set_ignore_missing(true)` for the same reason.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::Result;

/// The outbox's migrations, embedded at compile time. Usable with
/// `#[sqlx::test(migrator = "outbox::MIGRATOR")]`.
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../migrations")
};

/// Creates or upgrades `outbox_event`, `inbox_event` and `processed_event`.
///
/// Idempotent: applied versions are skipped; concurrent callers are
/// serialized by sqlx's advisory lock.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await?;
    Ok(())
}
