//! The subcommands: each reads the settings in effect ([`Ctx`]), opens what
//! it needs (a pool of a few connections, a Kafka client) and prints its
//! result.

use std::time::Duration;

use outbox_runtime::settings::Settings;
use outbox_runtime::{CancellationToken, Error, Relay, cleanup, kafka, ops, partition, replay};
use sqlx::PgPool;
use sqlx::types::chrono::{DateTime, Utc};

use crate::args::{
    AheadArgs, CleanupArgs, Command, DeadLetterSelection, DeadLettersCommand, ParkedCommand,
    PartitionsCommand, ProgressCommand, ReplayArgs, SagasCommand, TopicsCommand,
};
use crate::config::Layers;
use crate::output::{print_status, table};

/// What a subcommand runs with.
pub(crate) struct Ctx {
    pub layers: Layers,
    pub settings: Settings,
}

impl Ctx {
    /// A pool of at most `max` connections on the database, connecting
    /// lazily (the first query reports an unreachable server).
    pub(crate) async fn pool(&self, max: u32) -> Result<PgPool, Error> {
        let database = &self.settings.database;
        let options = database.connect_options()?;
        tracing::debug!(
            host = options.get_host(),
            database = ?options.get_database(),
            ssl_mode = ?options.get_ssl_mode(),
            "connecting"
        );
        database.pool(max).await
    }
}

pub(crate) async fn run(ctx: Ctx, command: Command) -> Result<(), Error> {
    match command {
        Command::Migrate(_) => {
            let pool = ctx.pool(2).await?;
            let schema = ctx.settings.database.schema.as_deref();
            if let Some(schema) = schema {
                // A plain identifier (checked with the connect options).
                sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                    .execute(&pool)
                    .await?;
            }
            outbox_core::migrate_with(&pool, &ctx.settings.database.lock_policy()).await?;
            match schema {
                Some(schema) => println!("migrations applied (schema {schema})"),
                None => println!("migrations applied"),
            }
        }
        Command::Relay(_) => relay(&ctx).await?,
        Command::Status { json } => {
            let pool = ctx.pool(2).await?;
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
            kafka: _,
        }) => {
            if from_outbox {
                let pool = ctx.pool(2).await?;
                topics.extend(ops::outbox_topics(&pool).await?);
            }
            topics.sort();
            topics.dedup();
            if topics.is_empty() {
                return Err(Error::Config(
                    "no topics: name them or pass --from-outbox".into(),
                ));
            }
            let kafka = &ctx.settings.kafka;
            let created = kafka::create_topics(
                kafka.brokers(),
                &kafka.pairs(),
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
            let pool = ctx.pool(2).await?;
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
            let pool = ctx.pool(2).await?;
            let n = ops::requeue_parked(&pool, ids.as_deref()).await?;
            println!("requeued {n} parked rows");
        }
        Command::Parked(ParkedCommand::Drop { selection, reason }) => {
            let ids = selection.ids()?;
            let pool = ctx.pool(2).await?;
            let n = ops::discard_parked(&pool, ids.as_deref(), &reason).await?;
            println!(
                "dropped {n} parked rows (kept as discarded; `outbox parked requeue --id N` undoes it)"
            );
        }
        Command::Replay(args) => replay_events(&ctx, args).await?,
        Command::Cleanup(args) => cleanup(&ctx, args).await?,
        Command::Partitions(command) => partitions(&ctx, command).await?,
        Command::Progress(ProgressCommand::Enable { consumer: None }) => {
            let pool = ctx.pool(2).await?;
            outbox_runtime::relay::progress::switch_on(&pool).await?;
            println!("progress mode: on (start the relays again, with lanes)");
            if let Err(error) = outbox_runtime::relay::progress::drop_marks_indexes(&pool).await {
                eprintln!(
                    "the default mode's indexes of unpublished rows are not dropped yet \
                     ({error}); run `outbox progress enable` again once the transactions \
                     open on outbox_event have ended"
                );
                return Err(error);
            }
            println!("the default mode's indexes of unpublished rows: dropped");
        }
        Command::Progress(ProgressCommand::Enable {
            consumer: Some(group),
        }) => {
            let pool = ctx.pool(2).await?;
            outbox_runtime::inbox::progress::enable(&pool, &group).await?;
            println!("progress mode of consumer group `{group}`: on (start its instances again)");
        }
        Command::Progress(ProgressCommand::Status { json }) => {
            let pool = ctx.pool(2).await?;
            let positions = outbox_runtime::relay::progress::positions(&pool).await?;
            // Topics held as missing (in `outbox status` as held rows too).
            let held = if positions.is_empty() || json {
                Vec::new()
            } else {
                outbox_runtime::relay::progress::held_topics(&pool).await?
            };
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&positions).unwrap_or_default()
                );
            } else if positions.is_empty() {
                println!("progress mode: off (`outbox progress enable` turns it on)");
            } else {
                // The positions with each lane's lag, and what holds them.
                if let Some(lag) = ops::progress_lag(&pool).await? {
                    crate::output::print_progress(&lag);
                }
                for h in held {
                    println!(
                        "held topic `{}`: {} rows passed over, held {:.0}s ago: {}",
                        h.topic, h.rows, h.held_secs_ago, h.reason
                    );
                }
            }
        }
        Command::DeadLetters(command) => dead_letters(&ctx, command).await?,
        Command::Sagas(command) => sagas(&ctx, command).await?,
        Command::Notify { state, lock: _ } => {
            let pool = ctx.pool(2).await?;
            let policy = ctx.settings.database.lock_policy();
            match state.as_str() {
                "on" => ops::set_notify_with(&pool, true, &policy).await?,
                "off" => ops::set_notify_with(&pool, false, &policy).await?,
                _ => {}
            }
            let on = ops::notify_enabled(&pool).await?;
            let channel = outbox_runtime::OutboxScope::of(&pool).await?.channel();
            println!(
                "notify: {} (channel {channel})",
                if on { "on" } else { "off" }
            );
        }
        Command::Console(args) => crate::console::run(&ctx, args).await?,
        Command::Config { json } => show_config(&ctx, json),
        // Run before settings are loaded (`schema::run`): no database.
        Command::Schema(_) => {}
    }
    Ok(())
}

