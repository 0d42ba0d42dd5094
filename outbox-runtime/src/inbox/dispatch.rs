//! The handler registry: typed [`InboxHandler`]s behind one object-safe
//! trait, and the routing table from (topic, event type) to the handlers
//! that run for it, in registration order. It refuses (at `build`) a
//! handler registered twice, or two handlers of one name for one event type:
//! a dead letter names its handler, which must say which one failed.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, BTreeSet, HashMap};

use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};

/// A decoded event, typed by the handler that decoded it.
pub(crate) type Decoded = Box<dyn Any + Send + Sync>;

/// An [`InboxHandler`] with its event type erased.
pub(crate) trait ErasedHandler: Send + Sync {
    /// The handler's name (`InboxHandler::NAME`).
    fn name(&self) -> &'static str;
    /// Decodes a payload of schema version `version` into the handler's
    /// event type (through its upcasters for an older version).
    fn decode(
        &self,
        event_type: &str,
        version: u32,
        payload: &[u8],
    ) -> Result<Decoded, outbox_core::Error>;
    /// The saga instance a decoded value moves (saga handlers only).
    fn saga_instance(&self, event: &Decoded) -> Option<(&'static str, String)>;
    /// Runs the handler on a value [`decode`](Self::decode) returned.
    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: Decoded,
    ) -> HandlerFuture<'a>
    where
        'c: 'a;
}

struct Typed<H>(H);

impl<H: InboxHandler> ErasedHandler for Typed<H> {
    fn name(&self) -> &'static str {
        H::NAME
    }

    fn saga_instance(&self, event: &Decoded) -> Option<(&'static str, String)> {
        event
            .downcast_ref::<H::Event>()
            .and_then(|e| self.0.saga_instance(e))
    }

    fn decode(
        &self,
        event_type: &str,
        version: u32,
        payload: &[u8],
    ) -> Result<Decoded, outbox_core::Error> {
        H::Event::from_versioned_payload(event_type, version, payload)
            .map(|e| Box::new(e) as Decoded)
    }

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: Decoded,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        match event.downcast::<H::Event>() {
            Ok(event) => self.0.handle(ctx, *event),
            Err(_) => Box::pin(async {
                Err(format!("internal error: `{}` got a value of another type", H::NAME).into())
            }),
        }
    }
}

/// Where a message goes.
pub(crate) enum Route<'a> {
    /// These handlers (indices into the registry), in registration order.
    Handlers(&'a [usize]),
    /// The event type was explicitly ignored on this topic.
    Ignored,
    /// No handler and not ignored.
    Unknown,
}

#[derive(Default)]
struct TopicRoutes {
    by_type: HashMap<String, Vec<usize>>,
    ignored: BTreeSet<String>,
}

/// What identifies a registered handler, for the duplicate check.
struct Identity {
    type_id: TypeId,
    /// The handler's Rust type.
    rust_type: &'static str,
    /// Its event's Rust type.
    event: &'static str,
}

