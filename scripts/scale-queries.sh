#!/usr/bin/env bash
# What the relay's claim, `outbox status`, the backlog gauges and a replay
# time range cost on a large outbox. Creates the database outbox_scale
# afresh, applies the migrations, fills it with generate_series (HISTORY
# published rows over 10 days, BLOCKED unpublished rows of a topic missing
# on the broker, FRESH unpublished rows of a good topic), then times each
# statement RUNS times (psql \timing; server time, planning included) and
# prints the median. The claim is timed twice: with the blocked topic's
# rows in the claim's index, filtered out by `topic <> ALL(...)` as relays
# did before held rows, and with them held (`held_until` set).
#
#   scripts/scale-queries.sh [HISTORY] [BLOCKED] [FRESH] [RUNS]
#   (defaults: 2000000 200000 200000 5)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HISTORY=${1:-2000000}
BLOCKED=${2:-200000}
FRESH=${3:-200000}
RUNS=${4:-5}
DB=outbox_scale
PSQL=(psql -X -q -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1)

"${PSQL[@]}" -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
for f in "$ROOT"/migrations/*.sql; do
    "${PSQL[@]}" -d "$DB" -f "$f" >/dev/null 2>&1
done
echo "== filling: $HISTORY published, $BLOCKED blocked, $FRESH fresh rows"
"${PSQL[@]}" -d "$DB" <<SQL
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic,
                          partition_key, created_at, published_at)
SELECT gen_random_uuid(), 'Order', 'o-' || (g % 50000), 'OrderPlaced',
       '{"n":1,"pad":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}',
       'topic-' || (g % 5), 'k-' || (g % 50000),
       now() - interval '10 days' + g * (interval '10 days' / $HISTORY), now()
FROM generate_series(1, $HISTORY) g;
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
SELECT gen_random_uuid(), 'Order', 'b-' || (g % 50000), 'OrderPlaced', '{"n":1}', 'missing', 'bk-' || (g % 50000)
FROM generate_series(1, $BLOCKED) g;
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
SELECT gen_random_uuid(), 'Order', 'o-' || (g % 50000), 'OrderPlaced', '{"n":1}', 'good', 'k-' || (g % 50000)
FROM generate_series(1, $FRESH) g;
VACUUM ANALYZE outbox_event;
SQL

# The claim as the relay runs it (without the byte-budget windows and the
# lock-session check): 2,000 rows, this relay owning lanes $OTHERS excluded.
claim() {
    local others=$1 extra=$2
    cat <<SQL
BEGIN; SET LOCAL enable_seqscan = off;
SELECT count(*) FROM (
SELECT id, payload::text AS payload, ctid::text AS tid,
       CASE WHEN (SELECT EXISTS (SELECT 1 FROM outbox_event
                                 WHERE held_until IS NOT NULL AND published_at IS NULL))
            THEN (SELECT EXTRACT(EPOCH FROM h.held_until - statement_timestamp())::float8
                  FROM outbox_event h
                  WHERE h.held_until IS NOT NULL AND h.published_at IS NULL
                    AND h.topic = outbox_event.topic
                    AND h.partition_key = outbox_event.partition_key
                    AND h.id < outbox_event.id
                  ORDER BY h.topic, h.partition_key, h.id LIMIT 1)
       END AS behind_held_secs
FROM outbox_event
WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
  AND partition_key <> ALL('{}'::text[]) $extra
  AND ((hashtext(partition_key) & 2147483647) % 16) <> ALL('$others'::int4[])
ORDER BY id LIMIT 2000 FOR UPDATE SKIP LOCKED) c;
ROLLBACK;
SQL
}

# Median of RUNS timings of the statement(s) on stdin (the slowest
# statement of each run: the one that does the work).
time_it() {
    local sql
    sql=$(cat)
    for _ in $(seq "$RUNS"); do
        { echo '\timing on'; echo "$sql"; } | "${PSQL[@]}" -d "$DB" 2>&1 |
            sed -n 's/^Time: \([0-9.]*\) ms.*/\1/p' | sort -n | tail -1
    done | sort -n | awk '{ a[NR] = $1 } END { printf "%8.1f ms\n", a[int((NR + 1) / 2)] }'
}

