//! The Unit of Work: one PostgreSQL transaction that carries the domain change
//! and the events it produced, written to `outbox_event` at commit.

use std::ops::{Deref, DerefMut};

use std::time::Duration;

use sqlx::types::chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use tracing::Instrument;
use uuid::Uuid;

use crate::aggregate::AggregateRoot;
use crate::error::{Error, Result};
use crate::event::DomainEvent;
use crate::message::{Headers, OutboxMessage};
use crate::trace::TraceParent;

/// The outbox insert around a `SELECT … FROM UNNEST(…) WITH ORDINALITY AS
/// u(…, n)` of the rows: the key locks (`$3` aggregate ids, `$7` partition
/// keys), then the rows in `n` order. `guarded`: only inside a transaction
/// the framework began ([`TX_MARK`]); elsewhere nothing is inserted (the
/// caller compares the row count).
macro_rules! insert_outbox {
    ($rows:literal) => {
        insert_outbox!($rows, "")
    };
    ($rows:literal, guarded) => {
        insert_outbox!(
            $rows,
            "current_setting('outbox.tx', true) IS NOT DISTINCT FROM 'on' AND "
        )
    };
    ($rows:literal, $guard:literal) => {
        concat!(
            "INSERT INTO outbox_event
    (event_id, aggregate_type, aggregate_id, event_type, event_version,
     topic, partition_key, payload, headers)
",
            $rows,
            "
WHERE ",
            $guard,
            "(SELECT count(pg_advisory_xact_lock(1868720896, s.h))
       FROM (SELECT DISTINCT hashtext(COALESCE(k.pk, k.ai)) & 255 AS h
             FROM UNNEST($3::text[], $7::text[]) AS k(ai, pk) ORDER BY 1) AS s) >= 0
ORDER BY n"
        )
    };
}

/// Marks a transaction as begun by the framework (transaction-local, so it
/// is gone once the transaction ends, however it ends). The Unit of Work's
/// insert and checks refuse to work outside such a transaction, so that
/// events are never written after the command ended the transaction itself.
pub const TX_MARK: &str = "SET LOCAL outbox.tx = 'on'";

/// True inside a transaction carrying [`TX_MARK`]; an error if the
/// transaction is aborted.
const CHECK_TX: &str = "SELECT current_setting('outbox.tx', true) IS NOT DISTINCT FROM 'on'";

/// The one statement that writes a whole batch of events. `WITH ORDINALITY`
/// and `ORDER BY` keep the identity (`id`) in record order. Headers and the
/// partition key are sent per row only where they differ from the shared
/// default (`$10`) and the aggregate id (a `NULL` array when no row has
/// its own): most events carry neither. The shared headers are parsed once
/// per statement (a sub-select, evaluated once), not once per row: a cached
/// statement runs with a generic plan, in which `$10::jsonb` alone would be
/// parsed again for every row.
///
/// Same-key order = commit order: before any `id` is drawn (the one-time
/// filter runs before the first row), the statement takes a transaction-level
/// advisory lock per distinct key bucket ([`KEY_LOCK_CLASS`]; 256 buckets of
/// `hashtext(partition_key)`, taken in bucket order, so two writers cannot
/// deadlock on them, and a transaction never holds more than 256 of them
/// however many keys it writes). A second writer of the same key waits there
/// until the first commits or rolls back, so for every key a smaller id always
/// commits first, and the relay, claiming in id order, publishes a key's
/// events in the order their transactions committed. Writers of different
/// keys of one bucket wait for each other the same way, from their outbox
/// insert to their commit only.
const INSERT_BATCH: &str = insert_outbox!(
    "SELECT e, at, ai, et, ev, t, COALESCE(pk, ai), p::jsonb, COALESCE(h::jsonb, (SELECT $10::jsonb))
FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[],
            $6::text[], $7::text[], $8::text[], $9::text[])
     WITH ORDINALITY AS u(e, at, ai, et, ev, t, pk, p, h, n)"
);

