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

use std::borrow::Cow;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};

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

fn classify(error: sqlx::Error) -> Broken {
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

const PROBE: &str = "SELECT current_setting('outbox.tx', true) IS NOT DISTINCT FROM 'on'";

/// Sets `outbox.commit` (the guard then lets our `COMMIT` through) only in
/// the consumer's own transaction: no row otherwise.
const SEAL: &str = "\
SELECT set_config('outbox.commit', 'on', true)
WHERE current_setting('outbox.tx', true) IS NOT DISTINCT FROM 'on'";

/// Checks, after one event's handlers, that the transaction is still the
/// consumer's and usable. Does not allow the commit: later handlers run.
pub(crate) async fn probe(conn: &mut PgConnection) -> Result<(), Broken> {
    match sqlx::query_scalar::<_, bool>(PROBE).fetch_one(conn).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Broken::Ended),
        Err(error) => Err(classify(error)),
    }
}

/// Checks, after the last handler, that the transaction is still the
/// consumer's and usable, and allows its `COMMIT` (no handler runs after
/// this).
pub(crate) async fn seal(conn: &mut PgConnection) -> Result<(), Broken> {
    match sqlx::query_scalar::<_, String>(SEAL)
        .fetch_optional(conn)
        .await
    {
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

/// A connection of the consumer's own for transactions that run handlers
/// (see the module docs). Held across transactions; closed, never returned
/// to the pool with its session settings, when dropped without
/// [`release`](Self::release).
pub(crate) struct GuardedConn {
    pool: PgPool,
    conn: Option<PoolConnection<Postgres>>,
    begin: String,
}

impl GuardedConn {
    /// `statement_timeout` bounds every statement of its transactions (a
    /// handler's too: its timeout stops the database side of it as well).
    pub fn new(pool: PgPool, statement_timeout: Duration) -> Self {
        let ms = statement_timeout.as_millis().clamp(1, i32::MAX as u128);
        let begin = format!(
            "BEGIN READ WRITE; SET LOCAL statement_timeout = {ms}; SET LOCAL outbox.tx = 'on'; \
             INSERT INTO outbox_tx_guard (pid) VALUES (pg_backend_pid()) \
             ON CONFLICT (pid) DO UPDATE SET armed_at = now()"
        );
        Self {
            pool,
            conn: None,
            begin,
        }
    }

    /// Begins a guarded transaction (acquiring and preparing a connection
    /// first if none is held). After an error the caller decides whether to
    /// [`discard`](Self::discard) the connection (an outage) or keep it.
    pub async fn begin(&mut self) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
        if self.conn.is_none() {
            let mut conn = self.pool.acquire().await?;
            if let Err(error) = sqlx::query("SET default_transaction_read_only = on")
                .execute(&mut *conn)
                .await
            {
                conn.close_on_drop();
                return Err(error);
            }
            self.conn = Some(conn);
        }
        let statement = Cow::Owned(self.begin.clone());
        let conn = self.conn.as_mut().expect("connection held");
        conn.begin_with(statement).await
    }

    /// Finishes the rollback of a transaction dropped without commit: sqlx
    /// only queues the `ROLLBACK`, and until it runs the transaction keeps
    /// its locks (the rows and partitions the caller is about to update).
    /// On failure the connection is dropped.
    pub async fn settle(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            if conn.ping().await.is_err() {
                self.discard();
            }
        }
    }

    /// Drops the held connection (closing it): after an outage, or when its
    /// state is unknown.
    pub fn discard(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close_on_drop();
        }
    }

    /// Gives the held connection back to the pool with its session settings
    /// reset (closes it if that fails).
    pub async fn release(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            if sqlx::query("RESET default_transaction_read_only")
                .execute(&mut *conn)
                .await
                .is_err()
            {
                conn.close_on_drop();
            }
        }
    }
}

impl Drop for GuardedConn {
    fn drop(&mut self) {
        self.discard();
    }
}
