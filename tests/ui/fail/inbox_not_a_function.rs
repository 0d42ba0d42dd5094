use outbox::prelude::*;

#[inbox_handler]
struct OnOrderCreated;

fn main() {}
