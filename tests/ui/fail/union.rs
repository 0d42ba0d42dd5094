use outbox::DomainEvent;

#[derive(DomainEvent)]
#[event(topic = "orders")]
union OrderId {
    number: u64,
    bytes: [u8; 8],
}

fn main() {}
