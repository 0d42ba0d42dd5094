//! The `outbox` command (see the library for what it does); applications
//! that want `outbox schema export` build their own with
//! `outbox_cli::run_with`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    outbox_cli::run().await
}
