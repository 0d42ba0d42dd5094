//! What a handler does to its database session stays with its event, in
//! both modes, against a real PostgreSQL and the real broker:
//!
//! - a handler that changes the session (`SET SESSION AUTHORIZATION`, `SET
//!   ROLE`, `SET search_path`, a custom setting, `SET lock_timeout` — without
//!   `LOCAL`): the handler of a
//!   later event, in a later transaction, sees the session as it was, and so
//!   does the application on the pool's connections once the consumer
//!   stopped;
//! - a handler that switches role or `search_path` for its own work (`SET
//!   LOCAL`) and records follow-up events: the consumer's own statements
//!   after it (follow-up events, bookkeeping, commit) still run as the
//!   consumer, in its schema — the follow-ups land in the consumer's outbox,
//!   not in the other schema's, and nothing is refused.
//!
//! Handlers are bound to their event's topic (`DomainEvent::TOPIC` is a
//! constant), so each test has its own fixed topic, emptied at its start.

mod common;

use std::marker::PhantomData;
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::inbox::dead_letter::{self, DeadLetterFilter};
use outbox_runtime::{Consumer, Mode};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor as _, PgPool};
use uuid::Uuid;

/// What the handler does after recording the session it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Act {
    /// Nothing more.
    Observe,
    /// Changes the session: session user, role, `search_path`, a custom
    /// setting, a timeout (plain `SET`, not `LOCAL`).
    ChangeSession,
    /// `SET LOCAL search_path` to another service's schema, then records a
    /// follow-up event.
    LocalSearchPath,
    /// `SET LOCAL ROLE` to a role without the consumer's privileges, then
    /// records a follow-up event.
    LocalRole,
}

macro_rules! step_event {
    ($name:ident, $topic:literal) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        struct $name {
            key: String,
            seq: i32,
            act: Act,
        }

        impl DomainEvent for $name {
            const TOPIC: &'static str = $topic;
            const AGGREGATE_TYPE: &'static str = "Order";
            const EVENT_TYPES: &'static [&'static str] = &["OrderPlaced"];
            fn event_type(&self) -> &'static str {
                "OrderPlaced"
            }
            fn event_version(&self) -> u32 {
                1
            }
            fn aggregate_id(&self) -> String {
                self.key.clone()
            }
        }

        impl Step for $name {
            fn seq(&self) -> i32 {
                self.seq
            }
            fn act(&self) -> Act {
                self.act
            }
        }
    };
}

trait Step: DomainEvent {
    fn seq(&self) -> i32;
    fn act(&self) -> Act;
}

step_event!(SessionDedup, "handler-session-dedup");
step_event!(SessionInbox, "handler-session-inbox");
step_event!(LocalDedup, "handler-session-local-dedup");
step_event!(LocalInbox, "handler-session-local-inbox");

/// The follow-up event the `Local*` acts record.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Noted {
    key: String,
    seq: i32,
}

impl DomainEvent for Noted {
    const TOPIC: &'static str = "handler-session-noted";
    const AGGREGATE_TYPE: &'static str = "Order";
    const EVENT_TYPES: &'static [&'static str] = &["Noted"];
    fn event_type(&self) -> &'static str {
        "Noted"
    }
    fn event_version(&self) -> u32 {
        1
    }
    fn aggregate_id(&self) -> String {
        self.key.clone()
    }
}

/// The session as a statement sees it.
const SESSION: &str = "current_user::text, session_user::text, current_setting('search_path'), \
     coalesce(current_setting('app.tenant', true), ''), current_setting('lock_timeout')";

type Session = (String, String, String, String, String);

struct Handler<E> {
    /// The role the handler switches to.
    role: String,
    _event: PhantomData<fn() -> E>,
}

