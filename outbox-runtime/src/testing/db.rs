//! Test databases ([`TestDb`]): a migrated database per test in
//! milliseconds, for `#[tokio::test]`.
//!
//! Creating a database and running the migrations costs a second or more
//! per test (`#[sqlx::test]` does both for each test). Here the migrations
//! run once, into a template database named by a hash of the migration set
//! (`outbox_tpl_<hash>`); tests get clones of it (`outbox_test_<hash>_<id>`)
//! and give them back when they pass. A test first takes a free clone and
//! resets it to the template's state (a few statements), and creates a new
//! clone only when none is free. So the databases that exist are the
//! template plus as many clones as tests ran at once.
//!
//! Coordination between tests and test processes is by PostgreSQL advisory
//! locks on the maintenance database (the one `DATABASE_URL` names), held
//! by one connection per test process (a thread of its own serves the
//! process's tests): building a template holds its lock, and a clone's lock
//! is held while a test uses it — a crashed test process releases its
//! locks with its connection. A test that panics leaves its clone marked
//! failed (with `COMMENT ON DATABASE`) and untouched for inspection;
//! failed clones older than an hour, and the templates (with their clones)
//! of a migration set unused for a day, are dropped by the next test
//! process.
//!
//! On a loopback server and without an `sslmode` in the URL (or
//! `PGSSLMODE`), the kit connects without TLS: a TLS connection costs more
//! than the rest of a handler test.
//!
//! Reset (`testdb.sql`): the template holds a schema `_outbox_testdb` with a snapshot of
//! its rows (tables that migrations seeded), its sequences, and a
//! fingerprint of its schema. Taking a clone empties the tables a test
//! filled, restores the seeded rows and the sequences, and compares the
//! fingerprint: a clone whose schema a test changed (a table created or
//! altered) is dropped instead, and another one taken or created.

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, Connection, Executor as _, PgConnection, PgPool};
use tokio::sync::{mpsc, oneshot};

/// What can go wrong creating a [`TestDb`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestDbError {
    /// `DATABASE_URL` is not set (and no URL was given).
    #[error("TestDb: DATABASE_URL is not set (a PostgreSQL URL whose user may create databases)")]
    NoUrl,
    /// A statement failed.
    #[error("TestDb: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed while building the template.
    #[error("TestDb: building the template database {template}: {error}")]
    Migrate {
        /// The template being built.
        template: String,
        /// What failed.
        error: String,
    },
}

/// Advisory lock namespace (the first key of the two-key form): `"otdb"`.
const LOCK_SPACE: i32 = 0x6f74_6462;

/// Bumped when the template's layout changes in a way `testdb.sql` (also
/// hashed) does not show, so that templates of an older kit are rebuilt.
const KIT_VERSION: &str = "testdb-2";

/// Failed clones are kept this long for inspection.
const KEEP_FAILED: &str = "1 hour";
/// Templates (and clones) of a migration set no test process used for
/// this long are dropped.
const KEEP_UNUSED: &str = "1 day";

/// The comments on the kit's databases (then a time): a failed clone, a
/// template and when a test process last used it.
const FAILED: &str = "failed at ";
const USED: &str = "outbox test template, used ";

/// The template's snapshot and the reset function, run in the template
/// after the migrations.
const SNAPSHOT_SQL: &str = include_str!("testdb.sql");

/// Builds a [`TestDb`]: the migrations and SQL its template starts from.
#[derive(Debug, Clone, Default)]
pub struct TestDbBuilder {
    url: Option<String>,
    migrators: Vec<&'static Migrator>,
    sql: Vec<String>,
    outbox: bool,
}

impl TestDbBuilder {
    /// Runs `migrator` into the template too, after the outbox's migrations
    /// and the migrators given before (the application's own migrations;
    /// give it `ignore_missing`, as beside the outbox's).
    pub fn migrator(mut self, migrator: &'static Migrator) -> Self {
        self.migrators.push(migrator);
        self
    }

    /// Runs `sql` (any number of statements) into the template after the
    /// migrations: tables a test needs that are no migration.
    pub fn sql(mut self, sql: impl Into<String>) -> Self {
        self.sql.push(sql.into());
        self
    }

    /// Leaves out the outbox's own migrations (an application whose
    /// migrator includes them).
    pub fn without_outbox_migrations(mut self) -> Self {
        self.outbox = false;
        self
    }

