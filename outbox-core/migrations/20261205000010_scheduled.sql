-- Scheduled messages (`UnitOfWork::record_at`, `record_after`): a row with a
-- `due_at` is published at or after that time, never before. It is written
-- with `held_until = due_at` as well, so it stays out of the claim's index
-- like a held row until the relay's release of held rows puts it back once
-- due. NULL: publish now (every row written before this migration).
-- Adding a nullable column without a default does not rewrite the table.
ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS due_at timestamptz;

-- A scheduled row is ordered by its time, not by its id: it must not hold
-- back the rows of its key written after it. The claim's probe for an
-- earlier held row of a key therefore leaves rows that ever had a `due_at`
-- out, and its index with them (else a million timeouts a week ahead would
-- be in it, and every claim would probe it and walk them).
--
-- Built in this migration's transaction, not CONCURRENTLY: `outbox_event`
-- may be partitioned (`outbox partitions enable`), where PostgreSQL cannot
-- build an index concurrently. The build reads the table once (only held
-- rows enter the index: nothing to sort); the table's writers wait for it.
-- On a large outbox, build it before upgrading and this statement skips it:
-- plain table:
--   CREATE INDEX CONCURRENTLY ix_outbox_event_held_key_unscheduled
--       ON outbox_event (topic, partition_key, id)
--       WHERE held_until IS NOT NULL AND published_at IS NULL AND due_at IS NULL;
-- (after `ALTER TABLE outbox_event ADD COLUMN due_at timestamptz`); on the
-- partitioned layout, `CREATE INDEX … ON ONLY outbox_event`, the same index
-- CONCURRENTLY on each partition, then `ALTER INDEX … ATTACH PARTITION`
-- for each (see README.md in this directory).
CREATE INDEX IF NOT EXISTS ix_outbox_event_held_key_unscheduled
    ON outbox_event (topic, partition_key, id)
    WHERE held_until IS NOT NULL AND published_at IS NULL AND due_at IS NULL;
DROP INDEX IF EXISTS ix_outbox_event_held_key;
ALTER INDEX ix_outbox_event_held_key_unscheduled RENAME TO ix_outbox_event_held_key;
