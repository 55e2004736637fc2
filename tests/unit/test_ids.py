"""Message ids are UUIDv7: ordered by the time they were made (framework/ids.py)."""

from __future__ import annotations

import time

from framework import ids
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
