//! Least privilege: the application, the relay and the consumers run as
//! ordinary roles with exactly the GRANTs the README's "Roles and
//! privileges" lists (these tests execute that block, in a database where
//! `PUBLIC` holds nothing), separate from the role that owns the tables and
//! runs migrations; each role is refused what it has no business doing.
//!
//! The block is exactly what the processes need: the roles hold nothing
//! else, every process runs its failure paths as its role without a
//! refusal, and each privilege revoked alone makes its process's path
//! refused. A refused statement is reported once, does not spin, costs no
//! duplicate, no double application and no dead letter, and everything
//! resumes once the privilege is given back.
//!
//! The tests that run a relay run in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command), the relay role
//! holding the block and the guide's grants for that mode (its positions,
//! the topics missing on the broker), each of those needed as well:
//! "published" is then "passed by its slot's position" (see
//! `common::unpublished`), and a missing topic is held as a row of
//! `outbox_held_topic`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::roles::*;
use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler, UnitOfWork};
use outbox_runtime::{Consumer, ConsumerHealth, Mode, Relay, RelayHealth};
use sqlx::PgPool;

#[test]
fn the_guide_lists_exactly_these_grants() {
    let readme = include_str!("../../docs/src/production.md");
    assert!(
        readme.contains(&format!("```sql\n{GRANTS}```")),
        "the guide's roles block (docs/src/production.md) differs from this test's GRANTS"
    );
}

/// The progress mode's grants are those the guide gives after the block.
#[test]
fn the_guide_lists_the_progress_modes_grants() {
    let words = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let readme = words(include_str!("../../docs/src/production.md"));
    let grants = words(PROGRESS_GRANTS);
    assert!(
        readme.contains(&format!("`{}`", grants.trim_end_matches(';'))),
        "the guide (docs/src/production.md) does not give {grants}"
    );
}

async fn refused(pool: &PgPool, sql: &str) -> bool {
    match sqlx::query(sql).execute(pool).await {
        Err(sqlx::Error::Database(e)) => e.code().as_deref() == Some("42501"),
        _ => false,
    }
}

keyed_event!(RoleEvent, "roles-events");

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
    roles.relay_mode().await;
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
    let follow_ups: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_event WHERE topic = $1")
        .bind(FollowUp::TOPIC)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(follow_ups as usize, 2 * committed.len());
    assert_eq!(unpublished_of(&pool, FollowUp::TOPIC).await, 0);

    // Nothing beyond that.
    let relay_pool = roles.pool("outbox_relay", 1);
    assert!(refused(&relay_pool, "DELETE FROM outbox_event").await);
    assert!(refused(&relay_pool, "UPDATE outbox_event SET payload = '{}'").await);
    assert!(refused(&relay_pool, "SELECT count(*) FROM processed_event").await);
    // (It may read the columns that find a scheduled event to cancel.)
    assert!(refused(&app, "SELECT payload FROM outbox_event").await);
    assert!(refused(&app, "UPDATE outbox_event SET published_at = now()").await);
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

/// The relay as the relay role, on its failure path: 19 events of a topic
/// the broker has and one of a topic it lacks. The missing topic's row is
/// held (which writes `held_until`; in the progress mode, the topic's row
/// of `outbox_held_topic`), each of the 19 is published once, and nothing
/// is refused.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_relay_role_holds_a_missing_topic_and_publishes_each_event_once(pool: PgPool) {
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    roles.relay_mode().await;
    let good = unique_topic("roles-good");
    let missing = unique_topic("roles-missing");
    create_topic(&brokers(), &good).await;
    let app = roles.pool("outbox_app", 2);
    let mut uow = UnitOfWork::begin(&app).await.unwrap();
    let mut committed = Vec::new();
    for seq in 0..19 {
        committed.push(uow.record_message(message(&good, &format!("k{}", seq % 4), seq)));
    }
    uow.record_message(message(&missing, "k0", 19));
    uow.commit().await.unwrap();

    let relay = Relay::builder(roles.pool("outbox_relay", 4))
        .brokers(brokers())
        .poll_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    let held = eventually(Duration::from_secs(20), || held(&pool, &missing)).await;
    // A few more seconds of the relay's rounds.
    tokio::time::sleep(Duration::from_secs(5)).await;
    relay.shutdown().await.unwrap();
    let received = read_all(&brokers(), &good, Duration::from_secs(30)).await;
    let logs = logs.text();
    let refusals = logs
        .lines()
        .filter(|l| l.contains("permission denied"))
        .count();
    assert_eq!(
        received.len(),
        19,
        "{} messages for the 19 events; {refusals} log lines of refusals:\n{}",
        received.len(),
        logs.lines().take(20).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(verify(&committed, &received), 0);
    assert!(held, "the missing topic's row was never held");
    assert_eq!(refusals, 0, "{logs}");
    assert_eq!(unpublished(&pool).await, 1);
    app.close().await;
    roles.drop_all().await;
}

