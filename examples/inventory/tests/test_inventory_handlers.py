"""The inventory service's handlers, against a database of the test's own: no broker, no daemons."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from examples._defaults import demo_token
from examples.inventory.app import service
from examples.inventory.models import Stock
from framework import Unauthorized
from framework.testing import Harness

ALEMBIC = Path(__file__).resolve().parents[1] / "alembic.ini"
RESTOCKER = demo_token("inventory:restock")  # RestockItem requires it


@pytest.fixture
def harness(txbox_database: Callable[..., str]) -> Iterator[Harness]:
    with Harness(service, database_url=txbox_database(ALEMBIC)) as harness:
        yield harness


def stock(harness: Harness, sku: str) -> tuple[int, int] | None:
    with harness.engine().connect() as conn:
        row = conn.execute(select(Stock.available, Stock.reserved).where(Stock.sku == sku)).one_or_none()
    return None if row is None else (row.available, row.reserved)


def test_restocking_adds_to_what_is_available(harness: Harness) -> None:
    harness.deliver(
        "RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 3}, auth_token=RESTOCKER
    )
    harness.deliver(
        "RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 2}, auth_token=RESTOCKER
    )
    assert stock(harness, "BOOK-1") == (5, 0)


def test_restocking_needs_a_token_granting_it(harness: Harness) -> None:
    payload = {"sku": "BOOK-1", "quantity": 3}
    with pytest.raises(Unauthorized, match="carries no auth_token"):
        harness.deliver("RestockItem", aggregate_id="BOOK-1", payload=payload)
    with pytest.raises(Unauthorized, match="does not grant inventory:restock"):
        harness.deliver("RestockItem", aggregate_id="BOOK-1", payload=payload, auth_token=demo_token("inventory:read"))
    assert stock(harness, "BOOK-1") is None


def test_an_order_within_stock_is_reserved(harness: Harness) -> None:
    harness.deliver(
        "RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 3}, auth_token=RESTOCKER
    )
    done = harness.deliver(
        "OrderPlaced", aggregate_id="o-1", payload={"order_id": "o-1", "sku": "BOOK-1", "quantity": 2}
    )
    assert stock(harness, "BOOK-1") == (1, 2)
    assert done.sent_types() == ["StockReserved"]


def test_an_order_beyond_stock_is_rejected_with_the_reason(harness: Harness) -> None:
    harness.deliver(
        "RestockItem", aggregate_id="BOOK-1", payload={"sku": "BOOK-1", "quantity": 1}, auth_token=RESTOCKER
    )
    done = harness.deliver(
        "OrderPlaced", aggregate_id="o-1", payload={"order_id": "o-1", "sku": "BOOK-1", "quantity": 2}
    )
    assert stock(harness, "BOOK-1") == (1, 0)
    [rejected] = done.sent
    assert rejected.message_type == "StockRejected"
    assert rejected.payload["reason"] == "only 1 left"
