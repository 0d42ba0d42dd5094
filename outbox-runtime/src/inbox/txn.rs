//! The transactions in which the consumer runs application handlers, and how
//! it knows a handler left them intact.
//!
//! A handler is handed the transaction's connection, so it can break the
//! transaction in ways sqlx does not report:
//!
//! - **it swallows an SQL error**: the transaction is aborted, every later
//!   statement fails, and PostgreSQL answers the final `COMMIT` with
//!   `ROLLBACK` — which sqlx reports as success;
//! - **it runs `COMMIT`, `ROLLBACK` or `RELEASE`** through the connection:
//!   the transaction ends (or aborts) under the consumer's feet, and later
//!   statements would run outside it, each committing on its own.
//!
//! So a [`GuardedConn`] is a connection of the consumer's own whose session
//! default is read-only (`default_transaction_read_only`): its transactions
//! begin `READ WRITE`, and anything run after a handler ended one cannot
//! write. Each transaction marks itself (`outbox.tx`, transaction-local) and
//! arms the commit guard (a row in `outbox_tx_guard`, whose deferred
//! constraint trigger refuses any `COMMIT` the consumer did not announce), so
//! a handler's `COMMIT` fails and rolls everything back. After the handlers,
//! [`seal`] checks that the transaction is still the consumer's and not
//! aborted, and announces the commit. A failed seal makes the caller run the
//! range again with [`probe`] after each event, which names the event whose
//! handler did it; that event then fails like any failing handler.
//!
//! The checks cost one statement per transaction; the careful rerun happens
//! only after a handler misbehaved.
//!
//! A handler can also change the session: `SET ROLE`, `SET search_path`, a
//! custom setting, without `LOCAL`. So the connection's session is taken
//! down when the consumer takes it from the pool (its user, role, and the
//! parameters set for the session, e.g. by the pool's `after_connect`), and
//! put back in three places, none of them an extra round trip: at the start
//! of each transaction (`RESET ALL` and the rest, inside the `BEGIN`
//! statement), by the seal and the careful checks after the handlers (the
//! user, role and `search_path`, so that the consumer's own statements —
//! follow-up events, bookkeeping, `COMMIT` — run as the consumer, in its
//! schema, whatever a handler set, `LOCAL` or not), and when the connection
//! goes back to the pool. The events of one transaction share its session,
//! as they share the transaction. (Custom `x.y` settings the pool's
//! `after_connect` made are not kept: PostgreSQL does not list them, so
//! `RESET ALL` resets them like a handler's.)

use std::borrow::Cow;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Connection, Executor as _, PgConnection, PgPool, Postgres, Row as _, Transaction};

/// What a check found wrong with the transaction.
#[derive(Debug)]
pub(crate) enum Broken {
    /// A statement failed and its error was not returned (SQLSTATE 25P02).
    Aborted,
    /// The transaction is not the consumer's any more: a handler ran
    /// `COMMIT` or `ROLLBACK` (and maybe `BEGIN`) through its connection.
    Ended,
    /// The check itself could not run: the database is unavailable.
    Outage(sqlx::Error),
}

impl Broken {
    /// The dead letter's error for the handler that did it.
    pub fn blame(&self) -> String {
        match self {
            Broken::Aborted => {
                "the handler returned Ok but left the transaction aborted: one of its \
                 statements failed and it did not return the error (PostgreSQL: 25P02 current \
                 transaction is aborted); its work was rolled back"
                    .into()
            }
            Broken::Ended => "the handler ended the consumer's transaction (COMMIT, ROLLBACK or \
                 BEGIN through its connection): refused, its work was rolled back; only the \
                 consumer commits a handler's work, together with its bookkeeping"
                .into(),
            Broken::Outage(error) => error.to_string(),
        }
    }
}

/// What a failed statement says of the transaction: aborted, ended, or
/// neither (an outage).
pub(crate) fn classify(error: sqlx::Error) -> Broken {
    match &error {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02") => Broken::Aborted,
        // 25P01: no transaction in progress; 3B001: savepoint missing.
        sqlx::Error::Database(db)
            if matches!(db.code().as_deref(), Some("25P01" | "3B001" | "2D000")) =>
        {
            Broken::Ended
        }
        _ => Broken::Outage(error),
    }
}

