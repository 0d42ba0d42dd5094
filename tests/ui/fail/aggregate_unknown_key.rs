use outbox::aggregate;

#[aggregate(name = OrderRoot)]
struct Order {
    id: u64,
}

#[aggregate(root = CartRoot, root = Basket)]
struct Cart {
    id: u64,
}

fn main() {
    // The roots are still generated, under the default or first name.
    let _ = OrderRoot::new(Order { id: 1 });
    let _ = CartRoot::new(Cart { id: 1 });
}
