//! The load and the observers of the reliability scenarios: writers that
//! commit (and deliberately roll back) events through the Unit of Work and
//! record what they did, the verifying consumer's effect table, and the
//! collection of the evidence the checker judges.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::UnitOfWork;
use outbox_runtime::CancellationToken;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::checker::{Evidence, Seen, Written};
use crate::common::{message, read_all};

/// How long and how often the scenarios inject their faults: 1 in CI;
/// `OUTBOX_SOAK=1` (or any non-number) soaks with a factor of 5,
/// `OUTBOX_SOAK=N` (N ≥ 2) with a factor of N; unset or 0: no soak.
pub fn soak() -> u32 {
    match std::env::var("OUTBOX_SOAK") {
        Ok(v) if !v.is_empty() => match v.parse::<u32>() {
            Ok(0) => 1,
            Ok(1) | Err(_) => 5,
            Ok(n) => n,
        },
        _ => 1,
    }
}

/// `d` scaled by the soak factor.
pub fn scaled(d: Duration) -> Duration {
    d * soak()
}

/// The writers' load.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Events per second over all writers (on average two per transaction).
    pub rate: u32,
    /// Concurrent writer tasks; each owns its keys, so a key's transactions
    /// are serialized and its expected order is well defined.
    pub writers: usize,
    /// Keys per writer (with `shared_keys`: keys in all).
    pub keys: usize,
    /// Prepended to every key (distinct loads in one scenario).
    pub prefix: &'static str,
    /// All writers write the same keys, two of them the same key at the
    /// same moment: a key's order is then the order in which its
    /// transactions committed, known only from the database
    /// ([`commit_order_table`]).
    pub shared_keys: bool,
}

impl Default for Load {
    fn default() -> Self {
        Self {
            rate: 300,
            writers: 4,
            keys: 8,
            prefix: "",
            shared_keys: false,
        }
    }
}

/// What the writers did.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    /// Committed, in commit order per writer.
    pub committed: Vec<Written>,
    /// Rolled back: dropped Units of Work, and commits refused by a deferred
    /// constraint after the outbox rows were inserted.
    pub rolled_back: Vec<Uuid>,
    /// Commits that failed without saying whether they happened (the
    /// connection was lost): resolved against the outbox afterwards.
    pub uncertain: Vec<Written>,
    /// Failed begins and commits.
    pub errors: u64,
    /// The first of those errors, for the report.
    pub first_error: Option<String>,
}

impl Ledger {
    fn error(&mut self, error: impl std::fmt::Display) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| error.to_string());
    }
}

/// Writer tasks committing events to one topic until stopped.
pub struct Writers {
    token: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    ledger: Arc<Mutex<Ledger>>,
    pool: PgPool,
}

/// The table whose deferred unique constraint makes a commit fail after the
/// Unit of Work wrote its outbox rows.
const GUARD: &str = "CREATE TABLE IF NOT EXISTS phantom_guard (
    id int,
    CONSTRAINT phantom_guard_unique UNIQUE (id) DEFERRABLE INITIALLY DEFERRED
)";

impl Writers {
    /// Starts the writers on a pool of their own (one connection each).
    pub async fn start(pool: &PgPool, topic: &str, load: Load) -> Self {
        // Created by the owner beforehand when the writers run as a role
        // that may not create tables.
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('phantom_guard') IS NOT NULL")
            .fetch_one(pool)
            .await
            .expect("guard table lookup");
        if !exists {
            sqlx::query(GUARD).execute(pool).await.expect("guard table");
        }
        let pool = PgPoolOptions::new()
            .max_connections(load.writers as u32 + 1)
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(pool.connect_options().as_ref().clone())
            .await
            .expect("writers' pool");
        let token = CancellationToken::new();
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        // Two events per transaction on average.
        let period = Duration::from_secs_f64(load.writers as f64 * 2.0 / load.rate as f64);
        let tasks = (0..load.writers)
            .map(|w| {
                let (pool, token, ledger) = (pool.clone(), token.clone(), ledger.clone());
                let topic = topic.to_owned();
                tokio::spawn(
                    async move { write(w, &pool, &topic, load, period, &token, &ledger).await },
                )
            })
            .collect();
        Self {
            token,
            tasks,
            ledger,
            pool,
        }
    }

