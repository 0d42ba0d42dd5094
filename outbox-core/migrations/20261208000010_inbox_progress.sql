-- Progress per batch for the inbox processor (see
-- docs/design/progress-per-batch.md, "The inbox processor"): each inbox row
-- stores the id of the transaction that stored it, and a processor of a
-- consumer in the progress mode records how far each of its partitions is
-- processed instead of marking every row it applies.
--
-- As for the outbox, the column is added without a default, then given
-- one: the table is not rewritten, and rows stored before keep NULL.
ALTER TABLE inbox_event ADD COLUMN IF NOT EXISTS txid xid8;
ALTER TABLE inbox_event ALTER COLUMN txid SET DEFAULT pg_current_xact_id();

-- The consumers in the progress mode, and where their partitions start:
-- every row of the consumer stored by a transaction visible in `start` was
-- processed (or had a state of its own) when the mode was enabled.
CREATE TABLE IF NOT EXISTS inbox_progress_consumer (
    consumer   text        PRIMARY KEY,
    start      pg_snapshot NOT NULL,
    enabled_at timestamptz NOT NULL DEFAULT now()
);

-- Positions, appended (never updated: a transaction holding the xmin
-- horizon leaves no chain of row versions to walk): the newest row of a
-- (consumer, topic, partition) is where it stands. Every row of the
-- partition whose transaction is visible in `done` is processed, or has a
-- state of its own (set aside behind a failure, failed, dead-lettered); of
-- the rows visible in `upto` and not in `done` (the window being
-- processed), those up to the received order `after_seq`.
CREATE TABLE IF NOT EXISTS inbox_progress (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer    text        NOT NULL,
    topic       text        NOT NULL,
    "partition" integer     NOT NULL,
    done        pg_snapshot NOT NULL,
    upto        pg_snapshot,
    after_seq   bigint,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((upto IS NULL) = (after_seq IS NULL))
);
CREATE INDEX IF NOT EXISTS ix_inbox_progress_partition
    ON inbox_progress (consumer, topic, "partition", id);

-- Partition retention's check under the parent's lock (indexes only): a
-- row stored into a partition since its first check (an event id of an old
-- range, redelivered) keeps it. In the progress mode such a row is in no
-- partial index of pending rows; its reception time, summarized per 128
-- pages, tells.
CREATE INDEX IF NOT EXISTS ix_inbox_event_received_brin
    ON inbox_event USING brin (received_at timestamptz_minmax_multi_ops);
