-- Lane slots: each row stores, at insert, the slot of its partition key
-- (`(hashtext(partition_key) & 2147483647) % 64`), and the claim's index of
-- relays with lanes holds it beside the id. A lane is a fixed set of slots
-- (lane = slot % L, so L must divide 64), and a relay owning some lanes
-- walks only the index ranges of its lanes' slots, merged in id order: it
-- reads about its batch, however many rows other relays' lanes hold (a
-- relay owning every lane keeps walking ix_outbox_event_unpublished). For the lane counts
-- earlier versions accepted that divide 64 a row keeps its lane
-- (hash % 64 % L = hash % L).
--
-- Adding a stored generated column rewrites the table (and its indexes)
-- under an exclusive lock: on a large outbox, plan the downtime (or drain
-- and clean up first). Relays of earlier versions do not know the slots and
-- accept other lane counts: stop them before applying this migration.
ALTER TABLE outbox_event ADD COLUMN IF NOT EXISTS lane_slot smallint
    GENERATED ALWAYS AS (((hashtext(partition_key) & 2147483647) % 64)::smallint) STORED;

-- The claim's index with lanes: unpublished, not parked, not held, by slot
-- and id. The claim without lanes keeps walking ix_outbox_event_unpublished.
-- The predicate is written as one expression (the same rows as the three
-- conditions): a slot's range is then found only here. Written as the three
-- conditions, the planner may walk ix_outbox_event_unpublished in id order
-- filtering by slot instead, reading every lane's rows.
CREATE INDEX IF NOT EXISTS ix_outbox_event_unpublished_slot
    ON outbox_event (lane_slot, id)
    WHERE coalesce(published_at, parked_at, held_until) IS NULL;
