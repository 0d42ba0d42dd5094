//! The console in a real browser: Chromium, headless, driven over WebDriver
//! (chromedriver, started by the test on a free port and stopped by its
//! PID), against a console served on a free port over a test database.
//! Screenshots of the main pages go to `console-screenshots/` in the target
//! directory on every run.
//!
//! Needs `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian's
//! `chromium` and `chromium-driver`, installed by `scripts/services.sh`);
//! the requeue test also needs the broker (`KAFKA_BROKERS`, default
//! 127.0.0.1:9092).

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use outbox_console::ConsoleConfig;
use outbox_runtime::{CancellationToken, Relay};
use serde_json::json;
use sqlx::PgPool;

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";
const WAIT: Duration = Duration::from_secs(20);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// chromedriver, killed by its PID when dropped.
struct Driver {
    child: Child,
    port: u16,
}

impl Driver {
    async fn start() -> Self {
        assert!(
            std::path::Path::new(CHROMEDRIVER).exists() && std::path::Path::new(CHROMIUM).exists(),
            "{CHROMEDRIVER} and {CHROMIUM} are needed (scripts/services.sh installs them)"
        );
        let port = free_port();
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let driver = Self { child, port };
        let deadline = Instant::now() + WAIT;
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "chromedriver did not listen");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        driver
    }

    async fn client(&self) -> Client {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,900"],
            }),
        );
        ClientBuilder::native()
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a browser session")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where screenshots go: `console-screenshots/` in the target directory.
fn screenshot_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let dir = target.join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(client: &Client, name: &str) {
    let png = client.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::write(screenshot_dir().join(format!("{name}.png")), png).unwrap();
}

async fn console(pool: &PgPool, config: ConsoleConfig) -> (SocketAddr, CancellationToken) {
    let stop = CancellationToken::new();
    let (addr, _task) = outbox_console::serve(
        "127.0.0.1:0".parse().unwrap(),
        pool.clone(),
        config,
        stop.clone(),
    )
    .await
    .unwrap();
    (addr, stop)
}

