//! Least-privilege roles for tests: the guide's "Roles and privileges"
//! block (checked verbatim by `tests/roles.rs`), roles of a test run made
//! from it in a database where `PUBLIC` holds nothing, logs captured to
//! count what the processes report, and a consumer scenario on a topic of
//! its own (good events, a malformed message, a failing key).

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, ConsumerHandle, Mode};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::{TestMessage, brokers, create_topic, keyed_event, produce, unique_topic};

/// The guide's block (docs/src/production.md), verbatim up to its closing fence (checked below).
pub const GRANTS: &str = "\
GRANT USAGE ON SCHEMA public TO outbox_app, outbox_relay, outbox_consumer;
-- the application: its Unit of Work inserts events and cancels scheduled ones
GRANT INSERT, SELECT (event_id, due_at, held_until, published_at),
    UPDATE (parked_at, discarded_at, discard_reason, held_until) ON outbox_event TO outbox_app;
-- the relay: reads the outbox, marks rows published, failed, held or parked
GRANT SELECT, UPDATE (published_at, attempts, last_error, last_attempt_at, parked_at, held_until)
    ON outbox_event TO outbox_relay;
-- the relay: reads the outbox's mode (see the progress mode, below)
GRANT SELECT ON outbox_progress TO outbox_relay;
-- a consumer: deduplication, the inbox, dead letters, follow-up events
GRANT SELECT, INSERT ON processed_event TO outbox_consumer;
GRANT SELECT, INSERT, UPDATE ON inbox_event, dead_letter TO outbox_consumer;
-- an inbox-mode consumer: reads its processor's mode (see the progress mode, below)
GRANT SELECT ON inbox_progress_consumer TO outbox_consumer;
GRANT INSERT ON outbox_event TO outbox_consumer;
-- a consumer: the commit guard of the transactions its handlers run in
GRANT SELECT, INSERT, UPDATE ON outbox_tx_guard TO outbox_consumer;
-- a consumer running sagas: their instances, and the cancels of their timeouts
GRANT SELECT, INSERT, UPDATE ON outbox_saga TO outbox_consumer;
GRANT SELECT (event_id, due_at, held_until, published_at),
    UPDATE (parked_at, discarded_at, discard_reason, held_until) ON outbox_event TO outbox_consumer;
-- the ids' sequences: needed once the tables are partitioned (harmless before)
GRANT USAGE ON SEQUENCE outbox_event_id_seq TO outbox_app, outbox_consumer;
GRANT USAGE ON SEQUENCE inbox_event_seq_seq TO outbox_consumer;
";

/// What the guide adds to the block for a relay in the progress mode
/// (docs/src/production.md, after the block: checked by `tests/roles.rs`):
/// its positions and the topics missing on the broker.
pub const PROGRESS_GRANTS: &str = "\
GRANT INSERT ON outbox_progress TO outbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_held_topic TO outbox_relay;
";

pub const ROLES: [&str; 3] = ["outbox_app", "outbox_relay", "outbox_consumer"];

/// The roles of this test run (roles are per server, databases share them).
pub struct Roles {
    pub suffix: String,
    pub admin: PgPool,
}

impl Roles {
    pub async fn create(admin: &PgPool) -> Self {
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
        // A hardened database (the test's own): nothing for PUBLIC, so the
        // block's `USAGE ON SCHEMA` is what lets the roles in.
        roles.sql("REVOKE ALL ON SCHEMA public FROM PUBLIC").await;
        roles.sql(GRANTS).await;
        roles
    }

    /// Puts the outbox in the progress mode when the suites run in it
    /// (`super::relay_mode`), and gives the relay role what the guide adds
    /// for that mode ([`PROGRESS_GRANTS`]); nothing in the default mode.
    pub async fn relay_mode(&self) {
        if super::progress_mode() {
            super::relay_mode(&self.admin).await;
            self.sql(PROGRESS_GRANTS).await;
        }
    }

    /// Runs `sql` as the owner, with this run's role names.
    pub async fn sql(&self, sql: &str) {
        let mut sql = sql.to_owned();
        for role in ROLES {
            sql = sql.replace(role, &self.name(role));
        }
        sqlx::raw_sql(&sql).execute(&self.admin).await.unwrap();
    }

    pub fn name(&self, role: &str) -> String {
        format!("{role}_{}", self.suffix)
    }

    /// A pool on the test database logged in as `role`.
    pub fn pool(&self, role: &str, max: u32) -> PgPool {
        let options = (*self.admin.connect_options())
            .clone()
            .username(&self.name(role));
        PgPoolOptions::new()
            .max_connections(max)
            .connect_lazy_with(options)
    }

    pub async fn drop_all(self) {
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

keyed_event!(
    /// A follow-up event recorded by the handlers of these tests.
    pub FollowUp, "roles-follow-ups"
);

/// The log lines of the code under test, captured on this test's thread
/// (a `#[sqlx::test]` runs its tasks on one thread).
pub struct Logs {
    lines: Arc<std::sync::Mutex<Vec<u8>>>,
    _guard: tracing::subscriber::DefaultGuard,
}

impl Logs {
    pub fn capture() -> Self {
        let lines = Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("outbox_runtime=info")
            .with_ansi(false)
            .with_writer(move || Writer(writer.clone()))
            .finish();
        Self {
            lines,
            _guard: tracing::subscriber::set_default(subscriber),
        }
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.lines.lock().unwrap()).into_owned()
    }

    /// The lines containing `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.text().lines().filter(|l| l.contains(needle)).count()
    }