/// `outbox relay`: the relay with the settings in effect, until a signal.
async fn relay(ctx: &Ctx) -> Result<(), Error> {
    let settings = &ctx.settings;
    // Claims, the batch being delivered, the batch being marked, metrics.
    let pool = ctx.pool(4).await?;
    let _metrics = match settings.relay.metrics_addr {
        Some(addr) => Some(outbox_runtime::metrics::serve(addr).await?),
        None => None,
    };
    let relay = Relay::builder(pool)
        .kafka(&settings.kafka)
        .settings(&settings.relay)
        .build()?;
    let token = CancellationToken::new();
    tokio::spawn(stop_on_signal(token.clone()));
    relay.run(token).await
}

/// `outbox config`: every setting in effect and its source.
fn show_config(ctx: &Ctx, json: bool) {
    let entries = ctx.layers.entries();
    if json {
        let value = serde_json::json!({
            "file": ctx.layers.path.as_ref().map(|p| p.display().to_string()),
            "settings": entries,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
        return;
    }
    if let Some(path) = &ctx.layers.path {
        println!("configuration file: {}", path.display());
    }
    let rows: Vec<[String; 3]> = entries
        .into_iter()
        .map(|e| [e.setting, e.value, e.source.to_owned()])
        .collect();
    print!("{}", table(&["SETTING", "VALUE", "SOURCE"], &rows));
}

async fn sagas(ctx: &Ctx, command: SagasCommand) -> Result<(), Error> {
    use outbox_runtime::ops::sagas;
    let time = |t: Option<&str>| t.unwrap_or("-").to_owned();
    fn json<T: serde::Serialize>(value: &T) {
        println!(
            "{}",
            serde_json::to_string_pretty(value).unwrap_or_default()
        );
    }
    match command {
        SagasCommand::Summary {
            stuck_after,
            json: as_json,
        } => {
            let stuck_after = ops::parse_duration(&stuck_after)?;
            let pool = ctx.pool(2).await?;
            let rows = sagas::summary(&pool, stuck_after).await?;
            if as_json {
                json(&rows);
                return Ok(());
            }
            let rows: Vec<[String; 6]> = rows
                .into_iter()
                .map(|r| {
                    [
                        r.saga_type,
                        r.stage,
                        r.running.to_string(),
                        r.completed.to_string(),
                        r.stuck.to_string(),
                        r.oldest_step_secs
                            .map_or_else(|| "-".to_owned(), crate::output::ops_age),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &[
                        "saga type",
                        "stage",
                        "running",
                        "completed",
                        "stuck",
                        "oldest step"
                    ],
                    &rows
                )
            );
        }
        SagasCommand::List {
            saga_type,
            stage,
            state,
            idle,
            limit,
            json: as_json,
        } => {
            let filter = sagas::SagaFilter {
                saga_type,
                stage,
                state: match state.as_str() {
                    "completed" => sagas::SagaState::Completed,
                    "all" => sagas::SagaState::All,
                    _ => sagas::SagaState::Running,
                },
                idle_longer_than: idle.as_deref().map(ops::parse_duration).transpose()?,
                limit,
            };
            let pool = ctx.pool(2).await?;
            let rows = sagas::list(&pool, &filter).await?;
            if as_json {
                json(&rows);
                return Ok(());
            }
            let rows: Vec<[String; 7]> = rows
                .into_iter()
                .map(|r| {
                    [
                        r.saga_type,
                        r.saga_id,
                        r.stage,
                        r.version.to_string(),
                        r.updated_at,
                        time(r.completed_at.as_deref()),
                        r.timeouts.to_string(),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &[
                        "saga type",
                        "id",
                        "stage",
                        "steps",
                        "last step",
                        "completed",
                        "timeouts"
                    ],
                    &rows
                )
            );
        }
        SagasCommand::Show {
            saga_type,
            saga_id,
            json: as_json,
        } => {
            let pool = ctx.pool(2).await?;
            let Some(saga) = sagas::show(&pool, &saga_type, &saga_id).await? else {
                return Err(Error::Config(format!(
                    "no saga instance {saga_type}/{saga_id} (never started, or completed and \
                     deleted by the retention)"
                )));
            };
            if as_json {
                json(&saga);
                return Ok(());
            }
            let i = &saga.instance;
            println!("saga      {}/{}", i.saga_type, i.saga_id);
            println!("stage     {}", i.stage);
            println!("steps     {}", i.version);
            println!("started   {}", i.started_at);
            println!("last step {}", i.updated_at);
            println!("completed {}", time(i.completed_at.as_deref()));
            println!("state     {}", saga.state);
            if saga.pending_timeouts.is_empty() {
                println!("timeouts  none pending");
            }
            for t in &saga.pending_timeouts {
                println!(
                    "timeout   {} (id {}) due {}",
                    t.name,
                    t.timeout_id,
                    time(t.due_at.as_deref())
                );
            }
        }
    }
    Ok(())
}

async fn dead_letters(ctx: &Ctx, command: DeadLettersCommand) -> Result<(), Error> {
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
            let pool = ctx.pool(2).await?;
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
            let pool = ctx.pool(2).await?;
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
            let pool = ctx.pool(2).await?;
            let n = dead_letter::discard(&pool, consumer.as_deref(), ids.as_deref()).await?;
            println!("dropped {n} dead letters");
        }
    }
    Ok(())
}

async fn replay_events(ctx: &Ctx, args: ReplayArgs) -> Result<(), Error> {
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
    let pool = ctx.pool(2).await?;
    if args.dry_run {
        let selected = replay::selection(&pool, &filter, dedup_window).await?;
        let (n, old) = (selected.matched, selected.beyond_window);
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "dry_run": true,
                    "matched": n,
                    "beyond_dedup_window": old,
                    "estimated": selected.estimated,
                })
            );
        } else {
            let refused = if old > 0 {
                " (beyond the dedup window: refused without --force)"
            } else {
                ""
            };
            println!(
                "dry run: {} published events match, {} of them published more than {} \
                 ago{refused}; nothing sent",
                replay::shown(n),
                replay::shown(old),
                ops::format_duration(dedup_window)
            );
        }
        return Ok(());
    }
    let mut options =
        replay::ReplayOptions::new(ctx.settings.kafka.brokers(), filter).kafka(&ctx.settings.kafka);
    options.dedup_window = dedup_window;
    options.force = args.force;
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