async fn text_of(client: &Client, css: &str) -> String {
    // An element found just before the page was replaced (after a click)
    // is stale: look again.
    let deadline = Instant::now() + WAIT;
    loop {
        let element = client
            .wait()
            .at_most(WAIT)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"));
        match element.text().await {
            Ok(text) => return text,
            Err(e) => assert!(Instant::now() < deadline, "{css}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The parked row and the pages are seen; a requeue without logging in is
/// refused, in the page and in the database; screenshots of every page.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn pages_show_the_rows_and_a_write_without_login_is_refused(pool: PgPool) {
    let id = parked_row(
        &pool,
        "orders",
        "order-17",
        json!({ "order_id": 17, "note": "<script>alert('x')</script>" }),
        json!({ "authorization": "Bearer sekrit", "traceparent": "00-4bf92f3577b34da6-01" }),
        "Broker: Unknown topic or partition",
    )
    .await;
    dead_letter(
        &pool,
        "billing",
        42,
        br#"{"order_id":17,"amount_cents":"not a number"}"#,
        json!({ "event_type": "OrderPlaced" }),
        "payload does not match OrderPlaced: invalid type: string \"not a number\", expected i64",
    )
    .await;
    let (addr, stop) = console(&pool, ConsoleConfig::new().write_token(TOKEN).unwrap()).await;
    let driver = Driver::start().await;
    let client = driver.client().await;
    let base = format!("http://{addr}");

    client.goto(&format!("{base}/")).await.unwrap();
    // The chart's script has run once it printed the time of its update.
    let deadline = Instant::now() + WAIT;
    while text_of(&client, "#updated").await == "–" {
        assert!(Instant::now() < deadline, "the chart never updated");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(text_of(&client, "#mode").await, "not logged in");
    screenshot(&client, "overview").await;

    client.goto(&format!("{base}/parked")).await.unwrap();
    let row = text_of(&client, &format!("tr[data-id=\"{id}\"]")).await;
    assert!(
        row.contains("order-17") && row.contains("Unknown topic"),
        "{row}"
    );
    screenshot(&client, "parked").await;

    client.goto(&format!("{base}/parked/{id}")).await.unwrap();
    assert_eq!(text_of(&client, "#state").await, "parked");
    let payload = text_of(&client, "#payload").await;
    assert!(
        payload.contains("<script>alert('x')</script>"),
        "shown as text: {payload}"
    );
    let source = client.source().await.unwrap();
    assert!(!source.contains("sekrit"));
    screenshot(&client, "detail").await;
    client
        .find(Locator::Css("#requeue"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let outcome = text_of(&client, "#outcome").await;
    assert!(outcome.starts_with("Refused"), "{outcome}");
    assert!(still_parked(&pool, id).await);
    assert_eq!(audit_count(&pool).await, 0);

    for (path, name) in [
        ("/dead-letters", "dead-letters"),
        ("/relays", "relays"),
        ("/consumers", "consumers"),
    ] {
        client.goto(&format!("{base}{path}")).await.unwrap();
        text_of(&client, "h1").await;
        screenshot(&client, name).await;
    }
    assert!(text_of(&client, "#groups").await.contains("billing"));
    client.close().await.unwrap();
    stop.cancel();
}

/// Log in, requeue a parked row through the UI (reason, confirmation: the
/// browser's forms carry the session's form token and pass the same-origin
/// check), see a real relay publish it, and log out.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn a_parked_row_requeued_in_the_browser_is_published(pool: PgPool) {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let topic = format!("console-{}", uuid::Uuid::new_v4().simple());
    outbox_runtime::kafka::create_topics(&brokers, &[], std::slice::from_ref(&topic), 1, 1)
        .await
        .expect("create the test's topic");
    let id = parked_row(
        &pool,
        &topic,
        "order-1",
        json!({ "order_id": 1 }),
        json!({}),
        "Broker: Unknown topic or partition",
    )
    .await;
    let relay = Relay::builder(pool.clone())
        .brokers(brokers.clone())
        .poll_interval(Duration::from_millis(100))
        .spawn()
        .unwrap();
    let (addr, stop) = console(&pool, ConsoleConfig::new().write_token(TOKEN).unwrap()).await;
    let driver = Driver::start().await;
    let client = driver.client().await;
    let base = format!("http://{addr}");

    client.goto(&format!("{base}/login")).await.unwrap();
    client
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#operator"))
        .await
        .unwrap()
        .send_keys("ann")
        .await
        .unwrap();
    client
        .find(Locator::Css("#token"))
        .await
        .unwrap()
        .send_keys(TOKEN)
        .await
        .unwrap();
    client
        .find(Locator::Css("#login"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while text_of(&client, "#mode").await != "writing as ann" {
        assert!(Instant::now() < deadline, "not logged in");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    client.goto(&format!("{base}/parked/{id}")).await.unwrap();
    assert_eq!(text_of(&client, "#state").await, "parked");
    client
        .find(Locator::Css("#requeue"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    client
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#reason"))
        .await
        .unwrap()
        .send_keys("the topic exists now")
        .await
        .unwrap();
    screenshot(&client, "confirm").await;
    client
        .find(Locator::Css("#confirm"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let outcome = text_of(&client, "#outcome").await;
    assert!(outcome.contains("Requeued 1 of 1"), "{outcome}");

    // The relay publishes it: the detail page says so.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        client.goto(&format!("{base}/parked/{id}")).await.unwrap();
        if text_of(&client, "#state").await == "published" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the requeued row was not published"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    screenshot(&client, "published").await;
    // The overview while the relay publishes a stream of events: the chart
    // draws once it has two intervals.
    let writer = tokio::spawn({
        let pool = pool.clone();
        let topic = topic.clone();
        async move {
            for round in 0..16 {
                sqlx::query(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type,
                                               payload, topic, partition_key)
                     SELECT gen_random_uuid(), 'Order', 'o' || g, 'OrderPlaced',
                            jsonb_build_object('order_id', g), $1, 'o' || g
                     FROM generate_series($2::int8, $2::int8 + 24) AS g",
                )
                .bind(&topic)
                .bind(round * 100)
                .execute(&pool)
                .await
                .unwrap();
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });
    client.goto(&format!("{base}/")).await.unwrap();
    client
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#chart path"))
        .await
        .expect("the chart draws its lines");
    writer.await.unwrap();
    // The page itself follows: every row published (the requeued one and
    // the 400 written), without reloading it.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let published = text_of(&client, "[data-total=\"published\"]").await;
        let unpublished = text_of(&client, "[data-total=\"unpublished\"]").await;
        if (published.as_str(), unpublished.as_str()) == ("401", "0") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the overview shows {published} published, {unpublished} unpublished"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    screenshot(&client, "overview-live").await;
    let log = outbox_console::audit_log(&pool, None, 10).await.unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(
        (
            log[0].operator.as_str(),
            log[0].action.as_str(),
            log[0].ids.as_slice()
        ),
        ("ann", "parked_requeue", &[id][..])
    );
    assert_eq!(
        log[0].client.as_deref(),
        Some("127.0.0.1"),
        "the peer's address"
    );
    // The header's logout form carries the form token too.
    client
        .find(Locator::Css("form.inline button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while text_of(&client, "#mode").await != "not logged in" {
        assert!(Instant::now() < deadline, "not logged out");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client.close().await.unwrap();
    stop.cancel();
    relay.shutdown().await.unwrap();
}