    /// Connects as `url` instead of `DATABASE_URL` (its database is the
    /// maintenance database, where the kit takes its locks).
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// The key of the template: a hash of the migration set.
    fn key(&self) -> String {
        let mut hash = Sha256::new();
        hash.update(KIT_VERSION);
        hash.update(SNAPSHOT_SQL);
        for migrator in self.migrators() {
            hash.update(b"migrator");
            for m in migrator.iter() {
                hash.update(m.version.to_le_bytes());
                hash.update([u8::from(m.migration_type.is_down_migration())]);
                hash.update(&*m.checksum);
            }
        }
        for sql in &self.sql {
            hash.update(b"sql");
            hash.update(sql.len().to_le_bytes());
            hash.update(sql);
        }
        hash.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn migrators(&self) -> Vec<&'static Migrator> {
        let outbox = self.outbox.then_some(&outbox_core::MIGRATOR);
        outbox
            .into_iter()
            .chain(self.migrators.iter().copied())
            .collect()
    }

    /// The template this migration set is cloned from.
    pub fn template_name(&self) -> String {
        format!("outbox_tpl_{}", self.key())
    }

    fn coordinator(&self) -> Result<Coordinator, TestDbError> {
        let url = match self
            .url
            .clone()
            .or_else(|| std::env::var("DATABASE_URL").ok())
        {
            Some(url) => url,
            None => return Err(TestDbError::NoUrl),
        };
        Coordinator::of(&url)
    }

    /// Takes a free clone of the template and resets it, or creates one;
    /// builds the template first when no test built it for this migration
    /// set.
    ///
    /// # Errors
    ///
    /// When `DATABASE_URL` is not set, the server refuses (the user needs
    /// `CREATEDB`), or a migration fails.
    pub async fn create(self) -> Result<TestDb, TestDbError> {
        let coordinator = self.coordinator()?;
        loop {
            let (tx, rx) = oneshot::channel();
            coordinator.send(Request::Claim {
                set: self.clone(),
                reply: tx,
            })?;
            let Claimed { name, fresh } = rx.await.map_err(|_| gone())??;
            let pool = pool(&coordinator.maintenance, &name);
            let db = TestDb {
                name,
                pool,
                coordinator: coordinator.clone(),
            };
            if fresh {
                return Ok(db);
            }
            // Reset on the test's first connection.
            match sqlx::query_scalar("SELECT _outbox_testdb.reset()")
                .fetch_one(&db.pool)
                .await
            {
                Ok(true) => return Ok(db),
                // A test changed its schema: not reusable.
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, db = db.name, "resetting a test database"),
            }
            db.pool.close().await;
            let (tx, rx) = oneshot::channel();
            coordinator.send(Request::Discard {
                name: db.name.clone(),
                reply: tx,
            })?;
            drop(db.take());
            rx.await.map_err(|_| gone())?;
        }
    }

    /// Drops this migration set's template and its clones no test is
    /// using (those in use stay): for a test that made a migration set of
    /// its own. Unused sets are dropped after a day anyway.
    ///
    /// # Errors
    ///
    /// When `DATABASE_URL` is not set or a statement fails.
    pub async fn drop_databases(self) -> Result<(), TestDbError> {
        let coordinator = self.coordinator()?;
        let (tx, rx) = oneshot::channel();
        coordinator.send(Request::DropSet {
            set: self,
            reply: tx,
        })?;
        rx.await.map_err(|_| gone())?
    }
}

fn gone() -> TestDbError {
    TestDbError::Database(sqlx::Error::WorkerCrashed)
}

/// A clone handed to a test: `fresh` when just created (no reset needed).
struct Claimed {
    name: String,
    fresh: bool,
}

/// What the coordinator does for the tests of its process.
enum Request {
    Claim {
        set: TestDbBuilder,
        reply: oneshot::Sender<Result<Claimed, TestDbError>>,
    },
    /// A clone whose schema a test changed: dropped.
    Discard {
        name: String,
        reply: oneshot::Sender<()>,
    },
    /// A test is done with its clone; `failed`: keep it, and say when
    /// marked.
    Release {
        name: String,
        failed: Option<std::sync::mpsc::Sender<bool>>,
    },
    DropSet {
        set: TestDbBuilder,
        reply: oneshot::Sender<Result<(), TestDbError>>,
    },
}