/// Puts the session user, role and `search_path` back as the consumer found
/// them (`outbox.home_*`, set by the `BEGIN` statement), where a handler
/// changed them; nothing outside the consumer's transactions.
const RESTORE: &str = "\
CASE WHEN session_user::text <> nullif(current_setting('outbox.home_user', true), '')
     THEN set_config('session_authorization', current_setting('outbox.home_user'), false) END,
CASE WHEN current_setting('role') <> nullif(current_setting('outbox.home_role', true), '')
     THEN set_config('role', current_setting('outbox.home_role'), false) END,
CASE WHEN current_setting('search_path') <> nullif(current_setting('outbox.home_path', true), '')
     THEN set_config('search_path', current_setting('outbox.home_path'), false) END";

static PROBE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("SELECT current_setting('outbox.tx', true) IS NOT DISTINCT FROM 'on', {RESTORE}")
});

/// Sets `outbox.commit` (the guard then lets our `COMMIT` through) only in
/// the consumer's own transaction: no row otherwise.
static SEAL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT set_config('outbox.commit', 'on', true), {RESTORE}
         WHERE current_setting('outbox.tx', true) IS NOT DISTINCT FROM 'on'"
    )
});

/// Checks, after one event's handlers, that the transaction is still the
/// consumer's and usable. Does not allow the commit: later handlers run.
/// Puts the session back as the consumer found it (see the module docs).
pub(crate) async fn probe(conn: &mut PgConnection) -> Result<(), Broken> {
    let ours = sqlx::query(PROBE.as_str())
        .fetch_one(conn)
        .await
        .and_then(|row| row.try_get::<bool, _>(0));
    match ours {
        Ok(true) => Ok(()),
        Ok(false) => Err(Broken::Ended),
        Err(error) => Err(classify(error)),
    }
}

/// Checks, after the last handler, that the transaction is still the
/// consumer's and usable, and allows its `COMMIT` (no handler runs after
/// this). Puts the session back as the consumer found it, for the
/// consumer's statements that follow (see the module docs).
pub(crate) async fn seal(conn: &mut PgConnection) -> Result<(), Broken> {
    match sqlx::query(SEAL.as_str()).fetch_optional(conn).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(Broken::Ended),
        Err(error) => Err(classify(error)),
    }
}

/// When a handler's error is the symptom of a broken transaction rather than
/// a failure of its own, what broke it: the transaction was already aborted
/// (25P02), or already ended, so that a write ran in a read-only transaction
/// (25006). Unless every earlier event was checked, an earlier handler did it.
pub(crate) fn symptom_of(error: &sqlx::Error) -> Option<Broken> {
    match error {
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("25P02") => Some(Broken::Aborted),
            Some("25006") => Some(Broken::Ended),
            _ => None,
        },
        _ => None,
    }
}

/// The session of a connection as the consumer took it from the pool, as
/// SQL that puts it back: `SELECT`-list items, quoted by the server.
const TAKE_DOWN: &str = r#"
SELECT
    format('CASE WHEN session_user::text <> %1$L THEN set_config(''session_authorization'', %1$L, false) END,
            CASE WHEN current_setting(''role'') <> %2$L THEN set_config(''role'', %2$L, false) END',
           session_user, current_setting('role')),
    format('set_config(''outbox.home_user'', %L, true), set_config(''outbox.home_role'', %L, true),
            set_config(''outbox.home_path'', %L, true)',
           session_user, current_setting('role'), current_setting('search_path')),
    (SELECT string_agg(format('set_config(%L, %L, false)', name, current_setting(name)), ', ')
     FROM pg_settings WHERE source = 'session')"#;

/// A connection held by a [`GuardedConn`], with the statements that put its
/// session back.
struct Held {
    conn: PoolConnection<Postgres>,
    /// Begins a guarded transaction, the session put back first.
    begin: String,
    /// Puts the session back, outside a transaction (before the connection
    /// returns to the pool).
    reset: String,
}

