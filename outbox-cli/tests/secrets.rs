//! The canary: every `outbox` subcommand, the relay included, runs with a
//! canary value in every secret setting — Kafka secrets given with `-X`,
//! through the environment and in the configuration file, the database
//! password in the URL and in `PGPASSWORD` — with debug logging (ours and
//! librdkafka's), on success and on the error paths; the canary appears
//! nowhere: stdout, stderr (logs, errors, panics), `status --json`,
//! `config`, `/metrics`.

#[path = "../../outbox-runtime/tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::process::Output;
use std::time::Duration;

use common::*;
use sqlx::PgPool;

/// librdkafka settings whose values are secret and that the relay accepts
/// on a plain-text connection.
const SECRET_KEYS: &[&str] = &[
    "sasl.username",
    "sasl.password",
    "sasl.oauthbearer.config",
    "ssl.key.password",
    "ssl.keystore.password",
];

/// Secret settings of OAuth/OIDC, which this build of librdkafka refuses
/// (no libcurl): their error must not show them either.
const REFUSED_SECRET_KEYS: &[&str] = &[
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.assertion.private.key.passphrase",
];

struct Canary {
    /// The prefix of every secret value of this run.
    word: String,
    file: std::path::PathBuf,
    env: Vec<(String, String)>,
    x: Vec<String>,
}

