//! Shared helpers of the runtime's integration tests: the broker address,
//! unique topics, committing messages through a Unit of Work, reading a
//! topic back, a TCP proxy that can cut or delay connections, a private
//! broker process, and the `outbox relay` process (for the tests of the
//! `outbox-cli` package, which include this module); a private PostgreSQL
//! server in [`pg`], certificates and a TLS-terminating proxy in [`tls`], a
//! SASL-authenticating one in [`sasl`].

#![allow(dead_code)]

pub mod pg;
pub mod roles;
pub mod sasl;
pub mod tls;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{OutboxMessage, UnitOfWork};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use uuid::Uuid;

pub const PARTITIONS: i32 = 4;

pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

pub fn unique_topic(prefix: &str) -> String {
    format!("{prefix}-{}", Uuid::new_v4().simple())
}

pub async fn create_topic(brokers: &str, topic: &str) {
    outbox_runtime::kafka::create_topics(brokers, &[], &[topic.to_owned()], PARTITIONS, 1)
        .await
        .expect("create topic");
}

/// Header of the warm-up records [`create_warm_topic`] writes; readers of
/// this module skip them.
pub const WARM_UP: &str = "test-warm-up";

/// Creates `topic` and writes one warm-up record to each partition, awaited
/// one by one. The test broker (tansu 0.6, memory storage) once lost the
/// first record batch of a fresh partition that two producers wrote at once
/// (offsets assigned and acknowledged, never readable); after a first
/// write the partition is stable. For tests that read the topic with
/// [`read_topic`] only: a consumer of the framework would see the records.
pub async fn create_warm_topic(brokers: &str, topic: &str) {
    create_topic(brokers, topic).await;
    warm_partitions(brokers, topic).await;
}

/// [`reset_topic`], then one warm-up record to each partition (see
/// [`create_warm_topic`]): for scenarios where several relays write the
/// recreated topic at once. A consumer of the framework reading it must
/// ignore the event type `WarmUp`.
pub async fn reset_warm_topic(brokers: &str, topic: &str) {
    reset_topic(brokers, topic).await;
    warm_partitions(brokers, topic).await;
}

async fn warm_partitions(brokers: &str, topic: &str) {
    for partition in 0..PARTITIONS {
        let warm_up =
            TestMessage::event(Uuid::now_v7(), "WarmUp", "warm-up", serde_json::json!({}))
                .header(WARM_UP, "1")
                .on_partition(partition);
        produce_unbatched(brokers, topic, &[warm_up]).await;
    }
}

pub fn message(topic: &str, key: &str, seq: usize) -> OutboxMessage {
    OutboxMessage {
        event_id: Uuid::now_v7(),
        aggregate_type: "Order".into(),
        aggregate_id: key.into(),
        event_type: "OrderPlaced".into(),
        event_version: 1,
        topic: topic.into(),
        partition_key: key.into(),
        payload: serde_json::json!({ "key": key, "seq": seq, "pad": "x".repeat(120) }).to_string(),
        headers: outbox_core::Headers::default(),
    }
}

/// Commits `n` messages over `keys` keys, `per_commit` per Unit of Work;
/// returns their event ids in commit order.
pub async fn commit_messages(
    pool: &PgPool,
    topic: &str,
    n: usize,
    keys: usize,
    per_commit: usize,
) -> Vec<Uuid> {
    let mut ids = Vec::with_capacity(n);
    let mut seq = 0;
    while seq < n {
        let mut uow = UnitOfWork::begin(pool).await.expect("begin");
        for _ in 0..per_commit.min(n - seq) {
            ids.push(uow.record_message(message(topic, &format!("k{}", seq % keys), seq)));
            seq += 1;
        }
        uow.commit().await.expect("commit");
    }
    ids
}

/// One message read back from Kafka.
#[derive(Debug, Clone)]
pub struct Received {
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub payload: serde_json::Value,
    pub headers: HashMap<String, String>,
    /// Every header in order, repeated names included.
    pub header_list: Vec<(String, String)>,
}

impl Received {
    pub fn event_id(&self) -> Uuid {
        self.headers["event_id"]
            .parse()
            .expect("event_id header is a UUID")
    }
    /// The event id, if the message has a valid one.
    pub fn try_event_id(&self) -> Option<Uuid> {
        self.headers.get("event_id")?.parse().ok()
    }
    pub fn seq(&self) -> u64 {
        self.payload["seq"].as_u64().expect("seq")
    }
}

