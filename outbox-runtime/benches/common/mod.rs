//! Shared setup of the runtime's benchmark programs: the servers they talk
//! to and a database of their own, recreated at start and dropped at the end.

#![allow(dead_code)]

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

/// SQL for a time-ordered (version 7) UUID, like the event ids the framework
/// gives events (`Uuid::now_v7`): preloaded rows then cost what real rows
/// cost. Random (v4) ids would make every index insert on `event_id` land on
/// a random page.
pub const UUID_V7_SQL: &str = "encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) \
     placing substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3) \
     FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid";

/// `KAFKA_BROKERS`, default `127.0.0.1:9092`.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A benchmark's own database on the server `DATABASE_URL` names.
pub struct BenchDb {
    admin: PgConnection,
    name: String,
    /// A `DATABASE_URL` for child processes (the `outbox` binary).
    pub url: String,
    /// A pool on it, migrated.
    pub pool: PgPool,
}

impl BenchDb {
    /// Drops and recreates database `name`, applies the migrations.
    pub async fn create(
        name: &str,
        max_connections: u32,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        Self::open(name, max_connections, false).await
    }

    /// [`BenchDb::create`], or with `reuse` the database `name` as it is
    /// if it exists (created otherwise), with the migrations applied.
    pub async fn open(
        name: &str,
        max_connections: u32,
        reuse: bool,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let admin_opts: PgConnectOptions = url.parse()?;
        let mut admin = admin_opts.connect().await?;
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
                .bind(name)
                .fetch_one(&mut admin)
                .await?;
        if !(reuse && exists) {
            sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut admin)
                .await?;
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut admin)
                .await?;
        }
        let opts = admin_opts.database(name);
        let url = format!(
            "postgres://{}@{}:{}/{name}",
            opts.get_username(),
            opts.get_host(),
            opts.get_port()
        );
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(opts)
            .await?;
        outbox_core::migrate(&pool).await?;
        Ok(Self {
            admin,
            name: name.to_owned(),
            url,
            pool,
        })
    }

    /// Closes the pool and drops the database.
    pub async fn drop_database(mut self) -> Result<(), sqlx::Error> {
        self.pool.close().await;
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&mut self.admin)
        .await?;
        Ok(())
    }
}

/// Cheap progress probes (a count over the whole table every few
/// milliseconds would compete with the relay for the same two cores).
pub async fn any_published(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_event WHERE published_at IS NOT NULL)")
        .fetch_one(pool)
        .await
}

/// No row waits to be published (parked rows aside).
pub async fn drained(pool: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT NOT EXISTS (SELECT 1 FROM outbox_event WHERE published_at IS NULL AND parked_at IS NULL)",
    )
    .fetch_one(pool)
    .await
}

/// A producer for preloading a topic: idempotent, batching, with room for
/// a large backlog in its queue.
pub fn preload_producer(
    brokers: &str,
) -> rdkafka::error::KafkaResult<rdkafka::producer::FutureProducer> {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .create()
}

/// The identity headers the relay writes: `event_id`, `event_type`,
/// `event_version` 1.
pub fn identity_headers(event_id: &str, event_type: &str) -> rdkafka::message::OwnedHeaders {
    use rdkafka::message::Header;
    rdkafka::message::OwnedHeaders::new_with_capacity(3)
        .insert(Header {
            key: "event_id",
            value: Some(event_id.as_bytes()),
        })
        .insert(Header {
            key: "event_type",
            value: Some(event_type.as_bytes()),
        })
        .insert(Header {
            key: "event_version",
            value: Some("1".as_bytes()),
        })
}

/// Queues `record` on `producer`, waiting a millisecond at a time while the
/// producer's queue is full; returns its delivery.
pub async fn queue(
    producer: &rdkafka::producer::FutureProducer,
    mut record: rdkafka::producer::FutureRecord<'_, [u8], [u8]>,
) -> rdkafka::producer::DeliveryFuture {
    loop {
        match producer.send_result(record) {
            Ok(delivery) => return delivery,
            Err((_, back)) => {
                record = back;
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
    }
}

/// Waits for `deliveries`; the first failed one's error.
pub async fn delivered(
    deliveries: Vec<rdkafka::producer::DeliveryFuture>,
) -> Result<(), rdkafka::error::KafkaError> {
    for delivery in deliveries {
        if let Ok(Err((e, _))) = delivery.await {
            return Err(e);
        }
    }
    Ok(())
}

/// Deletes `topic` and creates it again, empty, with `partitions`.
pub async fn recreate_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Result<(), Box<dyn std::error::Error>> {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let options = AdminOptions::new().operation_timeout(Some(std::time::Duration::from_secs(10)));
    let _ = admin.delete_topics(&[topic], &options).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let created =
            outbox_runtime::kafka::create_topics(brokers, &[], &[topic.to_owned()], partitions, 1)
                .await?;
        if created.iter().all(|(_, new)| *new) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(format!("could not recreate the benchmark topic {topic}").into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// A session holding the xmin horizon of `pool`'s database, as a
/// `pg_dump` or a forgotten `REPEATABLE READ` session does: a transaction
/// whose snapshot is taken (a read of `outbox_event`) and kept until the
/// connection is rolled back or closed.
pub async fn hold_xmin(pool: &PgPool) -> PgConnection {
    let mut c = PgConnection::connect_with(&pool.connect_options())
        .await
        .unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut c)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM outbox_event")
        .execute(&mut c)
        .await
        .unwrap();
    c
}
