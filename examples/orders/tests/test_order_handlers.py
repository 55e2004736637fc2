"""The order service's handlers, against a database of the test's own: no broker, no daemons."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from examples.orders.app import service
from examples.orders.models import CANCELLED, COMPLETED, PLACED, Order
from framework import PermanentError
from framework.testing import DeliveryRejected, Harness

ALEMBIC = Path(__file__).resolve().parents[1] / "alembic.ini"
ORDER = {"customer": "ada", "sku": "BOOK-1", "quantity": 2}
NOW = datetime.now(UTC)


@pytest.fixture
def harness(txbox_database: Callable[..., str]) -> Iterator[Harness]:
    with Harness(service, database_url=txbox_database(ALEMBIC)) as harness:
        yield harness


def status(harness: Harness, order_id: str) -> str | None:
    with harness.engine().connect() as conn:
        return conn.scalar(select(Order.status).where(Order.id == order_id))


def test_place_order_stores_the_order_and_publishes_order_placed(harness: Harness) -> None:
    done = harness.deliver("PlaceOrder", aggregate_id="o-1", payload=ORDER, message_context={"correlation_id": "c-1"})

    assert status(harness, "o-1") == PLACED
    [placed] = done.sent
    assert placed.message_type == "OrderPlaced"
    assert placed.payload == {"order_id": "o-1", "sku": "BOOK-1", "quantity": 2}
    assert placed.message_context == {"correlation_id": "c-1"}  # copied from the command


def test_placing_an_order_twice_is_a_permanent_error(harness: Harness) -> None:
    harness.deliver("PlaceOrder", aggregate_id="o-1", payload=ORDER)
    with pytest.raises(PermanentError, match="already exists"):
        harness.deliver("PlaceOrder", aggregate_id="o-1", payload=ORDER)


def test_a_payload_the_contract_refuses_never_reaches_the_handler(harness: Harness) -> None:
    with pytest.raises(DeliveryRejected) as rejected:
        harness.deliver("PlaceOrder", aggregate_id="o-1", payload={**ORDER, "quantity": 0})
    assert rejected.value.reason == "schema_invalid"
    assert status(harness, "o-1") is None


@pytest.mark.parametrize(
    ("event", "final", "sent"),
    [("StockReserved", COMPLETED, "OrderCompleted"), ("StockRejected", CANCELLED, "OrderCancelled")],
)
def test_a_stock_result_finishes_the_order(harness: Harness, event: str, final: str, sent: str) -> None:
    harness.deliver("PlaceOrder", aggregate_id="o-1", payload=ORDER)
    result = {"order_id": "o-1", "sku": "BOOK-1", "quantity": 2}
    if event == "StockRejected":
        result["reason"] = "only 1 left"
    done = harness.deliver(event, aggregate_id="o-1", payload=result)
    assert status(harness, "o-1") == final
    assert done.sent_types() == [sent]


def test_an_order_the_web_api_stored_is_taken_over_by_its_own_command(harness: Harness) -> None:
    # examples/orders/api.py stores the order and sends PlaceOrder, with the command's
    # correlation id, in one transaction.
    with harness.engine().begin() as conn:
        conn.execute(
            insert(Order).values(
                id="o-1",
                customer="ada",
                sku="BOOK-1",
                quantity=2,
                status=PLACED,
                correlation_id="c-1",
                requested_at=NOW,
            )
        )
    done = harness.deliver("PlaceOrder", aggregate_id="o-1", payload=ORDER, message_context={"correlation_id": "c-1"})
    assert done.sent_types() == ["OrderPlaced"]
    with pytest.raises(PermanentError, match="already exists"):  # not this command's order
        harness.deliver("PlaceOrder", aggregate_id="o-1", payload=ORDER, message_context={"correlation_id": "c-2"})
