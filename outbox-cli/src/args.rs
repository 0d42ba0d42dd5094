//! The command line: subcommands and flags. Flags of settings that can also
//! come from the environment or the configuration file have no defaults
//! here: unset flags leave the setting to those sources (see `config`).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use outbox_runtime::Error;
use outbox_runtime::cloudevents::CloudEventsMode;
use outbox_runtime::settings::{KafkaSettings, RelaySettings, Settings};

#[derive(Parser)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox: migrations, relay, operations",
    after_help = "Settings: flags, then the environment (DATABASE_URL, KAFKA_BROKERS, \
                  OUTBOX_KAFKA_<PROPERTY>, OUTBOX_RELAY_<SETTING>, OUTBOX_DATABASE_<SETTING>), \
                  then the configuration file (--config), then defaults. `outbox config` \
                  shows what is in effect."
)]
pub(crate) struct Cli {
    /// Configuration file (TOML: [database], [kafka], [relay], [consumer]).
    #[arg(long, env = "OUTBOX_CONFIG", global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// PostgreSQL URL of the service's database. Prefer DATABASE_URL or the
    /// configuration file for a URL with a password: a command line is
    /// visible to every user of the machine.
    #[arg(long, global = true, value_name = "URL")]
    pub database_url: Option<String>,
    /// Connect timeout of the database in milliseconds (default 10000).
    #[arg(long, global = true, value_name = "MS")]
    pub connect_timeout_ms: Option<u64>,
    /// The schema holding this service's outbox tables, when services share
    /// a database (one schema each); default: the connection's search_path.
    #[arg(long, global = true, value_name = "NAME")]
    pub schema: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The settings given by flags.
    pub fn flag_settings(&self) -> Result<Settings, Error> {
        let mut settings = Settings::default();
        settings.database.url = self.database_url.clone();
        settings.database.connect_timeout_ms = self.connect_timeout_ms;
        settings.database.schema = self.schema.clone();
        match &self.command {
            Command::Relay(relay) => {
                settings.kafka = relay.kafka.settings()?;
                settings.relay = relay.settings();
            }
            Command::Replay(replay) => settings.kafka = replay.kafka.settings()?,
            Command::Console(console) => settings.kafka = console.kafka.settings()?,
            Command::Topics(TopicsCommand::Create { kafka, .. }) => {
                settings.kafka = kafka.settings()?
            }
            Command::Migrate(lock) | Command::Notify { lock, .. } => {
                settings.database.lock_timeout_ms = lock.lock_timeout_ms;
                settings.database.lock_max_wait_ms = lock.lock_max_wait_ms;
            }
            _ => {}
        }
        Ok(settings)
    }
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Create or upgrade the outbox tables (idempotent).
    Migrate(LockArgs),
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
    /// Saga instances: how many per type and stage (running, completed,
    /// stuck), lists, one instance with its state and pending timeouts.
    #[command(subcommand)]
    Sagas(SagasCommand),
    /// Publish already published events again (after the broker lost data,
    /// to rebuild a projection); the outbox is only read.
    Replay(ReplayArgs),
    /// Delete old published outbox rows, dedup rows and processed inbox rows,
    /// and (when asked) old dead letters, in small batches (never unpublished
    /// or parked rows).
    Cleanup(CleanupArgs),
    /// The partitioned layout (opt-in) of outbox_event, processed_event
    /// and inbox_event: retention then drops whole partitions.
    #[command(subcommand)]
    Partitions(PartitionsCommand),
    /// The progress mode (opt-in): relays record how far each lane is
    /// published, a row per batch and lane, instead of marking every event.
    #[command(subcommand)]
    Progress(ProgressCommand),
    /// The commit-time NOTIFY that wakes idle relays: `on`, `off` or `status`.
    Notify {
        /// on | off | status
        #[arg(value_parser = ["on", "off", "status"])]
        state: String,
        #[command(flatten)]
        lock: LockArgs,
    },
    /// Event schemas: export an application's (in a binary built with
    /// `outbox_cli::run_with`), check them against a committed snapshot.
    #[command(subcommand)]
    Schema(SchemaCommand),
    /// A web console for operators: backlog and throughput per topic,
    /// relays, consumer groups, parked rows and dead letters (requeue,
    /// retry, drop: with a write token only), until SIGINT/SIGTERM.
    Console(ConsoleArgs),
    /// Show the settings in effect and where each comes from (flag,
    /// environment, file, default); secrets as ***.
    Config {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// `outbox schema ...`.
#[derive(Subcommand)]
pub(crate) enum SchemaCommand {
    /// Write the JSON Schema of each event type and version, per-topic files
    /// for the broker's schema registry and `asyncapi.json` into DIR. Needs
    /// the application's catalogue: available in an `outbox` binary the
    /// application builds with `outbox_cli::run_with(catalogue)`.
    Export {
        /// The directory (created if missing).
        dir: PathBuf,
    },
    /// Compare the current schemas with a committed snapshot; exit 1 on a
    /// breaking change without a version bump, naming the event type,
    /// version and field.
    Check {
        /// The committed snapshot (a directory written by `schema export`).
        #[arg(long, value_name = "DIR")]
        against: PathBuf,
        /// The current schemas (a directory written by `schema export`);
        /// default: this binary's catalogue, when it has one.
        #[arg(long, value_name = "DIR")]
        current: Option<PathBuf>,
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
    },
}

/// `outbox console`.
#[derive(Args)]
pub(crate) struct ConsoleArgs {
    /// Address to serve on, e.g. 127.0.0.1:8080 (plain HTTP: keep it on
    /// loopback or behind a TLS proxy).
    #[arg(long, value_name = "ADDR")]
    pub addr: SocketAddr,
    /// File holding the write token (readable by its owner only); without
    /// it or OUTBOX_CONSOLE_WRITE_TOKEN in the environment the console is
    /// read-only. There is no flag taking the token itself: a command line
    /// is visible to every user of the machine.
    #[arg(long, value_name = "PATH")]
    pub write_token_file: Option<PathBuf>,
    /// Mark the session cookie Secure (sent over HTTPS only): when the
    /// console is reached through a TLS-terminating proxy.
    #[arg(long)]
    pub secure_cookie: bool,
    /// A reverse proxy whose X-Forwarded-For is believed for the audit
    /// trail's client address (repeat for several); from other peers the
    /// header is ignored.
    #[arg(long, value_name = "IP")]
    pub trusted_proxy: Vec<std::net::IpAddr>,
    /// Brokers to read the consumer groups' lag from (also KAFKA_BROKERS
    /// or the configuration file); without any, no lag is shown.
    #[command(flatten)]
    pub kafka: KafkaArgs,
}

/// How a schema change waits for table locks.
#[derive(Args, Clone)]
pub(crate) struct LockArgs {
    /// How long one attempt waits for a table lock before it gives up its
    /// place (writers go on) and tries again, in milliseconds (default 2000).
    #[arg(long, value_name = "MS")]
    pub lock_timeout_ms: Option<u64>,
    /// How long to keep trying, in milliseconds (default 300000).
    #[arg(long, value_name = "MS")]
    pub lock_max_wait_ms: Option<u64>,
}

#[derive(Args, Clone)]
pub(crate) struct KafkaArgs {
    /// Kafka bootstrap servers (default 127.0.0.1:9092).
    #[arg(long)]
    pub brokers: Option<String>,
    /// librdkafka setting, e.g. -X security.protocol=SASL_SSL (repeatable).
    /// Secrets belong in the environment (OUTBOX_KAFKA_SASL_PASSWORD) or the
    /// configuration file, not on a command line.
    #[arg(short = 'X', value_name = "KEY=VALUE")]
    pub settings: Vec<String>,
}

impl KafkaArgs {
    fn settings(&self) -> Result<KafkaSettings, Error> {
        let mut kafka = KafkaSettings::default();
        kafka.brokers = self.brokers.clone();
        for setting in &self.settings {
            let (key, value) = outbox_runtime::kafka::parse_setting(setting)?;
            kafka.set(key, value);
        }
        Ok(kafka)
    }
}

#[derive(Args)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Rows per batch (default 2000).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Bytes per batch: payloads, headers and keys; a batch ends with the
    /// row that reaches it, a larger row goes alone (default 16777216).
    #[arg(long, value_name = "BYTES")]
    pub max_batch_bytes: Option<usize>,
    /// Poll interval in milliseconds when no NOTIFY arrives (default 500).
    #[arg(long)]
    pub poll_interval_ms: Option<u64>,
    /// Do not LISTEN for NOTIFY; poll only.
    #[arg(long)]
    pub no_listen: bool,
    /// Message-level failures before a row is parked (default 5).
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// librdkafka message.timeout.ms (default 30000).
    #[arg(long)]
    pub delivery_timeout_ms: Option<u64>,
    /// Lanes the partition keys are spread over, shared out among the relays
    /// of the outbox (all must use the same count, a divisor of 64: 1, 2, 4,
    /// 8, 16, 32 or 64); 0 turns lanes off (then relays with lanes refuse to
    /// run beside it, and it beside them) (default 16).
    #[arg(long, value_parser = clap::value_parser!(u16).range(0..=64))]
    pub lanes: Option<u16>,
    /// How long this relay keeps its lanes once it stops answering (host
    /// frozen, connection half-open), in milliseconds (default 10000).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1_000..))]
    pub lane_timeout_ms: Option<u64>,
    /// statement_timeout of the relay's SQL in milliseconds; 0: none
    /// (default 30000).
    #[arg(long, value_name = "MS")]
    pub statement_timeout_ms: Option<u64>,
    /// Most events per second this relay claims, leaving the database's
    /// (and the host's) capacity to the application while a backlog
    /// drains (default: no limit).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_events_per_second: Option<u32>,
    /// Serve Prometheus metrics on this address (GET /metrics), e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// CloudEvents binary-mode headers (ce_id, ce_type, ce_source, ...):
    /// off, both (beside the framework's own headers) or only (instead of
    /// them) (default off).
    #[arg(long, value_name = "MODE")]
    pub cloud_events: Option<CloudEventsMode>,
    /// The ce_source of the events, a URI reference naming this service
    /// (default /outbox).
    #[arg(long, value_name = "URI")]
    pub cloud_events_source: Option<String>,
}

impl RelayArgs {
    fn settings(&self) -> RelaySettings {
        let mut relay = RelaySettings::default();
        relay.batch_size = self.batch_size;
        relay.max_batch_bytes = self.max_batch_bytes;
        relay.poll_interval_ms = self.poll_interval_ms;
        relay.listen = self.no_listen.then_some(false);
        relay.max_attempts = self.max_attempts;
        relay.delivery_timeout_ms = self.delivery_timeout_ms;
        relay.lanes = self.lanes;
        relay.statement_timeout_ms = self.statement_timeout_ms;
        relay.lane_timeout_ms = self.lane_timeout_ms;
        relay.max_events_per_second = self.max_events_per_second;
        relay.metrics_addr = self.metrics_addr;
        relay.cloud_events = self.cloud_events;
        relay.cloud_events_source = self.cloud_events_source.clone();
        relay
    }
}

#[derive(Args)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Outbox ids from (inclusive).
    #[arg(long)]
    pub from_id: Option<i64>,
    /// Outbox ids up to (inclusive).
    #[arg(long)]
    pub to_id: Option<i64>,
    /// Events created at or after: RFC 3339 (2026-11-30T12:00:00Z) or an
    /// age (2h = two hours ago).
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,
    /// Events created before: RFC 3339 or an age.
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
    /// Only this topic.
    #[arg(long)]
    pub topic: Option<String>,
    /// Only this aggregate type.
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// Only this aggregate id.
    #[arg(long)]
    pub aggregate_id: Option<String>,
    /// Publish to this topic instead of each event's own.
    #[arg(long)]
    pub to_topic: Option<String>,
    /// Only count the events that would be replayed.
    #[arg(long)]
    pub dry_run: bool,
    /// How long consumers keep their dedup rows (as `cleanup
    /// --dedup-window`): events published longer ago are refused without
    /// --force, since consumers would apply them again.
    #[arg(long, value_name = "DURATION", default_value = "7d")]
    pub dedup_window: String,
    /// Replay events published before the dedup window too (e.g. for a
    /// consumer rebuilding from scratch); consumers that lost their dedup
    /// rows apply them again.
    #[arg(long)]
    pub force: bool,
    /// Rows per page.
    #[arg(long, default_value_t = 1000)]
    pub batch_size: i64,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub(crate) struct CleanupArgs {
    /// Delete rows older than this (e.g. 30d, 12h).
    #[arg(long, value_name = "DURATION")]
    pub older_than: String,
    /// The consumers' dedup window: how long a redelivery can happen (the
    /// topics' Kafka retention plus the longest lag). A shorter
    /// --older-than is refused.
    #[arg(long, value_name = "DURATION", default_value = "7d")]
    pub dedup_window: String,
    /// Rows per statement.
    #[arg(long, default_value_t = 1000)]
    pub batch_size: i64,
    /// Also delete dead letters resolved (re-driven successfully) longer ago
    /// than this (e.g. 7d). Default: keep them.
    #[arg(long, value_name = "DURATION")]
    pub resolved_dead_letters_older_than: Option<String>,
    /// Also delete dead letters, resolved or not, whose last failure (or
    /// resolution) is older than this (e.g. 90d); never one marked for
    /// retry. Their messages are then gone from the database. Default: keep
    /// them.
    #[arg(long, value_name = "DURATION")]
    pub dead_letters_older_than: Option<String>,
    /// Delete completed saga instances this long after their completion
    /// (at least the dedup window). Default: --older-than.
    #[arg(long, value_name = "DURATION")]
    pub completed_sagas_older_than: Option<String>,
    /// Run every DURATION until SIGINT/SIGTERM, as the single leader among
    /// the cleanup jobs of this outbox (advisory lock); without it, one
    /// pass.
    #[arg(long, value_name = "DURATION")]
    pub every: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Which rows an operation applies to: every row, or the given ids.
#[derive(Args)]
pub(crate) struct Selection {
    /// Every row.
    #[arg(long, conflicts_with = "ids")]
    pub all: bool,
    /// Row ids (repeatable).
    #[arg(long = "id")]
    pub ids: Vec<i64>,
}

impl Selection {
    /// `None` for every row, else the ids; refuses an empty selection.
    pub fn ids(self) -> Result<Option<Vec<i64>>, Error> {
        if !self.all && self.ids.is_empty() {
            Err(Error::Config("pass --all or one or more --id N".into()))
        } else {
            Ok((!self.all).then_some(self.ids))
        }
    }
}

#[derive(Subcommand)]
pub(crate) enum TopicsCommand {
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
pub(crate) enum ParkedCommand {
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
pub(crate) enum ProgressCommand {
    /// Switch this outbox to the progress mode. Stop every relay first
    /// (relays of both modes would publish everything twice); start them
    /// again afterwards, with lanes. Unpublished events stay unpublished,
    /// parked ones parked; rows held back are released. Does nothing the
    /// second time.
    ///
    /// With `--consumer GROUP`: switch that inbox-mode consumer group's
    /// processor to the progress mode instead (stop every instance of the
    /// group first, start them again afterwards). Stored events not yet
    /// processed are processed in the new mode.
    Enable {
        /// An inbox-mode consumer group to switch, instead of the outbox.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Where each set of lane slots stands: its position, and how long ago
    /// it was recorded.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum PartitionsCommand {
    /// Convert the tables to the partitioned layout (also the migration of
    /// an installation holding rows: the old table becomes the first
    /// partition, no row copied). Stop the relays and cleanup jobs first;
    /// start them again afterwards. Does nothing to a table already
    /// partitioned.
    Enable {
        /// The time range of one partition (e.g. 1d, 6h; whole seconds).
        #[arg(long, value_name = "DURATION", default_value = "1d")]
        period: String,
        #[command(flatten)]
        ahead: AheadArgs,
    },
    /// Create the partitions missing ahead of now (as the single maintainer
    /// of this outbox: advisory lock). The cleanup job does it too, at each
    /// pass.
    Maintain {
        #[command(flatten)]
        ahead: AheadArgs,
    },
    /// List the partitions.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub(crate) struct AheadArgs {
    /// Partitions kept ready ahead of now.
    #[arg(long, default_value_t = 3)]
    pub ahead: u32,
    /// How long one attempt waits for a table lock, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub lock_timeout_ms: u64,
}

#[derive(Subcommand)]
pub(crate) enum DeadLettersCommand {
    /// List dead letters, oldest first (default: status dead and retry).
    List {
        /// Only this consumer group.
        #[arg(long)]
        consumer: Option<String>,
        /// dead | retry | resolved | all (repeatable).
        #[arg(long, value_parser = ["dead", "retry", "resolved", "all"])]
        status: Vec<String>,
        /// Only this reason (not_json, no_event_id, unknown_event_type,
        /// payload_mismatch, oversized, handler_failed, invalid_headers,
        /// no_key, unsupported_version).
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

#[derive(Subcommand)]
pub(crate) enum SagasCommand {
    /// Instances per saga type and stage: running, completed, stuck.
    Summary {
        /// A running instance without a step for longer than this, and no
        /// timeout still to come, is stuck.
        #[arg(long, value_name = "DURATION", default_value = "1h")]
        stuck_after: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List instances, the least recently moved first (default: running).
    List {
        /// Only this saga type.
        #[arg(long = "type", value_name = "SAGA_TYPE")]
        saga_type: Option<String>,
        /// Only this stage.
        #[arg(long)]
        stage: Option<String>,
        /// running | completed | all.
        #[arg(long, default_value = "running", value_parser = ["running", "completed", "all"])]
        state: String,
        /// Only instances without a step for longer than this (pending
        /// timeouts or not: `sagas show` tells).
        #[arg(long, value_name = "DURATION")]
        idle: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One instance: its stage, state and pending timeouts.
    Show {
        /// The saga type.
        saga_type: String,
        /// The instance's id (the correlation value).
        saga_id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub(crate) struct DeadLetterSelection {
    #[command(flatten)]
    pub selection: Selection,
    /// Only this consumer group's dead letters (with --all: all of them).
    #[arg(long)]
    pub consumer: Option<String>,
}
