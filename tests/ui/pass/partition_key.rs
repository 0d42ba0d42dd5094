use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "customers")]
struct CustomerMoved {
    #[event(aggregate_id)]
    customer_id: i32,
    #[event(partition_key)]
    tenant: String,
}

// Pointless but legal: the same field as both.
#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "customers")]
struct CustomerRenamed {
    #[event(aggregate_id, partition_key)]
    customer_id: i32,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "customers")]
enum CustomerEvent {
    Joined {
        #[event(aggregate_id)]
        customer_id: i32,
        #[event(partition_key)]
        tenant: String,
    },
    Left(#[event(aggregate_id)] i32),
}

fn main() {
    let moved = CustomerMoved {
        customer_id: 1,
        tenant: "acme".to_owned(),
    };
    assert_eq!(moved.partition_key(), "acme");
    assert_eq!(CustomerRenamed { customer_id: 2 }.partition_key(), "2");
    assert_eq!(CustomerEvent::Left(3).partition_key(), "3");
}
