"""`txbox dashboard` options: sources, defaults, misconfiguration named with the fix."""

from __future__ import annotations

import argparse
from pathlib import Path

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
    assert (settings.host, settings.port, settings.token, settings.views_need_token) == (
        "127.0.0.1",
        8470,
        None,
        False,
    )
    with pytest.raises(ConfigurationError, match="at least one source"):
        create_app([], settings)
    with pytest.raises(ConfigurationError, match="TXBOX_DASHBOARD_TOKEN"):
        load(DashboardSettings, {"TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN": "true"})


TOKEN = "0123456789abcdef"  # exactly the minimum length


def test_a_token_makes_viewing_need_it_unless_told_otherwise() -> None:
    assert load(DashboardSettings, {"TXBOX_DASHBOARD_TOKEN": TOKEN}).views_need_token
    relaxed = {"TXBOX_DASHBOARD_TOKEN": TOKEN, "TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN": "false"}
    assert not load(DashboardSettings, relaxed).views_need_token


def test_a_short_token_is_refused_at_start() -> None:
    with pytest.raises(ConfigurationError, match="at least 16") as exc:
        load(DashboardSettings, {"TXBOX_DASHBOARD_TOKEN": TOKEN[:-1]})
    assert TOKEN[:-1] not in str(exc.value)  # the error names the length, never the secret


def test_without_a_token_only_loopback_may_be_bound() -> None:
    with pytest.raises(ConfigurationError, match="loopback only"):
        load(DashboardSettings, {"TXBOX_DASHBOARD_HOST": "0.0.0.0"})
    with pytest.raises(ConfigurationError, match="loopback only"):
        cli.run(_args("--host", "0.0.0.0", "--source", "order-service=postgresql://postgres@127.0.0.1/orders"))
    settings = load(DashboardSettings, {"TXBOX_DASHBOARD_HOST": "0.0.0.0", "TXBOX_DASHBOARD_TOKEN": TOKEN})
    assert settings.hosts == ["127.0.0.1", "localhost", "::1"]  # a wildcard bind adds no name


def test_start_says_who_can_read_without_a_token() -> None:
    [line] = cli.warnings(load(DashboardSettings, {}))
    assert "anyone on this host can read every message" in line
    assert cli.warnings(load(DashboardSettings, {"TXBOX_DASHBOARD_TOKEN": TOKEN})) == []


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("TXBOX_DASHBOARD_SESSION_TTL", "0s"),
        ("TXBOX_DASHBOARD_HEADER_TIMEOUT", "0"),
        ("TXBOX_DASHBOARD_MAX_BODY_BYTES", "0"),
        ("TXBOX_DASHBOARD_MAX_CONNECTIONS", "0"),
    ],
)
def test_limits_must_be_positive(variable: str, value: str) -> None:
    with pytest.raises(ConfigurationError, match=variable):
        load(DashboardSettings, {variable: value})


def test_with_a_registry_the_service_has_no_database_and_no_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("TXBOX_TENANTS_FILE", "TXBOX_TENANTS_DATABASE_URL", "TXBOX_APP", "TXBOX_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    assert cli.tenanted(_args()) is None  # no registry: the dashboard as without one
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.acme]\ndatabase_url = "postgresql+psycopg://postgres@127.0.0.1/acme"\n')
    monkeypatch.setenv("TXBOX_TENANTS_FILE", str(path))
    monkeypatch.setenv("TXBOX_SERVICE", "order-service")
    found = cli.tenanted(_args())
    assert found is not None
    [source], follower = found
    try:
        assert source.name == "order-service" and follower.registry.keys() == ("acme",)
    finally:
        follower.stop()
    with pytest.raises(ConfigurationError, match="drop --source"):
        cli.tenanted(_args("--source", "order-service=postgresql://postgres@127.0.0.1/orders"))
