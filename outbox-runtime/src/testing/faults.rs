//! Fault modes of the [`TestBus`](super::TestBus): what a broker and a
//! crashing consumer do to an application, on demand — and [`FailTimes`],
//! a handler that fails its first calls.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use outbox_core::{HandlerContext, HandlerFuture, InboxHandler};

use crate::inbox::harness::Message;

/// How the bus misbehaves. Combine them:
///
/// ```
/// use outbox_runtime::testing::Faults;
/// let faults = Faults::new().deliver_twice().redeliver_batches().interleave_keys(7);
/// # let _ = faults;
/// ```
#[derive(Debug, Clone, Default)]
pub struct Faults {
    pub(super) twice: bool,
    pub(super) redeliver: bool,
    interleave: Option<u64>,
}

impl Faults {
    /// No fault (the default).
    pub fn new() -> Self {
        Self::default()
    }

    /// Every event reaches the broker twice, as when a relay dies between
    /// the broker's acknowledgement and its own commit: each message is
    /// followed by a copy at the next offset.
    pub fn deliver_twice(mut self) -> Self {
        self.twice = true;
        self
    }

    /// Every batch is delivered again after its transaction committed, as
    /// when the consumer dies between the database commit and the offset
    /// commit (same offsets).
    pub fn redeliver_batches(mut self) -> Self {
        self.redeliver = true;
        self
    }

    /// Messages of different keys are interleaved (pseudo-randomly, from
    /// `seed`), as consumers of several partitions see them; each key's
    /// messages keep their order.
    pub fn interleave_keys(mut self, seed: u64) -> Self {
        self.interleave = Some(seed);
        self
    }

    /// The order a consumer receives `messages` in.
    pub(super) fn arrange<'m>(&self, messages: Vec<&'m Message>) -> Vec<&'m Message> {
        let Some(seed) = self.interleave else {
            return messages;
        };
        let mut keys: Vec<(&[u8], VecDeque<&'m Message>)> = Vec::new();
        for m in &messages {
            let key = m.key.as_deref().unwrap_or_default();
            match keys.iter_mut().find(|(k, _)| *k == key) {
                Some((_, queue)) => queue.push_back(m),
                None => keys.push((key, VecDeque::from([*m]))),
            }
        }
        // xorshift64*: deterministic, no dependency.
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        let mut out = Vec::with_capacity(messages.len());
        while !keys.is_empty() {
            let i = (next() % keys.len() as u64) as usize;
            if let Some(m) = keys[i].1.pop_front() {
                out.push(m);
            }
            if keys[i].1.is_empty() {
                keys.remove(i);
            }
        }
        out
    }
}

/// A handler that fails its first `n` calls (with an error naming the
/// injected failure), then runs `handler`: registered in its place, it
/// drives the consumer's retries and dead letters.
///
/// ```no_run
/// # use outbox_runtime::{Consumer, testing::{FailTimes, TestBus}};
/// # fn f(pool: sqlx::PgPool, charge_order: impl outbox_core::InboxHandler) {
/// let bus = TestBus::new().service(
///     Consumer::builder(pool).group("billing").handler(FailTimes::new(charge_order, 2)),
/// );
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct FailTimes<H> {
    handler: H,
    left: Arc<AtomicU32>,
}

impl<H: InboxHandler> FailTimes<H> {
    /// `handler`, failing its first `n` calls.
    pub fn new(handler: H, n: u32) -> Self {
        Self {
            handler,
            left: Arc::new(AtomicU32::new(n)),
        }
    }

    /// Injected failures not yet used.
    pub fn left(&self) -> u32 {
        self.left.load(Ordering::Relaxed)
    }
}

impl<H: InboxHandler> InboxHandler for FailTimes<H> {
    type Event = H::Event;
    const NAME: &'static str = H::NAME;

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut HandlerContext<'c>,
        event: Self::Event,
    ) -> HandlerFuture<'a>
    where
        'c: 'a,
    {
        let failing = self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            Box::pin(async { Err("injected failure (FailTimes)".into()) })
        } else {
            self.handler.handle(ctx, event)
        }
    }
}
