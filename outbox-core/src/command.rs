//! The write-side handler contract: [`CommandHandler`] (implemented by
//! `#[command_handler]`) and [`execute`], which runs one command in its own
//! Unit of Work.
//!
//! A command handler receives the [`UnitOfWork`] — the transaction and the
//! event recorder — and the command. It cannot commit (`commit(self)` needs
//! the Unit of Work by value, the handler holds a borrow) and it is handed no
//! producer: the events it records reach Kafka through the outbox, and only
//! if the transaction commits.

use std::future::Future;
use std::pin::Pin;

use sqlx::PgPool;
use tracing::Instrument;

use crate::error::Error;
use crate::handler::sealed::Sealed;
use crate::uow::UnitOfWork;

/// The future a [`CommandHandler`] returns.
pub type CommandFuture<'a, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'a>>;

/// A write-side handler of one command type, implemented by
/// `#[command_handler]`.
///
/// Run it with [`execute`] (its own Unit of Work, committed on `Ok`), or call
/// [`handle`](Self::handle) on a Unit of Work you manage yourself, e.g. to
/// run several commands in one transaction.
pub trait CommandHandler: Send + Sync + 'static {
    /// The command handled (the function's second argument).
    type Command;
    /// What the handler returns on success.
    type Output;
    /// What the handler returns on failure. It absorbs the outbox's own
    /// errors (beginning and committing the transaction in [`execute`]):
    /// `Box<dyn Error + Send + Sync>` and `anyhow::Error` already do; give
    /// an error enum a `#[from] outbox::Error` variant.
    type Error: From<Error>;

    /// A stable name for logs (the function's name).
    const NAME: &'static str;

    /// Applies the command inside `uow`'s transaction. It neither commits nor
    /// rolls back: the caller decides.
    fn handle<'a>(
        &'a self,
        uow: &'a mut UnitOfWork,
        command: Self::Command,
    ) -> CommandFuture<'a, Self::Output, Self::Error>;
}

/// What a `#[command_handler]` function returns: `Result<T, E>` (or an alias
/// of it, such as `anyhow::Result<T>`).
///
/// Used by the generated code; sealed.
#[diagnostic::on_unimplemented(
    message = "a `#[command_handler]` must return `Result<T, E>`, not `{Self}`",
    label = "expected `Result<T, E>`",
    note = "`Ok` commits the Unit of Work, `Err` rolls it back (with `outbox::execute`)"
)]
pub trait CommandOutput: Sealed {
    /// The success type.
    type Ok;
    /// The error type.
    type Err;

    /// The value as a `Result`.
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
}

impl<T, E> CommandOutput for Result<T, E> {
    type Ok = T;
    type Err = E;

    #[inline]
    fn into_result(self) -> Result<T, E> {
        self
    }
}

/// Runs `handler` on `command` in a Unit of Work of its own.
///
/// Begins a transaction on `pool`, runs the handler, then:
///
/// - `Ok(output)`: commits — the handler's writes and the events it recorded,
///   atomically — and returns `output`. If the commit fails, its error is
///   returned (converted into the handler's error type) and nothing is
///   written.
/// - `Err(error)`: rolls back — the writes and the recorded events are
///   discarded — and returns `error`.
///
/// Errors of the outbox itself come back converted into the handler's error
/// type ([`CommandHandler::Error`] is `From<outbox::Error>`).
///
/// Nothing is retried: a serialization failure or a deadlock is returned like
/// any other error, and the caller decides whether to run the command again.
pub async fn execute<H>(
    pool: &PgPool,
    handler: H,
    command: H::Command,
) -> Result<H::Output, H::Error>
where
    H: CommandHandler,
{
    // The command's span carries the trace its events will carry, so the
    // command's logs join the consumers' (`handle_event` spans). The Unit of
    // Work begins inside it: with OpenTelemetry, its trace is the span's.
    let span = tracing::info_span!(
        "command",
        command = H::NAME,
        trace_id = tracing::field::Empty,
        correlation_id = tracing::field::Empty,
    );
    let uow = UnitOfWork::begin(pool).instrument(span.clone()).await?;
    if let Some(trace) = uow.trace_context() {
        span.record("trace_id", trace.trace_id());
    }
    if let Some(id) = uow.headers().correlation_id {
        span.record("correlation_id", tracing::field::display(id));
    }
    run(uow, handler, command).instrument(span).await
}

async fn run<H: CommandHandler>(
    mut uow: UnitOfWork,
    handler: H,
    command: H::Command,
) -> Result<H::Output, H::Error> {
    match handler.handle(&mut uow, command).await {
        Ok(output) => {
            uow.commit().await?;
            Ok(output)
        }
        Err(error) => {
            if let Err(rollback) = uow.rollback().await {
                // The connection is discarded with its transaction: nothing
                // of the command was committed either way.
                tracing::warn!(
                    handler = H::NAME,
                    error = %rollback,
                    "rolling back a failed command failed"
                );
            }
            Err(error)
        }
    }
}
