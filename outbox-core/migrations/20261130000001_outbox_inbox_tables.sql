-- Transactional outbox: every outgoing event, written in the same transaction
-- as the domain change. Published rows stay (audit, replay); only a retention
-- job deletes them.
CREATE TABLE IF NOT EXISTS outbox_event (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL UNIQUE,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    topic           text        NOT NULL,
    partition_key   text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    -- additions to the guide's schema
    event_version   integer     NOT NULL DEFAULT 1 CHECK (event_version >= 1),
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb
);

-- The relay's hot path: only unpublished rows, in id order.
CREATE INDEX IF NOT EXISTS ix_outbox_event_unpublished
    ON outbox_event (id) WHERE published_at IS NULL;

-- The table churns (insert, then update of published_at): keep statistics
-- fresh so the claim query's plan stays on the partial index.
ALTER TABLE outbox_event SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.01
);

-- Inbox (critical flows): received messages are stored first and processed
-- by a separate task in local transactions.
CREATE TABLE IF NOT EXISTS inbox_event (
    event_id     uuid        PRIMARY KEY,
    received_at  timestamptz NOT NULL DEFAULT now(),
    payload      jsonb       NOT NULL,
    processed    boolean     NOT NULL DEFAULT false,
    processed_at timestamptz
);

CREATE INDEX IF NOT EXISTS ix_inbox_event_unprocessed
    ON inbox_event (received_at) WHERE NOT processed;

-- Consumer-side deduplication (the default mode): one row per consumer and
-- event applied; INSERT ... ON CONFLICT DO NOTHING tells whether it is new.
CREATE TABLE IF NOT EXISTS processed_event (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
