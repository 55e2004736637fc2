# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/txbox demo

test: setup
	bash scripts/test.sh

lint:
	.venv/bin/ruff check framework tests migrations examples && .venv/bin/mypy

bench: setup
	for stage in relay receiver worker e2e latency analyze; do .venv/bin/txbox bench $$stage --json; done
