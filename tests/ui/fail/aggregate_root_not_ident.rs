use outbox::aggregate;

#[aggregate(root = "OrderRoot")]
struct Order {
    id: u64,
}

#[aggregate(root = roots::CartRoot)]
struct Cart {
    id: u64,
}

#[aggregate(root)]
struct Invoice {
    id: u64,
}

#[aggregate(root = Account)]
struct Account {
    id: u64,
}

fn main() {
    // A string is still read as the name.
    let _ = OrderRoot::new(Order { id: 1 });
}
