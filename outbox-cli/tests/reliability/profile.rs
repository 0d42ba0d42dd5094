//! The production profile of the reliability scenarios: every process as
//! the README's role, the partitioned layout with periods of seconds and a
//! maintainer creating and dropping partitions meanwhile.
//!
//! [`Setup::prepare`] makes a scenario's tables and, with
//! `OUTBOX_TEST_PROFILE=production` (or for a scenario that always runs
//! that way), the roles — created from the README's "Roles and privileges"
//! block, which is parsed here, so that the scenarios run exactly what it
//! says — the partitions and the maintainer. The scenario takes its pools
//! and URLs from [`Setup::pool`] and [`Setup::url`] (the owner's in the
//! default profile) and ends with [`Setup::finish`], which judges the
//! maintenance: every pass completed, a partition ahead at every sample.

use std::time::Duration;

use outbox_runtime::CancellationToken;
use outbox_runtime::cleanup::Retention;
use outbox_runtime::partition::{self, PartitionPlan};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use crate::checker::Figures;
use crate::common::database_url;
use crate::harness::{effect_tables, pool_of};

/// The partitions' period in the production profile: short, so that
/// partitions roll and expire within a scenario.
pub const PERIOD: Duration = Duration::from_secs(10);

/// Whether `OUTBOX_TEST_PROFILE=production`.
pub fn production() -> bool {
    std::env::var("OUTBOX_TEST_PROFILE").as_deref() == Ok("production")
}

/// Whether `OUTBOX_TEST_RELAY_MODE=progress`: the scenarios that call
/// [`relay_mode`] (all that run relays) put their outbox in the progress
/// mode (positions per batch, no row written to publish it) before any
/// relay starts.
pub fn progress_mode() -> bool {
    std::env::var("OUTBOX_TEST_RELAY_MODE").as_deref() == Ok("progress")
}

/// Puts the outbox of `pool` in the relay mode the environment asks for
/// ([`progress_mode`]); nothing in the default mode, nor when the mode is
/// on already (`pool` may then be a role's that may only read the
/// positions, as the relay's in the production profile: [`Setup::prepare`]
/// enabled it as the owner).
pub async fn relay_mode(pool: &PgPool) {
    if !progress_mode() {
        return;
    }
    let on: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_progress)")
        .fetch_one(pool)
        .await
        .expect("the relay mode");
    if !on {
        outbox_runtime::relay::progress::enable(pool)
            .await
            .expect("the progress mode");
    }
}

/// A scenario's tables and, in the production profile, its roles,
/// partitions and maintainer.
pub struct Setup {
    /// The tables' owner (the test's pool).
    pub owner: PgPool,
    roles: Option<Roles>,
    maintainer: Option<(CancellationToken, tokio::task::JoinHandle<Maintenance>)>,
}

impl Setup {
    /// The effect tables and `phantom_guard`; in the production profile
    /// also the rest (see the module docs), with a retention of
    /// `retention` (also the dedup window: it must outlive the scenario's
    /// redeliveries).
    pub async fn prepare(pool: &PgPool, retention: Duration) -> Self {
        Self::prepare_as(pool, production(), retention).await
    }

