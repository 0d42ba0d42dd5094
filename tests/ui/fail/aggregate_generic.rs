use outbox::aggregate;

#[aggregate]
struct Order<Id> {
    id: Id,
}

#[aggregate]
struct Cart<'a> {
    owner: &'a str,
}

fn main() {
    // The struct is still emitted.
    let _ = Order { id: 1 };
}
