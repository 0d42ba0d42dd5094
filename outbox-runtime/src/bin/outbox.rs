//! The `outbox` command: migrations, the relay, status, topics, parked rows,
//! the NOTIFY switch and the consumers' dead letters. Settings come from flags or the environment
//! (`DATABASE_URL`, `KAFKA_BROKERS`); `-X key=value` passes librdkafka
//! settings through (TLS, SASL). Credentials are never logged.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use outbox_runtime::{CancellationToken, Error, Relay, kafka, ops};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[derive(Parser)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox: migrations, relay, operations"
)]
struct Cli {
    /// PostgreSQL URL of the service's database.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox tables (idempotent).
    Migrate,
    /// Publish the outbox to Kafka until SIGINT/SIGTERM.
    Relay(RelayArgs),
    /// Backlog, oldest unpublished age and parked rows, per topic.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Kafka topics.
    #[command(subcommand)]
    Topics(TopicsCommand),
    /// Rows parked after repeated delivery failures.
    #[command(subcommand)]
    Parked(ParkedCommand),
    /// Messages consumers could not apply (list, retry, drop).
    #[command(subcommand)]
    DeadLetters(DeadLettersCommand),
    /// The commit-time NOTIFY that wakes idle relays: `on`, `off` or `status`.
    Notify {
        /// on | off | status
        #[arg(value_parser = ["on", "off", "status"])]
        state: String,
    },
}

#[derive(Args, Clone)]
struct KafkaArgs {
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = kafka::DEFAULT_BROKERS)]
    brokers: String,
    /// librdkafka setting passed through, e.g. -X security.protocol=SASL_SSL (repeatable).
    #[arg(short = 'X', value_name = "KEY=VALUE")]
    settings: Vec<String>,
}

#[derive(Args)]
struct RelayArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Rows per batch.
    #[arg(long, default_value_t = 2000)]
    batch_size: usize,
    /// Poll interval in milliseconds when no NOTIFY arrives.
    #[arg(long, default_value_t = 500)]
    poll_interval_ms: u64,
    /// Do not LISTEN for NOTIFY; poll only.
    #[arg(long)]
    no_listen: bool,
    /// Message-level failures before a row is parked.
    #[arg(long, default_value_t = 5)]
    max_attempts: u32,
    /// librdkafka message.timeout.ms.
    #[arg(long, default_value_t = 30_000)]
    delivery_timeout_ms: u64,
    /// Lanes the partition keys are spread over, shared out among the relays
    /// of the database (all must use the same count); 0 turns lanes off.
    #[arg(long, env = "OUTBOX_LANES", default_value_t = 16, value_parser = clap::value_parser!(u16).range(0..=1024))]
    lanes: u16,
}

#[derive(Subcommand)]
enum TopicsCommand {
    /// Create topics (existing ones are left alone).
    Create {
        /// Topics to create.
        topics: Vec<String>,
        /// Also every topic named by rows in the outbox.
        #[arg(long)]
        from_outbox: bool,
        #[arg(long, default_value_t = 4)]
        partitions: i32,
        #[arg(long, default_value_t = 1)]
        replication: i32,
        #[command(flatten)]
        kafka: KafkaArgs,
    },
}

