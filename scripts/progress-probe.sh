#!/usr/bin/env bash
# A probe for the progress-per-batch design (docs/design/progress-per-batch.md):
# the WAL and dead tuples of publishing EVENTS outbox rows by marking each one
# (`UPDATE … SET published_at`, 500 per batch, as the relay does) against
# recording one snapshot per batch in a progress row (rows carry their
# transaction id, `txid xid8`). SQL only, no relay: it measures what the
# database writes, not a relay's speed. Prints one line per figure and a JSON
# line. Needs psql; creates and drops the database outbox_progress_probe.
#
#   scripts/progress-probe.sh [EVENTS in thousands (default 100)]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
N="${1:-100}"
DB=outbox_progress_probe
ADMIN="psql -X -q -h 127.0.0.1 -U postgres -d postgres"
P="psql -X -q -t -A -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres -d $DB"
$ADMIN -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
trap '$ADMIN -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)"' EXIT
for f in migrations/2*.sql; do $P -f "$f" >/dev/null 2>&1; done

lsn() { $P -c "SELECT pg_current_wal_lsn()"; }
per_event() { $P -c "SELECT round(pg_wal_lsn_diff('$2', '$1') / ($N * 1000.0))"; }
dead() { $P -c "SELECT pg_stat_force_next_flush()" >/dev/null; $P -c "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_event'"; }
insert() { # N transactions of 1,000 events (~250 bytes of payload), 500 keys
    for _ in $(seq 1 "$N"); do
        echo "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
              SELECT gen_random_uuid(), 'order', 'o' || g, 'placed',
                     jsonb_build_object('n', g, 'note', repeat('x', 200)), 't', 'k' || (g % 500)
              FROM generate_series(1, 1000) g;"
    done | $P
}

$P -c "CHECKPOINT"
a=$(lsn); insert; b=$(lsn); insert_marked=$(per_event "$a" "$b")
$P -c "SELECT pg_stat_reset()" >/dev/null
a=$(lsn)
for _ in $(seq 1 $((N * 2 + 1))); do
    echo "UPDATE outbox_event SET published_at = now() WHERE id IN (
            SELECT id FROM outbox_event
            WHERE published_at IS NULL AND parked_at IS NULL AND held_until IS NULL
            ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED);"
done | $P
b=$(lsn); publish_marked=$(per_event "$a" "$b"); dead_marked=$(dead)

# The progress design's schema: the writer's transaction id, one index on
# (lane_slot, txid) instead of the two partial indexes of unpublished rows.
$P -c "TRUNCATE outbox_event" \
    -c "ALTER TABLE outbox_event ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id()" \
    -c "DROP INDEX ix_outbox_event_unpublished, ix_outbox_event_unpublished_slot" \
    -c "CREATE INDEX ix_outbox_event_txid ON outbox_event (lane_slot, txid)" \
    -c "CREATE TABLE outbox_progress (lane int PRIMARY KEY, snap pg_snapshot NOT NULL)" \
    -c "INSERT INTO outbox_progress VALUES (0, pg_current_snapshot())" \
    -c "CHECKPOINT"
a=$(lsn); insert; b=$(lsn); insert_progress=$(per_event "$a" "$b")
$P -c "SELECT pg_stat_reset()" >/dev/null
a=$(lsn)
# A batch: the rows whose transaction committed between the lane's snapshot
# and a new one (counted here; the relay would read them in id order, in
# chunks); the new snapshot is recorded with the batch.
read=0 batches=0
while :; do
    n=$($P <<'SQL'
BEGIN;
WITH p AS (SELECT snap AS prev, pg_current_snapshot() AS cur FROM outbox_progress WHERE lane = 0 FOR UPDATE),
b AS (SELECT e.id FROM outbox_event e, p
      WHERE e.lane_slot BETWEEN 0 AND 63
        AND e.txid >= pg_snapshot_xmin(p.prev) AND e.txid < pg_snapshot_xmax(p.cur)
        AND NOT pg_visible_in_snapshot(e.txid, p.prev) AND pg_visible_in_snapshot(e.txid, p.cur)),
u AS (UPDATE outbox_progress SET snap = (SELECT cur FROM p) WHERE lane = 0 RETURNING 1)
SELECT count(*) FROM b, u;
COMMIT;
SQL
)
    batches=$((batches + 1)); read=$((read + n))
    [ "$n" = 0 ] && break
done
b=$(lsn); publish_progress=$(per_event "$a" "$b"); dead_progress=$(dead)

echo "insert, today's schema:          $insert_marked B/event"
echo "publish by marking:              $publish_marked B/event, $dead_marked dead tuples"
echo "insert, with txid:               $insert_progress B/event"
echo "publish by progress:             $publish_progress B/event, $dead_progress dead tuples ($read events in $batches snapshots)"
printf '{"events":%d,"insert_marked_wal_per_event":%s,"publish_marked_wal_per_event":%s,"dead_marked":%s,"insert_progress_wal_per_event":%s,"publish_progress_wal_per_event":%s,"dead_progress":%s}\n' \
    $((N * 1000)) "$insert_marked" "$publish_marked" "$dead_marked" "$insert_progress" "$publish_progress" "$dead_progress"
