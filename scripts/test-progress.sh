#!/usr/bin/env bash
# Runs the whole test suite with the relay in the progress mode (positions
# per batch, no row written to publish it): every test that starts a relay
# puts its outbox in that mode first (`OUTBOX_TEST_RELAY_MODE=progress`);
# the rest run as in `scripts/test.sh`. Then the consumer-groups scenario
# alone, its inbox group's processor in the progress mode too, and the
# reliability scenarios in the production profile. Longer than
# `scripts/test.sh` (which runs a subset of this, the relay's suites and
# scenarios, in the progress mode): run it before changing either mode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/services.sh start
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
export OUTBOX_TEST_RELAY_MODE=progress
# lanes' relays_with_and_without_lanes_refuse_each_other is about relays
# without lanes, which the progress mode refuses (progress_relay's
# a_relay_without_lanes_is_refused).
# --no-fail-fast: every test binary runs, a failure in one does not hide
# those of the others.
cargo test --workspace --no-fail-fast "$@" -- --skip groups::consumer_groups_killed_and_restarted \
    --skip relays_with_and_without_lanes_refuse_each_other
echo "== the consumer-groups reliability scenario, alone, both processors' modes"
cargo test -p outbox-cli --test reliability -- groups::consumer_groups_killed_and_restarted
OUTBOX_TEST_INBOX_MODE=progress OUTBOX_TEST_DEDUP_MEMORY=1 cargo test -p outbox-cli --test reliability -- \
    groups::consumer_groups_killed_and_restarted
echo "== the reliability scenarios in the production profile"
OUTBOX_TEST_PROFILE=production cargo test -p outbox-cli --test reliability -- \
    --skip groups::consumer_groups_killed_and_restarted