/// Reads `topic` from the beginning until `expected` distinct event ids were
/// seen (or `timeout`); returns every message, duplicates included, in
/// partition/offset order. Runs off the async threads.
pub async fn read_topic(
    brokers: &str,
    topic: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<Received> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || read_topic_blocking(&brokers, &topic, expected, timeout))
        .await
        .expect("reader thread")
}

fn read_topic_blocking(
    brokers: &str,
    topic: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<Received> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("verify-{}", Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "50")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut distinct = std::collections::HashSet::new();
    while distinct.len() < expected && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                let r = received(&m);
                if r.headers.contains_key(WARM_UP) {
                    continue;
                }
                distinct.insert(r.event_id());
                out.push(r);
            }
            Some(Err(e)) => eprintln!("consumer error (retrying): {e}"),
            None => {}
        }
    }
    out.sort_by_key(|r| (r.partition, r.offset));
    out
}

/// Reads every message of `topic` present when called (up to each
/// partition's high watermark), duplicates included, in partition/offset
/// order. Runs off the async threads.
pub async fn read_all(brokers: &str, topic: &str, timeout: Duration) -> Vec<Received> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || read_all_blocking(&brokers, &topic, timeout))
        .await
        .expect("reader thread")
}

fn read_all_blocking(brokers: &str, topic: &str, timeout: Duration) -> Vec<Received> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("verify-{}", Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "50")
        .create()
        .expect("consumer");
    let deadline = Instant::now() + timeout;
    let mut high = HashMap::new();
    for p in 0..PARTITIONS {
        let (_, h) = loop {
            match consumer.fetch_watermarks(topic, p, Duration::from_secs(5)) {
                Ok(w) => break w,
                Err(e) => {
                    assert!(Instant::now() < deadline, "watermarks of {topic}/{p}: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        };
        high.insert(p, h);
    }
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let mut next: HashMap<i32, i64> = (0..PARTITIONS).map(|p| (p, 0)).collect();
    let mut out = Vec::new();
    // Up to the watermarks, then until the topic has been quiet for a
    // second (the test broker's watermark can lag its last message).
    let mut quiet_since = Instant::now();
    while next.iter().any(|(p, n)| *n < high[p]) || quiet_since.elapsed() < Duration::from_secs(1) {
        assert!(
            Instant::now() < deadline,
            "{topic} not read to its end in {timeout:?}: at {next:?}, end {high:?}"
        );
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                next.insert(m.partition(), m.offset() + 1);
                out.push(received(&m));
                quiet_since = Instant::now();
            }
            Some(Err(e)) => eprintln!("consumer error (retrying): {e}"),
            None => {}
        }
    }
    out.sort_by_key(|r| (r.partition, r.offset));
    out
}

fn received(m: &rdkafka::message::BorrowedMessage<'_>) -> Received {
    let mut headers = HashMap::new();
    let mut header_list = Vec::new();
    for (name, value) in raw_headers(m) {
        let name = String::from_utf8_lossy(name).into_owned();
        let value = value
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        headers.insert(name.clone(), value.clone());
        header_list.push((name, value));
    }
    Received {
        partition: m.partition(),
        offset: m.offset(),
        key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
        // Not JSON (a hostile message): null.
        payload: serde_json::from_slice(m.payload().unwrap_or_default())
            .unwrap_or(serde_json::Value::Null),
        headers,
        header_list,
    }
}

/// Checks every committed id arrived, nothing else did, and per key the
/// first deliveries follow commit order. Returns the duplicate count.
pub fn verify(committed: &[Uuid], received: &[Received]) -> usize {
    let position: HashMap<Uuid, usize> = committed
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, i))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut last_by_key: HashMap<&str, usize> = HashMap::new();
    let mut duplicates = 0;
    for r in received {
        let id = r.event_id();
        let pos = *position
            .get(&id)
            .unwrap_or_else(|| panic!("phantom event {id}"));
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        if let Some(prev) = last_by_key.insert(r.key.as_str(), pos) {
            assert!(
                prev < pos,
                "key {} out of order: {} after {}",
                r.key,
                pos,
                prev
            );
        }
    }
    let missing: Vec<_> = committed.iter().filter(|id| !seen.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} events lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    duplicates
}

