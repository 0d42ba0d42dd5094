-- Consumer safety against application mistakes and hostile input.

-- 1. The inbox is keyed per consumer group: two groups consuming one topic
--    into one database each keep their own row of an event (keyed on
--    event_id alone, the second group took the first group's rows for
--    duplicates and never applied those events). Rows written without a
--    consumer (by other tools) keep fitting, under the empty name.
UPDATE inbox_event SET consumer = '' WHERE consumer IS NULL;
ALTER TABLE inbox_event ALTER COLUMN consumer SET DEFAULT '';
ALTER TABLE inbox_event ALTER COLUMN consumer SET NOT NULL;
ALTER TABLE inbox_event DROP CONSTRAINT IF EXISTS inbox_event_pkey;
ALTER TABLE inbox_event ADD CONSTRAINT inbox_event_pkey PRIMARY KEY (consumer, event_id);

-- 2. A handler cannot commit the consumer's transaction. Every transaction
--    in which the consumer runs handlers first upserts its backend's row
--    here; the deferred constraint trigger runs at COMMIT and refuses it
--    unless the consumer itself said so (`outbox.commit`, set transaction-
--    locally by the consumer's last statement before its own COMMIT). A
--    `COMMIT` sent by a handler through its connection therefore fails and
--    rolls everything back, and the consumer dead-letters that event. One
--    row per backend, unlogged: it holds nothing worth keeping.
CREATE UNLOGGED TABLE IF NOT EXISTS outbox_tx_guard (
    pid      integer     PRIMARY KEY,
    armed_at timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION outbox_tx_guard_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.commit', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'COMMIT refused: a handler ended the consumer''s transaction (the consumer commits a handler''s work together with its bookkeeping)'
            USING ERRCODE = 'invalid_transaction_termination';
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS outbox_tx_guard_check ON outbox_tx_guard;
CREATE CONSTRAINT TRIGGER outbox_tx_guard_check
    AFTER INSERT OR UPDATE ON outbox_tx_guard
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox_tx_guard_check();

-- 3. Dead-letter reasons for hostile messages: headers the consumer cannot
--    trust (a name that is not UTF-8, an identity header given twice with
--    different values, headers over the size limit) and a message without
--    a key.
ALTER TABLE dead_letter DROP CONSTRAINT IF EXISTS dead_letter_reason_check;
ALTER TABLE dead_letter ADD CONSTRAINT dead_letter_reason_check CHECK (reason IN (
    'not_json', 'no_event_id', 'unknown_event_type', 'payload_mismatch', 'oversized',
    'handler_failed', 'invalid_headers', 'no_key'));

-- 4. A dead letter of a message over the size limit keeps a prefix of its
--    payload; `payload_bytes` is then the payload's full size (NULL when the
--    whole payload is kept). Such a letter cannot be re-driven.
ALTER TABLE dead_letter ADD COLUMN IF NOT EXISTS payload_bytes bigint;