impl Canary {
    fn new(pool: &PgPool) -> Self {
        let word = format!("CANARY{}", uuid::Uuid::new_v4().simple());
        let o = pool.connect_options();
        let url = format!(
            "postgres://{}:{word}-url@{}:{}/{}",
            o.get_username(),
            o.get_host(),
            o.get_port(),
            o.get_database().expect("database")
        );
        let mut file_text = format!("[database]\nurl = \"{url}\"\n[kafka]\n");
        let mut env = vec![
            ("DATABASE_URL".to_owned(), url.clone()),
            ("PGPASSWORD".to_owned(), format!("{word}-pgpassword")),
            ("KAFKA_BROKERS".to_owned(), brokers()),
            ("RUST_LOG".to_owned(), "debug".to_owned()),
            // librdkafka's own debug output, its configuration dump included.
            (
                "OUTBOX_KAFKA_DEBUG".to_owned(),
                "conf,security,broker".to_owned(),
            ),
        ];
        let mut x = Vec::new();
        for key in SECRET_KEYS {
            file_text.push_str(&format!("\"{key}\" = \"{word}-file-{key}\"\n"));
            env.push((
                format!("OUTBOX_KAFKA_{}", key.to_uppercase().replace('.', "_")),
                format!("{word}-env-{key}"),
            ));
            x.push(format!("{key}={word}-flag-{key}"));
        }
        let file = std::env::temp_dir().join(format!(
            "outbox-canary-{}.toml",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::write(&file, file_text).unwrap();
        env.push(("OUTBOX_CONFIG".to_owned(), file.display().to_string()));
        Self { word, file, env, x }
    }

    /// `-X` flags with every secret.
    fn x_flags(&self) -> Vec<&str> {
        self.x.iter().flat_map(|s| ["-X", s.as_str()]).collect()
    }

    fn command(&self, args: &[&str], extra_env: &[(&str, &str)]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(outbox_bin());
        cmd.args(args);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    /// Runs a subcommand to its end; checks the canary stays hidden;
    /// returns the output.
    async fn run(&self, args: &[&str], extra_env: &[(&str, &str)]) -> Output {
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            self.command(args, extra_env).output(),
        )
        .await
        .unwrap_or_else(|_| panic!("outbox {args:?} finished in time"))
        .expect("run outbox");
        self.check(args, &out);
        out
    }

    fn check(&self, args: &[&str], out: &Output) {
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !all.contains(&self.word),
            "outbox {args:?} printed a secret:\n{}",
            all.lines()
                .filter(|l| l.contains(&self.word))
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(
            !all.contains("panicked"),
            "outbox {args:?} panicked:\n{all}"
        );
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn ok(args: &[&str], o: &Output) {
    assert!(
        o.status.success(),
        "outbox {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `GET /metrics` on `addr`, the whole response.
async fn scrape(addr: &str) -> String {
    let addr = addr.to_owned();
    tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut conn) = std::net::TcpStream::connect(&addr) {
                conn.set_read_timeout(Some(Duration::from_secs(10)))
                    .unwrap();
                conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .unwrap();
                let mut body = String::new();
                let _ = conn.read_to_string(&mut body);
                if body.contains("outbox_relay_published_total") {
                    return body;
                }
            }
            assert!(std::time::Instant::now() < deadline, "no metrics on {addr}");
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .unwrap()
}

#[sqlx::test(migrations = false)]
async fn no_subcommand_prints_a_secret(pool: PgPool) {
    let canary = Canary::new(&pool);
    let topic = unique_topic("canary");
    // `args` followed by -X flags with every secret.
    let with_x = |args: &[&str]| -> Vec<String> {
        args.iter()
            .copied()
            .chain(canary.x_flags())
            .map(str::to_owned)
            .collect()
    };

    let o = canary.run(&["migrate"], &[]).await;
    ok(&["migrate"], &o);
    let args = with_x(&["topics", "create", &topic]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = canary.run(&args, &[]).await;
    ok(&args, &o);
    commit_messages(&pool, &topic, 20, 4, 20).await;

    // The relay, with metrics, until it published everything; then SIGTERM.
    let metrics = format!("127.0.0.1:{}", free_port());
    let args = with_x(&["relay", "--metrics-addr", &metrics]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let child = canary.command(&args, &[]).spawn().expect("start the relay");
    let pid = child.id().expect("running");
    // Read its output while it runs (debug logs fill a pipe quickly).
    let output = tokio::spawn(child.wait_with_output());
    if !wait_until_published(&pool, Duration::from_secs(30)).await {
        signal(pid, "-KILL");
        let out = output.await.unwrap().unwrap();
        panic!(
            "the relay did not publish: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let scraped = scrape(&metrics).await;
    assert!(!scraped.contains(&canary.word), "{scraped}");
    signal(pid, "-TERM");
    let out = tokio::time::timeout(Duration::from_secs(30), output)
        .await
        .expect("relay stopped")
        .unwrap()
        .unwrap();
    canary.check(&args, &out);
    ok(&args, &out);

    for args in [
        vec!["status"],
        vec!["status", "--json"],
        vec!["config"],
        vec!["config", "--json"],
        vec!["parked", "list", "--json"],
        vec!["parked", "requeue", "--all"],
        vec!["parked", "drop", "--all", "--reason", "canary"],
        vec!["dead-letters", "list", "--json"],
        vec!["dead-letters", "retry", "--all"],
        vec!["dead-letters", "drop", "--all"],
        vec!["replay", "--dry-run", "--json"],
        vec!["cleanup", "--older-than", "30d", "--json"],
        vec!["notify", "off"],
        vec!["notify", "on"],
        vec!["notify", "status"],
    ] {
        let o = canary.run(&args, &[]).await;
        ok(&args, &o);
    }
    let args = with_x(&["replay", "--topic", &topic]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = canary.run(&args, &[]).await;
    ok(&args, &o);
    assert!(stdout(&o).contains("replayed 20 events"), "{}", stdout(&o));
}

#[sqlx::test(migrations = false)]
async fn no_error_prints_a_secret(pool: PgPool) {
    let canary = Canary::new(&pool);
    let word = &canary.word;
    // A client certificate's key that is no key: the Kafka client cannot be
    // created (relay, replay, topics create).
    let pem = format!("-----BEGIN PRIVATE KEY-----\n{word}-pem\n-----END PRIVATE KEY-----");
    let ssl = [
        ("OUTBOX_KAFKA_SECURITY_PROTOCOL", "SSL"),
        ("OUTBOX_KAFKA_SSL_KEY_PEM", pem.as_str()),
    ];
    for args in [
        vec!["relay"],
        vec!["topics", "create", "canary-error"],
        vec!["replay", "--from-id", "1"],
    ] {
        let o = canary.run(&args, &ssl).await;
        assert!(!o.status.success(), "{args:?} failed");
    }
    // Secret settings this build refuses, from each source.
    for key in REFUSED_SECRET_KEYS {
        let flag = format!("{key}={word}-flag");
        let o = canary.run(&["relay", "-X", &flag], &[]).await;
        assert_eq!(o.status.code(), Some(2), "{key} refused");
        let var = format!("OUTBOX_KAFKA_{}", key.to_uppercase().replace('.', "_"));
        let value = format!("{word}-env");
        let o = canary
            .run(&["topics", "create", "canary-error"], &[(&var, &value)])
            .await;
        assert_eq!(o.status.code(), Some(2), "{key} refused");
    }

    // Database URLs that are wrong, unreachable or refused, with a password.
    for url in [
        format!("postgres://u:{word}@127.0.0.1:notaport/db"),
        format!("mysql://u:{word}@127.0.0.1/db"),
        format!("postgres://u:{word}@127.0.0.1:1/db"),
        format!("postgres://u:{word}@127.0.0.1/db?sslmode={word}"),
        format!("postgres://u:{word}@127.0.0.1/db?password={word}&sslmode=bogus"),
    ] {
        for args in [vec!["status"], vec!["migrate"]] {
            let o = canary.run(&args, &[("DATABASE_URL", url.as_str())]).await;
            assert!(!o.status.success(), "{args:?} with a bad URL failed");
        }
    }

    // A configuration file that does not parse, around a secret.
    let file = std::env::temp_dir().join(format!(
        "outbox-canary-bad-{}.toml",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::write(&file, format!("[kafka]\n\"sasl.password\" = {word}\n")).unwrap();
    let o = canary
        .run(&["status"], &[("OUTBOX_CONFIG", file.to_str().unwrap())])
        .await;
    assert_eq!(o.status.code(), Some(2));
    std::fs::write(&file, format!("[relay]\nbatch_size = \"{word}\"\n")).unwrap();
    let o = canary
        .run(&["status"], &[("OUTBOX_CONFIG", file.to_str().unwrap())])
        .await;
    assert_eq!(o.status.code(), Some(2));
    let _ = std::fs::remove_file(&file);
}