pub async fn unpublished(pool: &PgPool) -> i64 {
    let published = outbox_runtime::relay::progress::Published::of(pool)
        .await
        .expect("the relay mode");
    sqlx::query_scalar(&format!(
        "{}SELECT count(*) FROM outbox_event WHERE NOT {}",
        published.with, published.condition
    ))
    .fetch_one(pool)
    .await
    .expect("count")
}

/// Whether the suites that run in both modes run in the progress mode
/// (`OUTBOX_TEST_RELAY_MODE=progress`).
pub fn progress_mode() -> bool {
    std::env::var("OUTBOX_TEST_RELAY_MODE").as_deref() == Ok("progress")
}

/// Records a position of every lane slot at the current snapshot, as a
/// relay records one in the progress mode: every row committed so far
/// (and not parked or held) is published.
pub async fn record_position(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO outbox_progress (slots, done)
         SELECT ARRAY(SELECT generate_series(0, 63))::int2[], pg_current_snapshot()",
    )
    .execute(pool)
    .await
    .expect("a position");
}

/// Puts the outbox of `pool` in the progress mode when
/// `OUTBOX_TEST_RELAY_MODE=progress` (the suites that run in both modes
/// call it before their relays start).
pub async fn relay_mode(pool: &PgPool) {
    if progress_mode() {
        outbox_runtime::relay::progress::enable(pool)
            .await
            .expect("the progress mode");
    }
}

/// Rows of one topic not yet published: not marked (the default mode), or
/// not marked nor passed by their slot's position (the progress mode).
pub async fn unpublished_of(pool: &PgPool, topic: &str) -> i64 {
    let published = outbox_runtime::relay::progress::Published::of(pool)
        .await
        .expect("the relay mode");
    sqlx::query_scalar(&format!(
        "{}SELECT count(*) FROM outbox_event WHERE topic = $1 AND NOT {}",
        published.with, published.condition
    ))
    .bind(topic)
    .fetch_one(pool)
    .await
    .expect("count")
}

/// Waits until every row of `topic` is published (marked, or passed by the
/// positions): a consumer can read a batch before the relay has recorded
/// the broker's acknowledgement.
pub async fn wait_until_topic_published(pool: &PgPool, topic: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if unpublished_of(pool, topic).await == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

pub async fn wait_until_published(pool: &PgPool, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if unpublished(pool).await == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A TCP proxy whose connections can be cut and restored, delayed, or
/// frozen (kept open with nothing passing, as to a frozen host or over a
/// half-open connection).
pub struct Proxy {
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
    frozen: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        Self::start_on(0, upstream).await
    }

    pub async fn start_on(port: u16, upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let cut = Arc::new(AtomicBool::new(false));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let frozen = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (c, d, f, k) = (cut.clone(), delay_ms.clone(), frozen.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if c.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let (delay, frozen) = (d.clone(), f.clone());
                let task = tokio::spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(upstream).await {
                        let (in_read, in_write) = inbound.into_split();
                        let (out_read, out_write) = outbound.into_split();
                        let _ = tokio::try_join!(
                            pump(in_read, out_write, delay.clone(), frozen.clone()),
                            pump(out_read, in_write, delay, frozen)
                        );
                    }
                });
                k.lock().unwrap().push(task);
            }
        });
        Self {
            addr,
            cut,
            delay_ms,
            frozen,
            conns,
            accept,
        }
    }

    /// Stops passing data, both ways, on every connection (new ones too)
    /// without closing any: the peers see a silent, open connection.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    /// Lets data pass again after [`Proxy::freeze`].
    pub fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for task in self.conns.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// Holds every chunk of data, both ways, for `delay` before passing it on
    /// (zero: no delay).
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

/// Copies one direction of a proxied connection, chunk by chunk, each held
/// for the current delay and while the proxy is frozen; closes the write
/// side at end of stream.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_ms: Arc<AtomicU64>,
    frozen: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        while frozen.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let n = from.read(&mut buf).await?;
        while frozen.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if n == 0 {
            to.shutdown().await?;
            return Ok(());
        }
        let delay = delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        to.write_all(&buf[..n]).await?;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// A listener on a port of its own, and the port: for a server whose port
