"""Fixtures: a migrated template database cloned per test, a RabbitMQ vhost per test (both made
ahead and dropped behind, tests/pools.py).

Integration tests need the real PostgreSQL and RabbitMQ (`make test` starts them); if
either is missing they fail with the fix, they are never skipped silently.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from framework import migrate
from framework.service import Service
from framework.settings import Settings
from tests import support
from tests.pools import Pool
from txbox_tools.processes import ProcessGroup

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = ROOT / "contracts"

#: Options of every Spark JVM the tests start. Their jobs are small and short-lived: the
#: client compiler alone and the serial collector halve a JVM's CPU seconds (start and
#: jobs, measured: 37 s -> 19 s), where the optimising compiler of a long job would pay
#: off. Inherited by each JVM this run starts: the shared session's driver and those of
#: `txbox analyze|archive` processes and spark-submit (SPARK_SUBMIT_OPTS: in client mode
#: the driver is spark-submit's JVM), the private cluster's master and workers
#: (SPARK_DAEMON_JAVA_OPTS); executors get it as spark.executor.defaultJavaOptions.
SPARK_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("SPARK_SUBMIT_OPTS", SPARK_JVM_OPTIONS)
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", SPARK_JVM_OPTIONS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for suite in ("unit", "integration", "acceptance"):
            if suite in parts:
                item.add_marker(getattr(pytest.mark, suite))
        if "spark" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            # The shared Spark session starts in the first such test's budget (tests/spark/conftest.py).
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(autouse=True)
def _command_logging_undone() -> Iterator[None]:
    """A command run in-process configures the root logger (framework.logs.configure):
    its handler writes to ``sys.stderr`` as it is at each record, so daemon threads that
    outlive the test would print into the run's output. It goes with the test."""
    from framework.logs import StderrHandler

    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if isinstance(handler, StderrHandler) and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """A database migrated to head, used as the template of every test database."""
    try:
        with psycopg.connect(support.PG_ADMIN_URL, connect_timeout=5):
            pass
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {support.PG_ADMIN_URL} ({exc}); run `make setup` first")
    name = support.unique("txbox_tpl")
    support.create_database(name)
    migrate.upgrade(support.db_url(name))
    yield name
    support.drop_database(name)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local Spark session for the whole run (it costs ~10 s to start); `txbox analyze` and
    `txbox archive` called in-process use it too (framework.analytics.session.job_session)."""
    from framework.analytics.session import spark_session
    from framework.analytics.settings import AnalyzeSettings

    session = spark_session(AnalyzeSettings(master="local[2]", shuffle_partitions=4, driver_memory="1g"), "txbox-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def database_pool(template_db: str) -> Iterator[Pool]:
    """Clones of the template made ahead and dropped behind, off the tests' time (tests/pools.py)."""

    def clone() -> str:
        name = support.unique("txbox_t")
        support.create_database(name, template=template_db)
        return name

    with Pool("databases", clone, support.drop_database) as pool:
        yield pool


@pytest.fixture
def database(database_pool: Pool) -> Iterator[str]:
    """Name of a fresh, migrated database of this test's own (never one another test used)."""
    name = database_pool.take()
    yield name
    database_pool.give_back(name)


@pytest.fixture
def database_url(database: str) -> str:
    return support.db_url(database)


@pytest.fixture
def empty_database_url() -> Iterator[str]:
    """A database with nothing in it (migration tests)."""
    name = support.unique("txbox_e")
    support.create_database(name)
    yield support.db_url(name)
    support.drop_database(name)


@pytest.fixture(scope="session")
def vhost_pool() -> Iterator[Pool]:
    """Empty vhosts made ahead and deleted behind, off the tests' time (tests/pools.py)."""
    try:
        support.mgmt("GET", "/overview")
    except OSError as exc:
        pytest.fail(f"RabbitMQ management API is not reachable at {support.MGMT_URL} ({exc}); run `make setup` first")

    def new_vhost() -> str:
        name = support.unique("txbox-test")
        support.create_vhost(name)
        return name

    with Pool("vhosts", new_vhost, support.delete_vhost) as pool:
        yield pool


@pytest.fixture
def vhost(vhost_pool: Pool) -> Iterator[str]:
    """A RabbitMQ vhost of this test's own (queues and exchanges vanish with it)."""
    name = vhost_pool.take()
    yield name
    vhost_pool.give_back(name)


@pytest.fixture
def amqp_url(vhost: str) -> str:
    return support.amqp_url(vhost)


@pytest.fixture
def settings(database_url: str, amqp_url: str) -> Settings:
    return Settings(
        service="order-service",
        database_url=database_url,
        amqp_url=amqp_url,
        contracts_dir=CONTRACTS,
        queue_type=os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),
    )  # type: ignore[arg-type]


@pytest.fixture
def service(settings: Settings) -> Service:
    return Service(settings=settings)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Daemon processes a test starts (``txbox ...``); every one is stopped afterwards."""
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        yield group
    finally:
        group.stop_all(timeout=10)