report() { printf '%-58s' "$1"; time_it; }

TWO='{8,9,10,11,12,13,14,15}'
SIXTEEN='{1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}'
echo "== claim of 2,000 rows (median of $RUNS)"
report "blocked rows in the index, filtered (before), 1 relay" < <(claim '{}' "AND topic <> ALL('{missing}'::text[])")
report "blocked rows in the index, filtered (before), 2 relays" < <(claim "$TWO" "AND topic <> ALL('{missing}'::text[])")
# Before the hold, the claim's index holds the whole backlog, as before.
report "gauges before: count and min(created_at) over the backlog" <<SQL
SELECT (SELECT count(*) FROM outbox_event
        WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL),
       (SELECT min(created_at) FROM outbox_event
        WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL);
SQL
"${PSQL[@]}" -d "$DB" -c "UPDATE outbox_event SET held_until = now() + interval '1 day'
                          WHERE topic = 'missing' AND published_at IS NULL" -c "VACUUM ANALYZE outbox_event"
report "blocked rows held, 1 relay" < <(claim '{}' "")
report "blocked rows held, 2 relays (8 of 16 lanes)" < <(claim "$TWO" "")
report "blocked rows held, 16 relays (1 of 16 lanes)" < <(claim "$SIXTEEN" "")

echo "== operations (median of $RUNS)"
report "status before: GROUP BY topic over the table" <<SQL
SELECT topic, count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL),
  min(created_at) FILTER (WHERE published_at IS NULL AND parked_at IS NULL),
  count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NOT NULL AND discarded_at IS NULL),
  count(*) FILTER (WHERE discarded_at IS NOT NULL), count(*) FILTER (WHERE published_at IS NOT NULL)
FROM outbox_event GROUP BY topic;
SQL
report "status now: backlog per topic over the partial indexes" <<SQL
WITH q AS (SELECT topic, count(*) AS n, min(id) AS first FROM outbox_event
           WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL GROUP BY topic),
     h AS (SELECT topic, count(*) AS n, min(id) AS first FROM outbox_event
           WHERE held_until IS NOT NULL AND published_at IS NULL GROUP BY topic),
     p AS (SELECT topic, count(*) AS n FROM outbox_event
           WHERE parked_at IS NOT NULL AND published_at IS NULL GROUP BY topic)
SELECT topic, (SELECT created_at FROM outbox_event o WHERE o.id = least(q.first, h.first))
FROM q FULL JOIN h USING (topic) FULL JOIN p USING (topic);
SQL
report "status now: published per topic, estimated" <<SQL
SELECT v.topic, sum(v.freq * greatest(c.reltuples, 0)) FROM pg_class c
JOIN pg_stats s ON s.tablename = c.relname AND s.attname = 'topic' AND NOT s.inherited
CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs) AS v(topic, freq)
WHERE c.oid = 'outbox_event'::regclass GROUP BY v.topic;
SQL
report "gauges now: index-only counts, the queue's first entry" <<SQL
SELECT (SELECT count(*) FROM outbox_event
        WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL),
       (SELECT count(*) FROM outbox_event WHERE held_until IS NOT NULL AND published_at IS NULL),
       (SELECT created_at FROM outbox_event
        WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL ORDER BY id LIMIT 1);
SQL
report "replay 10-minute window before: filter over the table" <<SQL
SET enable_bitmapscan = off;
SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL
  AND created_at >= now() - interval '5 days' AND created_at < now() - interval '5 days' + interval '10 minutes';
SQL
report "replay 10-minute window now: ids through the BRIN index" <<SQL
SELECT min(id), max(id) FROM (SELECT id FROM outbox_event
  WHERE created_at >= now() - interval '5 days' AND created_at < now() - interval '5 days' + interval '10 minutes'
  OFFSET 0) r;
SQL
