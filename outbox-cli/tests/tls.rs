//! The `outbox` command over TLS: PostgreSQL with `sslmode=verify-full` and
//! a CA made at test time (a wrong CA or host name is refused with a hint),
//! and Kafka through a TLS endpoint, its settings from the environment and
//! a configuration file: topics, the relay, replay; a SCRAM login with the
//! password from the environment, and a flag's password winning over it.
//! The relays run in the relay mode the test command asks for
//! (`OUTBOX_TEST_RELAY_MODE=progress`: the progress mode).

#[path = "../../outbox-runtime/tests/common/mod.rs"]
mod common;

use std::process::Output;
use std::time::Duration;

use common::pg::PrivatePostgres;
use common::sasl::SaslBroker;
use common::tls::{Pki, TlsBroker};
use common::*;
use sqlx::PgPool;

async fn outbox(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(outbox_bin());
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .env("RUST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("outbox finished in time")
        .expect("run outbox")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test]
async fn postgres_verify_full_with_a_custom_ca() {
    let pki = Pki::generate("postgres");
    let hba = "local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n";
    let Some(server) = PrivatePostgres::start_tls(&pki, hba) else {
        return;
    };
    let url = |host: &str, ca: &str| {
        format!(
            "postgres://postgres@{host}:{}/postgres?sslmode=verify-full&sslrootcert={}",
            server.port,
            pki.path(ca)
        )
    };
    let good = url("localhost", "ca.pem");
    let o = outbox(&[("DATABASE_URL", &good)], &["migrate"]).await;
    assert!(o.status.success(), "{}", text(&o));
    let o = outbox(&[("DATABASE_URL", &good)], &["status", "--json"]).await;
    assert!(o.status.success(), "{}", text(&o));

    for bad in [url("localhost", "other-ca.pem"), url("127.0.0.1", "ca.pem")] {
        let o = outbox(&[("DATABASE_URL", &bad)], &["status"]).await;
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let err = text(&o);
        assert!(err.contains("certificate verify failed"), "{err}");
        assert!(
            err.contains("hint: the server's TLS certificate was refused"),
            "{err}"
        );
    }
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn kafka_over_tls_from_the_environment_and_a_file(pool: PgPool) {
    relay_mode(&pool).await;
    let broker = TlsBroker::start().await;
    let url = database_url(&pool);
    let topic = unique_topic("tls-cli");
    let bootstrap = format!("localhost:{}", broker.proxy.port);
    let ca = broker.pki.path("ca.pem");
    // The environment: topics create.
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("KAFKA_BROKERS", bootstrap.as_str()),
        ("OUTBOX_KAFKA_SECURITY_PROTOCOL", "SSL"),
        ("OUTBOX_KAFKA_SSL_CA_LOCATION", ca.as_str()),
        ("OUTBOX_KAFKA_BROKER_ADDRESS_FAMILY", "v4"),
    ];
    let o = outbox(&env, &["topics", "create", &topic]).await;
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("{topic}: created")),
        "{}",
        text(&o)
    );

    // A configuration file: the relay and replay.
    let file =
        std::env::temp_dir().join(format!("outbox-tls-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(
        &file,
        format!(
            "[kafka]\nbrokers = \"{bootstrap}\"\n\"security.protocol\" = \"SSL\"\n\
             \"ssl.ca.location\" = \"{ca}\"\n\"broker.address.family\" = \"v4\"\n"
        ),
    )
    .unwrap();
    let file_env = [
        ("DATABASE_URL", url.as_str()),
        ("OUTBOX_CONFIG", file.to_str().unwrap()),
    ];
    commit_messages(&pool, &topic, 30, 3, 10).await;
    let mut relay = tokio::process::Command::new(outbox_bin());
    relay
        .arg("relay")
        .env_remove("KAFKA_BROKERS")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    for (k, v) in file_env {
        relay.env(k, v);
    }
    let relay = relay.spawn().unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    signal(relay.id().unwrap(), "-TERM");
    let status = tokio::time::timeout(Duration::from_secs(30), relay.wait_with_output())
        .await
        .unwrap()
        .unwrap()
        .status;
    assert!(status.success(), "{status}");

    let o = outbox(&file_env, &["replay", "--topic", &topic, "--json"]).await;
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["replayed"], 30);
    let _ = std::fs::remove_file(&file);

    // The wrong CA: topic creation fails and says why.
    let other = broker.pki.path("other-ca.pem");
    let mut wrong = env.to_vec();
    wrong[3] = ("OUTBOX_KAFKA_SSL_CA_LOCATION", other.as_str());
    wrong.push(("OUTBOX_KAFKA_SOCKET_TIMEOUT_MS", "2000"));
    let o = outbox(&wrong, &["topics", "create", "never"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("certificate verify failed"),
        "{}",
        text(&o)
    );
}

#[tokio::test]
async fn kafka_scram_password_from_the_environment() {
    let broker = SaslBroker::start().await;
    let settings = broker.settings("SCRAM-SHA-512", "unused");
    let env: Vec<(String, String)> = settings
        .properties
        .iter()
        .filter(|(k, _)| *k != "sasl.password")
        .map(|(k, v)| {
            (
                format!("OUTBOX_KAFKA_{}", k.to_uppercase().replace('.', "_")),
                v.clone(),
            )
        })
        .chain([
            ("KAFKA_BROKERS".to_owned(), settings.brokers().to_owned()),
            (
                "OUTBOX_KAFKA_SOCKET_TIMEOUT_MS".to_owned(),
                "2000".to_owned(),
            ),
        ])
        .collect();
    let with = |password: &str| -> Vec<(String, String)> {
        let mut env = env.clone();
        env.push(("OUTBOX_KAFKA_SASL_PASSWORD".into(), password.into()));
        env
    };
    let run = |env: Vec<(String, String)>, args: Vec<&'static str>| async move {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        outbox(&env, &args).await
    };
    let o = run(with("s3cret-pw"), vec!["topics", "create", "scram-env"]).await;
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("scram-env: created"), "{}", text(&o));
    let o = run(with("wrong"), vec!["topics", "create", "scram-wrong"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("invalid credentials"), "{}", text(&o));
    // A -X flag beats the environment.
    let o = run(
        with("wrong"),
        vec![
            "topics",
            "create",
            "scram-flag",
            "-X",
            "sasl.password=s3cret-pw",
        ],
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
}
