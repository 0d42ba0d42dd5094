#!/usr/bin/env bash
# Runs the whole test suite against real services, starting them as needed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/services.sh start
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
cargo test --workspace "$@"
