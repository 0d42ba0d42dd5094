//! Re-drive racing with a concurrent change of the same dead letter, against
//! a real PostgreSQL and the real broker: a re-drive that lost the row's
//! lock (its handler ended the transaction) must not overwrite what another
//! consumer of the group decided meanwhile, nor write its late outcome on a
//! retry an operator requested since.

mod common;

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};
use outbox_runtime::inbox::dead_letter;
use outbox_runtime::{Consumer, ConsumerBuilder};
use sqlx::PgPool;
use uuid::Uuid;

keyed_event!(RaceResolved, "redrive-race-resolved");
keyed_event!(RaceRetried, "redrive-race-retried");

/// At its first call: ends the consumer's transaction (which releases the
/// dead letter's row lock), says so, and waits until the dead letter's
/// status and retry requests are `until`; then returns `Ok` (the consumer
/// finds the ended transaction). Later calls record the effect.
struct EndAndWait<E> {
    event: PhantomData<fn() -> E>,
    pool: PgPool,
    letter: i64,
    until: (&'static str, i32),
    entered: Arc<AtomicBool>,
}

impl<E: DomainEvent> InboxHandler for EndAndWait<E> {
    type Event = E;
    const NAME: &'static str = "apply";

    fn handle<'a, 'c>(&'a self, ctx: &'a mut HandlerContext<'c>, _event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            if self.entered.load(Ordering::SeqCst) {
                sqlx::query("INSERT INTO effect (event_id) VALUES ($1)")
                    .bind(ctx.incoming().event_id)
                    .execute(&mut **ctx)
                    .await?;
                return Ok(());
            }
            sqlx::query("ROLLBACK").execute(&mut **ctx).await?;
            self.entered.store(true, Ordering::SeqCst);
            let (until, retries) = self.until;
            let reached = eventually(Duration::from_secs(30), || async {
                let (status, _, _, r) = status(&self.pool, self.letter).await;
                status == until && r == retries
            })
            .await;
            assert!(
                reached,
                "the dead letter never became {until} ({retries} retries)"
            );
            Ok(())
        })
    }
}

/// Always fails.
struct Fail<E>(PhantomData<fn() -> E>);

impl<E: DomainEvent> InboxHandler for Fail<E> {
    type Event = E;
    const NAME: &'static str = "apply";

    fn handle<'a, 'c>(&'a self, _ctx: &'a mut HandlerContext<'c>, _event: E) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async { Err("still failing".into()) })
    }
}

