//! `TestDb` (the testing kit's databases) against a real PostgreSQL: a
//! clone has the migrations and nothing a previous test left, seeded rows
//! and sequences come back, a clone whose schema a test changed is not
//! reused, a failed test's clone is kept, tests building one template at
//! once build it once, and a changed migration set gets a template of its
//! own.
//!
//! Each test makes a migration set of its own (a unique SQL comment), so
//! that no other test takes its clones, and drops it at the end.

use outbox::prelude::*;
use outbox::testing::{TestDb, TestDbBuilder};
use sqlx::PgPool;

/// The SQL of a migration set of its own (with the outbox's migrations).
fn unique(sql: &str) -> String {
    format!("-- test set {}\n{sql}", Uuid::new_v4())
}

fn set(sql: &str) -> TestDbBuilder {
    TestDb::builder().sql(sql)
}

#[derive(serde::Serialize, serde::Deserialize, DomainEvent)]
#[event(topic = "testdb", aggregate_type = "Note")]
struct Noted {
    #[event(aggregate_id)]
    id: Uuid,
}

/// Records an event in the outbox.
async fn record(pool: &PgPool) {
    let mut uow = UnitOfWork::begin(pool).await.unwrap();
    uow.record(Noted { id: Uuid::now_v7() });
    uow.commit().await.unwrap();
}

async fn scalar<T>(pool: &PgPool, sql: &str) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn maintenance() -> sqlx::PgConnection {
    use sqlx::Connection as _;
    sqlx::PgConnection::connect(&std::env::var("DATABASE_URL").expect("DATABASE_URL"))
        .await
        .unwrap()
}

async fn databases(prefix: &str) -> Vec<(String, Option<String>)> {
    let mut conn = maintenance().await;
    sqlx::query_as(
        "SELECT datname::text, shobj_description(oid, 'pg_database') FROM pg_database
         WHERE starts_with(datname, $1) ORDER BY datname",
    )
    .bind(prefix)
    .fetch_all(&mut conn)
    .await
    .unwrap()
}

fn clone_prefix(template: &str) -> String {
    format!("outbox_test_{}_", &template["outbox_tpl_".len()..])
}

const PLANS: &str = "CREATE TABLE plans (id serial PRIMARY KEY, name text NOT NULL);
                     INSERT INTO plans (name) VALUES ('basic'), ('pro');
                     CREATE TABLE notes (id bigint GENERATED ALWAYS AS IDENTITY, body text);";

#[tokio::test]
async fn a_clone_has_the_migrations_and_nothing_a_previous_test_left() {
    let sql = unique(PLANS);
    let first = set(&sql).create().await.unwrap();
    let pool = first.pool();
    // The outbox's tables, the set's SQL and its seeded rows.
    assert_eq!(
        scalar::<i64>(pool, "SELECT count(*) FROM outbox_event").await,
        0
    );
    assert_eq!(
        scalar::<String>(pool, "SELECT string_agg(name, ',' ORDER BY id) FROM plans").await,
        "basic,pro"
    );
    // A test fills and changes everything …
    record(pool).await;
    sqlx::raw_sql(
        "DELETE FROM plans WHERE name = 'basic'; UPDATE plans SET name = 'gold';
         INSERT INTO plans (name) VALUES ('extra'); INSERT INTO notes (body) VALUES ('a'), ('b');",
    )
    .execute(pool)
    .await
    .unwrap();
    let name = first.name().to_owned();
    drop(first);

    // … and the next test of the set gets the same clone, as the template was.
    let second = set(&sql).create().await.unwrap();
    assert_eq!(second.name(), name, "the free clone is reused");
    let pool = second.pool();
    assert_eq!(
        scalar::<i64>(pool, "SELECT count(*) FROM outbox_event").await,
        0
    );
    assert_eq!(
        scalar::<String>(pool, "SELECT string_agg(name, ',' ORDER BY id) FROM plans").await,
        "basic,pro"
    );
    assert_eq!(scalar::<i64>(pool, "SELECT count(*) FROM notes").await, 0);
    // Sequences as the template left them.
    let plan: i32 = scalar(pool, "INSERT INTO plans (name) VALUES ('new') RETURNING id").await;
    assert_eq!(plan, 3);
    let note: i64 = scalar(pool, "INSERT INTO notes (body) VALUES ('c') RETURNING id").await;
    assert_eq!(note, 1);
    let event: i64 = {
        record(pool).await;
        scalar(pool, "SELECT min(id) FROM outbox_event").await
    };
    assert_eq!(event, 1);

    // Two at once: two clones.
    let third = set(&sql).create().await.unwrap();
    assert_ne!(third.name(), second.name());
    drop((second, third));
    set(&sql).drop_databases().await.unwrap();
}

#[tokio::test]
async fn a_clone_whose_schema_a_test_changed_is_not_reused() {
    let sql = unique(PLANS);
    let first = set(&sql).create().await.unwrap();
    sqlx::query("CREATE TABLE scratch (x int)")
        .execute(first.pool())
        .await
        .unwrap();
    let changed = first.name().to_owned();
    drop(first);

    let second = set(&sql).create().await.unwrap();
    assert_ne!(second.name(), changed, "a fresh clone");
    let scratch: Option<String> =
        scalar(second.pool(), "SELECT to_regclass('scratch')::text").await;
    assert_eq!(scratch, None);
    // The changed clone is gone.
    let names: Vec<String> = databases(&clone_prefix(&set(&sql).template_name()))
        .await
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, [second.name().to_owned()]);
    drop(second);
    set(&sql).drop_databases().await.unwrap();
}

