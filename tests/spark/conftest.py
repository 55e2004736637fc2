"""Spark tests: several service databases; the one local Spark session (``spark``) is in tests/conftest.py.

Every test module here is marked ``spark`` (and ``integration``: they use the real
PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import support

if TYPE_CHECKING:
    pass

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
