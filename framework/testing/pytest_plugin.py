"""pytest fixtures for testing txbox services (docs/explanation/development.md, "Testing handlers").

Loaded automatically wherever txbox is installed (the ``pytest11`` entry point); the
fixtures cost nothing until a test asks for one:

- ``txbox_database(alembic_ini=None, schema="txbox")``: the URL of a database of this
  test's own, migrated (the framework's history, then the service's history of
  ``alembic_ini``), cloned from a template migrated once per session; dropped afterwards.
- ``txbox_templates``: the session's :class:`~framework.testing.databases.Templates`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from framework import tables
from framework.errors import ConfigurationError
from framework.testing.databases import Templates


@pytest.fixture(scope="session")
def txbox_templates() -> Iterator[Templates]:
    try:
        templates = Templates()
    except ConfigurationError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield templates
    finally:
        templates.close()


@pytest.fixture
def txbox_database(txbox_templates: Templates) -> Iterator[Callable[..., str]]:
    made: list[str] = []

    def make(alembic_ini: str | Path | None = None, schema: str = tables.SCHEMA) -> str:
        url = txbox_templates.clone(alembic_ini, schema)
        made.append(url)
        return url

    try:
        yield make
    finally:
        for url in made:
            txbox_templates.drop(url)