    /// The ids committed so far (uncertain commits not included).
    pub fn committed_ids(&self) -> Vec<Uuid> {
        let ledger = self.ledger.lock().unwrap();
        ledger.committed.iter().map(|w| w.event_id).collect()
    }

    /// Stops the writers and resolves the uncertain commits against the
    /// outbox through the writers' own pool.
    pub async fn stop(self) -> Ledger {
        let pool = self.pool.clone();
        self.stop_checking(&pool).await
    }

    /// Stops the writers and resolves the uncertain commits against the
    /// outbox through `check` (writers running as a role that may only
    /// insert cannot read the outbox).
    pub async fn stop_checking(self, check: &PgPool) -> Ledger {
        self.token.cancel();
        for task in self.tasks {
            task.await.expect("writer task");
        }
        // A copy: a recovery measurement may still read the shared one.
        let mut ledger = self.ledger.lock().unwrap().clone();
        let uncertain = std::mem::take(&mut ledger.uncertain);
        if !uncertain.is_empty() {
            let ids: Vec<Uuid> = uncertain.iter().map(|w| w.event_id).collect();
            let present: HashSet<Uuid> =
                sqlx::query_scalar("SELECT event_id FROM outbox_event WHERE event_id = ANY($1)")
                    .bind(&ids)
                    .fetch_all(check)
                    .await
                    .expect("resolve uncertain commits")
                    .into_iter()
                    .collect();
            for w in uncertain {
                if present.contains(&w.event_id) {
                    ledger.committed.push(w);
                } else {
                    ledger.rolled_back.push(w.event_id);
                }
            }
        }
        self.pool.close().await;
        ledger
    }
}

async fn write(
    writer: usize,
    pool: &PgPool,
    topic: &str,
    load: Load,
    period: Duration,
    token: &CancellationToken,
    ledger: &Mutex<Ledger>,
) {
    let keys = load.keys;
    let mut seqs = vec![0_u64; keys];
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for tx in 0_u64.. {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tick.tick() => {}
        }
        let (k, key) = if load.shared_keys {
            // Writers 0 and 1 on one key, 2 and 3 on the next, at each tick.
            let k = (tx as usize + writer / 2) % keys;
            (k, format!("{}shared-k{k}", load.prefix))
        } else {
            let k = tx as usize % keys;
            (k, format!("{}w{writer}-k{k}", load.prefix))
        };
        let mut uow = match UnitOfWork::begin(pool).await {
            Ok(uow) => uow,
            Err(e) => {
                ledger.lock().unwrap().error(e);
                continue;
            }
        };
        let events: Vec<Written> = (0..1 + tx % 3)
            .map(|_| {
                let seq = seqs[k];
                seqs[k] += 1;
                Written {
                    event_id: uow.record_message(message(topic, &key, seq as usize)),
                    key: key.clone(),
                    seq,
                }
            })
            .collect();
        let ids = || events.iter().map(|w| w.event_id);
        match tx % 20 {
            // Dropped: nothing reaches the database.
            7 => {
                drop(uow);
                ledger.lock().unwrap().rolled_back.extend(ids());
            }
            // The outbox rows are inserted, then COMMIT fails on a deferred
            // constraint: the whole transaction rolls back.
            17 => {
                let poisoned = sqlx::query("INSERT INTO phantom_guard VALUES (1), (1)")
                    .execute(&mut *uow)
                    .await;
                let result = match poisoned {
                    Ok(_) => uow.commit().await,
                    Err(e) => Err(e.into()),
                };
                let mut ledger = ledger.lock().unwrap();
                match result {
                    Err(e) if e.to_string().contains("phantom_guard_unique") => {
                        ledger.rolled_back.extend(ids());
                    }
                    Ok(_) => panic!("a commit that must fail succeeded"),
                    Err(e) => {
                        ledger.error(e);
                        ledger.uncertain.extend(events);
                    }
                }
            }
            _ => {
                let result = uow.commit().await;
                let mut ledger = ledger.lock().unwrap();
                match result {
                    Ok(_) => ledger.committed.extend(events),
                    Err(e) => {
                        ledger.error(e);
                        ledger.uncertain.extend(events);
                    }
                }
            }
        }
    }
}