// ---- The block, exactly: each grant needed, nothing more -------------------

/// One privilege the block gives: `privilege` on `object` (a table, or
/// `SCHEMA public`), on one column if a column list names it, to `role`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Grant {
    role: &'static str,
    privilege: String,
    object: String,
    column: Option<String>,
}

impl Grant {
    /// The privilege as `GRANT`/`REVOKE` write it.
    fn sql(&self) -> String {
        match &self.column {
            Some(c) => format!("{} ({c}) ON {}", self.privilege, self.object),
            None => format!("{} ON {}", self.privilege, self.object),
        }
    }
}

/// Splits `s` at the commas outside parentheses.
fn split_top(s: &str) -> Vec<String> {
    let (mut parts, mut depth, mut current) = (Vec::new(), 0, String::new());
    for ch in s.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(current.trim().to_owned());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(ch);
    }
    parts.push(current.trim().to_owned());
    parts
}

/// Every privilege of the block, one by one.
fn block() -> Vec<Grant> {
    privileges(GRANTS)
}

/// The relay role's privileges in the mode the suite runs in: the block's,
/// and in the progress mode the guide's grants for it.
fn relay_grants() -> Vec<Grant> {
    let mut grants: Vec<Grant> = block()
        .into_iter()
        .filter(|g| g.role == "outbox_relay")
        .collect();
    if progress_mode() {
        grants.extend(privileges(PROGRESS_GRANTS));
    }
    grants
}

/// Every privilege of the `GRANT` statements `grants`, one by one.
fn privileges(grants: &str) -> Vec<Grant> {
    let text: String = grants
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join(" ");
    let mut grants = Vec::new();
    for statement in text.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let rest = statement.strip_prefix("GRANT ").expect(statement);
        let (privileges, rest) = rest.split_once(" ON ").expect(statement);
        let (objects, roles) = rest.split_once(" TO ").expect(statement);
        let objects: Vec<String> = match objects.strip_prefix("SCHEMA ") {
            Some(schema) => vec![format!("SCHEMA {}", schema.trim())],
            None => split_top(objects),
        };
        for privilege in split_top(privileges) {
            let (privilege, columns) = match privilege.split_once('(') {
                Some((p, cols)) => (
                    p.trim().to_owned(),
                    split_top(cols.trim_end_matches(')'))
                        .into_iter()
                        .map(Some)
                        .collect(),
                ),
                None => (privilege, vec![None]),
            };
            for role in split_top(roles) {
                let role = ROLES.into_iter().find(|r| *r == role).expect(statement);
                for object in &objects {
                    for column in &columns {
                        grants.push(Grant {
                            role,
                            privilege: privilege.clone(),
                            object: object.clone(),
                            column: column.clone(),
                        });
                    }
                }
            }
        }
    }
    grants.sort();
    grants
}

