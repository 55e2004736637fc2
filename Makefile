# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test lint bench fuzz spark-cluster

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/txbox demo

test: setup
	bash scripts/test.sh

# The daemon-level fuzz run, longer than the budget of `make test`:
#   make fuzz SEED=7 EXAMPLES=300 BATCH=40   (logs of the daemons in FUZZ_LOGS)
SEED ?= 1
EXAMPLES ?= 200
BATCH ?= 40
FUZZ_TIMEOUT ?= 7200
FUZZ_LOGS ?= artifacts/fuzz-logs
fuzz: setup
	TXBOX_FUZZ_SEED=$(SEED) TXBOX_FUZZ_EXAMPLES=$(EXAMPLES) TXBOX_FUZZ_BATCH=$(BATCH) TXBOX_FUZZ_LOG_DIR=$(FUZZ_LOGS) \
		.venv/bin/pytest -p no:cacheprovider --timeout=$(FUZZ_TIMEOUT) tests/fuzz

lint:
	.venv/bin/ruff check framework tests migrations examples && .venv/bin/mypy

bench: setup
	for stage in relay receiver worker e2e latency analyze; do .venv/bin/txbox bench $$stage --json; done

# `txbox analyze` on a private Spark standalone cluster (a master and two workers on 127.0.0.1,
# from the pyspark package) against local mode: a few minutes, so not part of `make test`.
spark-cluster: setup
	TXBOX_SPARK_CLUSTER=1 .venv/bin/pytest -p no:cacheprovider tests/spark/test_cluster.py