/// [`INSERT_BATCH`], guarded (the Unit of Work's).
const INSERT_BATCH_GUARDED: &str = insert_outbox!(
    "SELECT e, at, ai, et, ev, t, COALESCE(pk, ai), p::jsonb, COALESCE(h::jsonb, (SELECT $10::jsonb))
FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[],
            $6::text[], $7::text[], $8::text[], $9::text[])
     WITH ORDINALITY AS u(e, at, ai, et, ev, t, pk, p, h, n)",
    guarded
);

/// [`INSERT_BATCH`] for a batch whose events share their aggregate type,
/// event type, version and topic (the common case: one command's events):
/// those four go once, as scalars (measured: 0.72–0.87 → 0.84–0.88 of a
/// hand-written insert at 100 events per commit).
const INSERT_UNIFORM: &str = insert_outbox!(
    "SELECT e, $2::text, ai, $4::text, $5::int4, $6::text, COALESCE(pk, ai), p::jsonb,
       COALESCE(h::jsonb, (SELECT $10::jsonb))
FROM UNNEST($1::uuid[], $3::text[], $7::text[], $8::text[], $9::text[])
     WITH ORDINALITY AS u(e, ai, pk, p, h, n)"
);

/// [`INSERT_UNIFORM`], guarded (the Unit of Work's).
const INSERT_UNIFORM_GUARDED: &str = insert_outbox!(
    "SELECT e, $2::text, ai, $4::text, $5::int4, $6::text, COALESCE(pk, ai), p::jsonb,
       COALESCE(h::jsonb, (SELECT $10::jsonb))
FROM UNNEST($1::uuid[], $3::text[], $7::text[], $8::text[], $9::text[])
     WITH ORDINALITY AS u(e, ai, pk, p, h, n)",
    guarded
);

/// Advisory lock class (first key of the two-key form; the second is the key
/// bucket `hashtext(partition_key) & 255`) that serializes writers of one
/// partition key from their outbox insert to their commit.
pub const KEY_LOCK_CLASS: i32 = 0x6F62_6B00;

/// The insert of scheduled rows ([`UnitOfWork::record_at`],
/// [`UnitOfWork::record_after`]), a statement of its own so that the
/// batch inserts above stay as they are. Each row's due time is `$10` (an
/// absolute time) or `$11` seconds from this statement's time (the
/// database's clock), written to `due_at` and to `held_until`: the row is
/// out of the relay's claims until its release puts it back once due. Only
/// inside a transaction carrying [`TX_MARK`]. No key lock: a scheduled row
/// is not ordered with its key's rows, and holds none of them back.
static INSERT_SCHEDULED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    INSERT_SCHEDULED_UNGUARDED.replace(
        "\nORDER BY n",
        "\nWHERE current_setting('outbox.tx', true) IS NOT DISTINCT FROM 'on'\nORDER BY n",
    )
});

/// The statement of [`INSERT_SCHEDULED`] without its guard: a consumer's
/// transaction (a saga's timeouts, written with the step that scheduled
/// them).
const INSERT_SCHEDULED_UNGUARDED: &str = "\
INSERT INTO outbox_event
    (event_id, aggregate_type, aggregate_id, event_type, event_version,
     topic, partition_key, payload, headers, due_at, held_until)
SELECT e, at, ai, et, ev, t, pk, p::jsonb, h::jsonb, d, d
FROM (SELECT u.*, coalesce(da, statement_timestamp() + make_interval(secs => ds)) AS d
      FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::text[],
                  $7::text[], $8::text[], $9::text[], $10::timestamptz[], $11::float8[])
           WITH ORDINALITY AS u(e, at, ai, et, ev, t, pk, p, h, da, ds, n)) s
ORDER BY n";