    /// The statements reported refused, one per report; each at most once
    /// (checked).
    pub fn refusals(&self) -> Vec<String> {
        let text = self.text();
        let statements: Vec<String> = text
            .lines()
            .filter(|l| l.contains(REFUSAL))
            .map(|l| {
                l.split("statement=\"")
                    .nth(1)
                    .and_then(|s| s.split('"').next())
                    .unwrap_or("(none)")
                    .to_owned()
            })
            .collect();
        let mut distinct = statements.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), statements.len(), "reported twice:\n{text}");
        statements
    }
}

pub struct Writer(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The line the relay and the consumers log, once, for a refused statement.
pub const REFUSAL: &str = "the database refuses a statement";

/// Whether the row of `topic` (a topic missing on the broker) is held: on
/// the row (the default mode), or as the topic's row of
/// `outbox_held_topic` (the progress mode, where the row is not written).
pub async fn held(pool: &PgPool, topic: &str) -> bool {
    let held = if super::progress_mode() {
        "SELECT EXISTS (SELECT 1 FROM outbox_held_topic WHERE topic = $1)"
    } else {
        "SELECT held_until IS NOT NULL FROM outbox_event WHERE topic = $1"
    };
    sqlx::query_scalar(held)
        .bind(topic)
        .fetch_one(pool)
        .await
        .unwrap()
}

keyed_event!(pub Placed, "roles-placed");

/// Applies an event: its id into `effect`, a follow-up event recorded; the
/// events of key `bad` fail (retried, then dead-lettered).
pub struct Effects;

impl InboxHandler for Effects {
    type Event = Placed;
    const NAME: &'static str = "effects";
    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: Placed) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            if event.key == "bad" {
                return Err("the bad key's events always fail".into());
            }
            sqlx::query("INSERT INTO effect (event_id) VALUES ($1)")
                .bind(ctx.incoming().event_id)
                .execute(&mut **ctx)
                .await?;
            ctx.record(FollowUp {
                key: event.key.clone(),
                seq: event.seq,
            });
            Ok(())
        })
    }
}

/// The consumer's side of a scenario: a topic of its own (under a unique
/// prefix) with `good` events on four keys, one malformed message
/// (dead-lettered) and `bad` events of the failing key; the handler's table.
pub struct Inbound {
    pub prefix: String,
    pub good: Vec<uuid::Uuid>,
}

impl Inbound {
    pub async fn produce(roles: &Roles, good: usize, bad: usize) -> Self {
        roles
            .sql(
                "CREATE TABLE IF NOT EXISTS effect (event_id uuid NOT NULL);
                 GRANT INSERT ON effect TO outbox_consumer;",
            )
            .await;
        let prefix = format!("{}.", unique_topic("roles"));
        let topic = format!("{prefix}{}", Placed::TOPIC);
        create_topic(&brokers(), &topic).await;
        let event = |key: &str, seq: usize| {
            let id = uuid::Uuid::now_v7();
            let payload = serde_json::json!({ "key": key, "seq": seq });
            (id, TestMessage::event(id, "OrderPlaced", key, payload))
        };
        let mut messages = vec![event("k0", 0).1.payload(b"not json".to_vec())];
        let mut ids = Vec::new();
        for seq in 0..good {
            let (id, message) = event(&format!("k{}", seq % 4), seq);
            ids.push(id);
            messages.push(message);
        }
        messages.extend((0..bad).map(|seq| event("bad", seq).1));
        produce(&brokers(), &topic, &messages).await;
        Self { prefix, good: ids }
    }

    pub fn consumer(&self, roles: &Roles, mode: Mode) -> ConsumerHandle {
        self.consumer_of(roles, mode, &unique_topic("roles-group"))
    }

    /// An inbox-mode consumer whose processor is in the progress mode
    /// (enabled by the owner).
    pub async fn consumer_in_progress_mode(&self, roles: &Roles) -> ConsumerHandle {
        let group = unique_topic("roles-group");
        outbox_runtime::inbox::progress::enable(&roles.admin, &group)
            .await
            .unwrap();
        self.consumer_of(roles, Mode::Inbox, &group)
    }

    fn consumer_of(&self, roles: &Roles, mode: Mode, group: &str) -> ConsumerHandle {
        Consumer::builder(roles.pool("outbox_consumer", 6))
            .group(group)
            .brokers(brokers())
            .topic_prefix(&self.prefix)
            .mode(mode)
            .max_attempts(2)
            .retry_backoff(Duration::from_millis(50), Duration::from_millis(100))
            .outage_backoff(Duration::from_millis(50), Duration::from_secs(1))
            .processor_poll_interval(Duration::from_millis(50))
            .redrive_interval(Duration::from_millis(500))
            .handler(Effects)
            .spawn()
            .unwrap()
    }
}

/// How often each event was applied (the handler's table).
pub async fn applied(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT count(*) FROM effect GROUP BY event_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// How often each of `ids` was applied, in order.
pub async fn applied_of(pool: &PgPool, ids: &[uuid::Uuid]) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM effect WHERE event_id = i) FROM unnest($1::uuid[])
         WITH ORDINALITY AS u(i, n) ORDER BY n",
    )
    .bind(ids)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Dead letters by reason.
pub async fn dead_letters(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT reason, count(*) FROM dead_letter GROUP BY reason ORDER BY reason")
        .fetch_all(pool)
        .await
        .unwrap()
}