/// A connection of the consumer's own for transactions that run handlers
/// (see the module docs). Held across transactions; closed, never returned
/// to the pool with its session settings, when dropped without
/// [`release`](Self::release).
pub(crate) struct GuardedConn {
    pool: PgPool,
    conn: Option<Held>,
    statement_timeout_ms: u128,
}

impl GuardedConn {
    /// `statement_timeout` bounds every statement of its transactions (a
    /// handler's too: its timeout stops the database side of it as well).
    pub fn new(pool: PgPool, statement_timeout: Duration) -> Self {
        Self {
            pool,
            conn: None,
            statement_timeout_ms: statement_timeout.as_millis().clamp(1, i32::MAX as u128),
        }
    }

    /// Takes a connection from the pool, takes its session down, and makes
    /// its session default read-only.
    async fn take(&self) -> Result<Held, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let (restore, home, settings) = match take_down(&mut conn).await {
            Ok(taken) => taken,
            Err(error) => {
                conn.close_on_drop();
                return Err(error);
            }
        };
        // The session's own settings, then the transaction's: a session
        // `statement_timeout` must not override the transaction's.
        let settings = settings.map(|s| format!("{s}, ")).unwrap_or_default();
        let ms = self.statement_timeout_ms;
        let begin = format!(
            "BEGIN READ WRITE; SELECT {restore}; RESET ALL; \
             SELECT {settings}{home}, set_config('outbox.tx', 'on', true), \
                    set_config('statement_timeout', '{ms}', true); \
             SET default_transaction_read_only = on; \
             INSERT INTO outbox_tx_guard (pid) VALUES (pg_backend_pid()) \
             ON CONFLICT (pid) DO UPDATE SET armed_at = now()"
        );
        let reset = match settings.strip_suffix(", ") {
            Some(settings) => format!("SELECT {restore}; RESET ALL; SELECT {settings}"),
            None => format!("SELECT {restore}; RESET ALL"),
        };
        Ok(Held { conn, begin, reset })
    }

    /// Begins a guarded transaction (acquiring and preparing a connection
    /// first if none is held), with the session as the consumer took it.
    /// After an error the caller decides whether to
    /// [`discard`](Self::discard) the connection (an outage) or keep it.
    pub async fn begin(&mut self) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
        if self.conn.is_none() {
            self.conn = Some(self.take().await?);
        }
        let held = self.conn.as_mut().expect("connection held");
        let statement = Cow::Owned(held.begin.clone());
        held.conn.begin_with(statement).await
    }

    /// Finishes the rollback of a transaction dropped without commit: sqlx
    /// only queues the `ROLLBACK`, and until it runs the transaction keeps
    /// its locks (the rows and partitions the caller is about to update).
    /// On failure the connection is dropped.
    pub async fn settle(&mut self) {
        if let Some(held) = self.conn.as_mut()
            && held.conn.ping().await.is_err()
        {
            self.discard();
        }
    }

    /// Drops the held connection (closing it): after an outage, or when its
    /// state is unknown.
    pub fn discard(&mut self) {
        if let Some(mut held) = self.conn.take() {
            held.conn.close_on_drop();
        }
    }

    /// Gives the held connection back to the pool with its session as the
    /// consumer took it (closes it if that fails).
    pub async fn release(&mut self) {
        if let Some(mut held) = self.conn.take() {
            // No arguments: one simple query, several statements.
            if held.conn.execute(held.reset.as_str()).await.is_err() {
                held.conn.close_on_drop();
            }
        }
    }
}

/// The session of `conn` as SQL that puts it back ([`TAKE_DOWN`]); then
/// its session default made read-only.
async fn take_down(
    conn: &mut PgConnection,
) -> Result<(String, String, Option<String>), sqlx::Error> {
    let taken = sqlx::query_as(TAKE_DOWN).fetch_one(&mut *conn).await?;
    sqlx::query("SET default_transaction_read_only = on")
        .execute(conn)
        .await?;
    Ok(taken)
}

impl Drop for GuardedConn {
    fn drop(&mut self) {
        self.discard();
    }
}
