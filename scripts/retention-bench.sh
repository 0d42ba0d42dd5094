#!/usr/bin/env bash
# What a retention pass costs the writers: commit latency of pgbench writers
# (one outbox row per transaction, UUIDv7 ids, a fixed rate) alone, then
# while `outbox cleanup --older-than 30d` removes ROWS published rows of 36
# days ago, for both layouts:
#   unpartitioned  the old rows deleted in batches of 1,000;
#   partitioned    `outbox partitions enable`, the old rows in their own
#                  (dated) partition, which the pass drops.
# Prints one line per run (p50/p99/max of the writers' transactions, the
# cleanup's wall time) and a JSON line. Needs psql and pgbench; creates and
# drops the database outbox_retention_bench.
#
#   scripts/retention-bench.sh [ROWS (default 10000000)] [RATE (default 400)] [SECONDS (default 40)]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROWS="${1:-10000000}" RATE="${2:-400}" SECONDS_="${3:-40}"
DB=outbox_retention_bench
ADMIN="postgres://postgres@127.0.0.1:5432/postgres"
export DATABASE_URL="postgres://postgres@127.0.0.1:5432/$DB"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# PROFILE=debug reuses a debug build (the figures are the database's).
PROFILE="${PROFILE:-release}"
if [ "$PROFILE" = release ]; then
    cargo build --quiet --release -p outbox-cli
else
    cargo build --quiet -p outbox-cli
fi
OUTBOX="$ROOT/target/$PROFILE/outbox"

cat > "$WORK/writer.sql" <<'SQL'
BEGIN;
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
VALUES ((lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0') || '7'
         || substr(md5(random()::text), 1, 19))::uuid,
        'Order', 'k', 'OrderPlaced', '{"n":1,"pad":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}', 'bench', 'k');
COMMIT;
SQL

# Rows of one day, 36 days ago, published then: ids are UUIDv7 of their time.
fill() {
    psql -q "$DATABASE_URL" <<SQL
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic,
                          partition_key, created_at, published_at)
SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::int8), 12, '0') || '7'
        || substr(md5(g::text), 1, 19))::uuid,
       'Order', 'k' || (g % 1000), 'OrderPlaced', '{"n":1}', 'bench', 'k' || (g % 1000), t, t
FROM (SELECT g, date_trunc('day', now()) - interval '36 days' + g * (interval '1 day' / $ROWS) AS t
      FROM generate_series(0, $ROWS - 1) g) s;
VACUUM ANALYZE outbox_event;
SQL
}

# p50, p99 and max (ms) of the pgbench log files $1.*
percentiles() {
    cat "$1".* | awk '$3 ~ /^[0-9]+$/ {print $3}' | sort -n | awk '
        {v[NR]=$1} END {printf "%.1f %.1f %.1f", v[int(NR*0.5)]/1000, v[int(NR*0.99)]/1000, v[NR]/1000}'
}

writers() {
    pgbench -n -c 4 -j 2 -R "$RATE" -T "$SECONDS_" -f "$WORK/writer.sql" -l \
        --log-prefix="$WORK/$1" "$DATABASE_URL" >/dev/null 2>&1
    percentiles "$WORK/$1"
}

json="{\"rows\":$ROWS,\"rate\":$RATE"
for layout in unpartitioned partitioned; do
    psql -q "$ADMIN" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
    "$OUTBOX" migrate >/dev/null
    if [ "$layout" = partitioned ]; then
        "$OUTBOX" partitions enable >/dev/null
        # The partition of that day (retention drops it once 30 days old), in
        # place of the (empty) legacy one that covers the past.
        psql -q "$DATABASE_URL" <<'SQL'
DROP TABLE outbox_event_legacy;
SELECT format('CREATE TABLE outbox_event_bench_day PARTITION OF outbox_event FOR VALUES FROM (%L) TO (%L)',
              (lpad(to_hex((extract(epoch FROM date_trunc('day', now()) - interval '36 days') * 1000)::int8), 12, '0') || repeat('0', 20))::uuid,
              (lpad(to_hex((extract(epoch FROM date_trunc('day', now()) - interval '35 days') * 1000)::int8), 12, '0') || repeat('0', 20))::uuid)
\gexec
SQL
    fi
    fill
    read -r a50 a99 amax <<< "$(writers "$layout-alone")"
    (
        start=$(date +%s.%N)
        "$OUTBOX" cleanup --older-than 30d --json > "$WORK/cleanup.json" 2>/dev/null
        awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}' > "$WORK/took"
    ) &
    cleaner=$!
    read -r d50 d99 dmax <<< "$(writers "$layout-during")"
    wait "$cleaner"
    took=$(cat "$WORK/took")
    printf '%-13s alone p50 %6s p99 %7s max %7s ms | during cleanup p50 %6s p99 %7s max %7s ms | cleanup %s s: %s\n' \
        "$layout" "$a50" "$a99" "$amax" "$d50" "$d99" "$dmax" "$took" "$(tr -d ' \n' < "$WORK/cleanup.json")"
    json="$json,\"$layout\":{\"alone_p99_ms\":$a99,\"during_p99_ms\":$d99,\"during_max_ms\":$dmax,\"cleanup_s\":$took}"
done
psql -q "$ADMIN" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)"
echo "$json}"
