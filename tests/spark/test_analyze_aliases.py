"""`txbox analyze` judges messages stored under a type's alias as that type.

Rows written before a contract renamed a type, or by a sender still using the old name,
carry the alias; the receiver stores such a delivery under the one type
(``Registry.get``), and the reconciliation must resolve the name the same way instead of
leaving those messages "not judged" (docs/explanation/receive.md, "Mosaic compatibility").
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from framework.analytics.job import run_once
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import Source
from framework.contracts import load_registry
from tests.spark.seed import Seeder, at
from tests.spark.test_analyze import INVENTORY, ORDER, ROOT, fetch, ids_of

SETTINGS = AnalyzeSettings(grace=300, sla=900, window=86400, partition_rows=5)  # type: ignore[arg-type]


def renamed_contracts(tmp_path: Path) -> Path:
    """The project's contracts with OrderPlaced renamed OrderAccepted: OrderPlaced, the
    name its payload's title and its component key still give, becomes an alias."""
    root = tmp_path / "contracts"
    shutil.copytree(ROOT / "contracts", root)
    contract = root / "order-service" / "order-service.yml"
    text = contract.read_text()
    marker = "    order-placed:\n"
    assert marker in text
    contract.write_text(text.replace(marker, marker + "      name: OrderAccepted\n", 1))
    return root


def test_rows_under_an_alias_are_judged_as_the_type(tmp_path: Path, make_database: Any, spark: Any) -> None:
    registry = load_registry(renamed_contracts(tmp_path))
    assert registry.aliases.get("OrderPlaced") == "OrderAccepted", registry.aliases
    order_url, inventory_url = make_database(), make_database()
    order, inv = Seeder(order_url, registry, ORDER), Seeder(inventory_url, registry, INVENTORY)
    hour = at(datetime.now(UTC), -3600)
    try:
        # Published under the old name; the receiver stored the delivered one under the new.
        delivered = order.outbox("OrderPlaced", hour, processed_at=at(hour, 1))
        inv.inbox("OrderAccepted", delivered, hour, at(hour, 2), processed_at=at(hour, 3))
        lost = order.outbox("OrderPlaced", at(hour, 10), processed_at=at(hour, 11))
        # And one under the new name, lost too: both names are one type.
        lost_new = order.outbox("OrderAccepted", at(hour, 20), processed_at=at(hour, 21))
    finally:
        order.close()
        inv.close()
    result = run_once(
        spark,
        sources=[Source(ORDER, order_url), Source(INVENTORY, inventory_url)],
        registry=registry,
        settings=SETTINGS,
        report_url=order_url,
        parquet=tmp_path / "report",
    )
    findings = fetch(order_url, result.run_id)["analytics_findings"]
    assert ids_of(findings, "lost") == {str(lost), str(lost_new)}
    assert not [note for note in result.notes if "not judged" in note], result.notes
    assert str(delivered) not in {r["message_id"] for r in findings}
