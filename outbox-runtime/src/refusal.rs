//! Errors that retrying cannot cure, told apart from outages.
//!
//! An outage (the server down, a connection lost, a lock or statement
//! timeout, a deadlock) passes by itself: the relay and the consumers back
//! off and retry, counting nothing. A *refusal* does not: the database
//! refuses one of our statements because of how it is set up — a missing
//! privilege (42501), a table, column or function that does not exist
//! (migrations not run), a statement it cannot run — and it answers the
//! same until an operator changes something. A refusal is reported once, at
//! error level, naming the statement and what it needs; it shows in the
//! health and the metrics as its own state, and is retried only slowly
//! (the back-off's cap), so that it never spins and resumes by itself once
//! fixed (see [`Health`](crate::backoff::Health)).
//!
//! Classification by SQLSTATE class ([`retrying_cures`]): 42 (syntax error
//! or access rule violation), 0A (feature not supported), 28 (invalid
//! authorization), 3D/3F (no such database or schema), 2F/38/39 (routine
//! exceptions), 22 (data exception: in our own statements a data error
//! comes back on every retry), 23 but unique and exclusion violations (a
//! concurrent writer causes those), 44 (check option); and sqlx's own
//! errors about the shape of a result (a column missing or of another type).
//! Everything else — connection exceptions (08), insufficient resources
//! (53), operator intervention (57), system errors (58), transaction
//! rollbacks (40), lock not available (55P03), invalid transaction state
//! (25, e.g. a standby during a failover), internal errors (XX), a trigger's
//! `RAISE` (P0, a policy that may be lifted) — is retried as an outage.

use std::fmt;

/// One of the framework's statements, as a refusal names it: what it does
/// and what the role running it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Statement {
    /// What it does, e.g. `relay: hold rows back`.
    pub name: &'static str,
    /// The privilege it needs, as the guide's GRANT block (docs/src/production.md) gives it, e.g.
    /// `UPDATE (held_until) ON outbox_event`.
    pub needs: &'static str,
}

/// A statement the database refuses (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// Our statement, when the caller named it.
    pub statement: Option<Statement>,
    /// The SQLSTATE, if the database gave one.
    pub code: Option<String>,
    /// The database's message.
    pub error: String,
}

impl Refusal {
    /// What identifies this refusal in reports: its statement, or its
    /// SQLSTATE and message.
    pub fn key(&self) -> String {
        match self.statement {
            Some(s) => s.name.to_owned(),
            None => format!("{} {}", self.code.as_deref().unwrap_or("-"), self.error),
        }
    }

    /// What an operator does about it.
    pub fn hint(&self) -> &'static str {
        match self.code.as_deref() {
            Some("42501") => {
                "grant the role what the guide's \"Roles and privileges\" (docs/src/production.md) lists for this process"
            }
            Some("42P01" | "42703" | "42883" | "42704") => {
                "a table, column or function is missing: run `outbox migrate` (with the same \
                 schema or search_path)"
            }
            Some(code) if code.starts_with("28") => "check the role's login and password",
            _ => "retrying cannot cure this: fix the database's setup or the role",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(s) = self.statement {
            write!(f, "{} (needs {}): ", s.name, s.needs)?;
        }
        f.write_str(&self.error)?;
        if let Some(code) = &self.code {
            write!(f, " (SQLSTATE {code})")?;
        }
        Ok(())
    }
}

/// A failed call to a dependency, as its retry sees it.
#[derive(Debug, Clone)]
pub(crate) enum Trouble {
    /// Unavailable: retried soon, backing off.
    Outage(String),
    /// Refused: reported once, retried slowly.
    Refused(Refusal),
}

impl Trouble {
    /// The same trouble; a refusal names `statement` (unless it names one).
    pub fn during(self, statement: Statement) -> Self {
        match self {
            Self::Refused(mut r) => {
                r.statement.get_or_insert(statement);
                Self::Refused(r)
            }
            outage => outage,
        }
    }

    /// The refusal, if it is one.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            Self::Refused(r) => Some(r),
            Self::Outage(_) => None,
        }
    }
}

impl fmt::Display for Trouble {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Outage(e) => f.write_str(e),
            Self::Refused(r) => r.fmt(f),
        }
    }
}

impl From<&sqlx::Error> for Trouble {
    fn from(error: &sqlx::Error) -> Self {
        if retrying_cures(error) {
            return Self::Outage(error.to_string());
        }
        let (code, message) = match error {
            sqlx::Error::Database(db) => (db.code().map(|c| c.into_owned()), db.message().into()),
            other => (None, other.to_string()),
        };
        Self::Refused(Refusal {
            statement: None,
            code,
            error: message,
        })
    }
}

impl From<sqlx::Error> for Trouble {
    fn from(error: sqlx::Error) -> Self {
        Self::from(&error)
    }
}