/// must be known before something else starts (a port from [`free_port`]
/// is free only until another process's connection takes it).
pub async fn held_port() -> (tokio::net::TcpListener, u16) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a port");
    let port = listener.local_addr().expect("local address").port();
    (listener, port)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Logs of the code under test, shown for failing tests (`RUST_LOG` filters).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("outbox_runtime=info")),
        )
        .with_test_writer()
        .try_init();
}

/// A broker process of the test's own (tansu, in-memory), listening on
/// `port` and advertising `advertised` (e.g. a proxy in front of it).
pub struct PrivateBroker {
    child: std::process::Child,
    pub port: u16,
}

impl PrivateBroker {
    pub fn start(port: u16, advertised: u16) -> Self {
        Self::start_advertising(port, &format!("tcp://127.0.0.1:{advertised}"))
    }

    /// A broker on `port` that tells clients to connect to `advertised`
    /// (`tcp://host:port`).
    pub fn start_advertising(port: u16, advertised: &str) -> Self {
        let bin = std::env::var("TANSU_BIN").unwrap_or_else(|_| "tansu".into());
        let child = std::process::Command::new(bin)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://127.0.0.1:{port}"),
                "--advertised-listener-url",
                advertised,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start tansu (install it with scripts/services.sh)");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "private broker did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, port }
    }

    /// The broker's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs the broker and reaps it. With in-memory storage its topics
    /// and the groups' offsets are gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Freezes the broker (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        signal(self.pid(), "-STOP");
    }

    /// Resumes a paused broker (SIGCONT).
    pub fn resume(&self) {
        signal(self.pid(), "-CONT");
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        signal(self.pid(), "-CONT");
        self.kill();
    }
}

/// Sends `sig` (e.g. `-KILL`, `-STOP`) to process `pid`; a process that
/// has already ended is not an error.
pub fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run kill");
}

/// The `outbox` binary: built for the tests and benchmarks of the
/// `outbox-cli` package, which include this module.
pub fn outbox_bin() -> &'static str {
    match option_env!("CARGO_BIN_EXE_outbox") {
        Some(bin) => bin,
        None => panic!("the `outbox` binary is built only for the outbox-cli package's tests"),
    }
}

/// Starts `outbox relay` (the CLI binary built with these tests) against
/// `database_url` and `brokers`, with extra arguments; killed on drop.
pub fn relay_process(database_url: &str, brokers: &str, extra: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(outbox_bin())
        .arg("relay")
        .args(extra)
        .env("DATABASE_URL", database_url)
        .env("KAFKA_BROKERS", brokers)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the outbox binary")
}

// ---- Consumer-side helpers -------------------------------------------------

/// A message to produce: key, payload bytes and headers, all optional, so
/// that malformed messages can be built too.
#[derive(Debug, Clone, Default)]
pub struct TestMessage {
    pub key: Option<String>,
    pub payload: Option<Vec<u8>>,
    pub headers: Vec<(String, String)>,
    /// Headers added after `headers`, as bytes (names need not be UTF-8).
    pub raw_headers: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    /// An explicit partition (else the key's).
    pub partition: Option<i32>,
}

impl TestMessage {
    /// A message as the relay writes it: key = partition key, JSON payload,
    /// the identity headers and a correlation id.
    pub fn event(event_id: Uuid, event_type: &str, key: &str, payload: serde_json::Value) -> Self {
        Self {
            key: Some(key.to_owned()),
            payload: Some(payload.to_string().into_bytes()),
            headers: vec![
                ("event_id".into(), event_id.to_string()),
                ("event_type".into(), event_type.into()),
                ("event_version".into(), "1".into()),
                ("aggregate_type".into(), "Order".into()),
                ("aggregate_id".into(), key.into()),
                ("content-type".into(), "application/json".into()),
                ("correlation_id".into(), Uuid::now_v7().to_string()),
            ],
            raw_headers: Vec::new(),
            partition: None,
        }
    }

    /// Sends the message to `partition` instead of its key's.
    pub fn on_partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// Replaces (or adds) a header.
    pub fn header(mut self, key: &str, value: &str) -> Self {
        self.headers.retain(|(k, _)| k != key);
        self.headers.push((key.into(), value.into()));
        self
    }

    /// Removes a header.
    pub fn without_header(mut self, key: &str) -> Self {
        self.headers.retain(|(k, _)| k != key);
        self
    }

    /// Adds a header given as bytes (its name need not be UTF-8).
    pub fn raw_header(mut self, name: &[u8], value: Option<&[u8]>) -> Self {
        self.raw_headers
            .push((name.to_vec(), value.map(<[u8]>::to_vec)));
        self
    }

