#!/usr/bin/env python3
# The relay's claim of 2,000 rows with lanes, before and after lane slots,
# as psql input: `scripts/lanes-claim.py MODE LANES DATABASE_URL [RUNS] |
# psql -q DATABASE_URL` prints EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) of
# RUNS executions (prepared: the relay's generic plan from the sixth on).
#   MODE old:   the lane filter over the id index (relays before lane slots)
#        new:   the merge of the owned lanes' slot ranges (claim_slots)
#        every: the id-index walk of a relay owning every lane
#   LANES: the owned lanes of 16, comma-separated (e.g. 0 or 0,1,2,3)
# The session takes the lane locks itself, so the ownership checks pass.
# The statements copy those of outbox-runtime/src/relay/claim.rs: keep
# them in step. Fill the database first, e.g. (1M rows, 100k keys):
#   INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id,
#     event_type, payload, topic, partition_key)
#   SELECT gen_random_uuid(), 'A', 'a', 'E', '{"x":1}', 't', 'key-' || (g % 100000)
#   FROM generate_series(1, 1000000) g;  VACUUM ANALYZE outbox_event;
import sys, subprocess
mode, owned = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
L = 16
CLAIM_COLUMNS = """SELECT id, event_id, aggregate_type, aggregate_id, event_type, event_version, topic,
       partition_key, payload::text AS payload, headers::text AS headers, attempts,
       ctid::text AS tid,
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
  AND partition_key <> ALL($2::text[])"""
RETURNED = "id, event_id, aggregate_type, aggregate_id, event_type, event_version, topic, partition_key, payload, headers, attempts, behind_held_secs, tid"
def bounded(locking, budget):
    return f"""/* outbox relay: claim */ SELECT {RETURNED} FROM (
  SELECT b.*, count(*) FILTER (WHERE b.bytes_before >= {budget}::int8)
              OVER (ROWS UNBOUNDED PRECEDING) AS past_budget
  FROM (
    SELECT c.*, coalesce(sum(octet_length(c.payload) + octet_length(c.headers)
                             + octet_length(c.partition_key))
                         OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS bytes_before
    FROM ({locking}) c
  ) b
) w WHERE past_budget = 0"""
SCOPE_LOCKS = """locktype = 'advisory' AND granted AND objsubid = 1
  AND classid = $1::int8::oid
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
def old(lane="((hashtext(partition_key) & 2147483647) % $3)"):
    locking = f"""{CLAIM_COLUMNS}
  AND {lane} <> ALL($4::int4[])
  AND {lane} <> ALL((
      SELECT coalesce(array_agg(l), '{{}}') FROM generate_series(0, $3 - 1) AS l
      WHERE NOT EXISTS (SELECT 1 FROM pg_locks
        WHERE {SCOPE_LOCKS.replace("$1", "$6")} AND pid = $5 AND objid::int8 = $7 + l)
      )::int4[])
ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"""
    return bounded(locking, "$8")
def new(slots):
    ranges = [f"""(SELECT id AS slot_id, ctid AS slot_tid, event_id AS slot_event_id FROM outbox_event
  WHERE lane_slot = {s} AND coalesce(published_at, parked_at, held_until) IS NULL
    AND partition_key <> ALL($2::text[]) AND EXISTS (SELECT 1 FROM owned WHERE lane = {s % L})
  ORDER BY id LIMIT $3)""" for s in slots]
    locking = f"""WITH owned AS MATERIALIZED (
  SELECT (objid::int8 - $6)::int4 AS lane FROM pg_locks
  WHERE {SCOPE_LOCKS.replace("$1", "$5")} AND pid = $4 AND objid::int8 >= $6 AND objid::int8 < $6 + {L})
SELECT o.* FROM (
{chr(10).join(['UNION ALL' + chr(10) + r if i else r for i, r in enumerate(ranges)])}
) s CROSS JOIN LATERAL ({CLAIM_COLUMNS}
  AND ctid = s.slot_tid AND event_id = s.slot_event_id
  FOR UPDATE SKIP LOCKED) o
ORDER BY s.slot_id LIMIT $1"""
    return bounded(locking, "$7")
oid = int(subprocess.check_output(["psql","-At",sys.argv[3],"-c","SELECT 'outbox_event'::regclass::oid"]).strip())
base_lane = (oid << 32) | (1 << 24)   # Lock::Lane = 1
objid_lane = 1 << 24
count_key = (oid << 32) | (4 << 24) | L
others = [l for l in range(L) if l not in owned]
lock = f"SELECT pg_advisory_lock_shared({count_key}), " + ", ".join(f"pg_advisory_lock({base_lane | l})" for l in owned) + ";"
ex = "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) "
runs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
if mode in ("old", "every"):
    stmt = "PREPARE c(int8, text[], int4, int4[], int4, int8, int8, int8) AS " + (old() if mode == "old" else old("(lane_slot % $3)")) + ";"
    exe = f"EXECUTE c(2000, '{{}}', {L}, '{{{','.join(map(str, others))}}}', pg_backend_pid(), {oid}, {objid_lane}, 4194304);"
else:
    slots = sorted(s for l in owned for s in range(l, 64, L))
    stmt = "PREPARE c(int8, text[], int8, int4, int8, int8, int8) AS " + new(slots) + ";"
    exe = f"EXECUTE c(2000, '{{}}', 6000, pg_backend_pid(), {oid}, {objid_lane}, 4194304);"
# pg_backend_pid() as a parameter of EXECUTE: evaluated per EXECUTE.
print("SET enable_seqscan = off; SET jit = off;")
print(lock); print(stmt)
for _ in range(runs):
    print("BEGIN;"); print(ex + exe); print("ROLLBACK;")