/// Every privilege `role` holds on the schema, its tables, their columns
/// and its sequences, as the catalog says (PUBLIC's included).
async fn held_privileges(roles: &Roles, role: &'static str) -> Vec<Grant> {
    let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT p.privilege, 'SCHEMA public', NULL FROM unnest(ARRAY['USAGE', 'CREATE']) AS p(privilege)
         WHERE has_schema_privilege($1, 'public', p.privilege)
         UNION ALL
         SELECT p.privilege, c.relname::text, NULL FROM pg_class c
         CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES',
                                 'TRIGGER']) AS p(privilege)
         WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
           AND has_table_privilege($1, c.oid, p.privilege)
         UNION ALL
         SELECT p.privilege, c.relname::text, a.attname::text FROM pg_class c
         JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
         CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'REFERENCES']) AS p(privilege)
         WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
           AND has_column_privilege($1, c.oid, a.attnum, p.privilege)
           AND NOT has_table_privilege($1, c.oid, p.privilege)
         UNION ALL
         SELECT p.privilege, 'SEQUENCE ' || c.relname::text, NULL FROM pg_class c
         CROSS JOIN unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) AS p(privilege)
         WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'S'
           AND has_sequence_privilege($1, c.oid, p.privilege)",
    )
    .bind(roles.name(role))
    .fetch_all(&roles.admin)
    .await
    .unwrap();
    let mut held: Vec<Grant> = rows
        .into_iter()
        .map(|(privilege, object, column)| Grant {
            role,
            privilege,
            object,
            column,
        })
        .collect();
    held.sort();
    held
}

#[test]
fn the_block_parses_into_its_privileges() {
    let grants = block();
    let relay: Vec<String> = grants
        .iter()
        .filter(|g| g.role == "outbox_relay")
        .map(Grant::sql)
        .collect();
    assert_eq!(
        relay,
        [
            "SELECT ON outbox_event",
            "SELECT ON outbox_progress",
            "UPDATE (attempts) ON outbox_event",
            "UPDATE (held_until) ON outbox_event",
            "UPDATE (last_attempt_at) ON outbox_event",
            "UPDATE (last_error) ON outbox_event",
            "UPDATE (parked_at) ON outbox_event",
            "UPDATE (published_at) ON outbox_event",
            "USAGE ON SCHEMA public",
        ]
    );
    assert!(grants.contains(&Grant {
        role: "outbox_consumer",
        privilege: "UPDATE".into(),
        object: "dead_letter".into(),
        column: None,
    }));
}

/// The roles hold exactly the block: nothing from PUBLIC, nothing else.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_roles_hold_the_block_and_nothing_else(pool: PgPool) {
    let roles = Roles::create(&pool).await;
    for role in ROLES {
        let expected: Vec<Grant> = block().into_iter().filter(|g| g.role == role).collect();
        assert_eq!(held_privileges(&roles, role).await, expected, "{role}");
    }
    roles.drop_all().await;
}

/// Whether `health` (a relay's or a consumer's) reports a refusal whose
/// text contains one of `expected`.
fn refused_with(error: Option<&str>, expected: &[&str]) -> bool {
    error.is_some_and(|e| expected.iter().any(|x| e.contains(x)))
}

fn relay_refusal(relay: &outbox_runtime::RelayHandle) -> Option<String> {
    match relay.health() {
        RelayHealth::Refused { error } => Some(error),
        _ => None,
    }
}

fn consumer_refusal(consumer: &outbox_runtime::ConsumerHandle) -> Option<String> {
    match consumer.health() {
        ConsumerHealth::Refused { error } => Some(error),
        _ => None,
    }
}

/// The relay's failure paths, as the relay role: events of a topic the
/// broker has, on four keys (one of them scheduled a second ahead) and on a key whose first event is too large
/// for the producer (it fails, is retried, then parked), and one of a topic
/// the broker lacks (held, its hold extended while missing; released rows
/// come back).
struct RelayRun {
    topic: String,
    missing: String,
    good: Vec<uuid::Uuid>,
}

impl RelayRun {
    async fn commit(roles: &Roles) -> Self {
        let topic = unique_topic("roles-relay");
        let missing = unique_topic("roles-relay-missing");
        create_topic(&brokers(), &topic).await;
        let app = roles.pool("outbox_app", 1);
        let mut uow = UnitOfWork::begin(&app).await.unwrap();
        let mut good = Vec::new();
        for seq in 0..10 {
            good.push(uow.record_message(message(&topic, &format!("k{}", seq % 4), seq)));
        }
        let mut poison = message(&topic, "poison", 10);
        poison.payload = serde_json::json!({ "blob": "x".repeat(300_000) }).to_string();
        uow.record_message(poison);
        uow.record_message(message(&missing, "k0", 11));
        // A scheduled event, due a second later: released and published.
        let due = std::time::SystemTime::now() + Duration::from_secs(1);
        good.push(uow.record_message_at(due, message(&topic, "k0", 12)));
        uow.commit().await.unwrap();
        app.close().await;
        Self {
            topic,
            missing,
            good,
        }
    }