    /// [`Setup::prepare`], in the production profile or not whatever the
    /// environment says.
    pub async fn prepare_as(pool: &PgPool, production: bool, retention: Duration) -> Self {
        effect_tables(pool).await;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS phantom_guard (
                 id int,
                 CONSTRAINT phantom_guard_unique UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)",
        )
        .execute(pool)
        .await
        .expect("guard table");
        let mut setup = Self {
            owner: pool.clone(),
            roles: None,
            maintainer: None,
        };
        if !production {
            relay_mode(pool).await;
            return setup;
        }
        let plan = PartitionPlan {
            period: PERIOD,
            ahead: 2,
            lock_timeout: Duration::from_millis(500),
        };
        partition::enable(pool, &plan).await.expect("partitions");
        relay_mode(pool).await;
        setup.roles = Some(Roles::create(pool).await);
        if progress_mode() {
            // What the production chapter adds to its block for this mode.
            setup
                .grant("INSERT ON outbox_progress", "outbox_relay")
                .await;
            setup
                .grant(
                    "SELECT, INSERT, UPDATE, DELETE ON outbox_held_topic",
                    "outbox_relay",
                )
                .await;
        }
        let retention = Retention::new(retention)
            .dedup_window(retention)
            .dead_letters(Duration::from_secs(3600));
        let stop = CancellationToken::new();
        setup.maintainer = Some((
            stop.clone(),
            maintainer(pool.clone(), plan, retention, stop),
        ));
        setup
    }

    /// A pool of `n` connections as `role` (`outbox_app`, `outbox_relay`,
    /// `outbox_consumer`), or as the owner in the default profile.
    pub async fn pool(&self, role: &str, n: u32) -> PgPool {
        match &self.roles {
            Some(roles) => roles.pool(role, n).await,
            None => pool_of(&self.owner, n).await,
        }
    }

    /// The `DATABASE_URL` of `role` (the owner's in the default profile).
    pub fn url(&self, role: &str) -> String {
        match &self.roles {
            Some(roles) => roles.url(role),
            None => database_url(&self.owner),
        }
    }

    /// Grants `privileges` (e.g. `INSERT ON t`) to `role`, in the
    /// production profile: for a scenario's own tables.
    pub async fn grant(&self, privileges: &str, role: &str) {
        if let Some(roles) = &self.roles {
            sqlx::query(&format!("GRANT {privileges} TO {}", roles.name(role)))
                .execute(&self.owner)
                .await
                .expect("grant");
        }
    }

    /// Stops the maintainer, notes what it did in `figures`, drops the
    /// roles. Returns the maintenance (production profile), for
    /// [`Maintenance::assert_kept_up`] once the figures are reported.
    pub async fn finish(self, figures: &mut Figures) -> Option<Maintenance> {
        let maintenance = match self.maintainer {
            Some((stop, task)) => {
                stop.cancel();
                Some(task.await.expect("maintainer"))
            }
            None => None,
        };
        if let Some(roles) = self.roles {
            roles.drop_all().await;
        }
        let m = maintenance?;
        figures.note(
            "profile",
            "production: processes as the README's roles, 10-second partitions, a maintainer",
        );
        figures.note(
            "maintenance",
            format!(
                "{} passes, {} partitions created ({} left busy), {} dropped, {} kept for a later pass; \
                 rows deleted: {} outbox, {} dedup, {} inbox; failures: {:?}",
                m.passes,
                m.created,
                m.busy,
                m.dropped,
                m.kept,
                m.outbox_rows_deleted,
                m.dedup_rows_deleted,
                m.inbox_rows_deleted,
                m.failures
            ),
        );
        figures.note(
            "samples without a partition ahead",
            format!(
                "{} of {} (first: {:?})",
                m.behind.len(),
                m.samples,
                m.behind.first()
            ),
        );
        Some(m)
    }
}

impl Maintenance {
    /// Every pass completed, and a partition was ahead at every sample.
    pub fn assert_kept_up(&self) {
        assert!(
            self.failures.is_empty(),
            "maintenance passes failed: {:?}",
            self.failures
        );
        assert!(
            self.behind.is_empty(),
            "no partition ahead at {:?}",
            self.behind
        );
    }
}

/// The guide's "Roles and privileges" block (docs/src/production.md), as it is written there.
pub fn readme_grants() -> String {
    let readme = include_str!("../../../docs/src/production.md");
    let section = readme
        .split("\n## Roles and privileges")
        .nth(1)
        .expect("the README has a roles section");
    let block = section
        .split("```sql\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the roles section has a SQL block");
    block.to_owned()
}

/// The role names the block grants to (`… TO a, b, c;`).
pub fn roles_in(grants: &str) -> Vec<String> {
    let mut roles: Vec<String> = Vec::new();
    for statement in grants.split(';') {
        let statement: String = statement
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join(" ");
        let Some((_, to)) = statement.rsplit_once(" TO ") else {
            continue;
        };
        for role in to.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            if !roles.iter().any(|r| r == role) {
                roles.push(role.to_owned());
            }
        }
    }
    roles
}

/// This run's roles: the README's, each with a unique suffix (roles are
/// per server), created and granted exactly the README's block, plus what
/// the scenario's own tables need (the application's rolled-back commits
/// write `phantom_guard`, the handlers their effect tables).
pub struct Roles {
    suffix: String,
    admin: PgPool,
    names: Vec<String>,
}

impl Roles {
    pub async fn create(admin: &PgPool) -> Self {
        let grants = readme_grants();
        let names = roles_in(&grants);
        for needed in ["outbox_app", "outbox_relay", "outbox_consumer"] {
            assert!(
                names.iter().any(|n| n == needed),
                "the README's block grants nothing to {needed}: {names:?}"
            );
        }
        let suffix = Uuid::new_v4().simple().to_string()[..8].to_owned();
        let roles = Self {
            suffix,
            admin: admin.clone(),
            names,
        };
        let mut sql = grants;
        for role in &roles.names {
            sqlx::query(&format!("CREATE ROLE {} LOGIN", roles.name(role)))
                .execute(admin)
                .await
                .expect("create role");
            sql = replace_word(&sql, role, &roles.name(role));
        }
        sqlx::raw_sql(&sql)
            .execute(admin)
            .await
            .expect("the README's GRANT block");
        let own = format!(
            "GRANT INSERT ON phantom_guard TO {app};
             GRANT INSERT ON effect, effect_inbox TO {consumer};
             GRANT USAGE ON SEQUENCE effect_id_seq TO {consumer};",
            app = roles.name("outbox_app"),
            consumer = roles.name("outbox_consumer"),
        );
        sqlx::raw_sql(&own)
            .execute(admin)
            .await
            .expect("grants on the scenario's tables");
        roles
    }

