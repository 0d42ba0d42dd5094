-- Progress per batch (see docs/design/progress-per-batch.md): each outbox
-- row stores the id of the transaction that wrote it, and a relay in the
-- progress mode records, per lane slot, the snapshots it has published up
-- to instead of marking every row it publishes.
--
-- The column is added without a default first, then given one: adding a
-- column with a volatile default would rewrite the table; this way the
-- table is not rewritten (rows written before it keep NULL) and only its
-- lock is taken, briefly. Writing an event assigns the writer's
-- transaction an id anyway: the default costs a column, nothing more.
ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS txid xid8;
ALTER TABLE outbox_event ALTER COLUMN txid SET DEFAULT pg_current_xact_id();

-- A lane slot's progress. Every event of the slot whose transaction is
-- visible in `done` is published; the events visible in `upto` and not in
-- `done` (the window being published) are published up to the id `after_id`.
-- No row, no progress: the slot is not published in the progress mode.
CREATE TABLE IF NOT EXISTS outbox_progress (
    slot       smallint    PRIMARY KEY CHECK (slot >= 0 AND slot < 64),
    done       pg_snapshot NOT NULL,
    upto       pg_snapshot,
    after_id   bigint,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((upto IS NULL) = (after_id IS NULL))
);
