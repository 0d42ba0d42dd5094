//! The handler registry: typed [`InboxHandler`]s behind one object-safe
//! trait, and the routing table from (topic, event type) to the handlers
//! that run for it, in registration order.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use outbox_core::{DomainEvent, HandlerContext, HandlerFuture, InboxHandler};

/// A decoded event, typed by the handler that decoded it.
pub(crate) type Decoded = Box<dyn Any + Send + Sync>;

/// An [`InboxHandler`] with its event type erased.
pub(crate) trait ErasedHandler: Send + Sync {
    /// The handler's name (`InboxHandler::NAME`).
    fn name(&self) -> &'static str;
    /// Decodes a payload into the handler's event type.
    fn decode(&self, event_type: &str, payload: &[u8]) -> Result<Decoded, outbox_core::Error>;
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

    fn decode(&self, event_type: &str, payload: &[u8]) -> Result<Decoded, outbox_core::Error> {
        H::Event::from_payload(event_type, payload).map(|e| Box::new(e) as Decoded)
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

/// Every registered handler and the routing table.
#[derive(Default)]
pub(crate) struct Registry {
    handlers: Vec<Box<dyn ErasedHandler>>,
    names: Vec<&'static str>,
    topics: BTreeMap<String, TopicRoutes>,
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
        self.handlers.push(Box::new(Typed(handler)));
        self.names.push(H::NAME);
        let routes = self
            .topics
            .entry(<H::Event as DomainEvent>::TOPIC.to_owned())
            .or_default();
        for event_type in <H::Event as DomainEvent>::EVENT_TYPES {
            routes
                .by_type
                .entry((*event_type).to_owned())
                .or_default()
                .push(index);
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
