"""Spark tests: one local Spark session for the whole run, several service databases.

Every test module here is marked ``spark`` (and ``integration``: they use the real
PostgreSQL). The session costs ~10 s to start, so it is created once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import support

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.spark)
            item.add_marker(pytest.mark.integration)
            if item.get_closest_marker("timeout") is None:
                # The shared session's start and the first run share one test's budget; on a
                # machine loaded by five suites at once that alone has taken minutes.
                item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    from framework.analytics.session import spark_session
    from framework.analytics.settings import AnalyzeSettings

    session = spark_session(AnalyzeSettings(master="local[2]", shuffle_partitions=4, driver_memory="1g"), "txbox-tests")
    yield session
    session.stop()


@pytest.fixture
def make_database(template_db: str) -> Iterator[Callable[[], str]]:
    """Factory of fresh migrated databases (clones of the template); all dropped at the end."""
    created: list[str] = []

    def make() -> str:
        name = support.unique("txbox_s")
        support.create_database(name, template=template_db)
        created.append(name)
        return support.db_url(name)

    yield make
    for name in created:
        support.drop_database(name)
