//! Least privilege: the application, the relay and the consumers run as
//! ordinary roles with exactly the GRANTs the README's "Roles and
//! privileges" lists (this test executes that block), separate from the
//! role that owns the tables and runs migrations; and each role is refused
//! what it has no business doing.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, Mode, Relay};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The README's block, verbatim up to its closing fence (checked below).
const GRANTS: &str = "\
GRANT USAGE ON SCHEMA public TO outbox_app, outbox_relay, outbox_consumer;
-- the application: its Unit of Work inserts events
GRANT INSERT ON outbox_event TO outbox_app;
-- the relay: reads the outbox, marks rows published, failed or parked
GRANT SELECT, UPDATE (published_at, attempts, last_error, last_attempt_at, parked_at)
    ON outbox_event TO outbox_relay;
-- a consumer: deduplication, the inbox, dead letters, follow-up events
GRANT SELECT, INSERT ON processed_event TO outbox_consumer;
GRANT SELECT, INSERT, UPDATE ON inbox_event, dead_letter TO outbox_consumer;
GRANT INSERT ON outbox_event TO outbox_consumer;
-- a consumer: the commit guard of the transactions its handlers run in
GRANT SELECT, INSERT, UPDATE ON outbox_tx_guard TO outbox_consumer;
";

const ROLES: [&str; 3] = ["outbox_app", "outbox_relay", "outbox_consumer"];

#[test]
fn the_readme_lists_exactly_these_grants() {
    let readme = include_str!("../../README.md");
    assert!(
        readme.contains(&format!("```sql\n{GRANTS}```")),
        "README.md's roles block differs from this test's GRANTS"
    );
}

/// The roles of this test run (roles are per server, databases share them).
struct Roles {
    suffix: String,
    admin: PgPool,
}

impl Roles {
    async fn create(admin: &PgPool) -> Self {
        let suffix = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        let roles = Self {
            suffix,
            admin: admin.clone(),
        };
        for role in ROLES {
            sqlx::query(&format!("CREATE ROLE {} LOGIN", roles.name(role)))
                .execute(admin)
                .await
                .unwrap();
        }
        let mut sql = GRANTS.to_owned();
        for role in ROLES {
            sql = sql.replace(role, &roles.name(role));
        }
        sqlx::raw_sql(&sql).execute(admin).await.unwrap();
        roles
    }

    fn name(&self, role: &str) -> String {
        format!("{role}_{}", self.suffix)
    }

    /// A pool on the test database logged in as `role`.
    fn pool(&self, role: &str, max: u32) -> PgPool {
        let options = (*self.admin.connect_options())
            .clone()
            .username(&self.name(role));
        PgPoolOptions::new()
            .max_connections(max)
            .connect_lazy_with(options)
    }

    async fn drop_all(self) {
        for role in ROLES {
            let name = self.name(role);
            let _ = sqlx::query(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"
            ))
            .execute(&self.admin)
            .await;
            let _ = sqlx::raw_sql(&format!("DROP OWNED BY {name}; DROP ROLE {name}"))
                .execute(&self.admin)
                .await;
        }
    }
}

async fn refused(pool: &PgPool, sql: &str) -> bool {
    match sqlx::query(sql).execute(pool).await {
        Err(sqlx::Error::Database(e)) => e.code().as_deref() == Some("42501"),
        _ => false,
    }
}

keyed_event!(RoleEvent, "roles-events");
keyed_event!(FollowUp, "roles-follow-ups");

/// Writes the handled event to `effect` and records a follow-up event.
struct Apply(Arc<AtomicUsize>);

impl InboxHandler for Apply {
    type Event = RoleEvent;
    const NAME: &'static str = "apply";
    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: RoleEvent,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            sqlx::query("INSERT INTO effect (key, seq) VALUES ($1, $2)")
                .bind(&event.key)
                .bind(event.seq as i64)
                .execute(&mut **ctx)
                .await?;
            ctx.record(FollowUp {
                key: event.key.clone(),
                seq: event.seq,
            });
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn app_relay_and_consumers_run_as_ordinary_roles(pool: PgPool) {
    init_tracing();
    let roles = Roles::create(&pool).await;
    // The handlers' own table, granted as an application would.
    sqlx::raw_sql(&format!(
        "CREATE TABLE effect (key text, seq bigint);
         GRANT INSERT ON effect TO {};",
        roles.name("outbox_consumer")
    ))
    .execute(&pool)
    .await
    .unwrap();
    let topic = RoleEvent::TOPIC;
    reset_topic(&brokers(), topic).await;
    reset_topic(&brokers(), FollowUp::TOPIC).await;

    // The application writes events.
    let app = roles.pool("outbox_app", 2);
    let committed = commit_messages(&app, topic, 40, 4, 10).await;

    // The relay publishes them (lanes and LISTEN included).
    let relay = Relay::builder(roles.pool("outbox_relay", 4))
        .brokers(brokers())
        .poll_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    assert!(
        wait_until_published(&pool, Duration::from_secs(30)).await,
        "published by the relay role"
    );

    // Consumers in both modes apply them; their follow-ups are published.
    let applied = Arc::new(AtomicUsize::new(0));
    let mut consumers = Vec::new();
    for (group, mode) in [("roles-dedup", Mode::Dedup), ("roles-inbox", Mode::Inbox)] {
        consumers.push(
            Consumer::builder(roles.pool("outbox_consumer", 4))
                .group(format!("{group}-{}", roles.suffix))
                .brokers(brokers())
                .mode(mode)
                .handler(Apply(applied.clone()))
                .spawn()
                .unwrap(),
        );
    }
    assert!(
        eventually(Duration::from_secs(60), || async {
            applied.load(Ordering::SeqCst) == 2 * committed.len()
        })
        .await,
        "applied by the consumer role: {}",
        applied.load(Ordering::SeqCst)
    );
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    for consumer in consumers {
        consumer.shutdown().await.unwrap();
    }
    relay.shutdown().await.unwrap();
    let follow_ups: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_event WHERE topic = $1 AND published_at IS NOT NULL",
    )
    .bind(FollowUp::TOPIC)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(follow_ups as usize, 2 * committed.len());

    // Nothing beyond that.
    let relay_pool = roles.pool("outbox_relay", 1);
    assert!(refused(&relay_pool, "DELETE FROM outbox_event").await);
    assert!(refused(&relay_pool, "UPDATE outbox_event SET payload = '{}'").await);
    assert!(refused(&relay_pool, "SELECT count(*) FROM processed_event").await);
    assert!(refused(&app, "SELECT count(*) FROM outbox_event").await);
    assert!(refused(&app, "DELETE FROM outbox_event").await);
    let consumer_pool = roles.pool("outbox_consumer", 1);
    assert!(
        refused(
            &consumer_pool,
            "UPDATE outbox_event SET published_at = now()"
        )
        .await
    );
    assert!(refused(&consumer_pool, "DELETE FROM processed_event").await);
    // Schema changes stay with the owner.
    assert!(
        refused(
            &relay_pool,
            "ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_notify"
        )
        .await
    );
    for p in [app, relay_pool, consumer_pool] {
        p.close().await;
    }
    roles.drop_all().await;
}