impl<E: Step> InboxHandler for Handler<E> {
    type Event = E;
    const NAME: &'static str = "step";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            sqlx::query(&format!(
                "INSERT INTO public.seen (seq, usr, session_usr, search_path, tenant, lock_timeout) \
                 SELECT $1, {SESSION}"
            ))
            .bind(event.seq())
            .execute(&mut **ctx)
            .await?;
            let statements = match event.act() {
                Act::Observe => Vec::new(),
                Act::ChangeSession => vec![
                    format!("SET SESSION AUTHORIZATION {}", self.role),
                    format!("SET ROLE {}", self.role),
                    "SET search_path TO elsewhere, public".to_owned(),
                    "SET app.tenant = 'leaked'".to_owned(),
                    "SET lock_timeout = '4s'".to_owned(),
                ],
                Act::LocalSearchPath => vec!["SET LOCAL search_path TO elsewhere".to_owned()],
                Act::LocalRole => vec![format!("SET LOCAL ROLE {}", self.role)],
            };
            for sql in statements {
                sqlx::query(&sql).execute(&mut **ctx).await?;
            }
            if matches!(event.act(), Act::LocalSearchPath | Act::LocalRole) {
                ctx.record(Noted {
                    key: event.aggregate_id(),
                    seq: event.seq(),
                });
            }
            Ok(())
        })
    }
}

/// Runs `body` with a role of the test's own, dropped afterwards (a role
/// outlives the test's database), also when `body` panics.
async fn with_role<F, Fut>(pool: &PgPool, body: F)
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use futures_util::FutureExt as _;
    let role = format!("handler_session_{}", Uuid::now_v7().simple());
    sqlx::query(&format!("CREATE ROLE {role} NOLOGIN"))
        .execute(pool)
        .await
        .unwrap();
    let outcome = std::panic::AssertUnwindSafe(body(role.clone()))
        .catch_unwind()
        .await;
    let mut dropped = Ok(());
    for sql in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        dropped = dropped.and(sqlx::query(&sql).execute(pool).await.map(drop));
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    dropped.unwrap();
}

async fn tables(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE seen (seq int NOT NULL, usr text NOT NULL, session_usr text NOT NULL,
                            search_path text NOT NULL, tenant text NOT NULL,
                            lock_timeout text NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn seen(pool: &PgPool) -> Vec<(i32, Session)> {
    sqlx::query_as::<_, (i32, String, String, String, String, String)>(
        "SELECT seq, usr, session_usr, search_path, tenant, lock_timeout FROM seen ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(seq, a, b, c, d, e)| (seq, (a, b, c, d, e)))
    .collect()
}

/// A pool of its own for the consumer, so that every connection it gave
/// back can be checked, with session settings of its own (as an
/// application sets them when it connects): they are part of the session a
/// handler must find.
async fn own_pool(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET lock_timeout = '7s'; SET search_path TO public, elsewhere")
                    .await?;
                Ok(())
            })
        })
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap()
}

fn message<E: Step>(seq: i32, act: Act) -> TestMessage {
    let key = "k1";
    TestMessage::event(
        Uuid::now_v7(),
        "OrderPlaced",
        key,
        serde_json::json!({ "key": key, "seq": seq, "act": act }),
    )
}

async fn session_changes_stay_with_their_event<E: Step>(pool: &PgPool, mode: Mode) {
    init_tracing();
    tables(pool).await;
    with_role(pool, |role| session_changes::<E>(pool, mode, role)).await;
}