/// Cancels the scheduled row of event id `$1` while it still waits for its
/// time (not yet released by a relay, nor published: a relay in the
/// progress mode publishes a due row without releasing it): it is parked
/// and dropped (reason `cancelled`), out of the held rows. A relay
/// releasing or publishing it right now holds its row lock: the update
/// waits, then finds it released or published and changes nothing.
const CANCEL_SCHEDULED: &str = "\
UPDATE outbox_event
SET parked_at = now(), discarded_at = now(), discard_reason = 'cancelled', held_until = NULL
WHERE event_id = $1 AND held_until = due_at AND published_at IS NULL";

/// When a scheduled event is due.
#[derive(Debug, Clone, Copy)]
enum Due {
    /// At this time.
    At(DateTime<Utc>),
    /// This long after the row is written (the database's clock).
    After(Duration),
}

/// One database transaction plus the events recorded during it.
///
/// Run domain queries on it the usual sqlx way (it derefs to the
/// transaction's [`PgConnection`]: `query.execute(&mut *uow)`), record events
/// with [`record`](Self::record) or [`collect`](Self::collect), then
/// [`commit`](Self::commit): the events are inserted into `outbox_event` with
/// one statement, inside the same transaction, just before `COMMIT`.
///
/// Dropping a Unit of Work without committing rolls the transaction back and
/// discards its events. `commit(self)` consumes it, so nothing can be
/// recorded after commit.
pub struct UnitOfWork {
    tx: Transaction<'static, Postgres>,
    /// The transaction carries [`TX_MARK`] (set at `begin`; a transaction
    /// the application began gets it at commit).
    marked: bool,
    messages: Vec<OutboxMessage>,
    /// Events recorded with a due time ([`record_at`](Self::record_at)).
    scheduled: Vec<(OutboxMessage, Due)>,
    error: Option<Error>,
    headers: Headers,
    /// The `traceparent` the Unit of Work chose itself (not set by the
    /// application): with OpenTelemetry, `commit` replaces it with its
    /// span's context.
    #[cfg(feature = "otel")]
    own_trace: Option<String>,
}

/// What a successful [`UnitOfWork::commit`] wrote to the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Committed {
    /// Ids of the events written, in record order; those recorded with a
    /// due time ([`UnitOfWork::record_at`]) come last.
    pub event_ids: Vec<Uuid>,
}