    fn relay(roles: &Roles) -> outbox_runtime::RelayHandle {
        Relay::builder(roles.pool("outbox_relay", 4))
            .brokers(brokers())
            .poll_interval(Duration::from_millis(100))
            .kafka_setting("message.max.bytes", "100000")
            .max_attempts(2)
            .retry_backoff(Duration::from_millis(100), Duration::from_millis(200))
            .missing_topic_hold(Duration::from_millis(100), Duration::from_millis(200))
            .outage_backoff(Duration::from_millis(50), Duration::from_secs(1))
            .spawn()
            .unwrap()
    }

    /// Whether every path was taken: the good events published, the
    /// poison parked after a retried failure, the missing topic's row held.
    async fn done(&self, pool: &PgPool) -> bool {
        let published = outbox_runtime::relay::progress::Published::of(pool)
            .await
            .unwrap();
        let (published, parked, attempts): (i64, i64, i32) = sqlx::query_as(&format!(
            "{}SELECT count(*) FILTER (WHERE {}),
                    count(*) FILTER (WHERE parked_at IS NOT NULL),
                    coalesce(max(attempts), 0)
             FROM outbox_event WHERE topic = $1",
            published.with, published.condition
        ))
        .bind(&self.topic)
        .fetch_one(pool)
        .await
        .unwrap();
        published == 11 && parked == 1 && attempts == 2 && held(pool, &self.missing).await
    }
}

/// What a refusal of `grant` names: the statement of the process's path
/// that needs it.
fn needs(grant: &Grant) -> &'static [&'static str] {
    let column = grant.column.as_deref();
    match (grant.privilege.as_str(), grant.object.as_str(), column) {
        ("USAGE", _, _) => &["outbox_event", "does not exist"],
        ("INSERT", "outbox_event", _) if grant.role == "outbox_consumer" => {
            &["write follow-up events"]
        }
        ("SELECT", "outbox_event", _) => &["permission denied"],
        ("SELECT", "outbox_progress", _) => &["read the outbox's mode"],
        ("INSERT", "outbox_progress", _) => &["record progress"],
        ("SELECT", "outbox_held_topic", _) => &[
            "read the topics held as missing",
            "topic missing on the broker",
        ],
        (_, "outbox_held_topic", _) => &["topic missing on the broker", "missing topic's rows"],
        ("SELECT", "inbox_progress_consumer", _) => &["read the processor's mode"],
        ("UPDATE", "outbox_event", Some("published_at")) => &["mark rows published"],
        ("UPDATE", "outbox_event", Some("held_until")) => &[
            "record failed deliveries",
            "hold rows back",
            "release held rows",
            "missing topic's rows",
        ],
        ("UPDATE", "outbox_event", Some(_)) => &["record failed deliveries"],
        (_, "processed_event", _) => &["record processed events"],
        ("INSERT", "inbox_event", _) => &["store received events"],
        (_, "inbox_event", _) => &["claim stored events"],
        ("SELECT", "dead_letter", _) => &["count dead letters", "re-drive dead letters"],
        ("INSERT", "dead_letter", _) => &["write dead letters"],
        ("UPDATE", "dead_letter", _) => &["re-drive dead letters"],
        (_, "outbox_tx_guard", _) => &["arm the commit guard"],
        other => panic!("no path known for {other:?}"),
    }
}