/// Declares a scenario's event type (bound to its topic, as derived events
/// are) and the verifying consumer's handler for it, which records each
/// applied event in the `effect` table inside the consumer's transaction.
macro_rules! scenario_event {
    ($name:ident, $topic:literal) => {
        $crate::common::keyed_event!(
            #[doc = concat!("The event of the scenario on topic `", $topic, "`.")]
            pub $name,
            $topic
        );

        impl outbox_core::InboxHandler for $crate::harness::Effect<$name> {
            type Event = $name;
            const NAME: &'static str = "record_effect";

            fn handle<'a, 'c>(
                &'a self,
                ctx: &'a mut outbox_core::HandlerContext<'c>,
                event: $name,
            ) -> outbox_core::HandlerFuture<'a>
            where
                'c: 'a,
            {
                Box::pin(async move {
                    let event_id = ctx.incoming().event_id;
                    $crate::harness::flaky(event_id)?;
                    $crate::harness::apply(&mut **ctx, event_id, &event.key, event.seq).await?;
                    Ok(())
                })
            }
        }

        impl outbox_core::InboxHandler for $crate::harness::InboxEffect<$name> {
            type Event = $name;
            const NAME: &'static str = "record_inbox_effect";

            fn handle<'a, 'c>(
                &'a self,
                ctx: &'a mut outbox_core::HandlerContext<'c>,
                event: $name,
            ) -> outbox_core::HandlerFuture<'a>
            where
                'c: 'a,
            {
                Box::pin(async move {
                    let event_id = ctx.incoming().event_id;
                    $crate::harness::apply_to(
                        &mut **ctx,
                        "effect_inbox",
                        event_id,
                        &event.key,
                        event.seq,
                    )
                    .await?;
                    Ok(())
                })
            }
        }
    };
}
pub(crate) use scenario_event;

/// On in a consumer process of a run with transient failures
/// ([`crate::children::DEDUP_MEMORY`]).
pub static FLAKY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// With [`FLAKY`] on, fails the first attempt in this process at one event
/// in 32 (by its id), without touching the transaction, and says so on
/// stderr (the scenario counts the lines): the event is retried and
/// applied; a process killed meanwhile leaves it to the next, which fails
/// it once more.
pub fn flaky(event_id: Uuid) -> Result<(), outbox_core::BoxError> {
    use std::sync::atomic::Ordering;
    static FAILED: Mutex<Option<HashSet<Uuid>>> = Mutex::new(None);
    if !FLAKY.load(Ordering::Relaxed) || !event_id.as_bytes()[15].is_multiple_of(32) {
        return Ok(());
    }
    let first = FAILED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(Default::default)
        .insert(event_id);
    if first {
        eprintln!("flaky handler: failing {event_id} once");
        return Err(format!("event {event_id} fails once").into());
    }
    Ok(())
}

/// The verifying consumer's handler of events `E`.
pub struct Effect<E>(std::marker::PhantomData<fn() -> E>);

