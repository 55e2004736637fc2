"""`txbox dashboard` options: sources, defaults, misconfiguration named with the fix."""

from __future__ import annotations

import argparse

import pytest

from framework.cli import dashboard as cli
from framework.dashboard.app import DashboardSettings, create_app
from framework.errors import ConfigurationError
from framework.settings import load


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser, "dashboard")
    return parser.parse_args(argv)


def test_several_sources_share_schema_and_contracts() -> None:
    sources = cli.sources_of(
        _args(
            "--source", "order-service=postgresql+psycopg://postgres@127.0.0.1/orders",
            "--source", "inventory-service=postgresql://postgres@127.0.0.1/inventory",
            "--schema", "tx",
        )
    )  # fmt: skip
    assert [(s.name, s.schema) for s in sources] == [("order-service", "tx"), ("inventory-service", "tx")]


@pytest.mark.parametrize("spec", ["orders", "Bad Name=postgresql://x/y", "orders=mysql://x/y"])
def test_a_bad_source_names_the_fix(spec: str) -> None:
    with pytest.raises(ConfigurationError, match="NAME=DATABASE_URL"):
        cli.sources_of(_args("--source", spec))


def test_defaults_bind_loopback_and_need_a_source() -> None:
    settings = load(DashboardSettings, {})
    assert (settings.host, settings.port, settings.token, settings.view_requires_token) == (
        "127.0.0.1",
        8470,
        None,
        False,
    )
    with pytest.raises(ConfigurationError, match="at least one source"):
        create_app([], settings)
    with pytest.raises(ConfigurationError, match="TXBOX_DASHBOARD_TOKEN"):
        load(DashboardSettings, {"TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN": "true"})
