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

-- Wake-up of idle relays: a NOTIFY at commit, sent only while a relay is
-- waiting for work. NOTIFY takes a cluster-wide lock at commit that
-- serializes concurrent committers, so it is skipped while relays are busy
-- (they claim again right away anyway). A waiting relay holds the advisory
-- lock 8031453476610924407 ("outbox_w") exclusively on its LISTEN
-- connection; a writer that can take it shared knows no relay waits.
-- `outbox notify off` disables the trigger (relays then poll).
CREATE OR REPLACE FUNCTION outbox_event_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(8031453476610924407) THEN
        PERFORM pg_notify('outbox_event', '');
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS outbox_event_notify ON outbox_event;
CREATE TRIGGER outbox_event_notify
    AFTER INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();
