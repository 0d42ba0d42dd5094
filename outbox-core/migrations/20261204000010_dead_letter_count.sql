-- The consumers' `outbox_dead_letters` gauge counts, every 5 s, a group's
-- dead letters awaiting an operator: an index-only count over this index,
-- whose size is the number of such rows (a few, normally), whatever the
-- table holds of resolved ones.
CREATE INDEX IF NOT EXISTS ix_dead_letter_dead
    ON dead_letter (consumer) WHERE status = 'dead';
