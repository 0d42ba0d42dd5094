//! Consumers as processes of their own, so that a scenario can SIGKILL
//! them: this test binary started again with only a scenario's child test
//! (an ignored test that calls [`run_consumer`]), its settings passed in
//! the environment. [`run_consumer`]'s dedup mode applies [`Effect`]
//! (table `effect`), its inbox mode [`InboxEffect`] (table `effect_inbox`);
//! [`run_consumer_with`] runs the handlers a scenario registers.

use std::time::Duration;

use outbox_core::{DomainEvent, InboxHandler};
use outbox_runtime::{Consumer, ConsumerBuilder, Mode};
use sqlx::postgres::PgPoolOptions;

use crate::common::init_tracing;
use crate::harness::{Effect, InboxEffect};

/// The consumers' session timeout: longer than the broker pauses of the
/// scenarios. When the test broker (tansu 0.6) is frozen longer than a
/// group's session timeout, it may keep an expelled member as the group's
/// leader forever: every member that rejoins is told to wait for that
/// leader's assignment and fails its SyncGroup with "unknown member", so
/// the group owns no partition again. Seen with our consumers and with a
/// plain rdkafka control group alike (each stalled at the same offsets).
pub const SESSION_MS: &str = "10000";

/// Above the session timeout: a consumer that the broker left without
/// partitions (it kept a killed member's) rejoins its group.
const STALL_TIMEOUT: Duration = Duration::from_secs(15);

const URL: &str = "RELIABILITY_CHILD_DATABASE_URL";
const BROKERS: &str = "RELIABILITY_CHILD_BROKERS";
const GROUP: &str = "RELIABILITY_CHILD_GROUP";
const MODE: &str = "RELIABILITY_CHILD_MODE";

/// Set (to anything) for a run, the dedup-mode consumer processes retry
/// from memory (`ConsumerBuilder::memory_retries`), and their handler
/// fails transiently: see [`crate::harness::flaky`].
pub const DEDUP_MEMORY: &str = "OUTBOX_TEST_DEDUP_MEMORY";

/// What a consumer process is to do.
pub struct Child<'a> {
    pub url: &'a str,
    pub brokers: &'a str,
    pub group: &'a str,
    pub mode: Mode,
}

/// Starts a consumer process running the ignored test `test` (its full
/// name), its output in `log`. Killed on drop.
pub fn consumer(test: &str, child: &Child<'_>, log: std::fs::File) -> tokio::process::Child {
    let err = log.try_clone().expect("log file");
    tokio::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--ignored", "--nocapture"])
        .env(URL, child.url)
        .env(BROKERS, child.brokers)
        .env(GROUP, child.group)
        .env(MODE, child.mode.to_string())
        .env(
            "RUST_LOG",
            std::env::var("RELIABILITY_CHILD_LOG")
                .unwrap_or_else(|_| "warn,outbox_runtime::inbox::poller=info".into()),
        )
        .stdout(log)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the consumer process")
}

/// The body of a consumer process: runs until killed. Returns at once when
/// not started by [`consumer`] (the test run as such).
pub async fn run_consumer<E: DomainEvent>()
where
    Effect<E>: InboxHandler<Event = E>,
    InboxEffect<E>: InboxHandler<Event = E>,
{
    run_consumer_with(|builder, mode| {
        let builder = builder.ignore_event_type(E::TOPIC, "WarmUp");
        match mode {
            Mode::Inbox => builder.handler(InboxEffect::<E>::new()),
            _ => builder.handler(Effect::<E>::new()),
        }
    })
    .await;
}

/// The body of a consumer process whose handlers `register` adds to the
/// builder (given the process's mode, already set): runs until killed.
/// Returns at once when not started by [`consumer`].
pub async fn run_consumer_with(register: impl FnOnce(ConsumerBuilder, Mode) -> ConsumerBuilder) {
    let Ok(url) = std::env::var(URL) else {
        return;
    };
    init_tracing();
    // A loaded database may refuse a new connection for a while (too many
    // clients while the whole suite runs): a restarted member waits for it
    // as a deployed one would be restarted, instead of dying at once.
    let started = std::time::Instant::now();
    let pool = loop {
        match PgPoolOptions::new()
            .max_connections(6)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&url)
            .await
        {
            Ok(pool) => break pool,
            Err(e) if started.elapsed() < Duration::from_secs(60) => {
                eprintln!("consumer: database not reachable yet: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("consumer pool: {e}"),
        }
    };
    let builder = Consumer::builder(pool)
        .group(std::env::var(GROUP).expect("group"))
        .brokers(std::env::var(BROKERS).expect("brokers"))
        .batch_size(200)
        .kafka_setting("session.timeout.ms", SESSION_MS)
        .kafka_setting("heartbeat.interval.ms", "1000")
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .stall_timeout(STALL_TIMEOUT);
    // librdkafka's debug contexts (e.g. `cgrp`), to see a group at work.
    let builder = match std::env::var("RELIABILITY_CHILD_DEBUG") {
        Ok(contexts) => builder.kafka_setting("debug", contexts),
        Err(_) => builder,
    };
    let (builder, mode) = match std::env::var(MODE).as_deref() {
        Ok("inbox") => (
            builder
                .mode(Mode::Inbox)
                .processor_poll_interval(Duration::from_millis(50)),
            Mode::Inbox,
        ),
        _ if std::env::var_os(DEDUP_MEMORY).is_some() => {
            crate::harness::FLAKY.store(true, std::sync::atomic::Ordering::Relaxed);
            (
                builder
                    .memory_retries(Duration::from_secs(1))
                    .max_attempts(4)
                    .retry_backoff(Duration::from_millis(200), Duration::from_millis(400)),
                Mode::Dedup,
            )
        }
        _ => (builder, Mode::Dedup),
    };
    let handle = register(builder, mode).spawn().expect("consumer");
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !handle.is_finished(),
            "the consumer stopped: {:?}",
            handle.health()
        );
    }
}
