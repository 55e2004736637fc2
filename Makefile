# The two commands of the README: `make demo` and `make test` (and `make docs`, the documentation site).
.PHONY: setup setup-test demo test lint docs bench bench-peers fuzz rabbit-cluster failover spark-cluster chaos-replicas

# What the demo needs; `setup-test` adds the test tools, Chromium and the Node test peer.
setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --for-test

demo: setup
	.venv/bin/txbox demo

test: setup-test
	bash scripts/test.sh

# The daemon-level fuzz run, longer than the budget of `make test`:
#   make fuzz SEED=7 EXAMPLES=300 BATCH=40   (logs of the daemons in FUZZ_LOGS)
SEED ?= 1
EXAMPLES ?= 200
BATCH ?= 40
FUZZ_TIMEOUT ?= 7200
FUZZ_LOGS ?= artifacts/fuzz-logs
fuzz: setup-test
	TXBOX_FUZZ_SEED=$(SEED) TXBOX_FUZZ_EXAMPLES=$(EXAMPLES) TXBOX_FUZZ_BATCH=$(BATCH) TXBOX_FUZZ_LOG_DIR=$(FUZZ_LOGS) \
		.venv/bin/pytest -p no:cacheprovider --timeout=$(FUZZ_TIMEOUT) tests/fuzz

# A private three-node RabbitMQ cluster loses the node leading the inbox queues mid-run, at
# full size (`make test` runs 1,000 orders):  make rabbit-cluster SEED=3 CLUSTER_ORDERS=3000
CLUSTER_ORDERS ?= 3000
rabbit-cluster: setup-test
	TXBOX_RABBIT_CLUSTER_ORDERS=$(CLUSTER_ORDERS) TXBOX_CHAOS_SEED=$(SEED) .venv/bin/pytest -p no:cacheprovider tests/acceptance/test_rabbit_cluster.py

# Two replicas of every daemon per service, the seeded kills picking among them
# (docs/explanation/operations.md, "Replicas of every daemon"; a few minutes, not part of `make test`):
#   make chaos-replicas SEED=7
chaos-replicas: setup-test
	.venv/bin/txbox chaos --replicas 2 --messages 2000 --faults 5 --seed $(SEED)

# What scripts/test.sh runs first, and .pre-commit-config.yaml before each commit.
LINT_PATHS = framework tests migrations examples tools
lint:
	.venv/bin/ruff check $(LINT_PATHS) && .venv/bin/ruff format --check $(LINT_PATHS) && .venv/bin/mypy

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or reference fails it.
# `make test` builds it too (scripts/test.sh). Serve it while writing: .venv/bin/mkdocs serve
docs: setup-test
	.venv/bin/mkdocs build --strict -d site

bench: setup
	for stage in relay receiver worker e2e latency analyze; do .venv/bin/txbox bench $$stage --json; done

# txbox's relay and inbox stages beside faststream-outbox and pg-transactional-outbox, each
# installed into a scratch folder (benchmarks/peers/README.md); not part of `make test`.
#   make bench-peers PEERS_ARGS="--rounds 1 --messages 5000"
bench-peers: setup-test
	bash benchmarks/peers/run.sh $(PEERS_ARGS)

# PostgreSQL failover at a larger size than the one of `make test` (docs/explanation/operations.md,
# "PostgreSQL failover"): kill -9 of a primary with a synchronous standby, mid-run.
#   make failover FAILOVER_MESSAGES=20000
FAILOVER_MESSAGES ?= 10000
failover: setup-test
	TXBOX_FAILOVER_MESSAGES=$(FAILOVER_MESSAGES) .venv/bin/pytest -p no:cacheprovider -s tests/acceptance/test_failover.py
# The heavy suites at full size; `make test` runs each bounded (fewer messages and kills,
# the same assertions). CONTRIBUTING.md "Running the heavy suites", RELIABILITY.md "In CI, and the heavy suites".
.PHONY: chaos heavy
CHAOS_MESSAGES ?= 5000
chaos: setup
	TXBOX_CHAOS_MESSAGES=$(CHAOS_MESSAGES) .venv/bin/pytest -p no:cacheprovider --durations=5 tests/acceptance/test_chaos_short.py

heavy: setup
	TXBOX_CHAOS_MESSAGES=$(CHAOS_MESSAGES) TXBOX_EXACTLY_ONCE_MESSAGES=10000 TXBOX_EXACTLY_ONCE_KILLS=5 \
		.venv/bin/pytest -p no:cacheprovider --durations=10 tests/acceptance/test_chaos_short.py tests/acceptance/test_exactly_once.py
# `txbox analyze` and `txbox archive` on a private Spark standalone cluster (a master and two
# workers on 127.0.0.1, from the pyspark package) against local mode, with a few thousand rows
# to archive: a few minutes. `make test` runs the bounded version (one worker, the small seed).
spark-cluster: setup
	TXBOX_SPARK_CLUSTER=1 .venv/bin/pytest -p no:cacheprovider tests/spark/test_cluster.py