async fn session_changes<E: Step>(pool: &PgPool, mode: Mode, role: String) {
    // The role may do what the consumer does, so that a leak shows as what
    // the next handler sees rather than as a refused statement.
    for sql in [
        format!("GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"),
        format!("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"),
        "CREATE SCHEMA elsewhere".to_owned(),
    ] {
        sqlx::query(&sql).execute(pool).await.unwrap();
    }
    let own = own_pool(pool).await;
    let baseline: Session = sqlx::query_as(&format!("SELECT {SESSION}"))
        .fetch_one(&own)
        .await
        .unwrap();
    assert_eq!((&*baseline.2, &*baseline.4), ("public, elsewhere", "7s"));

    let brokers = brokers();
    reset_topic(&brokers, E::TOPIC).await;
    let handle = Consumer::builder(own.clone())
        .group(unique_topic("handler-session"))
        .brokers(&brokers)
        .mode(mode)
        .processor_poll_interval(Duration::from_millis(50))
        .handler(Handler::<E> {
            role: role.clone(),
            _event: PhantomData,
        })
        .spawn()
        .unwrap();
    // One event at a time: each in a transaction of its own.
    let steps = [
        Act::ChangeSession,
        Act::Observe,
        Act::ChangeSession,
        Act::Observe,
    ];
    for (seq, act) in steps.into_iter().enumerate() {
        produce(&brokers, E::TOPIC, &[message::<E>(seq as i32, act)]).await;
        let handled = eventually(Duration::from_secs(60), || async {
            seen(pool).await.len() > seq
        })
        .await;
        assert!(handled, "event {seq} not handled: {:?}", handle.counts());
    }
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    for (seq, session) in seen(pool).await {
        assert_eq!(
            session, baseline,
            "the session the handler of event {seq} saw"
        );
    }
    assert_eq!(counts.handler_failures, 0, "{counts:?}");

    // Every connection of the pool, the consumer's included.
    let mut held = Vec::new();
    for _ in 0..own.size().max(1) {
        held.push(own.acquire().await.unwrap());
    }
    for conn in &mut held {
        let session: Session = sqlx::query_as(&format!("SELECT {SESSION}"))
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(session, baseline, "a connection of the pool");
        let read_only: String = sqlx::query_scalar("SHOW default_transaction_read_only")
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(read_only, "off", "a connection of the pool");
    }
    drop(held);
    own.close().await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_handlers_session_changes_reach_neither_later_events_nor_the_pool(pool: PgPool) {
    session_changes_stay_with_their_event::<SessionDedup>(&pool, Mode::Dedup).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_handlers_session_changes_reach_neither_later_events_nor_the_pool(pool: PgPool) {
    session_changes_stay_with_their_event::<SessionInbox>(&pool, Mode::Inbox).await;
}

async fn follow_ups_are_written_as_the_consumer<E: Step>(pool: &PgPool, mode: Mode) {
    init_tracing();
    tables(pool).await;
    // Another service's outbox in the same database.
    sqlx::query("CREATE SCHEMA elsewhere")
        .execute(pool)
        .await
        .unwrap();
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("search_path", "elsewhere")]);
    let elsewhere = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    outbox_core::migrate(&elsewhere).await.unwrap();
    elsewhere.close().await;
    // A role with no privilege on the consumer's tables.
    with_role(pool, |role| follow_ups::<E>(pool, mode, role)).await;
}

async fn follow_ups<E: Step>(pool: &PgPool, mode: Mode, role: String) {
    let brokers = brokers();
    reset_topic(&brokers, E::TOPIC).await;
    let group = unique_topic("handler-session-local");
    let acts = [Act::LocalSearchPath, Act::LocalRole];
    let messages: Vec<TestMessage> = acts
        .iter()
        .enumerate()
        .map(|(seq, act)| message::<E>(seq as i32, *act))
        .collect();
    produce(&brokers, E::TOPIC, &messages).await;
    let handle = Consumer::builder(pool.clone())
        .group(&group)
        .brokers(&brokers)
        .mode(mode)
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(20))
        .processor_poll_interval(Duration::from_millis(50))
        .handler(Handler::<E> {
            role: role.clone(),
            _event: PhantomData,
        })
        .spawn()
        .unwrap();
    let letters = || async {
        dead_letter::list(pool, &DeadLetterFilter::new().consumer(&group))
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.error)
            .collect::<Vec<_>>()
    };
    let settled = eventually(Duration::from_secs(60), || async {
        handle.counts().processed as usize >= acts.len() || !letters().await.is_empty()
    })
    .await;
    let counts = handle.counts();
    handle.shutdown().await.unwrap();
    assert!(settled, "{counts:?}");
    assert_eq!(letters().await, Vec::<String>::new(), "{counts:?}");
    assert_eq!(counts.processed as usize, acts.len(), "{counts:?}");
    let written = |schema: &'static str| async move {
        sqlx::query_scalar::<_, i64>(&format!(
            "SELECT count(*) FROM {schema}.outbox_event WHERE event_type = 'Noted'"
        ))
        .fetch_one(pool)
        .await
        .unwrap()
    };
    assert_eq!(
        written("public").await,
        2,
        "the follow-ups, in the consumer's outbox"
    );
    assert_eq!(
        written("elsewhere").await,
        0,
        "none in the other service's outbox"
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn dedup_a_handlers_local_role_or_search_path_does_not_redirect_the_consumers_writes(
    pool: PgPool,
) {
    follow_ups_are_written_as_the_consumer::<LocalDedup>(&pool, Mode::Dedup).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn inbox_a_handlers_local_role_or_search_path_does_not_redirect_the_consumers_writes(
    pool: PgPool,
) {
    follow_ups_are_written_as_the_consumer::<LocalInbox>(&pool, Mode::Inbox).await;
}