/// The process's coordinator for one server: a thread of its own (tests
/// each run on a runtime of their own, a connection outlives none of
/// them) holding one connection to the maintenance database, on which it
/// takes the locks of the clones the process's tests hold. Claiming and
/// releasing cost no connection of their own.
#[derive(Clone)]
struct Coordinator {
    requests: mpsc::UnboundedSender<Request>,
    maintenance: PgConnectOptions,
}

/// The coordinators of this process, by URL.
static COORDINATORS: Mutex<Vec<(String, Coordinator)>> = Mutex::new(Vec::new());

impl Coordinator {
    fn of(url: &str) -> Result<Self, TestDbError> {
        let mut all = COORDINATORS.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|(_, c)| !c.requests.is_closed());
        if let Some((_, c)) = all.iter().find(|(u, _)| u == url) {
            return Ok(c.clone());
        }
        let mut maintenance = PgConnectOptions::from_str(url)?;
        if local_without_ssl_mode(url, &maintenance) {
            // TLS costs each new connection more than the rest of a
            // handler test (loading the trust store, the handshake: ~100 ms
            // on a busy 2-core machine), and a loopback server's traffic
            // does not leave the host. A URL or PGSSLMODE that names a mode
            // is followed.
            maintenance = maintenance.ssl_mode(PgSslMode::Disable);
        }
        let (requests, receiver) = mpsc::unbounded_channel();
        let options = maintenance.clone();
        std::thread::Builder::new()
            .name("outbox-testdb".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    runtime.block_on(serve(options, receiver));
                }
            })
            .map_err(|e| TestDbError::Database(sqlx::Error::Io(e)))?;
        let coordinator = Self {
            requests,
            maintenance,
        };
        all.push((url.to_owned(), coordinator.clone()));
        Ok(coordinator)
    }

    fn send(&self, request: Request) -> Result<(), TestDbError> {
        self.requests.send(request).map_err(|_| gone())
    }
}

/// Whether `url` reaches the server over loopback (or a Unix socket)
/// without naming an `sslmode` (in the URL or `PGSSLMODE`).
fn local_without_ssl_mode(url: &str, options: &PgConnectOptions) -> bool {
    let named = url
        .split_once('?')
        .is_some_and(|(_, query)| query.split('&').any(|p| p.starts_with("sslmode=")))
        || std::env::var_os("PGSSLMODE").is_some();
    let host = options.get_host();
    let local = host.starts_with('/')
        || host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    local && !named
}

/// The coordinator's state: its connection, the templates it made sure
/// of, the clones its tests hold.
struct State {
    options: PgConnectOptions,
    conn: Option<PgConnection>,
    ready: HashSet<String>,
    held: HashSet<String>,
}