#[derive(Subcommand)]
enum ParkedCommand {
    /// List parked rows.
    List {
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Put parked rows back in the queue.
    Requeue {
        /// Every parked row.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Outbox row ids.
        #[arg(long = "id")]
        ids: Vec<i64>,
    },
}

#[derive(Subcommand)]
enum DeadLettersCommand {
    /// List dead letters, oldest first (default: status dead and retry).
    List {
        /// Only this consumer group.
        #[arg(long)]
        consumer: Option<String>,
        /// dead | retry | resolved | all (repeatable).
        #[arg(long, value_parser = ["dead", "retry", "resolved", "all"])]
        status: Vec<String>,
        /// Only this reason (not_json, no_event_id, unknown_event_type,
        /// payload_mismatch, oversized, handler_failed).
        #[arg(long)]
        reason: Option<String>,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON (with headers and payload) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Mark dead letters for retry: the consumer of their group runs them
    /// again within its re-drive interval.
    Retry {
        /// Every dead letter (of --consumer, if given).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Dead-letter ids.
        #[arg(long = "id")]
        ids: Vec<i64>,
        /// Only this consumer group.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Delete dead letters.
    Drop {
        /// Every dead letter (of --consumer, if given).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Dead-letter ids.
        #[arg(long = "id")]
        ids: Vec<i64>,
        /// Only this consumer group.
        #[arg(long)]
        consumer: Option<String>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            if matches!(error, Error::Config(_)) {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

async fn connect(url: Option<&str>, max: u32) -> Result<PgPool, Error> {
    let url = url.ok_or_else(|| {
        Error::Config("no database: pass --database-url or set DATABASE_URL".into())
    })?;
    let invalid = || Error::Config("DATABASE_URL is not a valid PostgreSQL URL".into());
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(invalid());
    }
    let options: PgConnectOptions = url.parse().map_err(|_| invalid())?;
    tracing::debug!(host = options.get_host(), database = ?options.get_database(), "connecting");
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options))
}

fn settings(kafka: &KafkaArgs) -> Result<Vec<(String, String)>, Error> {
    kafka
        .settings
        .iter()
        .map(|s| kafka::parse_setting(s))
        .collect()
}

async fn run(cli: Cli) -> Result<(), Error> {
    let url = cli.database_url.as_deref();
    match cli.command {
        Command::Migrate => {
            let pool = connect(url, 2).await?;
            outbox_core::migrate(&pool).await?;
            println!("migrations applied");
        }
        Command::Relay(args) => {
            let pool = connect(url, 4).await?;
            let relay = Relay::builder(pool)
                .brokers(args.kafka.brokers.clone())
                .batch_size(args.batch_size)
                .poll_interval(Duration::from_millis(args.poll_interval_ms))
                .listen(!args.no_listen)
                .max_attempts(args.max_attempts)
                .delivery_timeout(Duration::from_millis(args.delivery_timeout_ms))
                .lanes(args.lanes);
            let relay = settings(&args.kafka)?
                .into_iter()
                .fold(relay, |r, (k, v)| r.kafka_setting(k, v))
                .build()?;
            let token = CancellationToken::new();
            tokio::spawn(stop_on_signal(token.clone()));
            relay.run(token).await?;
        }
        Command::Status { json } => {
            let pool = connect(url, 2).await?;
            let status = ops::status(&pool).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&status).unwrap_or_default()
                );
            } else {
                print_status(&status);
            }
        }
        Command::Topics(TopicsCommand::Create {
            mut topics,
            from_outbox,
            partitions,
            replication,
            kafka: kafka_args,
        }) => {
            if from_outbox {
                let pool = connect(url, 2).await?;
                topics.extend(ops::outbox_topics(&pool).await?);
            }
            topics.sort();
            topics.dedup();
            if topics.is_empty() {
                return Err(Error::Config(
                    "no topics: name them or pass --from-outbox".into(),
                ));
            }
            let created = kafka::create_topics(
                &kafka_args.brokers,
                &settings(&kafka_args)?,
                &topics,
                partitions,
                replication,
            )
            .await?;
            for (topic, new) in created {
                println!("{topic}: {}", if new { "created" } else { "exists" });
            }
        }
        Command::Parked(ParkedCommand::List { limit, json }) => {
            let pool = connect(url, 2).await?;
            let rows = ops::parked(&pool, limit).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&rows).unwrap_or_default()
                );
            } else {
                println!(
                    "{:>10}  {:<36}  {:<20}  {:<20}  {:>8}  last error",
                    "id", "event id", "topic", "event type", "attempts"
                );
                for r in rows {
                    println!(
                        "{:>10}  {:<36}  {:<20}  {:<20}  {:>8}  {}",
                        r.id,
                        r.event_id,
                        r.topic,
                        r.event_type,
                        r.attempts,
                        r.last_error.unwrap_or_default()
                    );
                }
            }
        }
        Command::Parked(ParkedCommand::Requeue { all, ids }) => {
            if !all && ids.is_empty() {
                return Err(Error::Config("pass --all or one or more --id N".into()));
            }
            let pool = connect(url, 2).await?;
            let n = ops::requeue_parked(&pool, (!all).then_some(ids.as_slice())).await?;
            println!("requeued {n} parked rows");
        }
        Command::DeadLetters(command) => dead_letters(url, command).await?,
        Command::Notify { state } => {
            let pool = connect(url, 2).await?;
            match state.as_str() {
                "on" => ops::set_notify(&pool, true).await?,
                "off" => ops::set_notify(&pool, false).await?,
                _ => {}
            }
            let on = ops::notify_enabled(&pool).await?;
            println!("notify: {}", if on { "on" } else { "off" });
        }
    }
    Ok(())
}