    pub fn name(&self, role: &str) -> String {
        format!("{role}_{}", self.suffix)
    }

    pub fn url(&self, role: &str) -> String {
        let owner = database_url(&self.admin);
        let user = self.admin.connect_options().get_username().to_owned();
        owner.replacen(&format!("//{user}@"), &format!("//{}@", self.name(role)), 1)
    }

    pub async fn pool(&self, role: &str, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(2))
            .connect(&self.url(role))
            .await
            .expect("role pool")
    }

    pub async fn drop_all(self) {
        for role in &self.names {
            let name = self.name(role);
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
            )
            .bind(&name)
            .execute(&self.admin)
            .await;
            let _ = sqlx::raw_sql(&format!("DROP OWNED BY {name}; DROP ROLE {name}"))
                .execute(&self.admin)
                .await;
        }
    }
}

/// `text` with every whole-word `word` (not part of a longer identifier)
/// replaced.
pub fn replace_word(text: &str, word: &str, by: &str) -> String {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(ident) || after.is_some_and(ident) {
            out.push_str(word);
        } else {
            out.push_str(by);
        }
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
}

/// What the maintainer saw.
#[derive(Debug, Default)]
pub struct Maintenance {
    pub passes: u64,
    pub failures: Vec<String>,
    pub created: u64,
    /// Partitions not created at a pass: their table stayed locked.
    pub busy: u64,
    pub dropped: u64,
    pub kept: u64,
    pub outbox_rows_deleted: u64,
    pub dedup_rows_deleted: u64,
    pub inbox_rows_deleted: u64,
    /// Samples where no partition covered the next period.
    pub behind: Vec<String>,
    pub samples: u64,
}

/// The maintainer (the tables' owner): creates partitions ahead and runs
/// retention every half second until cancelled.
pub fn maintainer(
    pool: PgPool,
    plan: PartitionPlan,
    retention: Retention,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Maintenance> {
    tokio::spawn(async move {
        let mut seen = Maintenance::default();
        while !stop.is_cancelled() {
            seen.passes += 1;
            match partition::maintain(&pool, &plan).await {
                Ok(Some(report)) => {
                    seen.created += report.created;
                    seen.busy += report.busy;
                }
                Ok(None) => {}
                Err(e) => seen.failures.push(format!("maintain: {e}")),
            }
            match outbox_runtime::cleanup::cleanup(&pool, &retention).await {
                Ok(r) => {
                    seen.dropped += r.partitions_dropped;
                    seen.kept += r.partitions_kept;
                    seen.outbox_rows_deleted += r.outbox_events;
                    seen.dedup_rows_deleted += r.processed_events;
                    seen.inbox_rows_deleted += r.inbox_events;
                }
                Err(e) => seen.failures.push(format!("cleanup: {e}")),
            }
            seen.samples += 1;
            if let Some(gap) = partition_gap(&pool, plan.period).await {
                seen.behind.push(gap);
            }
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
        seen
    })
}

/// `Some(what is missing)` when a partitioned table has no partition for
/// now or for the next period.
async fn partition_gap(pool: &PgPool, period: Duration) -> Option<String> {
    let parts = partition::list(pool).await.ok()?;
    let now: i64 =
        sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8")
            .fetch_one(pool)
            .await
            .ok()?;
    let ahead = now + period.as_millis() as i64;
    for table in partition::TABLES {
        // A range, or the legacy partition (every id below the first
        // boundary): not the default one, where rows land only when no
        // partition of their own is there.
        let covers = |ms: i64| {
            parts.iter().any(|p| {
                p.table == table
                    && p.kind != partition::PartitionKind::Default
                    && p.from.is_none_or(|f| partition::ms_of(f) <= ms)
                    && p.to.is_some_and(|t| partition::ms_of(t) > ms)
            })
        };
        if !covers(now) || !covers(ahead) {
            let ranges: Vec<String> = parts
                .iter()
                .filter(|p| p.table == table && p.kind == partition::PartitionKind::Range)
                .map(|p| p.name.clone())
                .collect();
            return Some(format!("{table} at {now}: {ranges:?}"));
        }
    }
    None
}

#[test]
fn the_grants_block_names_its_roles() {
    let grants = "GRANT USAGE ON SCHEMA public TO outbox_app, outbox_relay;\n\
                  -- the relay: comment TO nobody\n\
                  GRANT SELECT ON outbox_event TO outbox_relay;\n";
    assert_eq!(roles_in(grants), ["outbox_app", "outbox_relay"]);
    assert_eq!(
        replace_word(
            "outbox_app ON outbox_app_x TO outbox_app;",
            "outbox_app",
            "r"
        ),
        "r ON outbox_app_x TO r;"
    );
}
