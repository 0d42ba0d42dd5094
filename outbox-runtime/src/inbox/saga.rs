//! Sagas on a consumer: [`ConsumerBuilder::saga`] registers a saga's
//! message types, each as an inbox handler ([`SagaHandler`]) that applies
//! the message to its instance in the consumer's transaction.

use outbox_core::saga::SagaHandler;
use outbox_core::{DomainEvent, MessageSteps, Saga, SagaRegistrar};

use super::ConsumerBuilder;
use super::dispatch::Registry;

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
        self
    }
}