async fn serve(options: PgConnectOptions, mut requests: mpsc::UnboundedReceiver<Request>) {
    let mut state = State {
        options,
        conn: None,
        ready: HashSet::new(),
        held: HashSet::new(),
    };
    while let Some(request) = requests.recv().await {
        match request {
            Request::Claim { set, reply } => {
                let _ = reply.send(state.claim(&set).await);
            }
            Request::Discard { name, reply } => {
                if let Ok(conn) = state.conn().await {
                    let _ = exec(conn, format!(r#"DROP DATABASE IF EXISTS "{name}""#)).await;
                    let _ = unlock(conn, &name).await;
                }
                state.held.remove(&name);
                let _ = reply.send(());
            }
            Request::Release { name, failed } => {
                let mut marked = false;
                if let Ok(conn) = state.conn().await {
                    if failed.is_some() {
                        marked = comment(conn, &name, FAILED).await.is_ok();
                    }
                    let _ = unlock(conn, &name).await;
                }
                state.held.remove(&name);
                if let Some(done) = failed {
                    let _ = done.send(marked);
                }
            }
            Request::DropSet { set, reply } => {
                let _ = reply.send(state.drop_set(&set).await);
            }
        }
    }
}

impl State {
    /// The connection, opened again if it broke (the locks it held are
    /// gone then: a test holding a clone may see it reset by another
    /// process — a server restart in the middle of a test run).
    async fn conn(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        if let Some(conn) = &mut self.conn
            && conn.ping().await.is_err()
        {
            self.conn = None;
        }
        if self.conn.is_none() {
            self.conn = Some(self.options.connect().await?);
        }
        Ok(self.conn.as_mut().expect("connected"))
    }

    async fn claim(&mut self, set: &TestDbBuilder) -> Result<Claimed, TestDbError> {
        let key = set.key();
        let template = format!("outbox_tpl_{key}");
        let options = self.options.clone();
        if !self.ready.contains(&template) {
            let held = self.held.clone();
            let conn = self.conn().await?;
            ensure_template(conn, &options, set, &template).await?;
            sweep(conn, &template, &held).await;
            self.ready.insert(template.clone());
        }
        let prefix = format!("outbox_test_{key}_");
        let held = self.held.clone();
        let conn = self.conn().await?;
        if let Some(name) = claim_free(conn, &prefix, &held).await? {
            self.held.insert(name.clone());
            return Ok(Claimed { name, fresh: false });
        }
        let name = format!("{prefix}{}", uuid::Uuid::new_v4().simple());
        lock(conn, &name).await?;
        let strategy = if server_version(conn).await? >= 150_000 {
            // WAL_LOG (the default since 15) copies the template's pages
            // through the WAL; FILE_COPY copies its files but costs two
            // checkpoints, many times slower for a small template.
            " STRATEGY WAL_LOG"
        } else {
            ""
        };
        let created = exec(
            conn,
            format!(r#"CREATE DATABASE "{name}" TEMPLATE "{template}"{strategy}"#),
        )
        .await;
        if let Err(error) = created {
            let _ = unlock(conn, &name).await;
            return Err(error.into());
        }
        self.held.insert(name.clone());
        Ok(Claimed { name, fresh: true })
    }

    async fn drop_set(&mut self, set: &TestDbBuilder) -> Result<(), TestDbError> {
        let key = set.key();
        let template = format!("outbox_tpl_{key}");
        let held = self.held.clone();
        let conn = self.conn().await?;
        drop_free_clones(conn, &format!("outbox_test_{key}_"), &held).await?;
        lock(conn, &template).await?;
        let dropped = drop_template(conn, &template).await;
        unlock(conn, &template).await?;
        self.ready.remove(&template);
        Ok(dropped?)
    }
}

/// Builds the template unless it is there: under its lock, so test
/// processes starting at once build it once.
async fn ensure_template(
    conn: &mut PgConnection,
    options: &PgConnectOptions,
    set: &TestDbBuilder,
    template: &str,
) -> Result<(), TestDbError> {
    if is_ready(conn, template).await? {
        comment(conn, template, USED).await?;
        return Ok(());
    }
    lock(conn, template).await?;
    let built = build_template(conn, options, set, template).await;
    unlock(conn, template).await?;
    built
}

/// Builds the template (its lock held).
async fn build_template(
    conn: &mut PgConnection,
    options: &PgConnectOptions,
    set: &TestDbBuilder,
    template: &str,
) -> Result<(), TestDbError> {
    if is_ready(conn, template).await? {
        return Ok(());
    }
    // Left half-built by a process that died, or by a failed migration:
    // start again.
    exec(conn, format!(r#"DROP DATABASE IF EXISTS "{template}""#)).await?;
    exec(conn, format!(r#"CREATE DATABASE "{template}""#)).await?;
    let mut tpl = options.clone().database(template).connect().await?;
    for migrator in set.migrators() {
        if let Err(e) = migrator.run_direct(&mut tpl).await {
            return Err(migrate_error(template, e.to_string()));
        }
    }
    for sql in &set.sql {
        if let Err(e) = exec(&mut tpl, sql.clone()).await {
            return Err(migrate_error(template, e.to_string()));
        }
    }
    if let Err(e) = exec(&mut tpl, SNAPSHOT_SQL.to_owned()).await {
        return Err(migrate_error(template, format!("the snapshot: {e}")));
    }
    tpl.close().await?;
    // No connections from now on: a clone needs a template nobody is
    // connected to.
    let seal = r#"WITH ALLOW_CONNECTIONS false IS_TEMPLATE true"#;
    exec(conn, format!(r#"ALTER DATABASE "{template}" {seal}"#)).await?;
    comment(conn, template, USED).await?;
    Ok(())
}
async fn drop_template(conn: &mut PgConnection, template: &str) -> Result<(), sqlx::Error> {
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(template.to_owned())
            .fetch_one(&mut *conn)
            .await?;
    if exists {
        exec(
            conn,
            format!(r#"ALTER DATABASE "{template}" IS_TEMPLATE false"#),
        )
        .await?;
        exec(conn, format!(r#"DROP DATABASE IF EXISTS "{template}""#)).await?;
    }
    Ok(())
}

fn migrate_error(template: &str, error: String) -> TestDbError {
    TestDbError::Migrate {
        template: template.to_owned(),
        error,
    }
}

async fn is_ready(conn: &mut PgConnection, template: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_database
         WHERE datname = $1 AND datistemplate AND NOT datallowconn)",
    )
    .bind(template.to_owned())
    .fetch_one(&mut *conn)
    .await
}

/// Sets the comment of database `name` to `text` followed by the server's
/// time (`COMMENT` takes only a literal: built server-side). The names are
/// the kit's own (hex digits and underscores).
async fn comment(conn: &mut PgConnection, name: &str, text: &str) -> Result<(), sqlx::Error> {
    exec(&mut *conn, format!(
        "DO $$ BEGIN EXECUTE format('COMMENT ON DATABASE %I IS %L', '{name}', '{text}' || now()); END $$"
    ))
    .await
    .map(|_| ())
}

/// Runs `sql` (statements without parameters) on `conn`.
async fn exec(conn: &mut PgConnection, sql: String) -> Result<(), sqlx::Error> {
    conn.execute(sql.as_str()).await.map(|_| ())
}

fn pool(maintenance: &PgConnectOptions, name: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(5)
        .idle_timeout(Some(Duration::from_secs(5)))
        .connect_lazy_with(maintenance.clone().database(name))
}

async fn server_version(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    let v: String = sqlx::query_scalar("SHOW server_version_num")
        .fetch_one(&mut *conn)
        .await?;
    Ok(v.parse().unwrap_or(0))
}

async fn try_lock(conn: &mut PgConnection, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(LOCK_SPACE)
        .bind(name)
        .fetch_one(&mut *conn)
        .await
}

async fn lock(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_lock($1, hashtext($2))")
        .bind(LOCK_SPACE)
        .bind(name)
        .execute(&mut *conn)
        .await
        .map(|_| ())
}

async fn unlock(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext($2))")
        .bind(LOCK_SPACE)
        .bind(name)
        .execute(&mut *conn)
        .await
        .map(|_| ())
}

/// Takes the first free, not failed clone named `prefix…` (not one of
/// `held`, this session's own: advisory locks are re-entrant); `None` when
/// there is none.
async fn claim_free(
    conn: &mut PgConnection,
    prefix: &str,
    held: &HashSet<String>,
) -> Result<Option<String>, TestDbError> {
    let free: Vec<String> = sqlx::query_scalar(
        "SELECT datname::text FROM pg_database
         WHERE starts_with(datname, $1)
           AND coalesce(shobj_description(oid, 'pg_database'), '') NOT LIKE 'failed%'
         ORDER BY datname",
    )
    .bind(prefix.to_owned())
    .fetch_all(&mut *conn)
    .await?;
    for name in free {
        if held.contains(&name) || !try_lock(conn, &name).await? {
            continue;
        }
        // Dropped or marked failed between the listing and the lock?
        let usable: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1
               AND coalesce(shobj_description(oid, 'pg_database'), '') NOT LIKE 'failed%')",
        )
        .bind(name.clone())
        .fetch_one(&mut *conn)
        .await?;
        if usable {
            return Ok(Some(name));
        }
        unlock(conn, &name).await?;
    }
    Ok(None)
}

/// Drops failed clones older than [`KEEP_FAILED`] and the templates (and
/// free clones) of migration sets unused for [`KEEP_UNUSED`]. Best effort.
async fn sweep(conn: &mut PgConnection, current: &str, held: &HashSet<String>) {
    let stale: Result<Vec<String>, sqlx::Error> = sqlx::query_scalar(&format!(
        "SELECT datname FROM pg_database d
         WHERE (starts_with(datname, 'outbox_test_')
                AND coalesce(shobj_description(oid, 'pg_database'), '') LIKE 'failed at %'
                AND substr(shobj_description(oid, 'pg_database'), {failed_len})::timestamptz
                    < now() - interval '{KEEP_FAILED}')
            OR (starts_with(datname, 'outbox_test_')
                AND NOT EXISTS (SELECT 1 FROM pg_database t
                                WHERE t.datname = 'outbox_tpl_' || split_part(d.datname, '_', 3)))
            OR (starts_with(datname, 'outbox_tpl_') AND datname <> $1 AND datistemplate
                AND coalesce(shobj_description(oid, 'pg_database'), '') LIKE 'outbox test template, used %'
                AND substr(shobj_description(oid, 'pg_database'), {used_len})::timestamptz
                    < now() - interval '{KEEP_UNUSED}')
         ORDER BY datname DESC",
        failed_len = FAILED.len() + 1,
        used_len = USED.len() + 1,
    ))
    .bind(current)
    .fetch_all(&mut *conn)
    .await;
    let Ok(stale) = stale else { return };
    for name in stale {
        if held.contains(&name) || !matches!(try_lock(conn, &name).await, Ok(true)) {
            continue;
        }
        if let Some(key) = name.strip_prefix("outbox_tpl_") {
            let prefix = format!("outbox_test_{key}_");
            let _ = drop_free_clones(conn, &prefix, held).await;
            let _ = exec(
                &mut *conn,
                format!(r#"ALTER DATABASE "{name}" IS_TEMPLATE false"#),
            )
            .await;
        }
        let _ = exec(&mut *conn, format!(r#"DROP DATABASE IF EXISTS "{name}""#)).await;
        let _ = unlock(conn, &name).await;
    }
}

async fn drop_free_clones(
    conn: &mut PgConnection,
    prefix: &str,
    held: &HashSet<String>,
) -> Result<(), sqlx::Error> {
    let clones: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE starts_with(datname, $1)")
            .bind(prefix)
            .fetch_all(&mut *conn)
            .await?;
    for name in clones {
        if !held.contains(&name) && try_lock(conn, &name).await? {
            let _ = exec(&mut *conn, format!(r#"DROP DATABASE IF EXISTS "{name}""#)).await;
            unlock(conn, &name).await?;
        }
    }
    Ok(())
}

/// A database for one test, with the migrations applied and nothing else
/// in it — in milliseconds (see the module docs). Use it with
/// `#[tokio::test]`; it goes back to the pool of clones when dropped, or is
/// kept for inspection (and named on stderr) when the test panicked.
///
/// ```no_run
/// # async fn f() {
/// use outbox_runtime::testing::TestDb;
/// let db = TestDb::new().await.unwrap(); // the outbox's tables, empty
/// let pool = db.pool();
/// # let _ = pool;
/// # }
/// ```
///
/// With the application's migrations (and SQL) too:
///
/// ```no_run
/// # static APP_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator::DEFAULT;
/// # async fn f() {
/// use outbox_runtime::testing::TestDb;
/// let db = TestDb::builder().migrator(&APP_MIGRATOR).create().await.unwrap();
/// # }
/// ```
pub struct TestDb {
    name: String,
    pool: PgPool,
    coordinator: Coordinator,
}

impl std::fmt::Debug for TestDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDb")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TestDb {
    /// A database with the outbox's migrations applied: `DATABASE_URL`'s
    /// server, a clone of the template (see the module docs).
    ///
    /// # Errors
    ///
    /// As [`TestDbBuilder::create`].
    pub async fn new() -> Result<Self, TestDbError> {
        Self::builder().create().await
    }

    /// A builder: the application's migrations and SQL for the template.
    pub fn builder() -> TestDbBuilder {
        TestDbBuilder {
            outbox: true,
            ..TestDbBuilder::default()
        }
    }

    /// A pool on the database (at most 5 connections).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Empties the name: dropping `self` then releases nothing.
    fn take(mut self) -> Self {
        self.name.clear();
        self
    }
}

impl Drop for TestDb {
    /// Gives the clone back. During a panic, first marks it failed (and
    /// waits for that), so that it is kept as the test left it.
    fn drop(&mut self) {
        if self.name.is_empty() {
            return;
        }
        let name = self.name.clone();
        if !std::thread::panicking() {
            let _ = self
                .coordinator
                .send(Request::Release { name, failed: None });
            return;
        }
        let (done, marked) = std::sync::mpsc::channel();
        let _ = self.coordinator.send(Request::Release {
            name,
            failed: Some(done),
        });
        if marked.recv_timeout(Duration::from_secs(10)) == Ok(true) {
            eprintln!(
                "TestDb: the test failed; its database {} is kept for an hour",
                self.name
            );
        }
    }
}
