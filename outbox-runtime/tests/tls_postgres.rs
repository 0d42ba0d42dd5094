//! PostgreSQL over TLS: the shared server with `sslmode=require`, and a
//! private server with a certificate from a CA made here — every
//! `sslmode`, `verify-full` with the right CA and host, a wrong CA or host
//! refused with a clear error, `allow` against a server that insists on
//! TLS, client certificates; and the relay's own connections (LISTEN,
//! lanes) as encrypted as its pool's.
//! The relays run in the relay mode the test command asks for
//! (`OUTBOX_TEST_RELAY_MODE=progress`: the progress mode).

mod common;

use std::time::Duration;

use common::pg::PrivatePostgres;
use common::tls::Pki;
use common::*;
use outbox_runtime::Relay;
use outbox_runtime::settings::DatabaseSettings;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, PgPool};

/// Whether the connection a pool hands out is encrypted.
async fn encrypted(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
}

/// A pool on `url` as the library builds it from settings.
async fn pool_of(url: &str) -> PgPool {
    let mut settings = DatabaseSettings::default();
    settings.url = Some(url.to_owned());
    settings.connect_timeout_ms = Some(10_000);
    settings.pool(4).await.expect("pool")
}

/// Every session named `app` is encrypted; returns how many there are.
async fn sessions_encrypted(admin: &PgPool, app: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE s.ssl)
         FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
         WHERE a.application_name = $1",
    )
    .bind(app)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// The relay on `pool` (lanes and LISTEN on) publishes a few events;
/// returns when they are published.
async fn relay_publishes(pool: &PgPool) {
    outbox_core::migrate(pool).await.expect("migrate over TLS");
    relay_mode(pool).await;
    let topic = unique_topic("tls-pg");
    create_topic(&brokers(), &topic).await;
    commit_messages(pool, &topic, 20, 4, 5).await;
    let relay = Relay::builder(pool.clone())
        .brokers(brokers())
        .poll_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    assert!(wait_until_published(pool, Duration::from_secs(30)).await);
    relay.shutdown().await.unwrap();
}

#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn the_shared_server_with_sslmode_require_and_every_relay_connection_encrypted(pool: PgPool) {
    let app = format!("outbox-tls-{}", uuid::Uuid::new_v4().simple());
    let options = (*pool.connect_options())
        .clone()
        .ssl_mode(PgSslMode::Require)
        .application_name(&app);
    let tls = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(options);
    assert!(
        encrypted(&tls)
            .await
            .expect("the shared server accepts TLS")
    );

    relay_mode(&pool).await;
    let topic = unique_topic("tls-pg");
    create_topic(&brokers(), &topic).await;
    commit_messages(&tls, &topic, 20, 4, 5).await;
    let relay = Relay::builder(tls.clone())
        .brokers(brokers())
        .poll_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    assert!(wait_until_published(&pool, Duration::from_secs(30)).await);
    // The pool's connections, LISTEN's and the lane connection: all TLS.
    let (sessions, ssl) = sessions_encrypted(&pool, &app).await;
    assert!(sessions >= 3, "pool, LISTEN and lane sessions: {sessions}");
    assert_eq!(ssl, sessions, "every session of the relay is encrypted");
    relay.shutdown().await.unwrap();
}

/// A server whose pg_hba.conf takes both plain and TLS connections.
const HBA_ANY: &str =
    "local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n";