async fn dead_letters(url: Option<&str>, command: DeadLettersCommand) -> Result<(), Error> {
    use outbox_runtime::inbox::dead_letter;
    let selection = |all: bool, ids: Vec<i64>| {
        if !all && ids.is_empty() {
            Err(Error::Config("pass --all or one or more --id N".into()))
        } else {
            Ok((!all).then_some(ids))
        }
    };
    match command {
        DeadLettersCommand::List {
            consumer,
            status,
            reason,
            limit,
            json,
        } => {
            let mut filter = dead_letter::DeadLetterFilter::new().limit(limit);
            if let Some(consumer) = consumer {
                filter = filter.consumer(consumer);
            }
            if status.iter().any(|s| s == "all") {
                filter = filter.statuses(["dead", "retry", "resolved"]);
            } else if !status.is_empty() {
                filter = filter.statuses(status);
            }
            if let Some(reason) = reason {
                filter = filter.reason(reason.parse()?);
            }
            let pool = connect(url, 2).await?;
            let rows = dead_letter::list(&pool, &filter).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&rows).unwrap_or_default()
                );
            } else {
                println!(
                    "{:>8}  {:<16}  {:<24}  {:>4}  {:>8}  {:<36}  {:<18}  {:<8}  {:>3}  error",
                    "id",
                    "consumer",
                    "topic",
                    "part",
                    "offset",
                    "event id",
                    "reason",
                    "status",
                    "att"
                );
                for r in rows {
                    println!(
                        "{:>8}  {:<16}  {:<24}  {:>4}  {:>8}  {:<36}  {:<18}  {:<8}  {:>3}  {}",
                        r.id,
                        r.consumer,
                        r.topic,
                        r.partition,
                        r.offset,
                        r.event_id
                            .map(|e| e.to_string())
                            .unwrap_or_else(|| "-".into()),
                        r.reason,
                        r.status,
                        r.attempts,
                        r.error.lines().next().unwrap_or_default()
                    );
                }
            }
        }
        DeadLettersCommand::Retry { all, ids, consumer } => {
            let ids = selection(all, ids)?;
            let pool = connect(url, 2).await?;
            let n = dead_letter::retry(&pool, consumer.as_deref(), ids.as_deref()).await?;
            println!(
                "marked {n} dead letters for retry (their consumers pick them up within their re-drive interval)"
            );
        }
        DeadLettersCommand::Drop { all, ids, consumer } => {
            let ids = selection(all, ids)?;
            let pool = connect(url, 2).await?;
            let n = dead_letter::discard(&pool, consumer.as_deref(), ids.as_deref()).await?;
            println!("dropped {n} dead letters");
        }
    }
    Ok(())
}

fn print_status(s: &ops::Status) {
    let age = |a: Option<f64>| a.map_or_else(|| "-".to_owned(), |a| format!("{a:.1}s"));
    println!(
        "unpublished: {}   oldest unpublished: {}   parked: {}   notify: {}",
        s.unpublished,
        age(s.oldest_unpublished_secs),
        s.parked,
        if s.notify_enabled { "on" } else { "off" }
    );
    println!(
        "{:<32} {:>12} {:>10} {:>8} {:>12}",
        "topic", "unpublished", "oldest", "parked", "published"
    );
    for t in &s.topics {
        println!(
            "{:<32} {:>12} {:>10} {:>8} {:>12}",
            t.topic,
            t.unpublished,
            age(t.oldest_unpublished_secs),
            t.parked,
            t.published
        );
    }
}

async fn stop_on_signal(token: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    token.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested: finishing the batch in flight");
    token.cancel();
}
