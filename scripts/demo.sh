#!/usr/bin/env bash
# The demo: orders → billing, end to end. Starts PostgreSQL and the broker
# as needed, creates the two services' databases afresh (outbox_demo_orders,
# outbox_demo_billing), builds the services and the driver, and runs the
# driver: it starts both services, sends orders over HTTP (default 1,000;
# `scripts/demo.sh --orders 5000`, `--help` for more), shows the progress and
# checks every order was paid exactly once; then sends a few orders whose card
# billing declines and checks the orders service's saga cancels each once its
# payment timeout fires and releases its stock. Exit code 0 only if so.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/services.sh start
for db in outbox_demo_orders outbox_demo_billing; do
    psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" \
        -c "CREATE DATABASE $db" >/dev/null
done
export ORDERS_DATABASE_URL="postgres://postgres@127.0.0.1:5432/outbox_demo_orders"
export BILLING_DATABASE_URL="postgres://postgres@127.0.0.1:5432/outbox_demo_billing"
export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
echo "== building the services and the demo driver"
cargo build --quiet -p orders-service -p billing-service -p demo
cargo run --quiet -p demo -- "$@"