/// The relay as its role on all its failure paths, two relays sharing the
/// lanes: nothing refused. Then each of its grants revoked in turn (in the
/// progress mode, the mode's grants too): a statement of those paths is
/// refused. Releasing a held topic (a `DELETE` in the progress mode) needs
/// the topic created: it is, for that grant.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_relay_needs_each_of_its_grants_and_no_more(pool: PgPool) {
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    roles.relay_mode().await;
    let run = RelayRun::commit(&roles).await;
    let relays = [RelayRun::relay(&roles), RelayRun::relay(&roles)];
    let done = eventually(Duration::from_secs(60), || async {
        assert!(
            relays.iter().all(|r| relay_refusal(r).is_none()),
            "refused with the block's grants:\n{}",
            logs.text()
        );
        run.done(&pool).await && relays.iter().all(|r| !r.lanes().is_empty())
    })
    .await;
    assert!(done, "{}", logs.text());
    // A few more rounds: the held row's hold extended, releases.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for relay in relays {
        assert_eq!(relay.health(), RelayHealth::Running);
        relay.shutdown().await.unwrap();
    }
    assert_eq!(logs.count(REFUSAL), 0, "{}", logs.text());
    let received = read_all(&brokers(), &run.topic, Duration::from_secs(30)).await;
    assert_eq!(verify(&run.good, &received), 0);

    for grant in relay_grants() {
        roles
            .sql(&format!("REVOKE {} FROM outbox_relay", grant.sql()))
            .await;
        let run = RelayRun::commit(&roles).await;
        let relay = RelayRun::relay(&roles);
        if grant.privilege == "DELETE" {
            // Held, then created on the broker: its hold is to end.
            assert!(
                eventually(Duration::from_secs(30), || held(&pool, &run.missing)).await,
                "{grant:?}: {:?}\n{}",
                relay.health(),
                logs.text()
            );
            create_topic(&brokers(), &run.missing).await;
        }
        let refused = eventually(Duration::from_secs(30), || async {
            refused_with(relay_refusal(&relay).as_deref(), needs(&grant))
        })
        .await;
        assert!(refused, "{grant:?}: {:?}", relay.health());
        relay.shutdown().await.unwrap();
        roles
            .sql(&format!("GRANT {} TO outbox_relay", grant.sql()))
            .await;
    }
    roles.drop_all().await;
}

/// The application's Unit of Work as its role: commits (and rolls back),
/// schedules an event and cancels it in a later transaction; without any
/// one of its grants, that is refused.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_application_needs_each_of_its_grants_and_no_more(pool: PgPool) {
    let roles = Roles::create(&pool).await;
    let app = roles.pool("outbox_app", 1);
    let commit = || async {
        let mut uow = UnitOfWork::begin(&app).await.unwrap();
        uow.record_message(message("roles-app", "k", 0));
        let later = std::time::SystemTime::now() + Duration::from_secs(3600);
        let scheduled = uow.record_message_at(later, message("roles-app", "k", 1));
        uow.commit().await?;
        let mut uow = UnitOfWork::begin(&app).await.unwrap();
        let cancelled = uow.cancel_scheduled(scheduled).await?;
        uow.commit().await?;
        assert!(cancelled);
        Ok::<_, outbox_core::Error>(())
    };
    commit().await.unwrap();
    let mut uow = UnitOfWork::begin(&app).await.unwrap();
    uow.record_message(message("roles-app", "k", 1));
    drop(uow);
    // The event, and the scheduled one cancelled (parked, dropped).
    assert_eq!(unpublished(&pool).await, 2);
    // (The sequences' grants are needed once partitioned: see below.)
    for grant in block()
        .into_iter()
        .filter(|g| g.role == "outbox_app" && !g.object.starts_with("SEQUENCE "))
    {
        roles
            .sql(&format!("REVOKE {} FROM outbox_app", grant.sql()))
            .await;
        let error = commit().await.unwrap_err();
        assert!(
            matches!(&error, outbox_core::Error::Database(sqlx::Error::Database(db))
                if matches!(db.code().as_deref(), Some("42501" | "42P01"))),
            "{grant:?}: {error}"
        );
        roles
            .sql(&format!("GRANT {} TO outbox_app", grant.sql()))
            .await;
        commit().await.unwrap();
    }
    app.close().await;
    roles.drop_all().await;
}

/// A consumer in `mode` as its role on all its failure paths: events
/// applied (follow-ups recorded), a malformed message and a failing event
/// dead-lettered after retries, the failing event's dead letter re-driven
/// (and failing again): nothing refused.
async fn consumer_paths(pool: &PgPool, roles: &Roles, logs: &Logs, mode: Mode) {
    consumer_paths_in(pool, roles, logs, mode, false).await;
}

