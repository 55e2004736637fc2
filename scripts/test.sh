#!/usr/bin/env bash
# The whole test suite: lint, types, the docs build, a vulnerability audit, then the unit, integration and
# acceptance tests against the real PostgreSQL and RabbitMQ that scripts/setup.sh made sure are running.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check framework tests migrations examples tools
.venv/bin/ruff format --check framework tests migrations examples tools
.venv/bin/mypy
# The documentation site, as `make docs` builds it: a broken link, a page left out of the
# navigation or a docstring reference that no longer resolves fails here (--strict).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet -d site
# Known vulnerabilities in the installed set, from the vendored advisory copy (no network).
.venv/bin/python scripts/audit.py
# One pytest run so the closing summary line counts every test. Two processes, each taking
# whole files (a module's fixtures stay in one process): most of the suite's time is spent
# waiting on daemons, brokers and JVMs, and every test has a database and a vhost of its
# own, so two run side by side on two cores in about two thirds of the time of one
# (1,066 s against 1,586 s on 2026-11-29). TXBOX_TEST_PROCESSES=0 runs them in this process.
exec .venv/bin/pytest -p no:cacheprovider --durations=15 -n "${TXBOX_TEST_PROCESSES:-2}" --dist loadfile "$@" tests
