use outbox::DomainEvent;
use outbox::prelude::Uuid;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "imports")]
struct RowImported {
    #[event(event_id)]
    row_id: Uuid,
    #[event(aggregate_id)]
    batch: u32,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "imports")]
enum ImportEvent {
    Row(#[event(aggregate_id)] u32, #[event(event_id)] Uuid),
    Done(#[event(aggregate_id)] u32),
}

fn main() {
    let id = Uuid::now_v7();
    assert_eq!(
        RowImported {
            row_id: id,
            batch: 1
        }
        .event_id(),
        Some(id)
    );
    assert_eq!(ImportEvent::Row(1, id).event_id(), Some(id));
    assert_eq!(ImportEvent::Done(1).event_id(), None);
}
