"""Message ids are UUIDv7: ordered by the time they were made (framework/ids.py)."""

from __future__ import annotations

import time
import uuid

from framework import ids
from framework.envelope import Message
from framework.outbox import Outbox
from tests import support


def test_ids_are_version_7_rfc_variant_and_begin_with_the_time_in_milliseconds() -> None:
    before = time.time_ns() // 1_000_000
    made = [ids.message_id() for _ in range(1000)]
    after = time.time_ns() // 1_000_000
    assert len(set(made)) == len(made)
    for value in made:
        assert value.version == 7 and value.variant == "specified in RFC 4122"
        assert before <= value.int >> 80 <= after


def test_ids_made_later_sort_after_them() -> None:
    first = ids.message_id()
    support.wait_until(lambda: time.time_ns() // 1_000_000 > first.int >> 80, 5, 0.0005, "the next millisecond")
    second = ids.message_id()
    assert first < second


def test_the_outbox_gives_a_message_without_an_id_a_version_7_one() -> None:
    from examples.orders.app import service

    outbox = Outbox(None, service.registry)  # type: ignore[arg-type]  # build() writes nothing
    spec = service.registry.get("PlaceOrder")
    row = outbox.build(spec, aggregate_id="o-1", payload={"customer": "ada", "sku": "BOOK-1", "quantity": 1})
    assert row.id.version == 7


PAYLOAD = {"customer": "ada", "sku": "BOOK-1", "quantity": 1}


def _sent(
    incoming: uuid.UUID, handler: str = "app.Reserve", service_name: str = "orders", n: int = 2
) -> list[uuid.UUID]:
    """The ids of ``n`` PlaceOrder commands sent by one handler run, as the worker builds its outbox."""
    from examples.orders.app import service

    message = Message(
        message_id=incoming, message_type="OrderPlaced", aggregate_type="order", aggregate_id="o-1", payload={}
    )
    outbox = Outbox(None, service.registry, incoming=message, defer_to=[], sent_by=(service_name, handler))  # type: ignore[arg-type]
    return [outbox.send_command("PlaceOrder", aggregate_id="o-1", payload=PAYLOAD) for _ in range(n)]


def test_a_handler_run_again_sends_under_the_same_ids() -> None:
    incoming = uuid.uuid4()
    first, again = _sent(incoming), _sent(incoming)
    assert first == again
    assert all(i.version == 5 for i in first)
    assert first == [ids.sent_id(incoming, "orders", "app.Reserve", "PlaceOrder", n) for n in range(2)]


def test_another_position_handler_service_or_incoming_message_gives_other_ids() -> None:
    incoming = uuid.uuid4()
    first = _sent(incoming)
    others = [*_sent(uuid.uuid4()), *_sent(incoming, handler="app.Other"), *_sent(incoming, service_name="billing")]
    assert len(set(first)) == 2, "each position its own id"
    assert not set(first) & set(others)
    assert ids.sent_id(incoming, "orders", "app.Reserve", "PlaceOrder", 0) != ids.sent_id(
        incoming, "orders", "app.Reserve", "OrderPlaced", 0
    )


def test_sends_outside_a_handler_and_explicit_ids_keep_their_own() -> None:
    from examples.orders.app import service

    incoming = uuid.uuid4()
    message = Message(
        message_id=incoming, message_type="OrderPlaced", aggregate_type="order", aggregate_id="o-1", payload={}
    )
    plain = Outbox(None, service.registry, incoming=message, defer_to=[])  # type: ignore[arg-type]
    assert plain.send_command("PlaceOrder", aggregate_id="o-1", payload=PAYLOAD).version == 7
    chosen = uuid.uuid4()
    handler = Outbox(None, service.registry, incoming=message, defer_to=[], sent_by=("orders", "app.Reserve"))  # type: ignore[arg-type]
    assert handler.send_command("PlaceOrder", aggregate_id="o-1", payload=PAYLOAD, message_id=chosen) == chosen
    # The explicit id took no position: the next send is the run's first derived one.
    assert handler.send_command("PlaceOrder", aggregate_id="o-1", payload=PAYLOAD) == _sent(incoming, n=1)[0]
