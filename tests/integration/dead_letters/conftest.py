"""Fixtures of the dead-letter tests: an autocommit psycopg connection to the test database."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from framework.contracts import Registry, load_registry
from framework.db import conninfo
from tests.conftest import CONTRACTS


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(conninfo(database_url), autocommit=True, row_factory=dict_row) as c:
        yield c


@pytest.fixture(scope="session")
def registry() -> Registry:
    return load_registry(CONTRACTS)
