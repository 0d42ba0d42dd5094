//! Two services (consumer groups) that consume the same topic into one
//! database, against a real PostgreSQL and the real broker: each group must
//! apply every event once, whatever the other group does, in either mode.

mod common;

use std::marker::PhantomData;
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::{Consumer, Mode};
use sqlx::PgPool;
use uuid::Uuid;

keyed_event!(SharedInbox, "shared-database-inbox");
keyed_event!(SharedMixed, "shared-database-mixed");

/// Records `(group, event_id)` in `effect`: each group's own effect.
struct Apply<E> {
    group: &'static str,
    _event: PhantomData<fn() -> E>,
}

fn apply<E>(group: &'static str) -> Apply<E> {
    Apply {
        group,
        _event: PhantomData,
    }
}

impl<E: DomainEvent> InboxHandler for Apply<E> {
    type Event = E;
    const NAME: &'static str = "apply";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, _event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            sqlx::query("INSERT INTO effect (grp, event_id) VALUES ($1, $2)")
                .bind(self.group)
                .bind(ctx.incoming().event_id)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}

async fn effects(pool: &PgPool, group: &str) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effect WHERE grp = $1")
        .bind(group)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Produces `n` events to `topic` and runs two consumer groups with
/// `modes` on it, into `pool`; each group must apply all `n`, once.
async fn two_groups<E: DomainEvent>(pool: &PgPool, topic: &str, modes: [Mode; 2]) {
    sqlx::query(
        "CREATE TABLE effect (grp text NOT NULL, event_id uuid NOT NULL, UNIQUE (grp, event_id))",
    )
    .execute(pool)
    .await
    .unwrap();
    reset_topic(&brokers(), topic).await;
    let n = 1000;
    let messages: Vec<TestMessage> = (0..n)
        .map(|seq| {
            let key = format!("k{}", seq % 16);
            TestMessage::event(
                Uuid::now_v7(),
                "OrderPlaced",
                &key,
                serde_json::json!({ "key": key, "seq": seq }),
            )
        })
        .collect();
    produce(&brokers(), topic, &messages).await;
    let groups = ["billing", "shipping"];
    let handles: Vec<_> = groups
        .iter()
        .zip(modes)
        .map(|(group, mode)| {
            Consumer::builder(pool.clone())
                .group(*group)
                .brokers(brokers())
                .mode(mode)
                .processor_poll_interval(Duration::from_millis(50))
                .handler(apply::<E>(group))
                .spawn()
                .unwrap()
        })
        .collect();
    let done = eventually(Duration::from_secs(60), || async {
        let mut all = true;
        for group in groups {
            all &= effects(pool, group).await.1 == n as i64;
        }
        all
    })
    .await;
    let counts: Vec<_> = handles.iter().map(|h| h.counts()).collect();
    for handle in handles {
        handle.shutdown().await.unwrap();
    }
    for group in groups {
        let (rows, distinct) = effects(pool, group).await;
        assert_eq!(
            distinct, n as i64,
            "{group} applied {distinct} of {n} events (done: {done}; counts: {counts:?})"
        );
        assert_eq!(rows, distinct, "{group} applied an event twice");
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn two_inbox_mode_groups_in_one_database_each_apply_every_event(pool: PgPool) {
    init_tracing();
    two_groups::<SharedInbox>(&pool, SharedInbox::TOPIC, [Mode::Inbox, Mode::Inbox]).await;
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn an_inbox_group_and_a_dedup_group_in_one_database_each_apply_every_event(pool: PgPool) {
    init_tracing();
    two_groups::<SharedMixed>(&pool, SharedMixed::TOPIC, [Mode::Inbox, Mode::Dedup]).await;
}
