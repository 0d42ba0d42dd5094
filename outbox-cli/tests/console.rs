//! `outbox console`: served on the address given, the write token taken
//! from a file or the environment (no flag takes it), read-only without
//! one, a short token refused with a clear error, and no secret in its
//! output.

use std::process::Stdio;
use std::time::Duration;

use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

const TOKEN: &str = "cli-console-token-0123456789";

fn url_of(pool: &PgPool, password: Option<&str>) -> String {
    let o = pool.connect_options();
    format!(
        "postgres://{}{}@{}:{}/{}",
        o.get_username(),
        password.map(|p| format!(":{p}")).unwrap_or_default(),
        o.get_host(),
        o.get_port(),
        o.get_database().expect("database")
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn console(url: &str, port: u16, args: &[&str], token_env: Option<&str>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(["console", "--addr", &format!("127.0.0.1:{port}")])
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .env_remove(outbox_console::WRITE_TOKEN_ENV)
        .env("DATABASE_URL", url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(token) = token_env {
        cmd.env(outbox_console::WRITE_TOKEN_ENV, token);
    }
    cmd
}

/// Starts the console and waits for the line saying where it serves.
async fn start(mut cmd: Command) -> (Child, String) {
    let mut child = cmd.spawn().expect("run outbox console");
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the console started in time")
        .unwrap()
        .unwrap_or_default();
    (child, line)
}

/// One HTTP/1.1 request; the whole response as text.
async fn http(port: u16, request: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut out))
        .await
        .expect("an answer in time")
        .unwrap();
    out
}

async fn login(port: u16, token: &str) -> String {
    let body = format!("operator=ann&token={token}");
    http(
        port,
        &format!(
            "POST /login HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await
}

async fn stop(mut child: Child) -> String {
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("stopped on SIGTERM")
        .unwrap();
    assert!(status.success(), "SIGTERM → exit 0: {status:?}");
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    err
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_token_comes_from_a_file_or_the_environment_never_argv(pool: PgPool) {
    // From a file (with the newline editors add).
    let dir = std::env::temp_dir().join(format!("console-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let port = free_port();
    let url = url_of(&pool, Some("s3cr3t-db"));
    let (child, line) = start(console(
        &url,
        port,
        &["--write-token-file", file.to_str().unwrap()],
        None,
    ))
    .await;
    assert!(
        line.contains(&format!("127.0.0.1:{port}")) && line.contains("writes allowed"),
        "{line}"
    );
    let page = http(
        port,
        "GET /parked HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("not logged in"));
    let ok = login(port, TOKEN).await;
    assert!(ok.starts_with("HTTP/1.1 303"), "{ok}");
    assert!(
        ok.contains("Set-Cookie: outbox_console=") || ok.contains("set-cookie: outbox_console="),
        "{ok}"
    );
    let refused = login(port, "wrong-token-0123456789").await;
    assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");
    let err = stop(child).await;
    assert!(!err.contains("s3cr3t-db") && !err.contains(TOKEN), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();

    // From the environment; the cookie Secure when asked.
    let port = free_port();
    let (child, line) = start(console(&url, port, &["--secure-cookie"], Some(TOKEN))).await;
    assert!(line.contains("writes allowed"), "{line}");
    let ok = login(port, TOKEN).await;
    assert!(ok.starts_with("HTTP/1.1 303"), "{ok}");
    assert!(ok.contains("; Secure"), "{ok}");
    stop(child).await;

    // Neither: read-only.
    let port = free_port();
    let (child, line) = start(console(&url, port, &[], None)).await;
    assert!(line.contains("read-only"), "{line}");
    let page = http(
        port,
        "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(page.contains("read-only"));
    assert!(login(port, TOKEN).await.starts_with("HTTP/1.1 403"));
    stop(child).await;

    // No flag takes the token itself; a short one is refused.
    let out = console(&url, free_port(), &["--write-token", TOKEN], None)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = console(&url, free_port(), &[], Some("short"))
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("write token is too short"), "{err}");
}
