"""The whole saga in one test: both services' handlers, each against its own database,
the messages they send routed between them until idle (no broker, no daemons)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from examples._defaults import demo_token
from examples.inventory.app import service as inventory
from examples.orders.app import service as orders
from examples.orders.models import CANCELLED, COMPLETED, Order
from framework.testing import Harness

EXAMPLES = Path(__file__).resolve().parents[1]


@pytest.fixture
def harness(txbox_database: Callable[..., str]) -> Iterator[Harness]:
    with Harness() as harness:
        harness.add(orders, database_url=txbox_database(EXAMPLES / "orders" / "alembic.ini"))
        harness.add(inventory, database_url=txbox_database(EXAMPLES / "inventory" / "alembic.ini"))
        yield harness


def order_status(harness: Harness, order_id: str) -> str | None:
    with harness.engine("order-service").connect() as conn:
        return conn.scalar(select(Order.status).where(Order.id == order_id))


@pytest.mark.parametrize(
    ("in_stock", "final", "last"), [(5, COMPLETED, "OrderCompleted"), (1, CANCELLED, "OrderCancelled")]
)
def test_an_order_runs_through_both_services(harness: Harness, in_stock: int, final: str, last: str) -> None:
    harness.deliver(
        "RestockItem",
        aggregate_id="BOOK-1",
        payload={"sku": "BOOK-1", "quantity": in_stock},
        auth_token=demo_token("inventory:restock"),
    )
    harness.deliver(
        "PlaceOrder",
        aggregate_id="o-1",
        payload={"customer": "ada", "sku": "BOOK-1", "quantity": 2},
        message_context={"correlation_id": "c-1"},
    )

    steps = harness.run_until_idle()

    assert [(d.service, d.message.message_type) for d in steps] == [
        ("inventory-service", "OrderPlaced"),
        ("order-service", "StockReserved" if final == COMPLETED else "StockRejected"),
    ]
    assert order_status(harness, "o-1") == final
    # Nobody here subscribes to the order's final event: it is kept, not lost.
    assert [m.message_type for m in harness.unrouted] == [last]
    assert all(d.message.message_context == {"correlation_id": "c-1"} for d in steps)
