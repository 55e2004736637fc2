from pathlib import Path
from typing import Any

import pytest

from framework import CommandHandler, EventHandler, Service
from framework.errors import AssemblyError

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"


class PlaceOrder(CommandHandler):
    message_type = "PlaceOrder"

    def handle(self, message: Any, session: Any, outbox: Any) -> None:
        pass


class StockReserved(EventHandler):
    message_type = "StockReserved"


class StockRejected(EventHandler):
    message_type = "StockRejected"


def orders(*handlers: Any) -> Service:
    service = Service(name="order-service", database_url="postgresql://x/y", contracts_dir=CONTRACTS)
    for h in handlers:
        service.register(h)
    return service


def test_complete_service_passes() -> None:
    assert orders(PlaceOrder(), StockReserved(), StockRejected()).check() == []


def errors_of(service: Service) -> str:
    with pytest.raises(AssemblyError) as err:
        service.check()
    return str(err.value)


def test_accepted_command_without_handler() -> None:
    text = errors_of(orders(StockReserved(), StockRejected()))
    assert "accepts command PlaceOrder but no handler is registered" in text


def test_subscribed_event_without_handler() -> None:
    text = errors_of(orders(PlaceOrder(), StockReserved()))
    assert "subscribes to event StockRejected but no handler" in text


def test_handler_for_unknown_type_names_the_handler() -> None:
    class Typo(CommandHandler):
        message_type = "PlaceOrdr"

    text = errors_of(orders(PlaceOrder(), StockReserved(), StockRejected(), Typo()))
    assert "test_service_check.test_handler_for_unknown_type_names_the_handler.<locals>.Typo" in text
    assert "unknown message type 'PlaceOrdr'" in text


def test_two_handlers_claim_one_type() -> None:
    class Again(CommandHandler):
        message_type = "PlaceOrder"

    text = errors_of(orders(PlaceOrder(), Again(), StockReserved(), StockRejected()))
    assert "2 handlers claim message type 'PlaceOrder'" in text and "Again" in text


def test_wrong_base_class() -> None:
    class Wrong(CommandHandler):
        message_type = "StockReserved"

    text = errors_of(orders(PlaceOrder(), Wrong(), StockRejected()))
    assert "StockReserved is an event: subclass EventHandler" in text


def test_handler_for_type_this_service_does_not_receive() -> None:
    class Restock(CommandHandler):
        message_type = "RestockItem"

    class Placed(EventHandler):
        message_type = "OrderPlaced"

    text = errors_of(orders(PlaceOrder(), StockReserved(), StockRejected(), Restock(), Placed()))
    assert "does not receive RestockItem (it is a command of inventory-service)" in text
    assert "does not receive OrderPlaced (add 'order-service.order.placed' to `x-subscribes`" in text


def test_contract_that_does_not_load(tmp_path: Path) -> None:
    (tmp_path / "bad.yml").write_text("asyncapi: 2.0.0\ninfo: {x-service-id: order-service}\nchannels: [\n")
    service = Service(name="order-service", database_url="postgresql://x/y", contracts_dir=tmp_path)
    assert "cannot read YAML" in errors_of(service)


def test_service_without_contract() -> None:
    service = Service(name="billing-service", database_url="postgresql://x/y", contracts_dir=CONTRACTS)
    assert "no contract declares service 'billing-service'" in errors_of(service)


def test_register_a_class_instead_of_instance_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"register\(PlaceOrder\(\)\)"):
        orders().register(PlaceOrder)  # type: ignore[arg-type]


def test_handler_without_message_type_is_named() -> None:
    class Forgot(CommandHandler):
        pass

    text = errors_of(orders(PlaceOrder(), StockReserved(), StockRejected(), Forgot()))
    assert "Forgot" in text and "does not set `message_type`" in text


def test_an_async_handle_assembles_beside_sync_ones() -> None:
    """``async def handle`` is awaited by the worker with an AsyncSession
    (docs/explanation/handle.md, "Async handlers"): ``check()`` takes it like a plain one."""

    class AsyncPlaceOrder(CommandHandler):
        message_type = "PlaceOrder"

        async def handle(self, message: Any, session: Any, outbox: Any) -> None:  # type: ignore[override]
            pass

    orders(AsyncPlaceOrder(), StockReserved(), StockRejected()).check()
