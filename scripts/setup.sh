#!/usr/bin/env bash
# Make this machine ready for txbox: a virtualenv with txbox, its extras and its development
# tools (tools/: `txbox bench|chaos|demo`), and the real services it talks to (PostgreSQL,
# RabbitMQ with its management API, Java 17 and the PostgreSQL JDBC driver for Spark).
#
#   scripts/setup.sh             what `make demo` needs
#   scripts/setup.sh --for-test  what `make test` needs besides: the test tools (pytest, ruff,
#                                mypy, Playwright), Chromium for the browser test, Node.js and
#                                the Mosaic test peer for the interoperability test
#
# Idempotent: on a machine that has everything it only checks. Missing services are
# started if installed, installed with apt when running as root, or else the script
# stops and prints exactly what to run.
set -euo pipefail
cd "$(dirname "$0")/.."

FOR_TEST=
case "${1:-}" in
  --for-test) FOR_TEST=1 ;;
  "") ;;
  *) printf 'usage: scripts/setup.sh [--for-test]\n' >&2; exit 2 ;;
esac

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] %s\033[0m\n' "$*" >&2; exit 1; }

PG_HOST=127.0.0.1
PG_PORT=5432
JDBC_JAR=${TXBOX_JDBC_JAR:-/usr/share/java/postgresql.jar}
APT_UPDATED=

is_root() { [ "$(id -u)" = 0 ]; }
apt_install() {
  if ! is_root || ! command -v apt-get >/dev/null; then
    die "missing: $*. Install it with: sudo apt-get install -y $* (then run this again)"
  fi
  if [ -z "$APT_UPDATED" ]; then
    say "apt-get update"; DEBIAN_FRONTEND=noninteractive apt-get update -qq; APT_UPDATED=1
  fi
  say "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
wait_for() {  # wait_for <seconds> <what> <command...>
  local seconds=$1 what=$2; shift 2
  for _ in $(seq "$((seconds * 5))"); do "$@" && return 0; sleep 0.2; done
  die "$what did not come up within ${seconds}s"
}

# --- Python ------------------------------------------------------------------------
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "txbox needs Python >= 3.11 (found: $("$PYTHON" --version 2>&1 || echo none)); set PYTHON=/path/to/python3.11"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv .venv || { apt_install python3-venv; "$PYTHON" -m venv .venv; }
fi
# pip and the build backend narrate (editable-install notes, index notices): their output goes
# to a log, shown only when pip fails.
PIP_LOG=.venv/pip.log
pip_logged() {
  .venv/bin/pip "$@" >>"$PIP_LOG" 2>&1 || { tail -n 40 "$PIP_LOG" >&2; die "pip $1 failed (whole log: $PIP_LOG)"; }
}
extras=spark,dashboard,otel,jwt
stamp=.venv/.txbox-installed
if [ -n "$FOR_TEST" ]; then extras=$extras,dev; stamp=.venv/.txbox-installed-for-test; fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ tools/pyproject.toml -nt "$stamp" ]; then
  say "installing txbox [$extras] and its development tools into .venv (log: $PIP_LOG)"
  : >"$PIP_LOG"
  # The setuptools a new venv gets from ensurepip is old enough to have known holes
  # (CVE-2022-40897, CVE-2024-6345, CVE-2025-47273); the audit of `make test` would stop on it.
  pip_logged install --upgrade pip "setuptools>=78.1.1"
  # Built with the setuptools just installed (what build-system.requires asks for): an isolated
  # build environment per project would download and install it twice more (~25 s).
  pip_logged install --no-build-isolation -e ".[$extras]" -e ./tools
  touch "$stamp"
  # The test set-up installs everything the base one does.
  [ -z "$FOR_TEST" ] || touch .venv/.txbox-installed
fi

# --- PostgreSQL --------------------------------------------------------------------
pg_up() { port_open "$PG_HOST" "$PG_PORT"; }
if ! pg_up; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    apt_install postgresql
    # A fresh Debian cluster asks for passwords on TCP; txbox's defaults (and the tests)
    # connect as postgres over loopback without one, as on the project's machines.
    hba=$(ls /etc/postgresql/*/main/pg_hba.conf | head -n 1)
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  say "starting PostgreSQL $version"
  if is_root; then
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  else
    die "PostgreSQL is installed but not running; start it: sudo pg_ctlcluster $version main start"
  fi
  wait_for 30 PostgreSQL pg_up
fi
if command -v psql >/dev/null && ! psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; then
  die "PostgreSQL runs on $PG_HOST:$PG_PORT but does not let role postgres in without a password. \
Either add 'host all all 127.0.0.1/32 trust' to pg_hba.conf, or point txbox at your server with \
TXBOX_TEST_PG=postgresql://user:password@host:port/postgres"
fi

# --- RabbitMQ ----------------------------------------------------------------------
mq_up() { port_open 127.0.0.1 5672; }
if ! mq_up; then
  command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
  is_root || die "RabbitMQ is installed but not running; start it: sudo rabbitmq-server -detached"
  say "starting RabbitMQ"
  rabbitmq-server -detached >/dev/null 2>&1 || true
  wait_for 90 RabbitMQ mq_up
fi
api_up() { port_open 127.0.0.1 15672; }
if ! api_up; then
  # The tests create a vhost per test through the management API.
  if is_root; then
    say "enabling the RabbitMQ management plugin"
    rabbitmq-plugins enable rabbitmq_management >/dev/null
    wait_for 60 "RabbitMQ management API" api_up
  else
    die "enable RabbitMQ's management plugin: sudo rabbitmq-plugins enable rabbitmq_management"
  fi
fi

# --- Java 17 + JDBC driver for Spark (the demo ends with `txbox analyze`) ------------
java_ok() { command -v java >/dev/null && java -version 2>&1 | grep -Eq 'version "(1[7-9]|2[0-9])'; }
java_ok || apt_install openjdk-17-jre-headless
[ -f "$JDBC_JAR" ] || apt_install libpostgresql-jdbc-java

ready="PostgreSQL $PG_HOST:$PG_PORT, RabbitMQ 127.0.0.1:5672 (management :15672), $(java -version 2>&1 | head -n 1), $JDBC_JAR"
if [ -z "$FOR_TEST" ]; then
  say "ready: $ready"
  exit 0
fi

# --- for the tests only: Chromium for the browser test -------------------------------
[ -x /usr/bin/chromium ] || apt_install chromium

# --- Node.js + the Mosaic test peer (tests/interop) ---------------------------------
# The interoperability test runs a service built with Mosaic's own npm libraries beside a
# txbox service. Node comes from Debian (nodejs, npm); the peer's packages from npm,
# exactly as locked in its package-lock.json. Node stays out of the Python package.
PEER=tests/interop/peer
node_ok() { command -v node >/dev/null && command -v npm >/dev/null \
  && node -e 'process.exit(Number(process.versions.node.split(".")[0]) < 18 ? 1 : 0)'; }
node_ok || apt_install nodejs npm
node_ok || die "Node.js >= 18 with npm is needed for the Mosaic interoperability test (found: $(node --version 2>&1 || echo none))"
peer_stamp=$PEER/node_modules/.txbox-installed
if [ ! -f "$peer_stamp" ] || [ $PEER/package-lock.json -nt "$peer_stamp" ]; then
  say "installing the Mosaic test peer's npm packages ($PEER)"
  (cd $PEER && npm ci --prefer-offline --no-audit --no-fund --loglevel=error) \
    || die "npm ci failed in $PEER: check that the npm registry is reachable (npm ping), then run this again"
  touch "$peer_stamp"
fi

say "ready for the tests: $ready, Node $(node --version)"
