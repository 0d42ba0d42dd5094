//! The HTTP traffic: a few bad requests that must be refused, the stream of
//! orders, and one `GET` to show an order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::prelude::Uuid;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// An order the service accepted.
#[derive(Debug, Clone, Copy)]
pub struct Order {
    /// Its id, from the `201` answer.
    pub id: Uuid,
    /// The amount sent.
    pub amount_cents: i64,
}

/// The outcome of sending the orders.
#[derive(Debug)]
pub struct Sent {
    /// The orders answered `201 Created`.
    pub orders: Vec<Order>,
    /// The requests that failed, with why.
    pub failures: Vec<String>,
    /// How long sending took.
    pub elapsed: Duration,
}

/// The bad requests sent and what was wrong with their answers.
#[derive(Debug)]
pub struct Refused {
    /// How many bad requests were sent.
    pub count: usize,
    /// Answers that were not a 4xx with a JSON error.
    pub problems: Vec<String>,
}

/// Sends requests the service must refuse, prints each answer.
pub async fn bad_requests(client: &reqwest::Client, base: &str) -> Refused {
    let cases: [(&str, &str); 6] = [
        ("malformed JSON", r#"{"customer": "ann", "amount_cents": "#),
        ("zero amount", r#"{"customer": "ann", "amount_cents": 0}"#),
        (
            "negative amount",
            r#"{"customer": "ann", "amount_cents": -500}"#,
        ),
        (
            "unknown field",
            r#"{"customer": "ann", "amount_cents": 500, "coupon": "FREE"}"#,
        ),
        (
            "wrong type",
            r#"{"customer": "ann", "amount_cents": "500"}"#,
        ),
        (
            "NUL in the name",
            r#"{"customer": "a\u0000b", "amount_cents": 500}"#,
        ),
    ];
    let mut problems = Vec::new();
    for (what, body) in cases {
        let answer = client
            .post(format!("{base}/orders"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await;
        match answer {
            Ok(response) => {
                let status = response.status();
                let body: Value = response.json().await.unwrap_or(Value::Null);
                let error = body["error"].as_str().unwrap_or_default();
                println!("  {what:<18}{} {}", status.as_u16(), shorten(error, 110));
                if !status.is_client_error() || error.is_empty() {
                    problems.push(format!(
                        "{what}: answered {status} {body}, not a 4xx with an error"
                    ));
                }
            }
            Err(e) => problems.push(format!("{what}: request failed: {e}")),
        }
    }
    Refused {
        count: cases.len(),
        problems,
    }
}

fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let cut: String = s.chars().take(max).collect();
        format!("{cut}…")
    }
}

/// Sends `n` orders, `concurrency` at a time, at most `rate` a second.
pub async fn orders(
    client: reqwest::Client,
    base: String,
    n: u64,
    concurrency: usize,
    rate: Option<u32>,
) -> Sent {
    let started = Instant::now();
    let url = Arc::new(format!("{base}/orders"));
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut pace = rate.map(|r| {
        let mut pace = tokio::time::interval(Duration::from_secs(1) / r);
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        pace
    });
    let mut tasks = JoinSet::new();
    for i in 0..n {
        if let Some(pace) = &mut pace {
            pace.tick().await;
        }
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break;
        };
        let (client, url) = (client.clone(), url.clone());
        tasks.spawn(async move {
            let _slot = slot;
            place(&client, &url, i).await
        });
    }
    let mut sent = Sent {
        orders: Vec::with_capacity(n as usize),
        failures: Vec::new(),
        elapsed: Duration::ZERO,
    };
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(Ok(order)) => sent.orders.push(order),
            Ok(Err(e)) => sent.failures.push(e),
            Err(e) => sent.failures.push(format!("request task failed: {e}")),
        }
    }
    sent.elapsed = started.elapsed();
    sent
}

/// Attempts of one order: the service answers `503` when it is over its
/// limits (too many requests in progress, a request past its timeout).
const ATTEMPTS: u32 = 30;

/// How long to wait before attempt `attempt + 1` of order `i`: what the
/// service asked (`Retry-After`), else a doubling delay (capped at 2 s),
/// plus up to half a second spread over the orders so that they do not all
/// come back at once.
fn pause(i: u64, attempt: u32, retry_after: Option<u64>) -> Duration {
    let base = match retry_after {
        Some(secs) => Duration::from_secs(secs.min(10)),
        None => Duration::from_millis((100_u64 << attempt.min(5)).min(2_000)),
    };
    base + Duration::from_millis((i * 7919 + u64::from(attempt) * 104_729) % 500)
}

/// One order: a customer among a few dozen, an amount between 1.00 and
/// 999.99. Sent with an `Idempotency-Key` (`demo-order-<i>`: the databases
/// are new each run), so that a retry after a `503` or a lost answer cannot
/// place it twice; retried up to [`ATTEMPTS`] times.
pub async fn place(client: &reqwest::Client, url: &str, i: u64) -> Result<Order, String> {
    place_for(client, url, i, &format!("customer-{}", i % 37)).await
}

/// [`place`], for `customer`.
pub async fn place_for(
    client: &reqwest::Client,
    url: &str,
    i: u64,
    customer: &str,
) -> Result<Order, String> {
    let amount_cents = 100 + (i as i64 * 7919) % 99_900;
    let body = json!({ "customer": customer, "amount_cents": amount_cents });
    let key = format!("demo-order-{i}");
    let mut attempt = 1;
    let (status, answer) = loop {
        let (why, retry_after) = match client
            .post(url)
            .header("idempotency-key", &key)
            .json(&body)
            .send()
            .await
        {
            Err(e) => (e.to_string(), None),
            Ok(response) => {
                let status = response.status();
                let retry_after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()?.parse().ok());
                let answer: Value = response
                    .json()
                    .await
                    .map_err(|e| format!("order {i}: {status}, unreadable answer: {e}"))?;
                if status != reqwest::StatusCode::SERVICE_UNAVAILABLE {
                    break (status, answer);
                }
                (format!("{status} {answer}"), retry_after)
            }
        };
        if attempt >= ATTEMPTS {
            return Err(format!("order {i}: {why} ({attempt} attempts)"));
        }
        tokio::time::sleep(pause(i, attempt, retry_after)).await;
        attempt += 1;
    };
    if status != reqwest::StatusCode::CREATED {
        return Err(format!("order {i}: {status} {answer}"));
    }
    let id = answer["id"]
        .as_str()
        .and_then(|id| id.parse().ok())
        .ok_or_else(|| format!("order {i}: no id in {answer}"))?;
    Ok(Order { id, amount_cents })
}

/// `GET /orders/{id}`, as text.
pub async fn show(client: &reqwest::Client, base: &str, id: Uuid) -> String {
    match client.get(format!("{base}/orders/{id}")).send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            let body = response.text().await.unwrap_or_default();
            format!("{status} {body}")
        }
        Err(e) => format!("request failed: {e}"),
    }
}
