//! The live counts, read from the two databases: orders created, their
//! `OrderCreated` events published, payments captured, orders paid. Progress
//! bars on a terminal, a plain line every two seconds otherwise (CI, a pipe).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use sqlx::PgPool;

/// The four counts, in the order events flow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Rows in `orders` (orders service).
    pub created: u64,
    /// `OrderCreated` outbox rows published (orders service).
    pub published: u64,
    /// Rows in `charges` (billing service).
    pub captured: u64,
    /// Orders with `paid_at` set (orders service).
    pub paid: u64,
}

impl Counts {
    /// Reads the counts.
    pub async fn read(orders: &PgPool, billing: &PgPool) -> Result<Self, sqlx::Error> {
        let (created, paid): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(paid_at) FROM orders")
                .fetch_one(orders)
                .await?;
        let published: i64 = sqlx::query_scalar(
            "SELECT count(published_at) FROM outbox_event WHERE event_type = 'OrderCreated'",
        )
        .fetch_one(orders)
        .await?;
        let captured: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(billing)
            .await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(Self {
            created: n(created),
            published: n(published),
            captured: n(captured),
            paid: n(paid),
        })
    }

    /// The counts since `baseline` was read.
    pub fn since(&self, baseline: &Counts) -> Counts {
        Counts {
            created: self.created.saturating_sub(baseline.created),
            published: self.published.saturating_sub(baseline.published),
            captured: self.captured.saturating_sub(baseline.captured),
            paid: self.paid.saturating_sub(baseline.paid),
        }
    }

    /// Whether every stage reached `n`.
    pub fn all_reached(&self, n: u64) -> bool {
        self.created >= n && self.published >= n && self.captured >= n && self.paid >= n
    }

    fn values(&self) -> [u64; 4] {
        [self.created, self.published, self.captured, self.paid]
    }
}

const LABELS: [&str; 4] = [
    "orders created",
    "events published",
    "payments captured",
    "orders paid",
];

/// Shows the counts as they change.
pub struct Progress {
    total: u64,
    bars: Option<(MultiProgress, Vec<ProgressBar>)>,
    last_line: Option<(Instant, Counts)>,
}

impl Progress {
    /// Bars if standard output is a terminal, plain lines otherwise.
    pub fn new(total: u64) -> Self {
        let bars = std::io::stdout().is_terminal().then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stdout());
            let style =
                ProgressStyle::with_template("  {prefix:<18} [{bar:40.cyan/blue}] {pos:>7}/{len}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> ");
            let bars = LABELS
                .iter()
                .map(|label| {
                    let bar = multi.add(ProgressBar::new(total));
                    bar.set_style(style.clone());
                    bar.set_prefix(*label);
                    bar
                })
                .collect();
            (multi, bars)
        });
        Self {
            total,
            bars,
            last_line: None,
        }
    }

    /// Shows `counts` (a plain line at most every two seconds).
    pub fn update(&mut self, counts: &Counts, elapsed: Duration) {
        match &self.bars {
            Some((_, bars)) => {
                for (bar, value) in bars.iter().zip(counts.values()) {
                    bar.set_position(value);
                }
            }
            None => {
                if self
                    .last_line
                    .is_none_or(|(at, _)| at.elapsed() >= Duration::from_secs(2))
                {
                    self.line(counts, elapsed);
                }
            }
        }
    }

    /// Shows the final counts.
    pub fn finish(&mut self, counts: &Counts, elapsed: Duration) {
        match self.bars.take() {
            Some((_, bars)) => {
                for (bar, value) in bars.iter().zip(counts.values()) {
                    bar.set_position(value);
                    bar.abandon();
                }
            }
            None => {
                if self.last_line.is_none_or(|(_, shown)| shown != *counts) {
                    self.line(counts, elapsed);
                }
            }
        }
    }

    fn line(&mut self, counts: &Counts, elapsed: Duration) {
        self.last_line = Some((Instant::now(), *counts));
        let parts: Vec<String> = LABELS
            .iter()
            .zip(counts.values())
            .map(|(label, value)| format!("{label} {value}/{}", self.total))
            .collect();
        println!("  [{:>5.1} s] {}", elapsed.as_secs_f64(), parts.join(", "));
    }
}