/// A dead letter's status, attempts, error and retry requests.
async fn status(pool: &PgPool, id: i64) -> (String, i32, String, i32) {
    sqlx::query_as("SELECT status, attempts, error, retries FROM dead_letter WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn consumer(pool: &PgPool, group: &str) -> ConsumerBuilder {
    Consumer::builder(pool.clone())
        .group(group)
        .brokers(brokers())
        .redrive_interval(Duration::from_millis(100))
}

/// A dead letter of `group` (its handler failed three times), marked for
/// re-drive by an operator: its event id and row id.
async fn marked_letter<E: DomainEvent>(pool: &PgPool, group: &str) -> (Uuid, i64) {
    sqlx::query("CREATE TABLE effect (event_id uuid NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    reset_topic(&brokers(), E::TOPIC).await;
    let event_id = Uuid::now_v7();
    let headers = serde_json::json!({
        "event_id": event_id.to_string(),
        "event_type": "OrderPlaced",
        "event_version": "1",
        "aggregate_type": "Order",
        "aggregate_id": "k1",
        "content-type": "application/json",
    });
    let letter: i64 = sqlx::query_scalar(
        r#"INSERT INTO dead_letter (consumer, topic, "partition", "offset", key, event_id,
               event_type, headers, payload, reason, error, handler, attempts)
           VALUES ($1, $2, 0, 0, 'k1', $3, 'OrderPlaced', $4, $5, 'handler_failed',
                   'first failure', 'apply', 3)
           RETURNING id"#,
    )
    .bind(group)
    .bind(E::TOPIC)
    .bind(event_id)
    .bind(&headers)
    .bind(br#"{"key":"k1","seq":0}"#.as_slice())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        dead_letter::retry(pool, Some(group), None).await.unwrap(),
        1
    );
    (event_id, letter)
}

async fn effects(pool: &PgPool) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT event_id FROM effect")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_redrive_that_lost_its_row_does_not_overwrite_another_consumers_resolution(pool: PgPool) {
    init_tracing();
    let group = unique_topic("redrive-race");
    let (event_id, letter) = marked_letter::<RaceResolved>(&pool, &group).await;

    // Consumer A re-drives it; its handler ends the transaction and waits.
    let entered = Arc::new(AtomicBool::new(false));
    let a = consumer(&pool, &group)
        .handler(EndAndWait::<RaceResolved> {
            event: PhantomData,
            pool: pool.clone(),
            letter,
            until: ("resolved", 1),
            entered: entered.clone(),
        })
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            entered.load(Ordering::SeqCst)
        })
        .await,
        "consumer A did not re-drive the dead letter"
    );
    // Consumer B of the same group finds the row unlocked and still marked,
    // and re-drives it successfully.
    let b = consumer(&pool, &group)
        .handler(RecordEffect::<RaceResolved>::new())
        .spawn()
        .unwrap();
    // A's handler returns once B resolved the row; A counts the failure,
    // then records (or not) its outcome before it stops.
    assert!(
        eventually(Duration::from_secs(30), || async {
            a.counts().handler_failures >= 1
        })
        .await,
        "{:?}",
        a.counts()
    );
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();

    assert_eq!(
        effects(&pool).await,
        vec![event_id],
        "B applied the event once"
    );
    assert_eq!(
        status(&pool, letter).await,
        ("resolved".to_owned(), 3, "first failure".to_owned(), 1),
        "B's resolution stands; A's late outcome is not written over it"
    );
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_late_redrive_outcome_is_not_written_on_a_newer_retry_request(pool: PgPool) {
    init_tracing();
    let group = unique_topic("redrive-race");
    let (event_id, letter) = marked_letter::<RaceRetried>(&pool, &group).await;

    // Consumer A re-drives it; its handler ends the transaction and waits.
    let entered = Arc::new(AtomicBool::new(false));
    let a = consumer(&pool, &group)
        .handler(EndAndWait::<RaceRetried> {
            event: PhantomData,
            pool: pool.clone(),
            letter,
            until: ("retry", 2),
            entered: entered.clone(),
        })
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            entered.load(Ordering::SeqCst)
        })
        .await,
        "consumer A did not re-drive the dead letter"
    );
    // Consumer B re-drives it meanwhile and fails: dead again …
    let b = consumer(&pool, &group)
        .handler(Fail::<RaceRetried>(PhantomData))
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            status(&pool, letter).await.0 == "dead"
        })
        .await,
        "{:?}",
        status(&pool, letter).await
    );
    b.shutdown().await.unwrap();
    // … and the operator asks for another retry, which A must run anew.
    assert_eq!(
        dead_letter::retry(&pool, Some(&group), None).await.unwrap(),
        1
    );
    let resolved = eventually(Duration::from_secs(30), || async {
        status(&pool, letter).await.0 == "resolved"
    })
    .await;
    let counts = a.counts();
    a.shutdown().await.unwrap();
    let (state, attempts, error, retries) = status(&pool, letter).await;
    assert!(
        resolved,
        "{counts:?}: {state}, {attempts} attempts: {error}"
    );
    assert_eq!(
        (attempts, retries),
        (4, 2),
        "B's failure counted, A's late outcome of the first request not"
    );
    assert_eq!(
        effects(&pool).await,
        vec![event_id],
        "the second request ran once"
    );
}
