//! Which outbox: several services may keep their outboxes in one database,
//! one schema each, each found through its connections' `search_path`.
//! Relays, cleanup jobs and `outbox status` coordinate through PostgreSQL
//! advisory locks (lanes, relay membership, the wake-up lock, the cleanup
//! leader) and a NOTIFY channel. Advisory locks and channels are per
//! database, so all of them are derived here from the oid of the outbox
//! table — the wake-up trigger derives its lock and channel from the same
//! oid (`TG_RELID`) — and the relays of one outbox never meet those of
//! another.
//!
//! Lock keys use the one-key (`bigint`) form `oid << 32 | kind << 24 |
//! value`: in `pg_locks` they show as `classid` = the table's oid, `objid` =
//! `kind << 24 | value`, `objsubid` = 1. Values are lane numbers, lane
//! counts and backend pids (below 2²² on Linux), all below 2²⁴.

use sqlx::PgExecutor;

use crate::error::{Error, Result};

/// The kinds of advisory lock of one outbox (the `kind` of the key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Lock {
    /// Ownership of a lane (value: the lane), held by a relay's lane session.
    Lane = 1,
    /// A lane in use by a claim transaction (value: the lane), held shared.
    InUse = 2,
    /// Relay membership (value: the backend pid of its lane session).
    Member = 3,
    /// The lane count a relay runs with (value: the count; 0 = no lanes),
    /// held shared.
    Count = 4,
    /// Held by a relay waiting for work; the trigger probes it.
    Wake = 5,
    /// The cleanup leader.
    Cleanup = 6,
    /// Topics held as missing in the progress mode: read under it held
    /// shared, released under it held exclusively (see
    /// `relay::progress::Skip`).
    HeldTopics = 7,
}

/// One outbox table, by oid. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OutboxScope {
    oid: u32,
}

impl OutboxScope {
    /// The outbox that `executor`'s `search_path` finds (`outbox_event`).
    pub async fn of<'e>(executor: impl PgExecutor<'e>) -> Result<Self> {
        let oid: Option<i64> = sqlx::query_scalar("SELECT to_regclass('outbox_event')::oid::int8")
            .fetch_one(executor)
            .await?;
        let oid = oid.ok_or_else(|| {
            Error::Config(
                "no `outbox_event` table in the connection's search_path: run `outbox migrate` \
                 (with the same --schema or search_path)"
                    .into(),
            )
        })?;
        u32::try_from(oid)
            .map(Self::from_oid)
            .map_err(|_| Error::Config(format!("unexpected table oid {oid}")))
    }

    /// The outbox whose table has this oid.
    pub fn from_oid(oid: u32) -> Self {
        Self { oid }
    }

    /// The outbox table's oid.
    pub fn oid(&self) -> u32 {
        self.oid
    }

    /// The NOTIFY channel of this outbox's wake-up trigger:
    /// `outbox_event_<oid>`.
    pub fn channel(&self) -> String {
        format!("outbox_event_{}", self.oid)
    }

    /// The advisory lock a relay of this outbox holds while it waits for
    /// work; writers notify only while it is held.
    pub fn wake_lock(&self) -> i64 {
        self.key(Lock::Wake, 0)
    }

    /// The advisory lock of this outbox's cleanup leader.
    pub fn cleanup_lock(&self) -> i64 {
        self.key(Lock::Cleanup, 0)
    }

    /// The key of a lock of `kind` on `value`.
    pub(crate) fn key(&self, kind: Lock, value: i32) -> i64 {
        self.base(kind) | i64::from(value & 0x00FF_FFFF)
    }

    /// The key of a lock of `kind` on value 0, to be or-ed with a value in SQL.
    pub(crate) fn base(&self, kind: Lock) -> i64 {
        ((u64::from(self.oid) << 32) | (u64::from(kind as u8) << 24)) as i64
    }

    /// The `objid` of `pg_locks` for a lock of `kind` (on value 0).
    pub(crate) fn objid(kind: Lock) -> i64 {
        i64::from(kind as u8) << 24
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_put_the_oid_in_the_high_half_and_kind_and_value_in_the_low() {
        let scope = OutboxScope::from_oid(16_384);
        assert_eq!(scope.key(Lock::Lane, 7), (16_384_i64 << 32) | (1 << 24) | 7);
        assert_eq!(scope.wake_lock() >> 32, 16_384);
        assert_eq!(scope.wake_lock() & 0xFFFF_FFFF, 5 << 24);
        assert_eq!(scope.cleanup_lock() & 0xFFFF_FFFF, 6 << 24);
        assert_eq!(scope.channel(), "outbox_event_16384");
        // Oids above 2^31 wrap into negative keys with the same bits, as
        // PostgreSQL's `oid::int8 << 32` does.
        let high = OutboxScope::from_oid(3_000_000_000);
        assert_eq!(
            (high.key(Lock::Member, 4_194_303) as u64) >> 32,
            3_000_000_000
        );
        assert_eq!(high.key(Lock::Member, 4_194_303) & 0xFF_FFFF, 4_194_303);
    }

    #[test]
    fn two_tables_never_share_a_key() {
        let (a, b) = (OutboxScope::from_oid(1), OutboxScope::from_oid(2));
        for kind in [
            Lock::Lane,
            Lock::InUse,
            Lock::Member,
            Lock::Count,
            Lock::Wake,
            Lock::Cleanup,
        ] {
            assert_ne!(a.key(kind, 3), b.key(kind, 3));
        }
        assert_ne!(a.channel(), b.channel());
    }
}
