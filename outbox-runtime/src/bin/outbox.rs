//! The `outbox` command: migrations, the relay, status, topics, parked rows,
//! replay, retention cleanup, the NOTIFY switch and the consumers' dead
//! letters. Settings come from flags or the environment
//! (`DATABASE_URL`, `KAFKA_BROKERS`); `-X key=value` passes librdkafka
//! settings through (TLS, SASL). Credentials are never logged.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use outbox_runtime::{CancellationToken, Error, Relay, cleanup, kafka, ops, replay};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::types::chrono::{DateTime, Utc};

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
    /// The schema holding this service's outbox tables, when services share
    /// a database (one schema each); default: the connection's search_path.
    #[arg(long, env = "OUTBOX_SCHEMA", global = true)]
    schema: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox tables (idempotent).
    Migrate,
    /// Publish the outbox to Kafka until SIGINT/SIGTERM.
    Relay(RelayArgs),
    /// Backlog, oldest unpublished age, parked, dropped and published rows,
    /// per topic.
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
    /// Publish already published events again (after the broker lost data,
    /// to rebuild a projection); the outbox is only read.
    Replay(ReplayArgs),
    /// Delete old published outbox rows, dedup rows and processed inbox rows,
    /// in small batches (never unpublished or parked rows).
    Cleanup(CleanupArgs),
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
    /// of the outbox (all must use the same count); 0 turns lanes off (then
    /// relays with lanes refuse to run beside it, and it beside them).
    #[arg(long, env = "OUTBOX_LANES", default_value_t = 16, value_parser = clap::value_parser!(u16).range(0..=1024))]
    lanes: u16,
    /// How long this relay keeps its lanes once it stops answering (host
    /// frozen, connection half-open), in milliseconds.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1_000..))]
    lane_timeout_ms: u64,
    /// Serve Prometheus metrics on this address (GET /metrics), e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

#[derive(Args)]
struct ReplayArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Outbox ids from (inclusive).
    #[arg(long)]
    from_id: Option<i64>,
    /// Outbox ids up to (inclusive).
    #[arg(long)]
    to_id: Option<i64>,
    /// Events created at or after: RFC 3339 (2026-11-30T12:00:00Z) or an
    /// age (2h = two hours ago).
    #[arg(long, value_name = "TIME")]
    since: Option<String>,
    /// Events created before: RFC 3339 or an age.
    #[arg(long, value_name = "TIME")]
    until: Option<String>,
    /// Only this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Only this aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only this aggregate id.
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Publish to this topic instead of each event's own.
    #[arg(long)]
    to_topic: Option<String>,
    /// Only count the events that would be replayed.
    #[arg(long)]
    dry_run: bool,
    /// How long consumers keep their dedup rows (as `cleanup
    /// --dedup-window`): events published longer ago are refused without
    /// --force, since consumers would apply them again.
    #[arg(long, value_name = "DURATION", default_value = "7d")]
    dedup_window: String,
    /// Replay events published before the dedup window too (e.g. for a
    /// consumer rebuilding from scratch); consumers that lost their dedup
    /// rows apply them again.
    #[arg(long)]
    force: bool,
    /// Rows per page.
    #[arg(long, default_value_t = 1000)]
    batch_size: i64,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct CleanupArgs {
    /// Delete rows older than this (e.g. 30d, 12h).
    #[arg(long, value_name = "DURATION")]
    older_than: String,
    /// The consumers' dedup window: how long a redelivery can happen (the
    /// topics' Kafka retention plus the longest lag). A shorter
    /// --older-than is refused.
    #[arg(long, value_name = "DURATION", default_value = "7d")]
    dedup_window: String,
    /// Rows per statement.
    #[arg(long, default_value_t = 1000)]
    batch_size: i64,
    /// Run every DURATION until SIGINT/SIGTERM, as the single leader among
    /// the cleanup jobs of this outbox (advisory lock); without it, one
    /// pass.
    #[arg(long, value_name = "DURATION")]
    every: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// Which rows an operation applies to: every row, or the given ids.
#[derive(Args)]
struct Selection {
    /// Every row.
    #[arg(long, conflicts_with = "ids")]
    all: bool,
    /// Row ids (repeatable).
    #[arg(long = "id")]
    ids: Vec<i64>,
}

impl Selection {
    /// `None` for every row, else the ids; refuses an empty selection.
    fn ids(self) -> Result<Option<Vec<i64>>, Error> {
        if !self.all && self.ids.is_empty() {
            Err(Error::Config("pass --all or one or more --id N".into()))
        } else {
            Ok((!self.all).then_some(self.ids))
        }
    }
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
    /// Put parked rows back in the queue (--all: every parked row not
    /// dropped; --id: dropped ones too).
    Requeue {
        #[command(flatten)]
        selection: Selection,
    },
    /// Give up on parked rows: they are marked discarded with the reason and
    /// kept (audit trail), never published, never deleted by cleanup;
    /// `requeue --id N` undoes it.
    Drop {
        #[command(flatten)]
        selection: Selection,
        /// Why (stored with the rows).
        #[arg(long)]
        reason: String,
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
    Retry(DeadLetterSelection),
    /// Delete dead letters.
    Drop(DeadLetterSelection),
}

#[derive(Args)]
struct DeadLetterSelection {
    #[command(flatten)]
    selection: Selection,
    /// Only this consumer group's dead letters (with --all: all of them).
    #[arg(long)]
    consumer: Option<String>,
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

/// Where to connect: the database URL and the outbox's schema, if chosen.
#[derive(Clone, Copy)]
struct Target<'a> {
    url: Option<&'a str>,
    schema: Option<&'a str>,
}

/// A schema name as `--schema` takes it: a plain identifier (what
/// `search_path` is set to, and what `outbox migrate` creates).
fn check_schema(schema: &str) -> Result<(), Error> {
    let mut chars = schema.chars();
    let plain = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && schema.len() <= 63;
    if plain {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid --schema `{schema}`: use a plain identifier (a-z, 0-9, _, not starting \
             with a digit, at most 63 characters)"
        )))
    }
}

