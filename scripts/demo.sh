#!/usr/bin/env bash
# Runs the demo against real services, starting them as needed. The demo
# gets a fresh database of its own (outbox_demo) on every run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/services.sh start
psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS outbox_demo WITH (FORCE)" \
    -c "CREATE DATABASE outbox_demo" >/dev/null
export DATABASE_URL="postgres://postgres@127.0.0.1:5432/outbox_demo"
cargo run --quiet -p quickstart
