"""`txbox analyze`'s sources for services with tenants: a registry per service in the
sources file, or TXBOX_SERVICE's own; every mistake named before Spark starts
(docs/how-to/tenants.md, "Analyze every tenant")."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from framework.analytics.sources import Source, check_history, check_unique, load_sources_file
from framework.cli import analyze as cli
from framework.errors import ConfigurationError

ORDERS = "postgresql+psycopg://app@db-acme:5432/orders"
SHARED = "postgresql+psycopg://app@db:5432/shared"


def _files(tmp_path: Path, entry: str, registry: str = "") -> Path:
    (tmp_path / "tenants").mkdir(parents=True)
    (tmp_path / "tenants" / "orders.toml").write_text(
        registry or f'[tenants.acme]\ndatabase_url = "{ORDERS}"\n[tenants.globex]\nschema = "tenant_globex"\n'
    )
    path = tmp_path / "sources.yml"
    path.write_text(f"sources:\n  inventory-service: {SHARED}\n  order-service:\n{entry}")
    return path


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser, "analyze")
    return parser.parse_args(argv)


def test_a_registry_in_the_sources_file_is_a_source_per_tenant(tmp_path: Path) -> None:
    path = _files(tmp_path, f"    tenants_file: tenants/orders.toml\n    database_url: {SHARED}\n")
    sources, _ = load_sources_file(path)  # the registry's path is the sources file's folder's
    assert [(s.service, s.tenant, s.url, s.schema) for s in check_unique(sources)] == [
        ("inventory-service", None, SHARED, None),
        ("order-service", "acme", ORDERS, "txbox"),
        ("order-service", "globex", SHARED, "tenant_globex"),
    ]
    assert [s.name for s in sources] == ["inventory-service", "order-service/acme", "order-service/globex"]


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ("    tenants_fil: tenants/orders.toml\n", "names its registry.*unknown: tenants_fil"),
        ("    schema: txbox\n", "names its registry, `tenants_file: PATH` or `tenants_database_url: URL`"),
        ("    tenants_file: tenants/none.toml\n", "sources.order-service: .*none.toml"),
        ("    tenants_file: tenants/orders.toml\n    schema: Bad-Schema\n", "schema 'Bad-Schema' is not a valid"),
        ("    tenants_file: [a, b]\n", "every field is a string"),
    ],
)
def test_a_bad_entry_names_where_and_the_fix(tmp_path: Path, entry: str, error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        load_sources_file(_files(tmp_path, entry))


def test_a_registry_that_does_not_load_is_named_with_its_problem_and_no_password(tmp_path: Path) -> None:
    registry = '[tenants.Acme]\ndatabase_url = "postgresql+psycopg://app:hunter2@db/orders"\n'
    with pytest.raises(ConfigurationError) as caught:
        load_sources_file(_files(tmp_path, "    tenants_file: tenants/orders.toml\n", registry))
    assert "sources.order-service" in str(caught.value) and "tenant key 'Acme' is not valid" in str(caught.value)
    path = _files(tmp_path / "b", "    tenants_file: tenants/orders.toml\n    database_url: mysql://u:hunter2@h/x\n")
    with pytest.raises(ConfigurationError, match="is not a PostgreSQL URL") as caught:
        load_sources_file(path)
    assert "hunter2" not in str(caught.value)


def test_a_service_is_read_as_one_database_or_as_tenants_not_both() -> None:
    both = [Source("order-service", ORDERS), Source("order-service", ORDERS, tenant="acme", schema="txbox")]
    with pytest.raises(ConfigurationError, match="both as one database and as tenants"):
        check_unique(both)
    with pytest.raises(ConfigurationError, match="'order-service/acme' is given twice"):
        check_unique([both[1], both[1]])


def test_history_is_refused_for_tenants() -> None:
    check_history([Source("order-service", ORDERS)])
    with pytest.raises(ConfigurationError, match=r"--history cannot be read for tenants \(order-service/acme\)"):
        check_history([Source("order-service", ORDERS, tenant="acme")])


def test_the_services_own_registry_gives_its_tenants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _files(tmp_path, "    tenants_file: tenants/orders.toml\n")
    registry = tmp_path / "tenants" / "orders.toml"
    for name in ("TXBOX_TENANTS_FILE", "TXBOX_TENANTS_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TXBOX_SERVICE", "order-service")
    monkeypatch.setenv("TXBOX_DATABASE_URL", SHARED)
    monkeypatch.setenv("TXBOX_TENANTS_FILE", str(registry))
    sources, _ = cli.sources_of(_args())
    assert [(s.name, s.url) for s in sources] == [("order-service/acme", ORDERS), ("order-service/globex", SHARED)]
    # --source given: the environment's registry is not added; --tenants-file is.
    sources, _ = cli.sources_of(_args("--source", f"inventory-service={SHARED}"))
    assert [s.name for s in sources] == ["inventory-service"]
    sources, _ = cli.sources_of(_args("--source", f"inventory-service={SHARED}", "--tenants-file", str(registry)))
    assert [s.name for s in sources] == ["inventory-service", "order-service/acme", "order-service/globex"]
    monkeypatch.delenv("TXBOX_SERVICE")
    with pytest.raises(ConfigurationError, match="set TXBOX_SERVICE to the service whose tenants it lists"):
        cli.sources_of(_args())