impl From<&crate::Error> for Trouble {
    fn from(error: &crate::Error) -> Self {
        match error {
            crate::Error::Database(db) => Self::from(db),
            // The setup is wrong (e.g. no outbox table): an operator fixes it.
            crate::Error::Config(message) => Self::Refused(Refusal {
                statement: None,
                code: None,
                error: message.clone(),
            }),
            other => Self::Outage(other.to_string()),
        }
    }
}

impl From<crate::Error> for Trouble {
    fn from(error: crate::Error) -> Self {
        Self::from(&error)
    }
}

impl From<&Trouble> for Trouble {
    fn from(trouble: &Trouble) -> Self {
        trouble.clone()
    }
}

impl From<String> for Trouble {
    fn from(error: String) -> Self {
        Self::Outage(error)
    }
}

impl From<&String> for Trouble {
    fn from(error: &String) -> Self {
        Self::Outage(error.clone())
    }
}

impl From<&str> for Trouble {
    fn from(error: &str) -> Self {
        Self::Outage(error.to_owned())
    }
}

/// Whether retrying may cure `error` (an outage), or not (a refusal). See
/// the module docs.
pub(crate) fn retrying_cures(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_none_or(|code| code_retried(&code)),
        sqlx::Error::Configuration(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::Encode(_) => false,
        _ => true,
    }
}

/// Whether an error of SQLSTATE `code` is retried as an outage.
fn code_retried(code: &str) -> bool {
    let class = code.get(..2).unwrap_or(code);
    match class {
        "42" | "0A" | "28" | "3D" | "3F" | "2F" | "38" | "39" | "22" | "44" => false,
        "23" => matches!(code, "23505" | "23P01"),
        _ => true,
    }
}

/// Whether `error` is a refusal a statement's data may cause (SQLSTATE 22
/// or 23): the data of a handler's follow-up events, say, rather than our
/// setup.
pub(crate) fn about_the_data(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().is_some_and(|c| c.starts_with("22") || c.starts_with("23")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every class the module docs name, both ways, on errors PostgreSQL
    /// really raised.
    #[sqlx::test(migrations = false)]
    async fn refusals_and_outages_by_sqlstate(pool: sqlx::PgPool) {
        let refused = [
            "42501", "42P01", "42703", "42883", "42601", "0A000", "28000", "28P01", "3D000",
            "3F000", "2F005", "38001", "39004", "22012", "22P02", "23514", "23502", "44000",
        ];
        let retried = [
            "08006", "53300", "53200", "57014", "57P01", "58030", "40001", "40P01", "55P03",
            "25006", "XX000", "P0001", "23505", "23P01", "72000",
        ];
        for (codes, cured) in [(&refused[..], false), (&retried[..], true)] {
            for code in codes {
                let error = sqlx::raw_sql(&format!(
                    "DO $$ BEGIN RAISE EXCEPTION 'raised' USING ERRCODE = '{code}'; END $$"
                ))
                .execute(&pool)
                .await
                .unwrap_err();
                assert_eq!(retrying_cures(&error), cured, "{code}: {error}");
                let trouble = Trouble::from(&error);
                assert_eq!(trouble.refusal().is_none(), cured, "{code}");
            }
        }
        // A real statement the database refuses: a table that is not there.
        let error = sqlx::query("SELECT * FROM no_such_table")
            .execute(&pool)
            .await
            .unwrap_err();
        let statement = Statement {
            name: "test: read a table",
            needs: "SELECT ON no_such_table",
        };
        let Trouble::Refused(refusal) = Trouble::from(&error).during(statement) else {
            panic!("{error}")
        };
        assert_eq!(refusal.code.as_deref(), Some("42P01"));
        assert!(refusal.hint().contains("outbox migrate"));
        assert_eq!(refusal.key(), "test: read a table");
        assert_eq!(
            refusal.to_string(),
            "test: read a table (needs SELECT ON no_such_table): relation \"no_such_table\" \
             does not exist (SQLSTATE 42P01)"
        );
    }

    #[test]
    fn sqlx_errors_about_the_connection_are_outages_about_the_result_refusals() {
        assert!(retrying_cures(&sqlx::Error::PoolTimedOut));
        assert!(retrying_cures(&sqlx::Error::PoolClosed));
        assert!(retrying_cures(&sqlx::Error::WorkerCrashed));
        assert!(retrying_cures(&sqlx::Error::Io(std::io::Error::other(
            "reset"
        ))));
        assert!(!retrying_cures(&sqlx::Error::ColumnNotFound("x".into())));
        assert!(!retrying_cures(&sqlx::Error::Configuration("bad".into())));
        let outage = Trouble::from(&sqlx::Error::PoolTimedOut).during(Statement {
            name: "x",
            needs: "y",
        });
        assert!(outage.refusal().is_none());
        assert!(matches!(
            Trouble::from(&crate::Error::Config("no table".into())),
            Trouble::Refused(_)
        ));
        assert!(matches!(
            Trouble::from(&crate::Error::Task("gone".into())),
            Trouble::Outage(_)
        ));
    }
}
