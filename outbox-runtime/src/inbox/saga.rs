//! Sagas on a consumer: [`ConsumerBuilder::saga`] registers a saga's
//! message types, each as an inbox handler ([`SagaHandler`]) that applies
//! the message to its instance in the consumer's transaction; and a
//! batch's lock plan ([`lock_instances`]): the instances a dedup batch's
//! messages route to, locked in `(saga_type, saga_id)` order before any
//! handler runs, so two batches never lock two instances in opposite
//! orders, and read in the same statement ([`Prefetched`]): the steps read
//! their instances from there and leave their results there, and the
//! consumer writes a segment's in one statement at its end.

use std::collections::BTreeSet;

use outbox_core::saga::{Prefetched, SagaHandler};
use outbox_core::{DomainEvent, MessageSteps, Saga, SagaRegistrar};
use sqlx::PgConnection;

use super::ConsumerBuilder;
use super::apply::Failure;
use super::dispatch::Registry;
use super::record::{Body, Record};

impl<S: Saga> SagaRegistrar<S> for Registry {
    fn add<M: DomainEvent>(&mut self, steps: MessageSteps<S, M>) {
        Registry::add(self, SagaHandler::new(steps));
    }
}

impl ConsumerBuilder {
    /// Registers saga `S`: each of its message types (its timeouts
    /// included, on `S::TIMEOUT_TOPIC`) is handled by a step applied to the
    /// instance the message correlates to, in the consumer's transaction
    /// with the message's deduplication (or inbox) bookkeeping.
    pub fn saga<S: Saga>(mut self) -> Self {
        S::steps(&mut self.registry);
        self.registry.add_saga(S::NAME);
        self
    }
}

/// Locks the existing instances that the events of `records` (those not
/// set aside) move, in `(saga_type, saga_id)` order, and reads them: their
/// steps read them from the returned [`Prefetched`] instead of reading the
/// rows, and leave their results there for the segment's flush. Instances created by a start message are not locked here: their
/// insert waits for another transaction's insert of the same key instead.
const LOCK_ALL: &str = "\
SELECT s.saga_type, s.saga_id, s.state, s.timeouts, s.completed_at IS NOT NULL
FROM outbox_saga s
JOIN UNNEST($1::text[], $2::text[]) AS k(t, i) ON s.saga_type = k.t AND s.saga_id = k.i
ORDER BY s.saga_type, s.saga_id
FOR UPDATE OF s";

pub(crate) async fn lock_instances(
    conn: &mut PgConnection,
    registry: &Registry,
    records: &[Record],
    set_aside: &[bool],
) -> Result<Prefetched, Failure> {
    let mut instances = BTreeSet::new();
    for (r, aside) in records.iter().zip(set_aside) {
        let Body::Event(e) = &r.body else { continue };
        if *aside {
            continue;
        }
        for (i, &h) in e.handlers.iter().enumerate() {
            if let Some(Some(value)) = e.decoded.get(i)
                && let Some(key) = registry.handler(h).saga_instance(value)
            {
                instances.insert(key);
            }
        }
    }
    let prefetched = Prefetched::default();
    if instances.len() < 2 {
        // One instance: its step's lock is the only one, and costs the
        // same round trip.
        return Ok(prefetched);
    }
    let (types, ids): (Vec<&str>, Vec<String>) = instances.into_iter().unzip();
    let rows: Vec<(String, String, serde_json::Value, serde_json::Value, bool)> =
        sqlx::query_as(LOCK_ALL)
            .bind(&types)
            .bind(&ids)
            .fetch_all(conn)
            .await?;
    for (saga_type, saga_id, state, timeouts, completed) in rows {
        prefetched.insert((saga_type, saga_id), state, timeouts, completed);
    }
    Ok(prefetched)
}