    /// Replaces the payload.
    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = Some(payload.into());
        self
    }
}

/// Produces `messages` to `topic` in order (idempotent producer: per-key
/// order kept) and waits for every delivery.
pub async fn produce(brokers: &str, topic: &str, messages: &[TestMessage]) {
    produce_batched(brokers, topic, messages, 10_000).await
}

/// Like [`produce`], one message per record batch. The test broker (tansu
/// 0.6, memory storage) answers a fetch that starts inside a record batch
/// wrongly (it skips to later offsets and repeats the last batch); a
/// consumer that resumes from a committed offset needs batch boundaries
/// everywhere. Real Kafka has no such problem.
pub async fn produce_unbatched(brokers: &str, topic: &str, messages: &[TestMessage]) {
    produce_batched(brokers, topic, messages, 1).await
}

async fn produce_batched(brokers: &str, topic: &str, messages: &[TestMessage], per_batch: usize) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", per_batch.to_string())
        .set("message.max.bytes", "33554432")
        .create()
        .expect("producer");
    let mut pending = Vec::with_capacity(messages.len());
    for m in messages {
        let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
        for (k, v) in &m.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        for (name, value) in &m.raw_headers {
            add_raw_header(&headers, name, value.as_deref());
        }
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(key) = &m.key {
            record = record.key(key.as_str());
        }
        if let Some(payload) = &m.payload {
            record = record.payload(payload.as_slice());
        }
        if let Some(partition) = m.partition {
            record = record.partition(partition);
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    pending.push(delivery);
                    break;
                }
                Err((_, back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    }
    for d in pending {
        d.await.expect("delivery").expect("delivered");
    }
}

/// A received message's headers as bytes (rdkafka's accessor panics on a
/// name that is not UTF-8, which hostile messages carry).
#[allow(unsafe_code)]
fn raw_headers<'a>(
    m: &'a rdkafka::message::BorrowedMessage<'a>,
) -> Vec<(&'a [u8], Option<&'a [u8]>)> {
    use rdkafka::bindings as rd;
    let mut list: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `m.ptr()` is the live message; the header list it returns is
    // owned by the message and lives as long as `m`.
    let err = unsafe { rd::rd_kafka_message_headers(m.ptr(), &mut list) };
    if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || list.is_null() {
        return Vec::new();
    }
    // SAFETY: `list` is valid (above).
    let count = unsafe { rd::rd_kafka_header_cnt(list) };
    (0..count)
        .map_while(|idx| {
            let mut name: *const std::ffi::c_char = std::ptr::null();
            let mut value: *const std::ffi::c_void = std::ptr::null();
            let mut size = 0;
            // SAFETY: `idx < count`; the out-pointers are valid locals; the
            // name is NUL-terminated and the value `size` bytes, both inside
            // the list, which lives as long as `m`.
            unsafe {
                let err = rd::rd_kafka_header_get_all(list, idx, &mut name, &mut value, &mut size);
                (err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && !name.is_null())
                    .then(|| {
                        let value = (!value.is_null())
                            .then(|| std::slice::from_raw_parts(value.cast::<u8>(), size));
                        (std::ffi::CStr::from_ptr(name).to_bytes(), value)
                    })
            }
        })
        .collect()
}

