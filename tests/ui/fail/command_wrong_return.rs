use outbox::prelude::*;

struct PlaceOrder;

// Nothing returned: nothing tells commit from rollback.
#[command_handler]
async fn no_result(_uow: &mut UnitOfWork, _cmd: PlaceOrder) {}

// A value, not a `Result`.
#[command_handler]
async fn a_value(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Uuid {
    Uuid::nil()
}

// A reference.
#[command_handler]
async fn a_reference(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> &'static str {
    "placed"
}

fn main() {}