async fn connect(target: Target<'_>, max: u32) -> Result<PgPool, Error> {
    let url = target.url.ok_or_else(|| {
        Error::Config("no database: pass --database-url or set DATABASE_URL".into())
    })?;
    let invalid = || Error::Config("DATABASE_URL is not a valid PostgreSQL URL".into());
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(invalid());
    }
    let mut options: PgConnectOptions = url.parse().map_err(|_| invalid())?;
    if let Some(schema) = target.schema {
        check_schema(schema)?;
        options = options.options([("search_path", schema)]);
    }
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
    let url = Target {
        url: cli.database_url.as_deref(),
        schema: cli.schema.as_deref(),
    };
    match cli.command {
        Command::Migrate => {
            let pool = connect(url, 2).await?;
            if let Some(schema) = url.schema {
                sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                    .execute(&pool)
                    .await?;
            }
            outbox_core::migrate(&pool).await?;
            match url.schema {
                Some(schema) => println!("migrations applied (schema {schema})"),
                None => println!("migrations applied"),
            }
        }
        Command::Relay(args) => {
            let pool = connect(url, 4).await?;
            let _metrics = match args.metrics_addr {
                Some(addr) => Some(outbox_runtime::metrics::serve(addr).await?),
                None => None,
            };
            let relay = Relay::builder(pool)
                .brokers(args.kafka.brokers.clone())
                .batch_size(args.batch_size)
                .poll_interval(Duration::from_millis(args.poll_interval_ms))
                .listen(!args.no_listen)
                .max_attempts(args.max_attempts)
                .delivery_timeout(Duration::from_millis(args.delivery_timeout_ms))
                .lanes(args.lanes)
                .lane_timeout(Duration::from_millis(args.lane_timeout_ms));
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
        Command::Parked(ParkedCommand::Requeue { selection }) => {
            let ids = selection.ids()?;
            let pool = connect(url, 2).await?;
            let n = ops::requeue_parked(&pool, ids.as_deref()).await?;
            println!("requeued {n} parked rows");
        }
        Command::Parked(ParkedCommand::Drop { selection, reason }) => {
            let ids = selection.ids()?;
            let pool = connect(url, 2).await?;
            let n = ops::discard_parked(&pool, ids.as_deref(), &reason).await?;
            println!(
                "dropped {n} parked rows (kept as discarded; `outbox parked requeue --id N` undoes it)"
            );
        }
        Command::Replay(args) => run_replay(url, args).await?,
        Command::Cleanup(args) => run_cleanup(url, args).await?,
        Command::DeadLetters(command) => dead_letters(url, command).await?,
        Command::Notify { state } => {
            let pool = connect(url, 2).await?;
            match state.as_str() {
                "on" => ops::set_notify(&pool, true).await?,
                "off" => ops::set_notify(&pool, false).await?,
                _ => {}
            }
            let on = ops::notify_enabled(&pool).await?;
            let channel = outbox_runtime::OutboxScope::of(&pool).await?.channel();
            println!(
                "notify: {} (channel {channel})",
                if on { "on" } else { "off" }
            );
        }
    }
    Ok(())
}

