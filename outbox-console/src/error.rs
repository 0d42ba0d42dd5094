//! Error pages: bad input (400, with what is wrong), refused writes (403),
//! missing rows (404) and failures (500, the cause logged, its text shown
//! with secrets scrubbed).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use maud::html;

use crate::html::{Nav, page, scrub_urls};
use crate::{Console, Shared};

/// A page or the error to show instead.
pub type Page = Result<axum::response::Response, ConsoleError>;

/// What went wrong with a request.
#[derive(Debug)]
pub enum ConsoleError {
    /// Input that cannot be used, and why.
    BadInput(String),
    /// A write without the right to write.
    Refused(String),
    /// No such row.
    NotFound(String),
    /// The database or the broker failed.
    Failed(outbox_runtime::Error),
}

impl From<outbox_runtime::Error> for ConsoleError {
    fn from(error: outbox_runtime::Error) -> Self {
        match error {
            outbox_runtime::Error::Config(text) => Self::BadInput(text),
            other => Self::Failed(other),
        }
    }
}

impl From<sqlx::Error> for ConsoleError {
    fn from(error: sqlx::Error) -> Self {
        Self::Failed(error.into())
    }
}

impl ConsoleError {
    /// The status and the text shown.
    pub fn parts(&self) -> (StatusCode, &'static str, String) {
        match self {
            Self::BadInput(text) => (StatusCode::BAD_REQUEST, "bad", format!("Bad input: {text}")),
            Self::Refused(text) => (StatusCode::FORBIDDEN, "refused", format!("Refused: {text}")),
            Self::NotFound(text) => (StatusCode::NOT_FOUND, "bad", format!("Not found: {text}")),
            Self::Failed(error) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "bad",
                format!("Failed: {}", scrub_urls(&error.to_string())),
            ),
        }
    }

    /// The error as a page.
    pub fn render(&self, console: &Console) -> Response {
        let (status, class, text) = self.parts();
        if let Self::Failed(error) = self {
            tracing::error!(error = %scrub_urls(&error.to_string()), "console request failed");
        }
        let body = html! {
            h1 { (status.canonical_reason().unwrap_or("Error")) }
            div.notice.(class) #outcome { (text) }
            p { a href="javascript:history.back()" { "back" } }
        };
        (status, page(console, Nav::Overview, &text, None, body)).into_response()
    }
}

/// Pages that do not exist.
pub async fn not_found(State(console): State<Shared>) -> Response {
    ConsoleError::NotFound("no such page".into()).render(&console)
}
