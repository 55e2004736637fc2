#!/usr/bin/env bash
# The whole test suite: lint, types, a vulnerability audit, then unit → integration → acceptance tests against
# the real PostgreSQL and RabbitMQ that scripts/setup.sh made sure are running.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check framework tests migrations examples tools
.venv/bin/ruff format --check framework tests migrations examples tools
.venv/bin/mypy
# Known vulnerabilities in the installed set, from the vendored advisory copy (no network).
.venv/bin/python scripts/audit.py
# One pytest run so the closing summary line counts every test.
exec .venv/bin/pytest -p no:cacheprovider --durations=15 "$@" tests
