//! Per-key order with several relay processes (lanes): three `outbox relay`
//! processes, killed and restarted while writers write, keep every key's
//! order and lose nothing. It runs in the progress mode too
//! (`OUTBOX_TEST_RELAY_MODE=progress`, in the test command; the mode is the
//! database's, enabled before the relay processes start).

#[path = "../../outbox-runtime/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use outbox_core::UnitOfWork;
use sqlx::PgPool;

fn relay_process(pool: &PgPool) -> tokio::process::Child {
    tokio::process::Command::new(outbox_bin())
        .args(["relay", "--batch-size", "1000"])
        .env("DATABASE_URL", database_url(pool))
        .env("KAFKA_BROKERS", brokers())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the outbox binary")
}

fn sigkill(child: &tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
}

/// 100k events over 1k keys from four concurrent writers (each key has one
/// writer, so its commit order is the writer's order), three relay processes
/// SIGKILLed and replaced while the writers write.
#[sqlx::test(migrator = "outbox_core::MIGRATOR")]
async fn three_relay_processes_killed_and_restarted_keep_per_key_order(pool: PgPool) {
    relay_mode(&pool).await;
    const EVENTS: usize = 100_000;
    const KEYS: usize = 1_000;
    const WRITERS: usize = 4;
    let topic = unique_topic("lanes-kill");
    create_topic(&brokers(), &topic).await;

    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (pool, topic) = (pool.clone(), topic.clone());
            tokio::spawn(async move {
                let mut ids = Vec::with_capacity(EVENTS / WRITERS);
                let mut seq = w;
                while seq < EVENTS {
                    let mut uow = UnitOfWork::begin(&pool).await.unwrap();
                    for _ in 0..50 {
                        if seq >= EVENTS {
                            break;
                        }
                        // Keys w, w+4, w+8, ... belong to writer w.
                        let key = format!("k{}", (seq / WRITERS) % (KEYS / WRITERS) * WRITERS + w);
                        ids.push(uow.record_message(message(&topic, &key, seq)));
                        seq += WRITERS;
                    }
                    uow.commit().await.unwrap();
                }
                ids
            })
        })
        .collect();

    let mut relays: Vec<tokio::process::Child> = (0..3).map(|_| relay_process(&pool)).collect();
    let mut kills = 0;
    let mut round = 0_usize;
    while writers.iter().any(|w| !w.is_finished()) || round < 4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let victim = round % relays.len();
        sigkill(&relays[victim]);
        relays[victim].wait().await.unwrap();
        kills += 1;
        relays[victim] = relay_process(&pool);
        round += 1;
    }
    let mut committed = Vec::with_capacity(EVENTS);
    for w in writers {
        committed.extend(w.await.unwrap());
    }
    assert_eq!(committed.len(), EVENTS);
    assert!(
        wait_until_published(&pool, Duration::from_secs(180)).await,
        "backlog drained"
    );
    for relay in &relays {
        let pid = relay.id().expect("running").to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
    }
    for relay in &mut relays {
        let status = tokio::time::timeout(Duration::from_secs(30), relay.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "graceful stop exits 0, got {status}");
    }

    let received = read_topic(&brokers(), &topic, EVENTS, Duration::from_secs(180)).await;
    let duplicates = verify(&committed, &received);
    let per_key: HashMap<&str, usize> = received.iter().fold(HashMap::new(), |mut m, r| {
        *m.entry(r.key.as_str()).or_default() += 1;
        m
    });
    assert_eq!(per_key.len(), KEYS);
    eprintln!(
        "3 relay processes, {kills} SIGKILLs, {EVENTS} events over {KEYS} keys: 0 lost, 0 out of order, {duplicates} duplicates"
    );
}