async fn dead_letters(url: Target<'_>, command: DeadLettersCommand) -> Result<(), Error> {
    use outbox_runtime::inbox::dead_letter;
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
        DeadLettersCommand::Retry(DeadLetterSelection {
            selection,
            consumer,
        }) => {
            let ids = selection.ids()?;
            let pool = connect(url, 2).await?;
            let n = dead_letter::retry(&pool, consumer.as_deref(), ids.as_deref()).await?;
            println!(
                "marked {n} dead letters for retry (their consumers pick them up within their re-drive interval)"
            );
        }
        DeadLettersCommand::Drop(DeadLetterSelection {
            selection,
            consumer,
        }) => {
            let ids = selection.ids()?;
            let pool = connect(url, 2).await?;
            let n = dead_letter::discard(&pool, consumer.as_deref(), ids.as_deref()).await?;
            println!("dropped {n} dead letters");
        }
    }
    Ok(())
}

fn print_status(s: &ops::Status) {
    let age = |a: Option<f64>| a.map_or_else(|| "-".to_owned(), ops_age);
    let rows: Vec<[String; 6]> = s
        .topics
        .iter()
        .map(|t| {
            [
                t.topic.clone(),
                t.unpublished.to_string(),
                age(t.oldest_unpublished_secs),
                t.parked.to_string(),
                t.discarded.to_string(),
                t.published.to_string(),
            ]
        })
        .chain(std::iter::once([
            "TOTAL".to_owned(),
            s.unpublished.to_string(),
            age(s.oldest_unpublished_secs),
            s.parked.to_string(),
            s.discarded.to_string(),
            s.published.to_string(),
        ]))
        .collect();
    let header = [
        "TOPIC",
        "UNPUBLISHED",
        "OLDEST UNPUBLISHED",
        "PARKED",
        "DROPPED",
        "PUBLISHED",
    ];
    print!("{}", table(&header, &rows));
    println!("outbox: schema {}", s.schema);
    println!(
        "notify: {} (channel {})",
        if s.notify_enabled { "on" } else { "off" },
        s.channel
    );
    if s.relays.is_empty() {
        println!("relays: none running");
    } else {
        let rows: Vec<[String; 4]> = s
            .relays
            .iter()
            .map(|r| {
                [
                    r.pid.to_string(),
                    r.client.clone().unwrap_or_else(|| "local".into()),
                    r.lane_count.map_or_else(|| "-".into(), |c| c.to_string()),
                    if r.lane_count == Some(0) {
                        "all (no lanes)".into()
                    } else {
                        lane_list(&r.lanes)
                    },
                ]
            })
            .collect();
        print!(
            "{}",
            table(
                &["RELAY (PID)", "CLIENT", "LANE COUNT", "LANES OWNED"],
                &rows
            )
        );
    }
}

