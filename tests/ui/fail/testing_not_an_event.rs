// The testing kit's assertions take domain events only.
use outbox::testing::Delivery;

#[derive(Debug)]
struct NotAnEvent {
    amount_cents: i64,
}

fn check(delivery: &Delivery) {
    delivery.assert_published::<NotAnEvent>(|e| e.amount_cents == 500);
}

fn main() {}