impl std::fmt::Debug for UnitOfWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitOfWork")
            .field("pending_events", &self.messages.len())
            .field("scheduled_events", &self.scheduled.len())
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl UnitOfWork {
    /// Begins a transaction on `pool`.
    ///
    /// The Unit of Work gets a fresh correlation id and starts a new W3C
    /// trace (`traceparent`), inherited by every event it records unless
    /// [`set_correlation_id`](Self::set_correlation_id) or
    /// [`set_trace_context`](Self::set_trace_context) replaces them.
    ///
    /// With the `otel` feature and a current span that has an
    /// OpenTelemetry context, the trace is that span's instead, and
    /// [`commit`](Self::commit) writes its own span's context (a child of
    /// the current span) to the rows.
    pub async fn begin(pool: &PgPool) -> Result<Self> {
        // The mark goes in the `BEGIN` round trip.
        let tx = pool.begin_with("BEGIN; SET LOCAL outbox.tx = 'on'").await?;
        let mut uow = Self::from_transaction(tx);
        uow.marked = true;
        Ok(uow)
    }

    /// Wraps a transaction the application already began. `commit` then
    /// finds an aborted transaction, but not one the application ended and
    /// began anew by hand.
    pub fn from_transaction(tx: Transaction<'static, Postgres>) -> Self {
        #[cfg(feature = "otel")]
        let (traceparent, tracestate) = match TraceParent::current() {
            Some((parent, state)) => (parent.to_string(), state),
            None => (TraceParent::new_root().to_string(), None),
        };
        #[cfg(not(feature = "otel"))]
        let (traceparent, tracestate) = (TraceParent::new_root().to_string(), None);
        Self {
            tx,
            marked: false,
            messages: Vec::new(),
            scheduled: Vec::new(),
            error: None,
            #[cfg(feature = "otel")]
            own_trace: Some(traceparent.clone()),
            headers: Headers {
                correlation_id: Some(Uuid::now_v7()),
                traceparent: Some(traceparent),
                tracestate,
                ..Headers::default()
            },
        }
    }

    /// The transaction's connection, for domain queries.
    pub fn connection(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// Records `event` for the outbox; returns its event id.
    ///
    /// The event is serialized now; if that fails, the error is returned by
    /// [`commit`](Self::commit), which then writes nothing.
    pub fn record<E: DomainEvent>(&mut self, event: E) -> Uuid {
        match OutboxMessage::from_event(&event) {
            Ok(message) => {
                let id = message.event_id;
                self.messages.push(message);
                id
            }
            Err(error) => {
                self.error.get_or_insert(error);
                event.event_id().unwrap_or_else(Uuid::now_v7)
            }
        }
    }

    /// Records `event` to be published at `at`, not before; returns its
    /// event id.
    ///
    /// The event is written to the outbox at [`commit`](Self::commit), in
    /// the same transaction as everything else, and a relay publishes it
    /// once its time has come (within about a second of it). It is not
    /// ordered with the events of its key: it does not hold back those
    /// recorded after it (once due, it is claimed in id order with the rest,
    /// so with a backlog it may go out before some of them). A time in the past means "as
    /// soon as possible". [`cancel_scheduled`](Self::cancel_scheduled)
    /// cancels it until then.
    ///
    /// `at` is a [`DateTime<Utc>`] or a [`SystemTime`](std::time::SystemTime).
    ///
    /// ```no_run
    /// # use outbox_core::{DomainEvent, UnitOfWork};
    /// # async fn example<E: DomainEvent>(pool: sqlx::PgPool, event: E) -> outbox_core::Result<()> {
    /// let at = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
    /// let mut uow = UnitOfWork::begin(&pool).await?;
    /// let reminder = uow.record_at(at, event);
    /// uow.commit().await?;
    /// # let _ = reminder; Ok(()) }
    /// ```
    pub fn record_at<E: DomainEvent>(&mut self, at: impl Into<DateTime<Utc>>, event: E) -> Uuid {
        self.schedule(Due::At(at.into()), &event)
    }

    /// Records `event` to be published `delay` after the commit writes it
    /// (by the database's clock), not before; returns its event id. See
    /// [`record_at`](Self::record_at).
    ///
    /// ```no_run
    /// # use outbox_core::{DomainEvent, UnitOfWork};
    /// # async fn example<E: DomainEvent>(pool: sqlx::PgPool, payment_due: E) -> outbox_core::Result<()> {
    /// use std::time::Duration;
    ///
    /// let mut uow = UnitOfWork::begin(&pool).await?;
    /// let timeout = uow.record_after(Duration::from_secs(15 * 60), payment_due);
    /// uow.commit().await?;
    /// // Later, in another transaction: the payment arrived in time.
    /// let mut uow = UnitOfWork::begin(&pool).await?;
    /// let cancelled = uow.cancel_scheduled(timeout).await?;
    /// uow.commit().await?;
    /// # let _ = cancelled; Ok(()) }
    /// ```
    pub fn record_after<E: DomainEvent>(&mut self, delay: Duration, event: E) -> Uuid {
        self.schedule(Due::After(delay), &event)
    }

    /// [`record_message`](Self::record_message), published at `at`, not
    /// before (see [`record_at`](Self::record_at)); returns its event id.
    pub fn record_message_at(
        &mut self,
        at: impl Into<DateTime<Utc>>,
        message: OutboxMessage,
    ) -> Uuid {
        let id = message.event_id;
        self.scheduled.push((message, Due::At(at.into())));
        id
    }

    fn schedule<E: DomainEvent>(&mut self, due: Due, event: &E) -> Uuid {
        match OutboxMessage::from_event(event) {
            Ok(message) => {
                let id = message.event_id;
                self.scheduled.push((message, due));
                id
            }
            Err(error) => {
                self.error.get_or_insert(error);
                event.event_id().unwrap_or_else(Uuid::now_v7)
            }
        }
    }

    /// Cancels the scheduled event `event_id` ([`record_at`](Self::record_at),
    /// [`record_after`](Self::record_after)) if it has not gone out: returns
    /// `true` if it will now never be published, `false` if it is due
    /// already (published, or on its way), was cancelled before, or is no
    /// scheduled event at all (an event recorded with
    /// [`record`](Self::record) is never cancelled).
    ///
    /// An event recorded in this Unit of Work is simply not written. One
    /// committed earlier is cancelled in this transaction: the cancel
    /// takes effect at [`commit`](Self::commit), and a rollback undoes it.
    /// The row stays in the outbox, parked and dropped with the reason
    /// `cancelled` (as `outbox parked drop` leaves a row).
    pub async fn cancel_scheduled(&mut self, event_id: Uuid) -> Result<bool> {
        if let Some(i) = self
            .scheduled
            .iter()
            .position(|(m, _)| m.event_id == event_id)
        {
            self.scheduled.remove(i);
            return Ok(true);
        }
        cancel_scheduled(&mut self.tx, event_id).await
    }

    /// Records a message that is already serialized (e.g. built by a relay
    /// tool or forwarded from elsewhere); returns its event id.
    pub fn record_message(&mut self, message: OutboxMessage) -> Uuid {
        let id = message.event_id;
        self.messages.push(message);
        id
    }

    /// Takes every event the aggregate root recorded, in record order.
    pub fn collect<R: AggregateRoot + ?Sized>(&mut self, root: &mut R) {
        let (messages, error) = root.pending_events().take();
        self.messages.extend(messages);
        if let Some(error) = error {
            self.error.get_or_insert(error);
        }
    }

    /// Number of events that `commit` will write (scheduled ones included).
    pub fn pending_events(&self) -> usize {
        self.messages.len() + self.scheduled.len()
    }

    /// The headers every recorded event inherits (entries an event sets
    /// itself win).
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// Mutable access to the inherited headers (trace context, custom entries).
    pub fn headers_mut(&mut self) -> &mut Headers {
        &mut self.headers
    }

    /// Sets the correlation id the recorded events carry.
    pub fn set_correlation_id(&mut self, id: Uuid) {
        self.headers.correlation_id = Some(id);
    }

    /// Continues the caller's trace: the recorded events carry this W3C
    /// `traceparent` (the span that did the work, e.g. the incoming HTTP
    /// request's) and `tracestate`, instead of the new trace the Unit of
    /// Work started. A malformed `traceparent` is refused and changes
    /// nothing.
    pub fn set_trace_context(&mut self, traceparent: &str, tracestate: Option<&str>) -> Result<()> {
        let parsed: TraceParent = traceparent.parse()?;
        self.headers.traceparent = Some(parsed.to_string());
        self.headers.tracestate = tracestate.map(str::to_owned);
        #[cfg(feature = "otel")]
        {
            self.own_trace = None;
        }
        Ok(())
    }

    /// The trace context the recorded events carry. With the `otel` feature
    /// and OpenTelemetry spans, the rows get the same trace id but the
    /// commit span's id as parent (decided at [`commit`](Self::commit)).
    pub fn trace_context(&self) -> Option<TraceParent> {
        self.headers.traceparent.as_deref()?.parse().ok()
    }

    /// Sets the causation id (the message that caused this work).
    pub fn set_causation_id(&mut self, id: Uuid) {
        self.headers.causation_id = Some(id);
    }

    /// Writes the recorded events to `outbox_event` (one statement) and
    /// commits the transaction.
    ///
    /// On any error the transaction is rolled back: neither the domain change
    /// nor the events are written. A transaction the command broke is an
    /// error, never a silent `Ok`: aborted by a statement whose error was
    /// not returned ([`Error::TransactionAborted`]), or ended by a `COMMIT`
    /// or `ROLLBACK` run through the connection ([`Error::TransactionEnded`];
    /// the events are then not written anywhere).
    ///
    /// Runs in an `outbox.commit` span, a child of the current span. With
    /// the `otel` feature, when that span has an OpenTelemetry context, the
    /// rows carry it as their `traceparent` (unless the application set the
    /// trace context itself), so a consumer's handling is its child.
    pub async fn commit(self) -> Result<Committed> {
        let span = tracing::info_span!("outbox.commit", events = self.pending_events());
        #[cfg(feature = "otel")]
        let uow = self.with_trace_of(&span);
        #[cfg(not(feature = "otel"))]
        let uow = self;
        uow.commit_in_span().instrument(span).await
    }

    /// With OpenTelemetry: the commit span's context replaces the trace the
    /// Unit of Work chose itself.
    #[cfg(feature = "otel")]
    fn with_trace_of(mut self, span: &tracing::Span) -> Self {
        if self.pending_events() == 0 || self.headers.traceparent != self.own_trace {
            return self;
        }
        if let Some((parent, state)) = TraceParent::of_span(span) {
            self.headers.traceparent = Some(parent.to_string());
            self.headers.tracestate = state;
        }
        self
    }

    async fn commit_in_span(mut self) -> Result<Committed> {
        if let Some(error) = self.error.take() {
            // Dropping `tx` rolls back.
            return Err(error);
        }
        check_headers(&self.messages, &self.headers)?;
        for (message, _) in &self.scheduled {
            message.headers.check()?;
        }
        if !self.marked {
            sqlx::query(TX_MARK)
                .execute(&mut *self.tx)
                .await
                .map_err(aborted)?;
        }
        let mut event_ids = if self.messages.is_empty() && self.scheduled.is_empty() {
            // Nothing to insert: the check is a statement of its own.
            let ours: bool = sqlx::query_scalar(CHECK_TX)
                .fetch_one(&mut *self.tx)
                .await
                .map_err(aborted)?;
            if !ours {
                return Err(Error::TransactionEnded);
            }
            Vec::new()
        } else if self.messages.is_empty() {
            Vec::new()
        } else {
            let (event_ids, inserted) = insert(&mut self.tx, &self.messages, &self.headers, true)
                .await
                .map_err(aborted)?;
            if inserted != self.messages.len() as u64 {
                return Err(Error::TransactionEnded);
            }
            event_ids
        };
        if !self.scheduled.is_empty() {
            let inserted = insert_scheduled(&mut self.tx, &self.scheduled, &self.headers)
                .await
                .map_err(aborted)?;
            if inserted != self.scheduled.len() as u64 {
                return Err(Error::TransactionEnded);
            }
            event_ids.extend(self.scheduled.iter().map(|(m, _)| m.event_id));
        }
        self.tx.commit().await?;
        Ok(Committed { event_ids })
    }

    /// Rolls the transaction back explicitly, discarding the events.
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await?;
        Ok(())
    }
}

