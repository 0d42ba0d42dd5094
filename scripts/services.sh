#!/usr/bin/env bash
# Makes the services the tests and the demo need ready, idempotently:
#   - the system OpenSSL headers and pkg-config that the TLS builds of
#     librdkafka and sqlx link against (Debian packages, installed if missing),
#   - PostgreSQL on 127.0.0.1:5432 (started if installed but down; installed if missing),
#   - a Kafka-protocol broker (tansu) on 127.0.0.1:9092 (installed with cargo if missing),
#   - promtool, which the tests of the Prometheus alert rules run (Debian's
#     prometheus package, installed if missing; its server is not started).
#   - Chromium and chromedriver for the web console's browser tests (Debian
#     packages, installed if missing).
# Fast when everything is already up. PID files and logs: $OUTBOX_SERVICES_DIR
# (default: .services/ in the repository).
#
#   scripts/services.sh          # start what is missing
#   scripts/services.sh stop     # stop the broker this script started
#   scripts/services.sh status
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${OUTBOX_SERVICES_DIR:-$ROOT/.services}"
mkdir -p "$DIR"

PG_HOST=127.0.0.1 PG_PORT=5432
KAFKA_HOST=127.0.0.1 KAFKA_PORT=9092
TANSU_VERSION=0.6.0
CARGO_BIN="${CARGO_HOME:-$HOME/.cargo}/bin"
export PATH="$CARGO_BIN:$PATH"

log() { printf '[services] %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

wait_port() { # host port seconds what
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        port_open "$1" "$2" && return 0
        sleep 0.1
    done
    log "$4 did not open $1:$2 within $3 s"
    return 1
}

build_deps_up() {
    command -v dpkg >/dev/null 2>&1 || return 0
    local missing=()
    dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} (OpenSSL for the TLS builds of librdkafka and sqlx)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# promtool checks and unit-tests deploy/prometheus/outbox-alerts.yml
# (outbox-runtime/tests/alert_rules.rs). Debian ships it in the prometheus
# package; the server it also contains is not started (installed only).
promtool_up() {
    command -v promtool >/dev/null 2>&1 && return 0
    command -v apt-get >/dev/null 2>&1 || { log "promtool is missing and apt-get is not available: the alert rule tests will fail"; return 0; }
    log "installing promtool (Debian's prometheus package) for the alert rule tests"
    # Not fatal: without it only the alert rule tests fail (and say why).
    { apt-get -o DPkg::Lock::Timeout=300 update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus >/dev/null; } ||
        log "could not install the prometheus package: the alert rule tests will fail"
}

browser_up() {
    command -v dpkg >/dev/null 2>&1 || return 0
    local missing=()
    dpkg -s chromium >/dev/null 2>&1 || missing+=(chromium)
    dpkg -s chromium-driver >/dev/null 2>&1 || missing+=(chromium-driver)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} (a headless browser for the console's browser tests)"
        apt-get -o DPkg::Lock::Timeout=300 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

postgres_up() {
    if pg_isready -q -h "$PG_HOST" -p "$PG_PORT" 2>/dev/null; then
        return 0
    fi
    if ! command -v pg_ctlcluster >/dev/null 2>&1; then
        log "PostgreSQL is not installed: installing it from the Debian packages"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    fi
    local version
    version="$(ls /etc/postgresql | sort -V | tail -1)"
    if ! pg_lsclusters -h | grep -q "^$version main"; then
        pg_createcluster "$version" main >/dev/null
    fi
    # Trust local TCP connections (test machine only), as the tests expect.
    local hba="/etc/postgresql/$version/main/pg_hba.conf"
    if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
        sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    fi
    log "starting PostgreSQL $version"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    local i
    for ((i = 0; i < 300; i++)); do
        pg_isready -q -h "$PG_HOST" -p "$PG_PORT" && break
        sleep 0.1
    done
    pg_isready -q -h "$PG_HOST" -p "$PG_PORT" || { log "PostgreSQL did not start"; return 1; }
    for db in test root; do
        psql -h "$PG_HOST" -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1 ||
            psql -h "$PG_HOST" -U postgres -d postgres -qc "CREATE DATABASE $db"
    done
}

tansu_installed() {
    command -v tansu >/dev/null 2>&1 && tansu --version 2>/dev/null | grep -q "$TANSU_VERSION"
}

# mdBook builds the guide (docs/); the test command builds it.
MDBOOK_VERSION=0.5.4

mdbook_up() {
    if command -v mdbook >/dev/null 2>&1 && mdbook --version 2>/dev/null | grep -q "v$MDBOOK_VERSION"; then
        return 0
    fi
    log "installing mdbook $MDBOOK_VERSION (builds the guide) with cargo; this takes a few minutes once"
    cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --features search --quiet
}

broker_up() {
    if port_open "$KAFKA_HOST" "$KAFKA_PORT"; then
        return 0
    fi
    if ! tansu_installed; then
        log "installing tansu $TANSU_VERSION (a Kafka-compatible broker) with cargo; this takes several minutes once"
        cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore --quiet
    fi
    log "starting tansu on $KAFKA_HOST:$KAFKA_PORT (in-memory storage), log: $DIR/tansu.log"
    nohup tansu broker \
        --listener-url "tcp://$KAFKA_HOST:$KAFKA_PORT" \
        --advertised-listener-url "tcp://$KAFKA_HOST:$KAFKA_PORT" \
        --storage-engine "memory://tansu/" \
        >"$DIR/tansu.log" 2>&1 &
    echo $! >"$DIR/tansu.pid"
    wait_port "$KAFKA_HOST" "$KAFKA_PORT" 30 tansu
}

broker_stop() {
    if [[ -f "$DIR/tansu.pid" ]]; then
        local pid
        pid="$(cat "$DIR/tansu.pid")"
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" && log "stopped tansu (pid $pid)"
        fi
        rm -f "$DIR/tansu.pid"
    fi
}

case "${1:-start}" in
start)
    build_deps_up
    promtool_up
    browser_up
    postgres_up
    broker_up
    mdbook_up
    log "ready: postgres://postgres@$PG_HOST:$PG_PORT, kafka $KAFKA_HOST:$KAFKA_PORT"
    ;;
stop) broker_stop ;;
status)
    pg_isready -h "$PG_HOST" -p "$PG_PORT" || true
    if port_open "$KAFKA_HOST" "$KAFKA_PORT"; then echo "broker: up"; else echo "broker: down"; fi
    ;;
*)
    echo "usage: $0 [start|stop|status]" >&2
    exit 2
    ;;
esac
