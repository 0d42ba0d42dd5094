use outbox::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(topic = "payments", aggregate_type = "Payment", version = 2)]
enum PaymentEvent {
    Authorized {
        #[event(aggregate_id)]
        payment_id: u64,
        amount_cents: i64,
    },
    #[event(event_type = "payment.captured", version = 4)]
    Captured(#[event(aggregate_id)] u64),
    #[event(version = 3)]
    Refunded(String, #[event(aggregate_id)] u64),
}

fn main() {
    assert_eq!(
        PaymentEvent::EVENT_TYPES,
        ["Authorized", "payment.captured", "Refunded"]
    );
    assert_eq!(PaymentEvent::Captured(1).event_version(), 4);
    assert_eq!(PaymentEvent::Refunded(String::new(), 9).aggregate_id(), "9");
}