impl Deref for UnitOfWork {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for UnitOfWork {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

/// Inserts `messages` into `outbox_event` with one statement, on `conn`
/// (normally inside a transaction); each message inherits the `defaults`
/// headers it does not set itself. Returns the event ids in order.
///
/// The Unit of Work and the consumer-side handler context both end here.
pub async fn insert_messages(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
    defaults: &Headers,
) -> Result<Vec<Uuid>> {
    check_headers(messages, defaults)?;
    Ok(insert(conn, messages, defaults, false).await?.0)
}

/// Cancels the scheduled event `event_id` on `conn` (normally inside a
/// transaction) while it still waits for its time; returns whether it did.
/// See [`UnitOfWork::cancel_scheduled`].
pub async fn cancel_scheduled(conn: &mut PgConnection, event_id: Uuid) -> Result<bool> {
    let cancelled = sqlx::query(CANCEL_SCHEDULED)
        .bind(event_id)
        .execute(conn)
        .await
        .map_err(aborted)?
        .rows_affected();
    Ok(cancelled > 0)
}

/// Inserts the scheduled events ([`INSERT_SCHEDULED`]), only inside a
/// transaction carrying [`TX_MARK`]; returns the number of rows inserted.
/// Writes messages to be published `delay` after this statement (by the
/// database's clock), on `conn`, in the caller's transaction (a consumer's:
/// no Unit of Work guard). Used for a saga's timeouts.
#[doc(hidden)]
pub async fn insert_scheduled_after(
    conn: &mut PgConnection,
    messages: Vec<(OutboxMessage, Duration)>,
) -> Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    let scheduled: Vec<(OutboxMessage, Due)> = messages
        .into_iter()
        .map(|(m, d)| (m, Due::After(d)))
        .collect();
    check_headers(
        &scheduled.iter().map(|(m, _)| m.clone()).collect::<Vec<_>>(),
        &Headers::default(),
    )?;
    insert_scheduled_with(
        conn,
        &scheduled,
        &Headers::default(),
        INSERT_SCHEDULED_UNGUARDED,
    )
    .await
    .map_err(aborted)?;
    Ok(())
}

async fn insert_scheduled(
    conn: &mut PgConnection,
    scheduled: &[(OutboxMessage, Due)],
    defaults: &Headers,
) -> std::result::Result<u64, sqlx::Error> {
    insert_scheduled_with(conn, scheduled, defaults, INSERT_SCHEDULED.as_str()).await
}

async fn insert_scheduled_with(
    conn: &mut PgConnection,
    scheduled: &[(OutboxMessage, Due)],
    defaults: &Headers,
    statement: &'static str,
) -> std::result::Result<u64, sqlx::Error> {
    let n = scheduled.len();
    let mut event_ids = Vec::with_capacity(n);
    let mut aggregate_types = Vec::with_capacity(n);
    let mut aggregate_ids = Vec::with_capacity(n);
    let mut event_types = Vec::with_capacity(n);
    let mut versions = Vec::with_capacity(n);
    let mut topics = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    let mut at: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(n);
    let mut after: Vec<Option<f64>> = Vec::with_capacity(n);
    for (m, due) in scheduled {
        event_ids.push(m.event_id);
        aggregate_types.push(m.aggregate_type.as_str());
        aggregate_ids.push(m.aggregate_id.as_str());
        event_types.push(m.event_type.as_str());
        versions.push(i32::try_from(m.event_version).unwrap_or(i32::MAX));
        topics.push(m.topic.as_str());
        keys.push(m.partition_key.as_str());
        payloads.push(m.payload.as_str());
        let mut own = m.headers.clone();
        own.fill_from(defaults);
        headers.push(own.to_json());
        match due {
            Due::At(time) => {
                at.push(Some(*time));
                after.push(None);
            }
            Due::After(delay) => {
                at.push(None);
                after.push(Some(delay.as_secs_f64()));
            }
        }
    }
    let result = sqlx::query(statement)
        .bind(&event_ids)
        .bind(&aggregate_types)
        .bind(&aggregate_ids)
        .bind(&event_types)
        .bind(&versions)
        .bind(&topics)
        .bind(&keys)
        .bind(&payloads)
        .bind(&headers)
        .bind(&at)
        .bind(&after)
        .execute(conn)
        .await?;
    Ok(result.rows_affected())
}

/// Refuses application headers named like the framework's own.
fn check_headers(messages: &[OutboxMessage], defaults: &Headers) -> Result<()> {
    defaults.check()?;
    messages.iter().try_for_each(|m| m.headers.check())
}

/// A statement error, or [`Error::TransactionAborted`] when it says the
/// transaction was already aborted.
fn aborted(error: sqlx::Error) -> Error {
    match &error {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02") => {
            Error::TransactionAborted { source: error }
        }
        _ => Error::Database(error),
    }
}

