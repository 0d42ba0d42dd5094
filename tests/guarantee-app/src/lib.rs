//! An application crate for the compile-time guarantee test: a command
//! handler that records its event on the Unit of Work. With the feature
//! `hidden-producer` it also reaches a Kafka producer the way the handler
//! macro cannot see — through a helper function it calls under a neutral
//! name, and a newtype around `FutureProducer` — which clippy, configured
//! with `examples/clippy.toml` and the lints at `deny`, must refuse.

use outbox::prelude::*;
use serde::{Deserialize, Serialize};

/// An order was placed.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders", aggregate_type = "Order")]
pub struct OrderPlaced {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// The command.
pub struct PlaceOrder {
    /// The order to place.
    pub order_id: Uuid,
}

/// Records `OrderPlaced` on the Unit of Work: the relay publishes it once
/// the transaction commits.
#[command_handler]
pub async fn place_order(uow: &mut UnitOfWork, cmd: PlaceOrder) -> Result<(), outbox::Error> {
    uow.record(OrderPlaced {
        order_id: cmd.order_id,
    });
    #[cfg(feature = "hidden-producer")]
    notifications::order_placed(cmd.order_id).await;
    Ok(())
}

/// What a handler must not do: publish to Kafka itself, out of the
/// transaction (the order may still roll back), hidden where the handler
/// macro cannot look.
#[cfg(feature = "hidden-producer")]
mod notifications {
    use outbox::prelude::Uuid;
    use rdkafka::config::ClientConfig;
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use std::time::Duration;

    /// The application's "event bus": a producer behind a newtype.
    pub struct Bus(FutureProducer);

    impl Bus {
        pub fn connect(brokers: &str) -> Bus {
            let producer = ClientConfig::new()
                .set("bootstrap.servers", brokers)
                .create()
                .expect("a producer");
            Bus(producer)
        }

        pub async fn publish(&self, topic: &str, key: &str, payload: &str) {
            let record = FutureRecord::to(topic).key(key).payload(payload);
            let _ = self.0.send(record, Duration::from_secs(5)).await;
        }
    }

    /// A helper the handler calls under a neutral name.
    pub async fn order_placed(order_id: Uuid) {
        let key = order_id.to_string();
        Bus::connect("127.0.0.1:9092")
            .publish("orders", &key, "{}")
            .await;
    }
}