/// Every registered handler and the routing table.
#[derive(Default)]
pub(crate) struct Registry {
    handlers: Vec<Box<dyn ErasedHandler>>,
    names: Vec<&'static str>,
    identities: Vec<Identity>,
    topics: BTreeMap<String, TopicRoutes>,
    /// Registration mistakes, reported by [`check`](Self::check).
    duplicates: Vec<String>,
    /// The saga types registered (their names).
    sagas: Vec<&'static str>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("handlers", &self.names)
            .field("topics", &self.topics.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Registry {
    pub fn add<H: InboxHandler>(&mut self, handler: H) {
        let index = self.handlers.len();
        let identity = Identity {
            type_id: TypeId::of::<H>(),
            rust_type: std::any::type_name::<H>(),
            event: std::any::type_name::<H::Event>(),
        };
        let topic = <H::Event as DomainEvent>::TOPIC;
        let routes = self.topics.entry(topic.to_owned()).or_default();
        for event_type in <H::Event as DomainEvent>::EVENT_TYPES {
            let same = routes.by_type.get(*event_type).and_then(|handlers| {
                handlers.iter().copied().find(|&i| {
                    self.identities[i].type_id == identity.type_id || self.names[i] == H::NAME
                })
            });
            if let Some(other) = same {
                let first = &self.identities[other];
                let what = match first.type_id == identity.type_id {
                    true => "the same handler is registered twice",
                    false => "two handlers share one name",
                };
                self.duplicates.push(format!(
                    "{what} for event type `{event_type}` on topic `{topic}`: handler \
                     `{}` ({}, event {}) and handler `{}` ({}, event {}); a dead letter \
                     names its handler, so each handler of an event type must be registered \
                     once, under its own name (`#[inbox_handler(name = \"...\")]`)",
                    self.names[other],
                    first.rust_type,
                    first.event,
                    H::NAME,
                    identity.rust_type,
                    identity.event,
                ));
                // Reported once per pair, not per event type.
                break;
            }
        }
        for event_type in <H::Event as DomainEvent>::EVENT_TYPES {
            routes
                .by_type
                .entry((*event_type).to_owned())
                .or_default()
                .push(index);
        }
        self.handlers.push(Box::new(Typed(handler)));
        self.names.push(H::NAME);
        self.identities.push(identity);
    }

    /// Fails with every registration mistake: a handler registered twice,
    /// or two handlers of one name for one event type.
    pub fn check(&self) -> Result<(), String> {
        match self.duplicates.as_slice() {
            [] => Ok(()),
            [one] => Err(one.clone()),
            many => Err(many.join("; ")),
        }
    }

    /// Routes by the topics as named on the broker: `{prefix}{topic}`.
    pub fn prefix_topics(&mut self, prefix: &str) {
        if prefix.is_empty() {
            return;
        }
        self.topics = std::mem::take(&mut self.topics)
            .into_iter()
            .map(|(topic, routes)| (format!("{prefix}{topic}"), routes))
            .collect();
    }

    /// Records an explicitly ignored event type (`"*"`: every event type
    /// without a handler). Fails for a topic no handler subscribes to.
    pub fn ignore(&mut self, topic: &str, event_type: &str) -> Result<(), String> {
        match self.topics.get_mut(topic) {
            Some(routes) => {
                routes.ignored.insert(event_type.to_owned());
                Ok(())
            }
            None => Err(format!(
                "ignore_event_type(\"{topic}\", \"{event_type}\"): no handler subscribes to topic `{topic}`"
            )),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.handlers.is_empty()
    }

    /// The topics to subscribe to (the union of the handlers' topics).
    pub fn topics(&self) -> Vec<String> {
        self.topics.keys().cloned().collect()
    }

    pub fn handler(&self, index: usize) -> &dyn ErasedHandler {
        self.handlers[index].as_ref()
    }

    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// Records that saga type `name` is registered.
    pub fn add_saga(&mut self, name: &'static str) {
        if !self.sagas.contains(&name) {
            self.sagas.push(name);
        }
    }

    /// The saga types registered.
    pub fn sagas(&self) -> &[&'static str] {
        &self.sagas
    }

    pub fn route(&self, topic: &str, event_type: &str) -> Route<'_> {
        let Some(routes) = self.topics.get(topic) else {
            return Route::Unknown;
        };
        if let Some(handlers) = routes.by_type.get(event_type) {
            return Route::Handlers(handlers);
        }
        if routes.ignored.contains(event_type) || routes.ignored.contains("*") {
            Route::Ignored
        } else {
            Route::Unknown
        }
    }

    /// The event types handled on `topic`, for error messages.
    pub fn known_types(&self, topic: &str) -> String {
        self.topics
            .get(topic)
            .map(|r| {
                let mut types: Vec<&str> = r.by_type.keys().map(String::as_str).collect();
                types.sort_unstable();
                types.join(", ")
            })
            .unwrap_or_default()
    }
}