#[tokio::test]
async fn a_failed_tests_clone_is_kept_as_it_was_and_not_reused() {
    let sql = unique(PLANS);
    let failing = {
        let sql = sql.clone();
        tokio::spawn(async move {
            let db = set(&sql).create().await.unwrap();
            sqlx::query("INSERT INTO plans (name) VALUES ('evidence')")
                .execute(db.pool())
                .await
                .unwrap();
            let name = db.name().to_owned();
            if !name.is_empty() {
                panic!("the test fails with its database {name}");
            }
            drop(db);
        })
    };
    let panic = failing.await.unwrap_err().into_panic();
    let message = panic.downcast_ref::<String>().unwrap();
    let kept = message.rsplit(' ').next().unwrap().to_owned();

    let next = set(&sql).create().await.unwrap();
    assert_ne!(next.name(), kept, "a failed clone is not reused");
    let all = databases(&clone_prefix(&set(&sql).template_name())).await;
    let (_, comment) = all.iter().find(|(n, _)| *n == kept).expect("kept");
    assert!(
        comment
            .as_deref()
            .is_some_and(|c| c.starts_with("failed at ")),
        "{comment:?}"
    );
    // As the test left it.
    let options: sqlx::postgres::PgConnectOptions =
        std::env::var("DATABASE_URL").unwrap().parse().unwrap();
    let kept_pool = PgPool::connect_with(options.database(&kept)).await.unwrap();
    assert_eq!(
        scalar::<i64>(
            &kept_pool,
            "SELECT count(*) FROM plans WHERE name = 'evidence'"
        )
        .await,
        1
    );
    kept_pool.close().await;
    drop(next);
    let mut conn = maintenance().await;
    sqlx::raw_sql(&format!(r#"DROP DATABASE "{kept}""#))
        .execute(&mut conn)
        .await
        .unwrap();
    set(&sql).drop_databases().await.unwrap();
}

/// Tests of one new migration set starting at once (in this process and,
/// as far as PostgreSQL can tell, in as many processes: one connection
/// each) build its template once, and each get a clone of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tests_starting_at_once_build_the_template_once() {
    let sql = unique(PLANS);
    let tests: Vec<_> = (0..6)
        .map(|_| {
            let sql = sql.clone();
            tokio::spawn(async move {
                let db = set(&sql).create().await.unwrap();
                let plans: i64 = scalar(db.pool(), "SELECT count(*) FROM plans").await;
                (db, plans)
            })
        })
        .collect();
    let mut names = Vec::new();
    let mut dbs = Vec::new();
    for test in tests {
        let (db, plans) = test.await.unwrap();
        assert_eq!(plans, 2);
        names.push(db.name().to_owned());
        dbs.push(db);
    }
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 6, "a clone each: {names:?}");
    let template = set(&sql).template_name();
    assert_eq!(databases(&template).await.len(), 1, "one template");
    drop(dbs);
    set(&sql).drop_databases().await.unwrap();
    assert!(databases(&template).await.is_empty());
    assert!(databases(&clone_prefix(&template)).await.is_empty());
}

#[tokio::test]
async fn a_changed_migration_set_gets_a_template_of_its_own() {
    let base = unique("CREATE TABLE plans (id serial PRIMARY KEY, name text NOT NULL);");
    let changed = format!("{base}\nALTER TABLE plans ADD COLUMN price_cents bigint;");
    let (old, new) = (set(&base).template_name(), set(&changed).template_name());
    assert_ne!(old, new);
    let before = set(&base).create().await.unwrap();
    let after = set(&changed).create().await.unwrap();
    let column = "SELECT count(*) FROM information_schema.columns
                  WHERE table_name = 'plans' AND column_name = 'price_cents'";
    assert_eq!(scalar::<i64>(before.pool(), column).await, 0);
    assert_eq!(scalar::<i64>(after.pool(), column).await, 1);
    // The outbox's migrations are part of the set too.
    assert_ne!(
        set(&base).template_name(),
        set(&base).without_outbox_migrations().template_name()
    );
    drop((before, after));
    set(&base).drop_databases().await.unwrap();
    set(&changed).drop_databases().await.unwrap();
}

#[tokio::test]
async fn a_migration_that_fails_says_which_template_and_why() {
    let sql = unique("CREATE TABLE plans (id serial PRIMARY KEY); CREATE TABLE plans (id int);");
    let error = set(&sql).create().await.unwrap_err().to_string();
    assert!(error.contains(&set(&sql).template_name()), "{error}");
    assert!(error.contains("already exists"), "{error}");
    // Not left behind as a usable template: the next attempt fails the same.
    let again = set(&sql).create().await.unwrap_err().to_string();
    assert!(again.contains("already exists"), "{again}");
    set(&sql).drop_databases().await.unwrap();
}

/// Test processes starting at once with a new migration set: this test
/// runs the next one (ignored otherwise) in three processes of its own.
#[tokio::test]
async fn test_processes_starting_at_once_build_the_template_once() {
    let sql = unique(PLANS);
    let children: Vec<_> = (0..3)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "a_child_process_takes_a_clone", "--ignored"])
                .env("OUTBOX_TESTDB_SET", &sql)
                .output()
        })
        .collect();
    for child in children {
        let out = child.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let template = set(&sql).template_name();
    assert_eq!(databases(&template).await.len(), 1, "one template");
    set(&sql).drop_databases().await.unwrap();
    assert!(databases(&template).await.is_empty());
    assert!(databases(&clone_prefix(&template)).await.is_empty());
}

#[tokio::test]
#[ignore = "run by test_processes_starting_at_once_build_the_template_once"]
async fn a_child_process_takes_a_clone() {
    let sql = std::env::var("OUTBOX_TESTDB_SET").expect("OUTBOX_TESTDB_SET");
    let db = set(&sql).create().await.unwrap();
    assert_eq!(
        scalar::<i64>(db.pool(), "SELECT count(*) FROM plans").await,
        2
    );
}
