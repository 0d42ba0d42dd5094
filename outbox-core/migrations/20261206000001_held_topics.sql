-- Topics missing on the broker, in the progress mode: one row per topic,
-- not a hold written on each of its rows. A relay that finds a topic
-- missing records it here with the finish of the batch that met it; the
-- lanes' windows then pass over the topic's rows without writing them
-- (the positions move on), and once the broker has the topic, one
-- statement gives the rows passed over a hold that has ended, and the
-- relays publish them, each key in order.
--
-- `since`: every row of the topic whose transaction is visible in it was
-- published (or has a state of its own) before the topic went missing; a
-- row of the topic not visible in it is waiting, whatever the positions
-- say. When several lanes meet the topic, it is the intersection of their
-- positions (the lowest). `rows`: how many rows the windows passed over,
-- for `status` and the gauges (counted when passed; a row read again after
-- a relay restarted counts again).
CREATE TABLE IF NOT EXISTS outbox_held_topic (
    topic      text        PRIMARY KEY,
    since      pg_snapshot NOT NULL,
    reason     text        NOT NULL,
    rows       bigint      NOT NULL DEFAULT 0,
    held_at    timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
