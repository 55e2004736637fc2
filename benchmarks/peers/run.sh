#!/usr/bin/env bash
# txbox's relay and inbox stages beside faststream-outbox and pg-transactional-outbox,
# in one session: see benchmarks/peers/README.md. Run from the repository root:
#   bash benchmarks/peers/run.sh [--rounds 3] [--messages 20000] [--stages relay,inbox] ...
# (options: .venv/bin/python benchmarks/peers/run.py --help). Needs `make setup`, Node
# with npm, PostgreSQL on 127.0.0.1:5432 and RabbitMQ with its management API.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/txbox ] || { echo "run.sh: .venv/bin/txbox missing: run make setup first" >&2; exit 2; }
command -v node >/dev/null && command -v npm >/dev/null \
  || { echo "run.sh: Node.js with npm is needed (make setup-test installs it)" >&2; exit 2; }
# A ceiling on the whole session (the harness has a deadline per stage as well).
exec timeout --signal=TERM --kill-after=60 "${PEERS_TIMEOUT:-5400}" .venv/bin/python benchmarks/peers/run.py "$@"
