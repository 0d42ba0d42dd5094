use outbox::prelude::*;
use outbox::BoxError;

struct PlaceOrder;

// An inbox handler's argument.
#[command_handler]
async fn with_context(_ctx: &mut HandlerContext<'_>, _cmd: PlaceOrder) -> Result<(), BoxError> {
    Ok(())
}

// The Unit of Work by value: the handler could commit it.
#[command_handler]
async fn by_value(_uow: UnitOfWork, _cmd: PlaceOrder) -> Result<(), BoxError> {
    Ok(())
}

// A bare transaction: no event recorder.
#[command_handler]
async fn bare_transaction(
    _tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    _cmd: PlaceOrder,
) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
