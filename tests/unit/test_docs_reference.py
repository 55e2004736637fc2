"""The reference pages of the documentation site are what the code says.

docs/reference/configuration.md (between its markers), cli.md, errors.md, metrics.md
and tables.md are rendered from the code by txbox_tools.docs; a page that differs from
its rendering fails here, so a new setting, flag, error class, metric or column without
its documentation fails. Regenerate them with ``python -m txbox_tools.docs``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from framework.settings import describe
from txbox_tools import docs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", ["configuration.md", "cli.md", "errors.md", "metrics.md", "tables.md"])
def test_the_reference_page_is_up_to_date(page: str) -> None:
    path = docs.REFERENCE / page
    expected = docs.rendered()[path]
    assert path.read_text() == expected, f"{path.relative_to(ROOT)} is stale: run `python -m txbox_tools.docs`"


def test_the_configuration_page_documents_every_setting() -> None:
    page = (docs.REFERENCE / "configuration.md").read_text()
    documented = set(re.findall(r"`(TXBOX_[A-Z0-9_]+)`", page))
    missing = [env for cls in docs.settings_classes() for env, *_ in describe(cls) if env not in documented]
    assert not missing, f"docs/reference/configuration.md does not document {', '.join(missing)}"


def test_every_error_class_and_metric_is_in_its_page() -> None:
    from framework import errors, metrics

    errors_page = (docs.REFERENCE / "errors.md").read_text()
    for name, obj in vars(errors).items():
        if isinstance(obj, type) and issubclass(obj, errors.TxboxError):
            assert f"**`{name}`**" in errors_page
    metrics_page = (docs.REFERENCE / "metrics.md").read_text()
    assert metrics_page.count("| `txbox_") == len({m._name for m in vars(metrics).values() if hasattr(m, "_name")})


def test_readme_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme
    assert "make test" in readme
