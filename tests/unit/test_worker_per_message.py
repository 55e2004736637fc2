"""What the worker does per message stays cheap: the driver's own timestamp loader, no span
object when nothing records (docs/explanation/handle.md, "Worker batches")."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from psycopg.types.datetime import TimestamptzLoader

from framework import Message, names, tracing
from framework.worker import decode
from framework.worker.batch import Claimed, handler_span

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def claimed(metadata: dict[str, Any]) -> Claimed:
    message_id = uuid.uuid4()
    message = Message(
        message_id=message_id, message_type="PlaceOrder", aggregate_type="order", aggregate_id="1", payload={}
    )
    return Claimed(
        id=message_id,
        message_type="PlaceOrder",
        routing_key="orders.place",
        started=1,
        finished=0,
        metadata=metadata,
        message=message,
        claimed_at=time.monotonic(),
    )


@pytest.mark.skipif(psycopg.pq.__impl__ == "python", reason="only psycopg's binary or C build has a faster loader")
def test_claimed_timestamps_are_read_by_the_drivers_own_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    def pure_python(self: Any, data: Any) -> Any:
        raise AssertionError("the pure-Python timestamp parser ran: ten times the C loader's cost")

    monkeypatch.setattr(TimestamptzLoader, "load", pure_python)
    loader = decode.LenientTimestamptzLoader(psycopg.adapters.types["timestamptz"].oid)
    assert loader.load(b"2026-11-24 23:40:04.721+00") == datetime(2026, 11, 24, 23, 40, 4, 721000, tzinfo=UTC)
    assert isinstance(loader.load(b"infinity"), decode.Undecodable)  # still lenient


def test_no_span_is_built_when_nothing_records(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_span(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a span was built although nothing records")

    monkeypatch.setattr(tracing.tracer, "start_as_current_span", no_span)
    with handler_span(claimed({names.METADATA_TRACE: {"traceparent": PARENT}}), tracer=None):
        # What the handler sends still continues the message's trace.
        assert tracing.current() == {"traceparent": PARENT}
    assert not trace.get_current_span().get_span_context().is_valid
    with handler_span(claimed({}), tracer=None):
        assert tracing.current() is None
