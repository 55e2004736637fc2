#!/usr/bin/env bash
# The whole test suite: lint, types, then unit → integration → acceptance tests against
# the real PostgreSQL and RabbitMQ that scripts/setup.sh made sure are running.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check framework tests migrations examples
.venv/bin/ruff format --check framework tests migrations examples
.venv/bin/mypy
# One pytest run so the closing summary line counts every test.
exec .venv/bin/pytest -p no:cacheprovider --durations=15 "$@" tests
