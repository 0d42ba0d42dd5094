#![deny(warnings, missing_docs)]
//! What the producer checks must not reject: channels (`.send(v)` with one
//! argument, in spawned tasks too), methods called `create` on other types,
//! `Producer`-free names that merely resemble Kafka's, and records of the
//! application's own.

use outbox::BoxError;
use outbox::prelude::*;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// An order was created.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "orders")]
pub struct OrderCreated {
    /// The order.
    #[event(aggregate_id)]
    pub order_id: Uuid,
}

/// A configuration of the application, with a `create` method.
pub struct Config;

impl Config {
    /// Not a Kafka client.
    pub fn create(&self) -> u32 {
        1
    }
}

/// Another crate's items named like Kafka's and the relay's.
pub mod tls {
    /// A TLS client configuration (like `rustls::ClientConfig`).
    #[derive(Debug)]
    pub struct ClientConfig;

    impl ClientConfig {
        /// A builder.
        pub fn builder() -> Self {
            ClientConfig
        }
    }

    /// A relay station of the domain.
    #[derive(Debug)]
    pub struct Relay;
}

/// The application's notification channel.
pub fn notifications() -> mpsc::UnboundedSender<Uuid> {
    mpsc::unbounded_channel().0
}

/// Channels, spawned tasks, `create` on other types.
#[inbox_handler]
pub async fn on_order_created(
    ctx: &mut HandlerContext<'_>,
    event: OrderCreated,
) -> Result<(), BoxError> {
    let (tx, mut rx) = mpsc::channel::<Uuid>(1);
    tx.send(event.order_id).await?;
    let _ = rx.recv().await;

    let sender = notifications();
    tokio::spawn(async move {
        let _ = sender.send(Uuid::nil());
    });
    std::thread::spawn(move || {
        let (tx, _rx) = std::sync::mpsc::channel::<u8>();
        let _ = tx.send(1);
    });

    let config = Config;
    let _: u32 = config.create();
    let _ = ctx.recorded_events();
    Ok(())
}

/// Same in a command handler; the command may carry another crate's
/// `ClientConfig` or `Relay`.
#[command_handler]
pub async fn notify(
    _uow: &mut UnitOfWork,
    cmd: (Uuid, tls::ClientConfig, tls::Relay),
) -> Result<(), BoxError> {
    let (id, config, relay) = cmd;
    let _ = (config, relay, tls::ClientConfig::builder());
    notifications().send(id)?;
    let results = vec![Config.create()];
    let _ = format!("{results:?}");
    Ok(())
}

fn main() {}
