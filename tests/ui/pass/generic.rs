use std::fmt::Display;

use outbox::DomainEvent;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

// The bounds the trait needs are on the struct; serde's own bounds would
// clash with them.
#[derive(Serialize, Deserialize, DomainEvent)]
#[serde(bound = "")]
#[event(topic = "things")]
struct Created<Id>
where
    Id: Display + Serialize + DeserializeOwned + Send + Sync + 'static,
{
    #[event(aggregate_id)]
    id: Id,
}

fn main() {
    assert_eq!(Created { id: 5u8 }.aggregate_id(), "5");
    assert_eq!(Created::<String>::TOPIC, "things");
}
