use outbox::prelude::*;
use outbox::BoxError;

#[inbox_handler]
async fn on_order_created(_ctx: &mut HandlerContext<'_>) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler]
async fn on_anything() -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