/// [`consumer_paths`], the processor in the progress mode if `progress`.
async fn consumer_paths_in(pool: &PgPool, roles: &Roles, logs: &Logs, mode: Mode, progress: bool) {
    let inbound = Inbound::produce(roles, 8, 1).await;
    let consumer = if progress {
        inbound.consumer_in_progress_mode(roles).await
    } else {
        inbound.consumer(roles, mode)
    };
    let settled = eventually(Duration::from_secs(60), || async {
        assert!(
            consumer_refusal(&consumer).is_none(),
            "refused with the block's grants:\n{}",
            logs.text()
        );
        applied_of(pool, &inbound.good).await == vec![1; 8] && dead_letters(pool).await.len() == 2
    })
    .await;
    assert!(settled, "{:?}\n{}", dead_letters(pool).await, logs.text());
    // The failing event re-driven: it fails again.
    sqlx::query("UPDATE dead_letter SET status = 'retry' WHERE reason = 'handler_failed'")
        .execute(pool)
        .await
        .unwrap();
    let redriven = eventually(Duration::from_secs(30), || async {
        assert!(consumer_refusal(&consumer).is_none(), "{}", logs.text());
        sqlx::query_scalar::<_, bool>(
            "SELECT status = 'dead' AND attempts > 2 FROM dead_letter WHERE reason = 'handler_failed'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    })
    .await;
    assert!(redriven, "{}", logs.text());
    assert_eq!(consumer.health(), ConsumerHealth::Running);
    consumer.shutdown().await.unwrap();
    assert_eq!(applied_of(pool, &inbound.good).await, vec![1; 8]);
    assert_eq!(logs.count(REFUSAL), 0, "{}", logs.text());
}

/// A consumer's grant for sagas only (their table, the cancels of their
/// timeouts): `tests/sagas.rs` proves the consumer role runs a saga with
/// them, and not without.
fn for_sagas(grant: &Grant) -> bool {
    grant.object == "outbox_saga" || (grant.object == "outbox_event" && grant.column.is_some())
}

/// [`consumer_paths`] with the block's grants; then each grant of the
/// consumer role that `mode` uses (`uses`) revoked in turn: a statement of
/// those paths is refused.
async fn consumer_needs(pool: PgPool, mode: Mode, uses: impl Fn(&Grant) -> bool) {
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    consumer_paths(&pool, &roles, &logs, mode).await;
    for grant in block().into_iter().filter(|g| {
        g.role == "outbox_consumer"
            && !g.object.starts_with("SEQUENCE ")
            && !for_sagas(g)
            && uses(g)
    }) {
        roles
            .sql(&format!("REVOKE {} FROM outbox_consumer", grant.sql()))
            .await;
        let inbound = Inbound::produce(&roles, 2, 0).await;
        let consumer = inbound.consumer(&roles, mode);
        let refused = eventually(Duration::from_secs(30), || async {
            refused_with(consumer_refusal(&consumer).as_deref(), needs(&grant))
        })
        .await;
        assert!(refused, "{grant:?}: {:?}", consumer.health());
        consumer.shutdown().await.unwrap();
        roles
            .sql(&format!("GRANT {} TO outbox_consumer", grant.sql()))
            .await;
    }
    roles.drop_all().await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_dedup_consumer_needs_each_of_its_grants_and_no_more(pool: PgPool) {
    consumer_needs(pool, Mode::Dedup, |g| !g.object.starts_with("inbox_")).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_inbox_consumer_needs_each_of_its_grants_and_no_more(pool: PgPool) {
    consumer_needs(pool, Mode::Inbox, |g| g.object.starts_with("inbox_")).await;
}

/// An inbox-mode consumer whose processor is in the progress mode, as its
/// role with the block's grants and the mode's two: every path of
/// [`consumer_paths`], nothing refused; without `INSERT` or `SELECT` on
/// `inbox_progress` it is refused, saying what it needs, and applies
/// nothing twice once granted again.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_inbox_progress_consumer_needs_its_two_grants(pool: PgPool) {
    let logs = Logs::capture();
    let roles = Roles::create(&pool).await;
    roles
        .sql("GRANT SELECT, INSERT ON inbox_progress TO outbox_consumer")
        .await;
    consumer_paths_in(&pool, &roles, &logs, Mode::Inbox, true).await;
    for privilege in ["INSERT", "SELECT"] {
        roles
            .sql(&format!(
                "REVOKE {privilege} ON inbox_progress FROM outbox_consumer"
            ))
            .await;
        let inbound = Inbound::produce(&roles, 2, 0).await;
        let consumer = inbound.consumer_in_progress_mode(&roles).await;
        let refused = eventually(Duration::from_secs(30), || async {
            refused_with(
                consumer_refusal(&consumer).as_deref(),
                &["SELECT, INSERT ON inbox_progress"],
            )
        })
        .await;
        assert!(refused, "{privilege}: {:?}", consumer.health());
        assert_eq!(applied_of(&pool, &inbound.good).await, vec![0, 0]);
        roles
            .sql(&format!(
                "GRANT {privilege} ON inbox_progress TO outbox_consumer"
            ))
            .await;
        let settled = eventually(Duration::from_secs(30), || async {
            applied_of(&pool, &inbound.good).await == vec![1, 1]
        })
        .await;
        assert!(
            settled,
            "{privilege} granted again: {:?}",
            consumer.health()
        );
        consumer.shutdown().await.unwrap();
    }
    roles.drop_all().await;
}

/// The sequences' grants, needed once the tables are partitioned (the
/// identity columns become sequence defaults; `partitions enable` grants
/// the sequences to the roles that could insert then, the block to those
/// granted later, as these are): with the block, the application commits
/// and the consumer's inserts — follow-up events, stored inbox rows — go
/// through; each sequence grant revoked alone refuses them.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn once_partitioned_the_sequences_grants_are_needed(pool: PgPool) {
    outbox_runtime::partition::enable(&pool, &outbox_runtime::partition::PartitionPlan::default())
        .await
        .unwrap();
    let roles = Roles::create(&pool).await;
    let (app, consumer) = (
        roles.pool("outbox_app", 1),
        roles.pool("outbox_consumer", 1),
    );
    let commit = |n: usize| {
        let app = app.clone();
        async move {
            let mut uow = UnitOfWork::begin(&app).await.unwrap();
            uow.record_message(message("roles-partitioned", "k", n));
            uow.commit().await.err().map(|e| e.to_string())
        }
    };
    let follow_up = || {
        let consumer = consumer.clone();
        async move {
            sqlx::query(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload,
                                           topic, partition_key)
                 VALUES (gen_random_uuid(), 'Order', 'k', 'FollowUp', '{}', 'roles-follow-ups', 'k')",
            )
            .execute(&consumer)
            .await
            .err()
            .map(|e| e.to_string())
        }
    };
    let stored = || {
        let consumer = consumer.clone();
        async move {
            sqlx::query(
                "INSERT INTO inbox_event (event_id, consumer, topic, partition, \"offset\", payload)
                 VALUES (gen_random_uuid(), 'g', 't', 0, 0, '{}')",
            )
            .execute(&consumer)
            .await
            .err()
            .map(|e| e.to_string())
        }
    };
    assert_eq!(commit(0).await, None);
    assert_eq!(follow_up().await, None);
    assert_eq!(stored().await, None);
    let sequences: Vec<Grant> = block()
        .into_iter()
        .filter(|g| g.object.starts_with("SEQUENCE "))
        .collect();
    assert_eq!(sequences.len(), 3, "{sequences:?}");
    for grant in sequences {
        roles
            .sql(&format!("REVOKE {} FROM {}", grant.sql(), grant.role))
            .await;
        let refused = match (grant.role, grant.object.as_str()) {
            ("outbox_app", _) => commit(1).await,
            ("outbox_consumer", "SEQUENCE outbox_event_id_seq") => follow_up().await,
            _ => stored().await,
        };
        assert!(
            refused
                .as_deref()
                .is_some_and(|e| e.contains("permission denied for sequence")),
            "{grant:?}: {refused:?}"
        );
        roles
            .sql(&format!("GRANT {} TO {}", grant.sql(), grant.role))
            .await;
    }
    assert_eq!(commit(2).await, None);
    app.close().await;
    consumer.close().await;
    roles.drop_all().await;
}
