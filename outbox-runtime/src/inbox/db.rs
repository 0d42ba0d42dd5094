//! Database helpers shared by the consumer's tasks: which errors are an
//! outage (back off, retry, lose nothing) rather than a verdict on one
//! message, and text that PostgreSQL can store. (The up/down state of a
//! dependency is `crate::backoff::Health`.)

use std::borrow::Cow;

use outbox_core::BoxError;

/// True when `error` says the database (or the connection to it) is
/// unavailable, not that the statement or its data was wrong.
pub(crate) fn is_outage(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // 08: connection exception; 53: insufficient resources;
            // 57P0x: shutdown / cannot connect now; 58: system error;
            // 40001/40P01: serialization failure / deadlock (retry helps).
            code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("57P")
                || code.starts_with("58")
                || code == "40001"
                || code == "40P01"
        }),
        _ => false,
    }
}

/// True when a statement failed because of the data it carried (SQLSTATE
/// class 22, e.g. a payload PostgreSQL's `jsonb` refuses).
pub(crate) fn is_data_error(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("22")))
}

/// True when a handler's error is really a database outage (a
/// [`sqlx::Error`] anywhere in its source chain that [`is_outage`]).
pub(crate) fn handler_error_is_outage(error: &BoxError) -> bool {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error.as_ref());
    while let Some(e) = current {
        if let Some(sqlx) = e.downcast_ref::<sqlx::Error>() {
            return is_outage(sqlx);
        }
        if let Some(outbox_core::Error::Database(sqlx)) = e.downcast_ref::<outbox_core::Error>() {
            return is_outage(sqlx);
        }
        current = e.source();
    }
    false
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
        assert!(handler_error_is_outage(&boxed));
        let core: BoxError = Box::new(outbox_core::Error::Database(sqlx::Error::PoolTimedOut));
        assert!(handler_error_is_outage(&core));
        let other: BoxError = "business rule".into();
        assert!(!handler_error_is_outage(&other));
    }
}