/// `0-5,9,12-13`.
fn lane_list(lanes: &[i32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lanes.len() {
        let start = lanes[i];
        while i + 1 < lanes.len() && lanes[i + 1] == lanes[i] + 1 {
            i += 1;
        }
        parts.push(if lanes[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", lanes[i])
        });
        i += 1;
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(",")
    }
}

/// An age for people: `850ms`, `42s`, `3m 12s`, `5h 02m`, `2d 03h`.
fn ops_age(secs: f64) -> String {
    let s = secs.max(0.0);
    if s < 1.0 {
        return format!("{:.0}ms", s * 1e3);
    }
    let s = s as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// A text table: the first column left-aligned, the others right-aligned,
/// columns as wide as their widest cell.
fn table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 0 {
                out.push_str(&format!("{cell:<w$}"));
            } else {
                out.push_str(&format!("  {cell:>w$}"));
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        out.push_str(&line(&cells));
    }
    out
}

async fn run_replay(url: Target<'_>, args: ReplayArgs) -> Result<(), Error> {
    let filter = replay::ReplayFilter {
        from_id: args.from_id,
        to_id: args.to_id,
        since: args.since.as_deref().map(parse_time).transpose()?,
        until: args.until.as_deref().map(parse_time).transpose()?,
        topic: args.topic,
        aggregate_type: args.aggregate_type,
        aggregate_id: args.aggregate_id,
    };
    let dedup_window = ops::parse_duration(&args.dedup_window)?;
    let pool = connect(url, 2).await?;
    if args.dry_run {
        let (old, n, _) = replay::beyond_window(&pool, &filter, dedup_window).await?;
        if args.json {
            println!(
                "{}",
                serde_json::json!({ "dry_run": true, "matched": n, "beyond_dedup_window": old })
            );
        } else {
            println!(
                "dry run: {n} published events match, {old} of them published more than {} ago \
                 (beyond the dedup window: refused without --force); nothing sent",
                ops::format_duration(dedup_window)
            );
        }
        return Ok(());
    }
    let mut options = replay::ReplayOptions::new(args.kafka.brokers.clone(), filter);
    options.dedup_window = dedup_window;
    options.force = args.force;
    options.kafka_settings = settings(&args.kafka)?;
    options.to_topic = args.to_topic;
    options.batch_size = args.batch_size;
    let report = replay::replay(&pool, &options).await?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else {
        let range = match (report.first_id, report.last_id) {
            (Some(a), Some(b)) => format!(" (outbox ids {a}..={b})"),
            _ => String::new(),
        };
        println!(
            "replayed {} events{range}; replay id {}",
            report.replayed, report.replay_id
        );
    }
    Ok(())
}

/// RFC 3339, or an age (`2h`: two hours ago).
fn parse_time(text: &str) -> Result<DateTime<Utc>, Error> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let age = ops::parse_duration(text).map_err(|_| {
        Error::Config(format!(
            "invalid time `{text}`: use RFC 3339 (2026-11-30T12:00:00Z) or an age (2h, 30d)"
        ))
    })?;
    if age > Duration::from_secs(100 * 365 * 86_400) {
        return Err(Error::Config(format!("age `{text}` is too long")));
    }
    Ok(Utc::now() - age)
}

async fn run_cleanup(url: Target<'_>, args: CleanupArgs) -> Result<(), Error> {
    let retention = cleanup::Retention::new(ops::parse_duration(&args.older_than)?)
        .dedup_window(ops::parse_duration(&args.dedup_window)?)
        .batch_size(args.batch_size);
    retention.validate()?;
    let every = args.every.as_deref().map(ops::parse_duration).transpose()?;
    let pool = connect(url, 3).await?;
    match every {
        None => {
            let report = cleanup::cleanup_as_leader(&pool, &retention)
                .await?
                .ok_or(Error::CleanupBusy)?;
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).unwrap_or_default()
                );
            } else {
                println!(
                    "deleted {} published outbox rows, {} processed_event rows, {} processed inbox rows (statements: {})",
                    report.outbox_events,
                    report.processed_events,
                    report.inbox_events,
                    report.statements
                );
            }
        }
        Some(every) => {
            let job = cleanup::Cleanup::new(pool, retention, every)?;
            let token = CancellationToken::new();
            tokio::spawn(stop_on_signal(token.clone()));
            job.run(token).await;
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::lane_list;

    #[test]
    fn lane_lists_collapse_runs() {
        assert_eq!(lane_list(&[]), "none");
        assert_eq!(lane_list(&[3]), "3");
        assert_eq!(lane_list(&[0, 1, 2, 3, 4, 5]), "0-5");
        assert_eq!(lane_list(&[0, 1, 2, 9, 12, 13]), "0-2,9,12-13");
    }
}
