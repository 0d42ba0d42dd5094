use outbox::prelude::*;
use outbox::BoxError;

#[inbox_handler]
async fn on_any<E: DomainEvent>(_ctx: &mut HandlerContext<'_>, _event: E) -> Result<(), BoxError> {
    Ok(())
}

#[inbox_handler]
async fn on_any_where<'c, E>(_ctx: &mut HandlerContext<'c>, _event: E) -> Result<(), BoxError>
where
    E: DomainEvent,
{
    Ok(())
}

#[inbox_handler]
async fn on_impl(_ctx: &mut HandlerContext<'_>, _event: impl DomainEvent) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