/// Adds a header whose name is raw bytes (rdkafka's API takes `&str` names
/// only): what a hostile producer can send.
#[allow(unsafe_code)]
fn add_raw_header(headers: &rdkafka::message::OwnedHeaders, name: &[u8], value: Option<&[u8]>) {
    use rdkafka::bindings as rd;
    let list = headers.as_borrowed() as *const rdkafka::message::BorrowedHeaders
        as *mut rd::rd_kafka_headers_t;
    let (value_ptr, value_len) = match value {
        Some(v) => (v.as_ptr().cast::<std::ffi::c_void>(), v.len() as isize),
        None => (std::ptr::null(), 0),
    };
    // SAFETY: `list` is the header list `headers` owns (the pointer
    // `as_borrowed` reinterprets), writable, and not shared; librdkafka
    // copies the name and value.
    let err = unsafe {
        rd::rd_kafka_header_add(
            list,
            name.as_ptr().cast(),
            name.len() as isize,
            value_ptr,
            value_len,
        )
    };
    assert_eq!(err, rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
}

/// Deletes `topic` (if it exists) and creates it again, empty: tests whose
/// handlers are bound to a fixed topic (`DomainEvent::TOPIC` is a constant)
/// start from a clean topic. Such a test must not run twice at once.
pub async fn reset_topic(brokers: &str, topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let _ = admin.delete_topics(&[topic], &options).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match outbox_runtime::kafka::create_topics(brokers, &[], &[topic.to_owned()], PARTITIONS, 1)
            .await
        {
            Ok(created) if created.iter().all(|(_, new)| *new) => break,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "could not recreate {topic}: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Polls `check` every 25 ms until it holds or `timeout` passes; returns
/// whether it held.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The `DATABASE_URL` of a test's pool (for the `outbox` binary).
pub fn database_url(pool: &PgPool) -> String {
    let o = pool.connect_options();
    format!(
        "postgres://{}@{}:{}/{}",
        o.get_username(),
        o.get_host(),
        o.get_port(),
        o.get_database().expect("test database name")
    )
}

/// The text of one scrape of the metrics endpoint at `addr`, headers
/// included.
#[allow(dead_code)]
pub async fn scrape(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}

/// The `effect` table handlers of the consumer tests write: one row per
/// application of an event (its id, key and number).
#[allow(dead_code)]
pub async fn effect_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text, seq bigint)",
    )
    .execute(pool)
    .await
    .expect("effect table");
}

/// Rows of `effect` per event id, for `ids`, in their order.
#[allow(dead_code)]
pub async fn effects_of(pool: &PgPool, ids: &[uuid::Uuid]) -> Vec<i64> {
    let rows: Vec<(uuid::Uuid, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM effect GROUP BY event_id")
            .fetch_all(pool)
            .await
            .expect("effects");
    let map: HashMap<uuid::Uuid, i64> = rows.into_iter().collect();
    ids.iter()
        .map(|id| map.get(id).copied().unwrap_or(0))
        .collect()
}

/// The offset `group` has committed on each of `topic`'s first
/// `partitions` partitions (-1: none), read by a client that does not join
/// the group.
#[allow(dead_code)]
pub async fn committed_offsets(group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("client");
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let offsets = client
            .committed_offsets(tpl, Duration::from_secs(10))
            .expect("committed offsets");
        offsets
            .elements()
            .iter()
            .map(|e| e.offset().to_raw().filter(|o| *o >= 0).unwrap_or(-1))
            .collect()
    })
    .await
    .expect("committed offsets")
}

/// Defines an event type bound to one test's topic, as derived events are:
/// `{ key, seq }`, event type `OrderPlaced` of aggregate `Order`, the key as
/// aggregate id.
#[allow(unused_macros)]
macro_rules! keyed_event {
    ($(#[$meta:meta])* $vis:vis $name:ident, $topic:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, ::serde::Serialize, ::serde::Deserialize)]
        $vis struct $name {
            /// The partition key.
            pub key: String,
            /// The event's number within its key (or the run).
            pub seq: u64,
        }

        impl ::outbox_core::DomainEvent for $name {
            const TOPIC: &'static str = $topic;
            const AGGREGATE_TYPE: &'static str = "Order";
            const EVENT_TYPES: &'static [&'static str] = &["OrderPlaced"];
            fn event_type(&self) -> &'static str {
                "OrderPlaced"
            }
            fn event_version(&self) -> u32 {
                1
            }
            fn aggregate_id(&self) -> String {
                self.key.clone()
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use keyed_event;

/// A handler that records each handled event's id in the test's `effect`
/// table (`CREATE TABLE effect (event_id uuid NOT NULL)`), in the
/// consumer's transaction.
pub struct RecordEffect<E>(std::marker::PhantomData<fn() -> E>);

impl<E> RecordEffect<E> {
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<E: outbox_core::DomainEvent> outbox_core::InboxHandler for RecordEffect<E> {
    type Event = E;
    const NAME: &'static str = "apply";

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut outbox_core::HandlerContext<'c>,
        _event: E,
    ) -> outbox_core::HandlerFuture<'a>
    where
        'c: 'a,
    {
        Box::pin(async move {
            sqlx::query("INSERT INTO effect (event_id) VALUES ($1)")
                .bind(ctx.incoming().event_id)
                .execute(&mut **ctx)
                .await?;
            Ok(())
        })
    }
}
