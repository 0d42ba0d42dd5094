use outbox::aggregate;

#[aggregate]
enum Order {
    Open { id: u64 },
    Closed { id: u64 },
}

#[aggregate]
fn order() {}

fn main() {
    // The items are still emitted.
    let _ = Order::Open { id: 1 };
    order();
}
