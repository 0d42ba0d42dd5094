-- Relay bookkeeping: delivery attempts, the last error, and parking of rows
-- that keep failing (poison events). Parked rows leave the hot path and the
-- partial index; `outbox parked requeue` puts them back.
ALTER TABLE outbox_event
    ADD COLUMN IF NOT EXISTS attempts        integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_error      text,
    ADD COLUMN IF NOT EXISTS last_attempt_at timestamptz,
    ADD COLUMN IF NOT EXISTS parked_at       timestamptz;

DROP INDEX IF EXISTS ix_outbox_event_unpublished;
CREATE INDEX ix_outbox_event_unpublished
    ON outbox_event (id) WHERE published_at IS NULL AND parked_at IS NULL;

CREATE INDEX IF NOT EXISTS ix_outbox_event_parked
    ON outbox_event (id) WHERE parked_at IS NOT NULL AND published_at IS NULL;

-- Wake-up of idle relays: one NOTIFY per inserting statement (a Unit of Work
-- inserts its events with one statement), delivered at commit. Writers that
-- do not want the cost disable it with
-- `ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_notify`
-- (`outbox notify off`); relays then rely on their poll interval.
CREATE OR REPLACE FUNCTION outbox_event_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_event', '');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS outbox_event_notify ON outbox_event;
CREATE TRIGGER outbox_event_notify
    AFTER INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();