/// [`insert_messages`]; `guarded`: only inside a transaction carrying
/// [`TX_MARK`]. Returns the event ids and the number of rows inserted.
async fn insert(
    conn: &mut PgConnection,
    messages: &[OutboxMessage],
    defaults: &Headers,
    guarded: bool,
) -> std::result::Result<(Vec<Uuid>, u64), sqlx::Error> {
    if messages.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let n = messages.len();
    let mut event_ids = Vec::with_capacity(n);
    let mut aggregate_types = Vec::with_capacity(n);
    let mut aggregate_ids = Vec::with_capacity(n);
    let mut event_types = Vec::with_capacity(n);
    let mut versions = Vec::with_capacity(n);
    let mut topics = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut headers: Vec<Option<String>> = Vec::with_capacity(n);
    // Most events carry no headers of their own: the defaults go once.
    let default_json = defaults.to_json();
    for m in messages {
        event_ids.push(m.event_id);
        aggregate_types.push(m.aggregate_type.as_str());
        aggregate_ids.push(m.aggregate_id.as_str());
        event_types.push(m.event_type.as_str());
        versions.push(i32::try_from(m.event_version).unwrap_or(i32::MAX));
        topics.push(m.topic.as_str());
        keys.push((m.partition_key != m.aggregate_id).then_some(m.partition_key.as_str()));
        payloads.push(m.payload.as_str());
        headers.push((!m.headers.is_empty()).then(|| {
            let mut own = m.headers.clone();
            own.fill_from(defaults);
            own.to_json()
        }));
    }
    let first = &messages[0];
    let uniform = messages.iter().all(|m| {
        m.aggregate_type == first.aggregate_type
            && m.event_type == first.event_type
            && m.event_version == first.event_version
            && m.topic == first.topic
    });
    let query = if uniform {
        sqlx::query(if guarded {
            INSERT_UNIFORM_GUARDED
        } else {
            INSERT_UNIFORM
        })
        .bind(&event_ids)
        .bind(aggregate_types[0])
        .bind(&aggregate_ids)
        .bind(event_types[0])
        .bind(versions[0])
        .bind(topics[0])
    } else {
        sqlx::query(if guarded {
            INSERT_BATCH_GUARDED
        } else {
            INSERT_BATCH
        })
        .bind(&event_ids)
        .bind(&aggregate_types)
        .bind(&aggregate_ids)
        .bind(&event_types)
        .bind(&versions)
        .bind(&topics)
    };
    // Arrays of nothing but NULLs go as one NULL (`UNNEST` pads with NULLs).
    let keys = keys.iter().any(Option::is_some).then_some(keys);
    let headers = headers.iter().any(Option::is_some).then_some(headers);
    let result = query
        .bind(&keys)
        .bind(&payloads)
        .bind(&headers)
        .bind(&default_json)
        .execute(conn)
        .await?;
    Ok((event_ids, result.rows_affected()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_lock_class_is_the_one_in_the_inserts() {
        let literal = format!("pg_advisory_xact_lock({KEY_LOCK_CLASS},");
        for sql in [
            INSERT_BATCH,
            INSERT_UNIFORM,
            INSERT_BATCH_GUARDED,
            INSERT_UNIFORM_GUARDED,
        ] {
            assert!(sql.contains(&literal), "{sql}");
        }
        assert!(INSERT_BATCH_GUARDED.contains("outbox.tx"));
        assert!(!INSERT_BATCH.contains("outbox.tx"));
        assert!(TX_MARK.contains("outbox.tx"));
    }
}
