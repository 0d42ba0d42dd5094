#!/usr/bin/env bash
# Runs the whole test suite against real services, starting them as needed;
# the consumer-groups scenario alone (then again with the inbox group's
# processor in the progress mode, and the dedup group's members retrying
# transient failures from memory); then a subset of the reliability
# scenarios again in the production
# profile (every process as the README's role, 10-second partitions created
# and dropped by a maintainer meanwhile: outbox-cli/tests/reliability/profile.rs);
# then the relay's, lanes', held and scheduled rows', refusals', roles' and
# operations' tests and the relay's scenarios in the progress mode (the scenarios in
# that profile). scripts/test-progress.sh runs every suite in that mode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/services.sh start
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
# The consumer-groups scenario runs alone afterwards: it measures how soon
# the groups recover after their last fault, which the other scenarios'
# load (run at once, on a couple of cores) stretches past its bound.
cargo test --workspace "$@" -- --skip groups::consumer_groups_killed_and_restarted
echo "== the consumer-groups reliability scenario, alone"
cargo test -p outbox-cli --test reliability -- groups::consumer_groups_killed_and_restarted
echo "== the consumer-groups scenario with the inbox group's processor in the progress mode and the dedup group's retries from memory, alone"
OUTBOX_TEST_INBOX_MODE=progress OUTBOX_TEST_DEDUP_MEMORY=1 cargo test -p outbox-cli --test reliability -- \
    groups::consumer_groups_killed_and_restarted
echo "== the reliability scenarios' production-profile subset"
OUTBOX_TEST_PROFILE=production cargo test -p outbox-cli --test reliability -- \
    relay_sigkilled_repeatedly consumer_killed_between long_transaction
echo "== the relay's, the lanes', the held and scheduled rows', the refusals', the roles', the operations' and the timeouts' tests in the relay's progress mode"
# Every test of these binaries but lanes'
# relays_with_and_without_lanes_refuse_each_other, about relays without
# lanes, which the progress mode refuses (progress_relay's
# a_relay_without_lanes_is_refused). scripts/test-progress.sh runs every
# suite in that mode.
OUTBOX_TEST_RELAY_MODE=progress cargo test -p outbox-runtime --test relay --test lanes --test held \
    --test scheduled --test refused --test ops --test roles --test timeouts -- \
    --skip relays_with_and_without_lanes_refuse_each_other
echo "== the relay's reliability scenarios in the progress mode (production profile)"
OUTBOX_TEST_RELAY_MODE=progress OUTBOX_TEST_PROFILE=production cargo test -p outbox-cli --test reliability -- \
    relay_sigkilled_repeatedly three_relays_one_killed broker_killed_and_restarted \
    broker_paused long_transaction
echo "== the guide builds (mdBook; its Rust snippets were compiled by the doc tests above)"
mdbook build docs -d "$(mktemp -d)"
