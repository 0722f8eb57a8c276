#!/usr/bin/env bash
# Start a throw-away PostgreSQL server for the archive tests (and CI). Idempotent.
#
#   scripts/start_postgres.sh [DATADIR] [PORT]      # defaults: /tmp/tapestry-pgdata 5432
#   scripts/start_postgres.sh --stop [DATADIR]
#
# Installs the Debian `postgresql` package if no server binaries are found, initializes DATADIR
# (trust authentication: loopback only, never expose it), starts the server on 127.0.0.1:PORT,
# creates the database `tapestry_test`, and prints its SQLAlchemy URL as the last line of stdout:
#
#   export TAPESTRY_PG_URL="$(scripts/start_postgres.sh)"
#
# PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user (created
# if missing). Progress messages go to stderr.
set -euo pipefail

log() { echo "start_postgres: $*" >&2; }
die() { log "error: $*"; exit 1; }

STOP=0
if [[ "${1:-}" == "--stop" ]]; then STOP=1; shift; fi
DATADIR="${1:-/tmp/tapestry-pgdata}"
PORT="${2:-5432}"
DBNAME="tapestry_test"
HOST="127.0.0.1"
PGUSER_NAME="postgres"

find_bindir() {
    local d
    if command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1; then
        dirname "$(readlink -f "$(command -v pg_ctl)")"
        return 0
    fi
    # Debian keeps the server binaries off PATH; take the newest installed major version.
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [[ -x "$d/pg_ctl" && -x "$d/initdb" ]]; then echo "$d"; return 0; fi
    done
    return 1
}

as_root() { if [[ $EUID -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

BINDIR="$(find_bindir || true)"
if [[ -z "$BINDIR" ]]; then
    [[ $STOP -eq 1 ]] && { log "no PostgreSQL installed; nothing to stop"; exit 0; }
    command -v apt-get >/dev/null 2>&1 || die "no PostgreSQL binaries and no apt-get to install them"
    log "installing PostgreSQL with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    BINDIR="$(find_bindir)" || die "apt-get installed postgresql but no pg_ctl/initdb was found"
fi

# Run a server binary as the account that owns the cluster.
if [[ $EUID -eq 0 ]]; then
    if ! id "$PGUSER_NAME" >/dev/null 2>&1; then
        log "creating system user $PGUSER_NAME"
        useradd --system --home-dir /var/lib/postgresql --shell /bin/bash "$PGUSER_NAME"
    fi
    run_pg() { runuser -u "$PGUSER_NAME" -- "$@"; }
else
    run_pg() { "$@"; }
fi

LOGFILE="$DATADIR/server.log"
pg_running() { run_pg "$BINDIR/pg_ctl" -D "$DATADIR" status >/dev/null 2>&1; }

if [[ $STOP -eq 1 ]]; then
    if [[ -f "$DATADIR/PG_VERSION" ]] && pg_running; then
        run_pg "$BINDIR/pg_ctl" -D "$DATADIR" -m fast -w stop >&2
    else
        log "no server running in $DATADIR"
    fi
    exit 0
fi

if [[ ! -f "$DATADIR/PG_VERSION" ]]; then
    log "initializing $DATADIR"
    mkdir -p "$DATADIR"
    [[ $EUID -eq 0 ]] && chown "$PGUSER_NAME" "$DATADIR"
    chmod 700 "$DATADIR"
    run_pg "$BINDIR/initdb" -D "$DATADIR" -U "$PGUSER_NAME" --auth=trust -E UTF8 \
        --no-instructions >&2
fi

if pg_running; then
    log "server already running in $DATADIR"
elif "$BINDIR/pg_isready" -q -h "$HOST" -p "$PORT" 2>/dev/null; then
    # Some other server (e.g. the cluster a Debian package install started): usable only if it
    # lets us in as postgres without a password.
    "$BINDIR/psql" -h "$HOST" -p "$PORT" -U "$PGUSER_NAME" -d postgres -qtA -c "SELECT 1" \
        >/dev/null 2>&1 \
        || die "another server listens on $HOST:$PORT and refuses password-less login as \
$PGUSER_NAME; stop it or pass another port: $0 $DATADIR 5433"
    log "a server already listens on $HOST:$PORT; using it"
else
    log "starting server on $HOST:$PORT"
    # TCP on loopback only; no Unix socket, so no writable /var/run/postgresql is needed.
    run_pg "$BINDIR/pg_ctl" -D "$DATADIR" -l "$LOGFILE" -w -t 60 \
        -o "-c listen_addresses=$HOST -p $PORT -c unix_socket_directories=''" start >&2 \
        || { tail -n 20 "$LOGFILE" >&2 || true; die "server did not start (log: $LOGFILE)"; }
fi

for _ in $(seq 1 30); do
    "$BINDIR/pg_isready" -q -h "$HOST" -p "$PORT" && break
    sleep 1
done
"$BINDIR/pg_isready" -q -h "$HOST" -p "$PORT" || die "server on $HOST:$PORT is not accepting connections"

PSQL=("$BINDIR/psql" -h "$HOST" -p "$PORT" -U "$PGUSER_NAME" -d postgres -v ON_ERROR_STOP=1 -qtA)
if [[ "$("${PSQL[@]}" -c "SELECT 1 FROM pg_database WHERE datname = '$DBNAME'")" != "1" ]]; then
    log "creating database $DBNAME"
    "${PSQL[@]}" -c "CREATE DATABASE $DBNAME" >&2
fi

echo "postgresql+psycopg://$PGUSER_NAME@$HOST:$PORT/$DBNAME"
