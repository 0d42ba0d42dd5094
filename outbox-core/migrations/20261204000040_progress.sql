-- Progress per batch (see docs/design/progress-per-batch.md): each outbox
-- row stores the id of the transaction that wrote it, and a relay in the
-- progress mode records how far its lanes are published instead of marking
-- every row it publishes.
--
-- The column is added without a default first, then given one: adding a
-- column with a volatile default would rewrite the table; this way the
-- table is not rewritten (rows written before it keep NULL) and only its
-- lock is taken, briefly. Writing an event assigns the writer's
-- transaction an id anyway: the default costs a column, nothing more.
ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS txid xid8;
ALTER TABLE outbox_event ALTER COLUMN txid SET DEFAULT pg_current_xact_id();

-- Positions, appended: the newest row of a set of lane slots is where they
-- stand. Every event of the slots whose transaction is visible in `done` is
-- published; of the events visible in `upto` and not in `done` (the window
-- being published), those up to the id `after_id`. Rows are only ever
-- inserted (and old ones deleted by the cleanup): a transaction holding the
-- xmin horizon leaves no chain of row versions for the relay to walk, and
-- `recorded_at` says when each position was reached (when an event was
-- published). No row for a slot: the slot is not published in the progress
-- mode.
CREATE TABLE IF NOT EXISTS outbox_progress (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    slots       smallint[]  NOT NULL,
    done        pg_snapshot NOT NULL,
    upto        pg_snapshot,
    after_id    bigint,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((upto IS NULL) = (after_id IS NULL))
);
CREATE INDEX IF NOT EXISTS ix_outbox_progress_slots ON outbox_progress (slots, id);