impl<E> Effect<E> {
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

/// A second group's handler of events `E` (inbox mode, in scenarios with
/// a group of each mode): its effects in `effect_inbox`.
pub struct InboxEffect<E>(std::marker::PhantomData<fn() -> E>);

impl<E> InboxEffect<E> {
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

/// Records one applied effect.
pub async fn apply(
    conn: &mut sqlx::PgConnection,
    event_id: Uuid,
    key: &str,
    seq: u64,
) -> Result<(), sqlx::Error> {
    apply_to(conn, "effect", event_id, key, seq).await
}

/// Records one applied effect in `table` (`effect`, `effect_inbox`).
pub async fn apply_to(
    conn: &mut sqlx::PgConnection,
    table: &str,
    event_id: Uuid,
    key: &str,
    seq: u64,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO {table} (event_id, key, seq) VALUES ($1, $2, $3)"
    ))
    .bind(event_id)
    .bind(key)
    .bind(seq as i64)
    .execute(conn)
    .await?;
    Ok(())
}

/// Creates `effect` and `effect_inbox` (idempotent): a scenario with a
/// consumer group of each mode.
pub async fn effect_tables(pool: &PgPool) {
    effect_table(pool).await;
    sqlx::query("CREATE TABLE IF NOT EXISTS effect_inbox (LIKE effect INCLUDING ALL)")
        .execute(pool)
        .await
        .expect("effect_inbox table");
}

/// The effects of `table`, as the checker reads them.
pub async fn effects_of(pool: &PgPool, table: &str) -> Vec<Seen> {
    sqlx::query_as::<_, (Uuid, String, i64)>(&format!(
        "SELECT event_id, key, seq FROM {table} ORDER BY id"
    ))
    .fetch_all(pool)
    .await
    .expect("effects")
    .into_iter()
    .map(|(event_id, key, seq)| Seen {
        event_id,
        key,
        seq: seq as u64,
    })
    .collect()
}

/// Creates the effect table (idempotent).
pub async fn effect_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS effect (
            id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, seq bigint NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await
    .expect("effect table");
    sqlx::query("CREATE INDEX IF NOT EXISTS effect_event_id ON effect (event_id)")
        .execute(pool)
        .await
        .expect("effect index");
}

/// A pool of `n` connections to the database `pool` reaches.
pub async fn pool_of(pool: &PgPool, n: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(n)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("pool")
}

