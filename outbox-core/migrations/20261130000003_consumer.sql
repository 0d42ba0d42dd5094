-- Consumer side: the inbox gets what its processor needs (strict received
-- order, the Kafka coordinates, the event's identity and headers, retry
-- bookkeeping), and a dead-letter table takes what a consumer cannot apply.
-- The guide's columns and its partial index stay as they are.

-- inbox_event: `seq` is the received order (one consumer stores a
-- partition's messages in offset order, batch after batch). The new columns
-- are nullable so rows written by other tools keep fitting; the consumer
-- always fills them.
ALTER TABLE inbox_event
    ADD COLUMN IF NOT EXISTS seq              bigint GENERATED ALWAYS AS IDENTITY,
    ADD COLUMN IF NOT EXISTS consumer         text,
    ADD COLUMN IF NOT EXISTS topic            text,
    ADD COLUMN IF NOT EXISTS "partition"      integer,
    ADD COLUMN IF NOT EXISTS "offset"         bigint,
    ADD COLUMN IF NOT EXISTS partition_key    text,
    ADD COLUMN IF NOT EXISTS event_type       text,
    ADD COLUMN IF NOT EXISTS event_version    integer NOT NULL DEFAULT 1,
    ADD COLUMN IF NOT EXISTS headers          jsonb   NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN IF NOT EXISTS attempts         integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_error       text,
    ADD COLUMN IF NOT EXISTS last_attempt_at  timestamptz,
    ADD COLUMN IF NOT EXISTS next_attempt_at  timestamptz,
    ADD COLUMN IF NOT EXISTS dead_lettered_at timestamptz;

-- The processor's queue: pending rows in received order. Keyed on `seq`
-- alone, so that storing a row appends to the index's rightmost page (a
-- wider key costs the ingest a third of its rate).
CREATE INDEX IF NOT EXISTS ix_inbox_event_pending
    ON inbox_event (seq)
    WHERE NOT processed AND dead_lettered_at IS NULL;

-- Rows waiting for a retry: they hold back the later rows of their key.
-- Small: only rows whose handler failed at least once are in it.
CREATE INDEX IF NOT EXISTS ix_inbox_event_retrying
    ON inbox_event (consumer, topic, partition_key, seq)
    WHERE NOT processed AND dead_lettered_at IS NULL AND next_attempt_at IS NOT NULL;

-- Like the outbox, the inbox churns (insert, then update of processed).
ALTER TABLE inbox_event SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.01
);

-- Messages a consumer could not apply: malformed input (kept byte for byte)
-- and events whose handler kept failing. One row per consumer and Kafka
-- message. `outbox dead-letters retry` sets status = 'retry'; the consumer
-- of that group picks the row up, runs it again and sets 'resolved' (or
-- 'dead' again, with the new error).
CREATE TABLE IF NOT EXISTS dead_letter (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer           text        NOT NULL,
    topic              text        NOT NULL,
    "partition"        integer     NOT NULL,
    "offset"           bigint      NOT NULL,
    key                bytea,
    event_id           uuid,
    event_type         text,
    headers            jsonb       NOT NULL DEFAULT '{}'::jsonb,
    payload            bytea,
    reason             text        NOT NULL CHECK (reason IN (
                           'not_json', 'no_event_id', 'unknown_event_type',
                           'payload_mismatch', 'oversized', 'handler_failed')),
    error              text        NOT NULL,
    handler            text,
    attempts           integer     NOT NULL DEFAULT 0,
    created_at         timestamptz NOT NULL DEFAULT now(),
    last_failed_at     timestamptz NOT NULL DEFAULT now(),
    status             text        NOT NULL DEFAULT 'dead'
                           CHECK (status IN ('dead', 'retry', 'resolved')),
    retry_requested_at timestamptz,
    retries            integer     NOT NULL DEFAULT 0,
    resolved_at        timestamptz,
    UNIQUE (consumer, topic, "partition", "offset")
);

-- What consumers poll for: rows an operator asked to retry.
CREATE INDEX IF NOT EXISTS ix_dead_letter_retry
    ON dead_letter (consumer, id) WHERE status = 'retry';

CREATE INDEX IF NOT EXISTS ix_dead_letter_event
    ON dead_letter (event_id) WHERE event_id IS NOT NULL;
