-- The web console's audit trail: every write an operator makes through it
-- (requeue or drop of parked outbox rows, retry or drop of dead letters),
-- who made it, on which rows, why and when. Written in the transaction of
-- the change itself: a change without its record never commits.
CREATE TABLE IF NOT EXISTS outbox_audit (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    operator  text        NOT NULL,
    action    text        NOT NULL CHECK (action IN (
                  'parked_requeue', 'parked_drop', 'dead_letter_retry', 'dead_letter_drop')),
    ids       bigint[]    NOT NULL,
    affected  bigint      NOT NULL,
    reason    text        NOT NULL CHECK (length(reason) BETWEEN 1 AND 1000),
    client    text
);

-- Open dead letters (waiting for an operator or a retry), by group: what
-- the console counts per consumer group and lists by default, without
-- reading the resolved ones.
CREATE INDEX IF NOT EXISTS ix_dead_letter_open
    ON dead_letter (consumer, id) WHERE status <> 'resolved';