#[tokio::test]
async fn every_sslmode_and_verify_full_with_a_custom_ca() {
    let pki = Pki::generate("postgres");
    let Some(server) = PrivatePostgres::start_tls(&pki, HBA_ANY) else {
        return;
    };
    let (ca, other) = (pki.path("ca.pem"), pki.path("other-ca.pem"));
    let url = |host: &str, query: &str| {
        format!(
            "postgres://postgres@{host}:{}/postgres?{query}",
            server.port
        )
    };
    for (query, tls) in [
        ("sslmode=disable".to_owned(), false),
        ("sslmode=allow".to_owned(), false),
        ("sslmode=prefer".to_owned(), true),
        ("sslmode=require".to_owned(), true),
        (format!("sslmode=verify-ca&sslrootcert={ca}"), true),
        (format!("sslmode=verify-full&sslrootcert={ca}"), true),
    ] {
        let pool = pool_of(&url("localhost", &query)).await;
        assert_eq!(encrypted(&pool).await.unwrap(), tls, "{query}");
    }

    // Refused: a CA that did not sign the server's certificate, or a host
    // name the certificate does not name (it names `localhost` only).
    for (host, query, why) in [
        (
            "localhost",
            format!("sslmode=verify-full&sslrootcert={other}"),
            "certificate verify failed",
        ),
        (
            "localhost",
            format!("sslmode=verify-ca&sslrootcert={other}"),
            "certificate verify failed",
        ),
        (
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca}"),
            "mismatch",
        ),
    ] {
        let pool = pool_of(&url(host, &query)).await;
        let error = encrypted(&pool).await.unwrap_err().to_string();
        assert!(
            error.contains("certificate verify failed") && error.contains(why),
            "{host} {query}: {error}"
        );
    }
    // verify-ca does not check the name: 127.0.0.1 is fine.
    let pool = pool_of(&url(
        "127.0.0.1",
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    ))
    .await;
    assert!(encrypted(&pool).await.unwrap());

    // The library end to end over verify-full: migrations, a Unit of
    // Work, the relay with LISTEN and lanes; every session encrypted.
    let app = format!("outbox-tls-{}", uuid::Uuid::new_v4().simple());
    let verified = pool_of(&url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}&application_name={app}"),
    ))
    .await;
    relay_publishes(&verified).await;
    let admin = pool_of(&url("localhost", "sslmode=disable")).await;
    let (sessions, ssl) = sessions_encrypted(&admin, &app).await;
    assert!(sessions >= 1);
    assert_eq!(ssl, sessions);
}

/// TLS only, and certificate authentication for `certuser`.
const HBA_TLS_ONLY: &str = "local all all trust\n\
    hostssl all certuser 127.0.0.1/32 cert\n\
    hostssl all all 127.0.0.1/32 trust\n\
    hostssl all all ::1/128 trust\n";

#[tokio::test]
async fn allow_against_a_server_that_insists_on_tls_and_client_certificates() {
    let pki = Pki::generate("certuser");
    let Some(server) = PrivatePostgres::start_tls(&pki, HBA_TLS_ONLY) else {
        return;
    };
    let base = |user: &str, query: &str| {
        format!(
            "postgres://{user}@localhost:{}/postgres?{query}",
            server.port
        )
    };
    let pool = pool_of(&base("postgres", "sslmode=disable")).await;
    let error = encrypted(&pool).await.unwrap_err().to_string();
    assert!(error.contains("no encryption"), "{error}");
    // libpq's `allow`: plain text refused, so TLS.
    let pool = pool_of(&base("postgres", "sslmode=allow")).await;
    assert!(encrypted(&pool).await.unwrap());

    sqlx::query("CREATE ROLE certuser LOGIN")
        .execute(&pool)
        .await
        .unwrap();
    let ca = pki.path("ca.pem");
    let (cert, key) = (pki.path("client.pem"), pki.path("client.key"));
    let with_cert = format!("sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}");
    let pool = pool_of(&base("certuser", &with_cert)).await;
    assert!(encrypted(&pool).await.unwrap());
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(user, "certuser");
    let without = format!("sslmode=verify-full&sslrootcert={ca}");
    let pool = pool_of(&base("certuser", &without)).await;
    let error = encrypted(&pool).await.unwrap_err().to_string();
    assert!(error.contains("certificate"), "{error}");

    // sqlx's own `allow` (without the library's settings) never tries TLS.
    let options: PgConnectOptions = base("postgres", "sslmode=allow").parse().unwrap();
    let error = options.connect().await.unwrap_err().to_string();
    assert!(error.contains("no encryption"), "{error}");
}