async fn cleanup(ctx: &Ctx, args: CleanupArgs) -> Result<(), Error> {
    let mut retention = cleanup::Retention::new(ops::parse_duration(&args.older_than)?)
        .dedup_window(ops::parse_duration(&args.dedup_window)?)
        .batch_size(args.batch_size);
    if let Some(age) = &args.resolved_dead_letters_older_than {
        retention = retention.resolved_dead_letters(ops::parse_duration(age)?);
    }
    if let Some(age) = &args.dead_letters_older_than {
        retention = retention.dead_letters(ops::parse_duration(age)?);
    }
    if let Some(age) = &args.completed_sagas_older_than {
        retention = retention.completed_sagas(ops::parse_duration(age)?);
    }
    retention.validate()?;
    let every = args.every.as_deref().map(ops::parse_duration).transpose()?;
    let pool = ctx.pool(3).await?;
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
                    "deleted {} published outbox rows, {} processed_event rows, {} processed inbox rows, {} dead letters, {} completed sagas (statements: {})",
                    report.outbox_events,
                    report.processed_events,
                    report.inbox_events,
                    report.dead_letters,
                    report.sagas,
                    report.statements
                );
                if report.partitions_dropped + report.partitions_kept + report.partitions_busy > 0 {
                    println!(
                        "dropped {} partitions; kept {} past the window (rows still needed); {} busy (dropped at a later pass)",
                        report.partitions_dropped, report.partitions_kept, report.partitions_busy
                    );
                }
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

