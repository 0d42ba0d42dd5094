-- Several outboxes in one database (one schema per service): the wake-up
-- lock and the NOTIFY channel belong to one outbox table, not to the whole
-- database. Both are derived from the table's oid (`TG_RELID`), as the
-- relays derive theirs: the lock is the one-key advisory lock
-- `oid << 32 | 5 << 24`, the channel `outbox_event_<oid>`. A relay waiting
-- on another schema's outbox no longer makes these writers notify, and a
-- commit here wakes only this outbox's relays.
CREATE OR REPLACE FUNCTION outbox_event_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared((TG_RELID::int8 << 32) | (5 << 24)) THEN
        PERFORM pg_notify('outbox_event_' || TG_RELID::int8, '');
    END IF;
    RETURN NULL;
END;
$$;
