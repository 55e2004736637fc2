"""`txbox analyze` over services read per tenant: each finding names its tenant, and a
message is due at its own tenant of the subscriber (docs/how-to/tenants.md, "Analyze
every tenant").

order-service keeps a database per tenant, inventory-service a schema per tenant in one
database; both registries are TOML files named by one sources file, as a user writes it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from framework import migrate
from framework.analytics.job import run_once
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import check_unique, load_sources_file
from framework.contracts import Registry, load_registry
from framework.db import conninfo
from tests import support
from tests.spark.seed import Seeder, at

ROOT = Path(__file__).resolve().parents[2]
ORDER, INVENTORY = "order-service", "inventory-service"
SETTINGS = AnalyzeSettings(grace=300, sla=900, window=86400)  # type: ignore[arg-type]


def _registry_file(path: Path, tenants: dict[str, str]) -> Path:
    path.write_text("".join(f"[tenants.{key}]\n{line}\n" for key, line in tenants.items()), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def contracts() -> Registry:
    return load_registry(ROOT / "contracts")


@pytest.fixture(scope="module")
def tenants_run(
    contracts: Registry, spark: Any, template_db: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, set[str]], list[dict[str, Any]], Any]]:
    """The two services' four tenants seeded, one run over them (the Spark run is the slow
    part: once for the module); (ids by case, findings, result)."""
    databases = [support.unique("txbox_s") for _ in range(3)]
    for name in databases:
        support.create_database(name, template=template_db)
    try:
        yield _run(contracts, spark, [support.db_url(n) for n in databases], tmp_path_factory.mktemp("tenants"))
    finally:
        for name in databases:
            support.drop_database(name)


def _run(
    contracts: Registry, spark: Any, urls: list[str], folder: Path
) -> tuple[dict[str, set[str]], list[dict[str, Any]], Any]:
    order_acme, order_globex, inventory = urls
    for schema in ("inv_acme", "inv_globex"):
        migrate.upgrade(inventory, schema)
    _registry_file(
        folder / "orders.toml",
        {"acme": f'database_url = "{order_acme}"', "globex": f'database_url = "{order_globex}"'},
    )
    _registry_file(folder / "inventory.toml", {"acme": 'schema = "inv_acme"', "globex": 'schema = "inv_globex"'})
    (folder / "sources.yml").write_text(
        f"sources:\n  {ORDER}:\n    tenants_file: orders.toml\n"
        f"  {INVENTORY}:\n    tenants_file: inventory.toml\n    database_url: {inventory}\n",
        encoding="utf-8",
    )
    sources, _ = load_sources_file(folder / "sources.yml")
    sources = check_unique(sources)
    assert [(s.service, s.tenant, s.schema) for s in sources] == [
        (ORDER, "acme", "txbox"),
        (ORDER, "globex", "txbox"),
        (INVENTORY, "acme", "inv_acme"),
        (INVENTORY, "globex", "inv_globex"),
    ]

    now = datetime.now(UTC)
    hour = at(now, -3600)
    ids: dict[str, set[str]] = {}
    seeders = {
        ("order", "acme"): Seeder(order_acme, contracts, ORDER),
        ("order", "globex"): Seeder(order_globex, contracts, ORDER),
        ("inventory", "acme"): Seeder(inventory, contracts, INVENTORY, schema="inv_acme"),
        ("inventory", "globex"): Seeder(inventory, contracts, INVENTORY, schema="inv_globex"),
    }
    try:

        def published(tenant: str, seconds: float) -> uuid.UUID:
            t = at(hour, seconds)
            return seeders[("order", tenant)].outbox("OrderPlaced", t, processed_at=at(t, 1))

        def received(tenant: str, mid: uuid.UUID, seconds: float) -> None:
            t = at(hour, seconds)
            seeders[("inventory", tenant)].inbox("OrderPlaced", mid, t, at(t, 2), processed_at=at(t, 3))

        for tenant, seconds in (("acme", 0), ("globex", 5)):  # delivered to their own tenant: no finding
            mid = published(tenant, seconds)
            received(tenant, mid, seconds)
            ids.setdefault("delivered", set()).add(str(mid))
        ids["lost_acme"] = {str(published("acme", 10))}  # received nowhere
        crossed = published("globex", 20)  # received by the wrong tenant
        received("acme", crossed, 20)
        ids["crossed"] = {str(crossed)}
        t = at(hour, 30)
        rejected = published("globex", 30)  # a dead letter at its own tenant: abandoned, not lost
        seeders[("inventory", "globex")].dead_letter(rejected, "OrderPlaced", at(t, 2), reason="schema_invalid")
        ids["rejected"] = {str(rejected)}
    finally:
        for seeder in seeders.values():
            seeder.close()

    result = run_once(
        spark, sources=sources, registry=contracts, settings=SETTINGS, schema="txbox", report_url=order_acme
    )
    with psycopg.connect(conninfo(order_acme)) as conn:
        cur = conn.execute("SELECT * FROM txbox.analytics_findings WHERE run_id = %s", (result.run_id,))
        columns = [d.name for d in cur.description or ()]
        findings = [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]
    return ids, findings, result


def _found(findings: list[dict[str, Any]], kind: str) -> set[tuple[str, str | None, str]]:
    return {(f["message_id"], f["tenant"], f["service"]) for f in findings if f["kind"] == kind}


def test_a_message_is_due_at_its_own_tenant(tenants_run: Any) -> None:
    ids, findings, result = tenants_run
    (lost,) = ids["lost_acme"]
    (crossed,) = ids["crossed"]
    # Lost: the one received nowhere, and the one another tenant received, each at the
    # tenant it was due at. Delivered ones and the dead-lettered one are not lost.
    assert _found(findings, "lost") == {(lost, "acme", INVENTORY), (crossed, "globex", INVENTORY)}
    assert result.lost == 2


def test_another_tenants_message_is_unexpected_where_it_landed(tenants_run: Any) -> None:
    ids, findings, _ = tenants_run
    (crossed,) = ids["crossed"]
    unexpected = [f for f in findings if f["kind"] == "unexpected"]
    assert [(f["message_id"], f["tenant"], f["reason"], f["publisher"]) for f in unexpected] == [
        (crossed, "acme", "other_tenant", ORDER)
    ]
    assert unexpected[0]["detail"] == f"published by tenant globex of {ORDER}"


def test_findings_and_the_run_name_their_tenants(tenants_run: Any) -> None:
    ids, findings, result = tenants_run
    (rejected,) = ids["rejected"]
    assert _found(findings, "abandoned") == {(rejected, "globex", INVENTORY)}
    assert result.notes[0].startswith(f"judged: {ORDER} (tenants acme, globex), {INVENTORY} (tenants acme, globex)")
    assert f"{INVENTORY}/globex" in result.summary()