fn partition_plan(ahead: &AheadArgs) -> partition::PartitionPlan {
    partition::PartitionPlan {
        ahead: ahead.ahead,
        lock_timeout: Duration::from_millis(ahead.lock_timeout_ms),
        ..partition::PartitionPlan::default()
    }
}

async fn partitions(ctx: &Ctx, command: PartitionsCommand) -> Result<(), Error> {
    let pool = ctx.pool(3).await?;
    match command {
        PartitionsCommand::Enable { period, ahead } => {
            let plan = partition::PartitionPlan {
                period: ops::parse_duration(&period)?,
                ..partition_plan(&ahead)
            };
            plan.validate()?;
            let report = partition::enable(&pool, &plan).await?;
            println!(
                "partitioned: {} (already: {}); {} partitions created, {} rows moved out of the legacy partitions; restart the relays and cleanup jobs",
                if report.converted.is_empty() {
                    "none".to_owned()
                } else {
                    report.converted.join(", ")
                },
                if report.already.is_empty() {
                    "none".to_owned()
                } else {
                    report.already.join(", ")
                },
                report.created,
                report.moved_rows
            );
        }
        PartitionsCommand::Maintain { ahead } => {
            match partition::maintain(&pool, &partition_plan(&ahead)).await? {
                Some(report) => println!(
                    "{} partitions created ahead, {} rows moved from the default partitions{}",
                    report.created,
                    report.moved_rows,
                    if report.busy > 0 {
                        format!(
                            "; {} not created (their table stayed busy): run it again",
                            report.busy
                        )
                    } else {
                        String::new()
                    }
                ),
                None => println!("another maintainer is at work: nothing done"),
            }
        }
        PartitionsCommand::List { json } => {
            let parts = partition::list(&pool).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&parts).unwrap_or_default()
                );
            } else if parts.is_empty() {
                println!("no partitioned table (`outbox partitions enable` converts them)");
            } else {
                let rows: Vec<[String; 6]> = parts
                    .iter()
                    .map(|p| {
                        let bound = |u: Option<_>, open: &str| {
                            u.and_then(|u| {
                                DateTime::<Utc>::from_timestamp_millis(partition::ms_of(u))
                            })
                            .map_or(open.to_owned(), |t| t.format("%Y-%m-%d %H:%M").to_string())
                        };
                        [
                            p.table.clone(),
                            p.name.clone(),
                            format!("{:?}", p.kind).to_lowercase(),
                            if p.kind == partition::PartitionKind::Default {
                                "-".into()
                            } else {
                                bound(p.from, "-inf")
                            },
                            if p.kind == partition::PartitionKind::Default {
                                "-".into()
                            } else {
                                bound(p.to, "+inf")
                            },
                            p.rows_estimate.max(0).to_string(),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table(
                        &["TABLE", "PARTITION", "KIND", "FROM", "TO", "ROWS~"],
                        &rows
                    )
                );
            }
        }
    }
    Ok(())
}

pub(crate) async fn stop_on_signal(token: CancellationToken) {
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
