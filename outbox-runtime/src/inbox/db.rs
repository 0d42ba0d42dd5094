//! Database helpers shared by the consumer's tasks: which errors are an
//! outage (back off, retry, lose nothing) rather than a verdict on one
//! message, and text that PostgreSQL can store. (The up/down state of a
//! dependency is `crate::backoff::Health`.)

use std::borrow::Cow;

use outbox_core::BoxError;

/// True when `error` says the database (or the connection to it) is
/// unavailable, not that the statement or its data was wrong: retried
/// without counting an attempt, for as long as it lasts.
///
/// Deadlocks and serialization failures (40P01, 40001) are not outages:
/// retrying helps, but one that comes back every time is a failing handler,
/// so they count as attempts and end as dead letters after `max_attempts`.
pub(crate) fn is_outage(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // 08: connection exception; 53: insufficient resources (too many
            // connections, out of memory, disk full); 57P0x: shutdown,
            // cannot connect now; 58: system error (I/O).
            code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("57P")
                || code.starts_with("58")
        }),
        _ => false,
    }
}

/// True when a statement failed because of the data it carried (SQLSTATE
/// class 22, e.g. a payload PostgreSQL's `jsonb` refuses).
pub(crate) fn is_data_error(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("22")))
}

/// The first [`sqlx::Error`] in a handler error's source chain (returned
/// directly, or wrapped in an [`outbox_core::Error`] or the application's
/// own error type).
pub(crate) fn sqlx_error_in(error: &BoxError) -> Option<&sqlx::Error> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error.as_ref());
    while let Some(e) = current {
        if let Some(sqlx) = e.downcast_ref::<sqlx::Error>() {
            return Some(sqlx);
        }
        if let Some(outbox_core::Error::Database(sqlx)) = e.downcast_ref::<outbox_core::Error>() {
            return Some(sqlx);
        }
        current = e.source();
    }
    None
}

/// `s` without NUL characters, which PostgreSQL text and jsonb cannot hold.
pub(crate) fn pg_text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_is_replaced_and_outages_are_told_apart() {
        assert_eq!(pg_text("a\0b"), "a\u{FFFD}b");
        assert!(matches!(pg_text("ab"), Cow::Borrowed("ab")));
        assert!(is_outage(&sqlx::Error::PoolTimedOut));
        assert!(!is_outage(&sqlx::Error::RowNotFound));
        let boxed: BoxError = Box::new(sqlx::Error::PoolClosed);
        assert!(sqlx_error_in(&boxed).is_some_and(is_outage));
        let core: BoxError = Box::new(outbox_core::Error::Database(sqlx::Error::PoolTimedOut));
        assert!(sqlx_error_in(&core).is_some_and(is_outage));
        let other: BoxError = "business rule".into();
        assert!(sqlx_error_in(&other).is_none());
    }
}
