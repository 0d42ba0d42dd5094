// `outbox::execute` returns the handler's error type, which must therefore
// absorb the outbox's own errors (begin, commit).
use outbox::prelude::*;

struct PlaceOrder;

#[derive(Debug)]
enum PlaceOrderError {
    Empty,
}

#[command_handler]
async fn place_order(_uow: &mut UnitOfWork, _cmd: PlaceOrder) -> Result<(), PlaceOrderError> {
    Err(PlaceOrderError::Empty)
}

async fn run(pool: &sqlx::PgPool) {
    let _ = outbox::execute(pool, place_order, PlaceOrder).await;
}

fn main() {
    let _ = run;
}
