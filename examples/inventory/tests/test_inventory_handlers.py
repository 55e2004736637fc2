"""The inventory service's handlers, against a database of the test's own: no broker, no daemons."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from examples.inventory.app import service
from examples.inventory.models import Stock
from framework.testing import Harness

ALEMBIC = Path(__file__).resolve().parents[1] / "alembic.ini"


@pytest.fixture
def harness(txbox_database: Callable[..., str]) -> Iterator[Harness]:
    with Harness(service, database_url=txbox_database(ALEMBIC)) as harness:
        yield harness


def stock(harness: Harness, sku: str) -> tuple[int, int] | None:
    with harness.engine().connect() as conn:
        row = conn.execute(select(Stock.available, Stock.reserved).where(Stock.sku == sku)).one_or_none()
    return None if row is None else (row.available, row.reserved)


def test_restocking_adds_to_what_is_available(harness: Harness) -> None:
    harness.deliver("RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 3})
    harness.deliver("RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 2})
    assert stock(harness, "BOOK-1") == (5, 0)


def test_an_order_within_stock_is_reserved(harness: Harness) -> None:
    harness.deliver("RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 3})
    done = harness.deliver(
        "OrderPlaced", aggregate_id="o-1", payload={"order_id": "o-1", "sku": "BOOK-1", "quantity": 2}
    )
    assert stock(harness, "BOOK-1") == (1, 2)
    assert done.sent_types() == ["StockReserved"]


def test_an_order_beyond_stock_is_rejected_with_the_reason(harness: Harness) -> None:
    harness.deliver("RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 1})
    done = harness.deliver(
        "OrderPlaced", aggregate_id="o-1", payload={"order_id": "o-1", "sku": "BOOK-1", "quantity": 2}
    )
    assert stock(harness, "BOOK-1") == (1, 0)
    [rejected] = done.sent
    assert rejected.message_type == "StockRejected"
    assert rejected.payload["reason"] == "only 1 left"