/// Waits until every event of `ids` has been applied; returns how long it
/// took, or `None` after `timeout`. Database errors (an outage) are retried.
pub async fn wait_applied(pool: PgPool, ids: Vec<Uuid>, timeout: Duration) -> Option<Duration> {
    let start = Instant::now();
    let want = ids.len() as i64;
    loop {
        let applied: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(*) FROM unnest($1::uuid[]) AS i(id)
             WHERE EXISTS (SELECT 1 FROM effect e WHERE e.event_id = i.id)",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await;
        if applied.is_ok_and(|n| n >= want) {
            return Some(start.elapsed());
        }
        if start.elapsed() > timeout {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts measuring recovery: the time from now until every event committed
/// so far (restricted to `only`, if given) is applied and so is the first
/// event committed from now on — the pipeline flows again.
pub fn recovery(
    pool: &PgPool,
    writers: &Writers,
    only: Option<&HashSet<Uuid>>,
) -> JoinHandle<Option<Duration>> {
    let mut ids = writers.committed_ids();
    let first_new = ids.len();
    if let Some(only) = only {
        ids.retain(|id| only.contains(id));
    }
    let (pool, ledger) = (pool.clone(), writers.ledger.clone());
    tokio::spawn(async move {
        let start = Instant::now();
        let timeout = Duration::from_secs(120);
        wait_applied(pool.clone(), ids, timeout).await?;
        loop {
            let next = ledger
                .lock()
                .unwrap()
                .committed
                .get(first_new)
                .map(|w| w.event_id);
            if let Some(id) = next {
                wait_applied(pool, vec![id], timeout.saturating_sub(start.elapsed())).await?;
                return Some(start.elapsed());
            }
            if start.elapsed() > timeout {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// Waits until the consumer applied everything that must arrive (or gives
/// up after `timeout`: the checker then reports what is missing), then
/// reads the topic and the effect table.
pub async fn collect(
    pool: &PgPool,
    brokers: &str,
    topic: &str,
    ledger: &Ledger,
    must_arrive: Option<HashSet<Uuid>>,
    timeout: Duration,
) -> Evidence {
    let mut ids: Vec<Uuid> = ledger.committed.iter().map(|w| w.event_id).collect();
    if let Some(must) = &must_arrive {
        ids.retain(|id| must.contains(id));
    }
    if wait_applied(pool.clone(), ids, timeout).await.is_none() {
        eprintln!("not everything was applied within {timeout:?}");
    }
    // Late copies or phantoms would show up now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Messages the writers did not send (hostile ones injected by a
    // scenario) may lack an event id or a JSON payload: skipped here.
    let kafka = read_all(brokers, topic, Duration::from_secs(60))
        .await
        .into_iter()
        .filter_map(|r| {
            Some(Seen {
                event_id: r.try_event_id()?,
                seq: r.payload["seq"].as_u64()?,
                key: r.key,
            })
        })
        .collect();
    let effects = sqlx::query_as::<_, (Uuid, String, i64)>(
        "SELECT event_id, key, seq FROM effect ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .expect("effects")
    .into_iter()
    .map(|(event_id, key, seq)| Seen {
        event_id,
        key,
        seq: seq as u64,
    })
    .collect();
    Evidence {
        committed: ledger.committed.clone(),
        rolled_back: ledger.rolled_back.clone(),
        must_arrive,
        kafka,
        effects,
        ..Evidence::default()
    }
}

/// Records the commit order of every key's events: at `COMMIT` (a deferred
/// constraint trigger, so after the Unit of Work's outbox insert), each row
/// takes the next number of its key from a counter row, whose lock it holds
/// until the commit is done. A later committer of the key waits for it, so
/// the numbers follow the order in which the key's transactions committed,
/// whatever the outbox's own key locks do; rolled-back transactions take
/// none.
pub async fn commit_order_table(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE key_counter (key text PRIMARY KEY, last bigint NOT NULL);
         CREATE TABLE commit_order (event_id uuid PRIMARY KEY, key text NOT NULL, seq bigint NOT NULL);
         CREATE FUNCTION record_commit_order() RETURNS trigger LANGUAGE plpgsql AS $$
         DECLARE n bigint;
         BEGIN
             INSERT INTO key_counter AS c VALUES (NEW.partition_key, 0)
                 ON CONFLICT (key) DO UPDATE SET last = c.last + 1
                 RETURNING last INTO n;
             INSERT INTO commit_order VALUES (NEW.event_id, NEW.partition_key, n);
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER record_commit_order AFTER INSERT ON outbox_event
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION record_commit_order();",
    )
    .execute(pool)
    .await
    .expect("commit order table");
}

/// Replaces every sequence number of `evidence` (the writers', Kafka's and
/// the effects') by the key's commit order recorded by
/// [`commit_order_table`]; returns how many committed events it numbered.
pub async fn number_by_commit_order(pool: &PgPool, evidence: &mut Evidence) -> usize {
    let order: std::collections::HashMap<Uuid, u64> =
        sqlx::query_as::<_, (Uuid, i64)>("SELECT event_id, seq FROM commit_order")
            .fetch_all(pool)
            .await
            .expect("commit order")
            .into_iter()
            .map(|(id, seq)| (id, seq as u64))
            .collect();
    let mut numbered = 0;
    for w in &mut evidence.committed {
        if let Some(seq) = order.get(&w.event_id) {
            w.seq = *seq;
            numbered += 1;
        }
    }
    for s in evidence.kafka.iter_mut().chain(evidence.effects.iter_mut()) {
        if let Some(seq) = order.get(&s.event_id) {
            s.seq = *seq;
        }
    }
    numbered
}
