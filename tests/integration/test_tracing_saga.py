"""W3C trace context across the example saga: both services' relay, receiver and worker
run in this process (threads), spans recorded by the SDK's in-memory exporter.

The chain asserted: business span → order-service handler → inventory handler →
order-service handler, every handler span the child of the span that wrote its message,
all in one trace; each hop's relay publish and receiver store are batch spans linked to
that writer's span. And a plain AMQP publisher's ``traceparent`` is joined, a malformed
one ignored.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pika
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session

from examples.inventory.app import service as inventory_app
from examples.orders.app import service as orders_app
from framework import names, topology
from framework.envelope import Message
from framework.receiver import Receiver, ReceiverConfig
from framework.relay import Relay, RelayConfig
from framework.service import Service
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import running

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ORDERS_INBOX = names.inbox_queue("order-service")
INVENTORY_INBOX = names.inbox_queue("inventory-service")


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """The process's tracer provider, set once (OpenTelemetry allows no second one)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def copy(app: Service, database_url: str, amqp_url: str) -> Service:
    """The example service with its handlers, on this test's database and vhost."""
    service = Service(settings=replace(app.settings, database_url=database_url, amqp_url=amqp_url))
    service.jwt = app.jwt
    for handler in dict.fromkeys(app.handlers.values()):
        service.register(handler)
    return service


@pytest.fixture
def services(txbox_database: Callable[..., str], amqp_url: str) -> Iterator[tuple[Service, Service]]:
    orders = copy(orders_app, txbox_database(EXAMPLES / "orders" / "alembic.ini"), amqp_url)
    inventory = copy(inventory_app, txbox_database(EXAMPLES / "inventory" / "alembic.ini"), amqp_url)
    for service in (orders, inventory):
        topology.declare(service.settings, service.registry)
    with contextlib.ExitStack() as stack:
        for service in (orders, inventory):
            stack.enter_context(running(Relay(service, RelayConfig(poll_interval=0.2), declare_topology=False)))
            stack.enter_context(running(Receiver(service, ReceiverConfig())))
            stack.enter_context(running(Worker(service, WorkerConfig(poll_interval=0.2))))
        yield orders, inventory
        for service in (orders, inventory):
            service.engine.dispose()


def wait_for(exporter: InMemorySpanExporter, done: Callable[[list[ReadableSpan]], bool]) -> list[ReadableSpan]:
    """The finished spans once ``done`` holds for them (the daemons run in other threads)."""

    def finished() -> list[ReadableSpan] | None:
        spans = list(exporter.get_finished_spans())
        return spans if done(spans) else None

    return support.wait_until(finished, 60, message="the spans asked for")


def child_of(finished: list[ReadableSpan], parent: ReadableSpan, name: str) -> ReadableSpan:
    parent_id = parent.get_span_context().span_id
    found = [s for s in finished if s.name == name and s.parent is not None and s.parent.span_id == parent_id]
    assert len(found) == 1, f"{name!r} children of {parent.name!r}: {[s.name for s in finished if s.parent]}"
    return found[0]


def linking(finished: list[ReadableSpan], name: str, target: ReadableSpan) -> list[ReadableSpan]:
    """The spans named ``name`` with a link to ``target``."""
    span_id = target.get_span_context().span_id
    return [s for s in finished if s.name == name and any(link.context.span_id == span_id for link in s.links)]


def test_one_trace_runs_through_both_services(spans: InMemorySpanExporter, services: tuple[Service, Service]) -> None:
    orders, _ = services
    business_span = trace.get_tracer("test").start_as_current_span("checkout")
    with business_span as business, Session(orders.engine) as session, session.begin():
        orders.outbox(session).send_command(
            "PlaceOrder", aggregate_id="o-1", payload={"customer": "ada", "sku": "BOOK-1", "quantity": 2}
        )

    def cancelled(finished: list[ReadableSpan]) -> bool:  # no stock: the saga cancels
        rejected = [s for s in finished if s.name == "handle StockRejected"]
        return any(linking(finished, "publish order-service", s) for s in rejected)

    finished = wait_for(spans, cancelled)

    # (service whose relay publishes, inbox that stores it, the handler span it leads to)
    hops = [
        ("order-service", ORDERS_INBOX, "handle PlaceOrder"),
        ("order-service", INVENTORY_INBOX, "handle OrderPlaced"),
        ("inventory-service", ORDERS_INBOX, "handle StockRejected"),
    ]
    span: ReadableSpan = next(s for s in finished if s.name == "checkout")
    assert span.get_span_context().span_id == business.get_span_context().span_id
    walked = [span]
    for publisher, inbox, handle in hops:
        # The relay's publish and the receiver's store are batch spans linked to the
        # message's writer; the handler is that writer's child.
        publishes = linking(finished, f"publish {publisher}", span)
        stores = linking(finished, f"store {inbox}", span)
        assert publishes and stores, f"no publish/store span links {span.name!r}"
        assert {s.kind for s in publishes + stores} == {trace.SpanKind.PRODUCER, trace.SpanKind.CONSUMER}
        span = child_of(finished, span, handle)
        assert span.kind == trace.SpanKind.CONSUMER
        walked.append(span)
    assert linking(finished, "publish order-service", span)  # OrderCancelled, written by the last handler
    assert {s.get_span_context().trace_id for s in walked} == {business.get_span_context().trace_id}


def publish_plain(amqp_url: str, headers: dict[str, Any]) -> uuid.UUID:
    """PlaceOrder from a plain AMQP publisher (no txbox), with the given headers."""
    message = Message(
        message_id=uuid.uuid4(),
        message_type="PlaceOrder",
        aggregate_type="order",
        aggregate_id=f"o-{uuid.uuid4().hex[:8]}",
        payload={"customer": "bob", "sku": "BOOK-1", "quantity": 1},
    )
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            names.COMMAND_EXCHANGE,
            orders_app.registry.get("PlaceOrder").routing_key,
            message.to_json(),
            pika.BasicProperties(content_type="application/json", message_id=str(message.message_id), headers=headers),
            mandatory=True,
        )
    finally:
        connection.close()
    return message.message_id


def handled(spans: InMemorySpanExporter, message_id: uuid.UUID) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The span of PlaceOrder ``message_id``'s handler run, and every span finished by then."""

    def found() -> tuple[ReadableSpan, list[ReadableSpan]] | None:
        finished = list(spans.get_finished_spans())
        for span in finished:
            if span.name == "handle PlaceOrder" and (span.attributes or {}).get("messaging.message.id") == str(
                message_id
            ):
                return span, finished
        return None

    return support.wait_until(found, 60, message=f"PlaceOrder {message_id} handled")


def test_a_foreign_traceparent_is_joined_and_a_malformed_one_ignored(
    spans: InMemorySpanExporter, services: tuple[Service, Service], amqp_url: str
) -> None:
    foreign_trace, foreign_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    joined = publish_plain(amqp_url, {"traceparent": f"00-{foreign_trace}-{foreign_span}-01", "tracestate": "v=1"})
    malformed = publish_plain(amqp_url, {"traceparent": "00-" + "z" * 5000, "tracestate": 7})

    span, finished = handled(spans, joined)
    assert format(span.get_span_context().trace_id, "032x") == foreign_trace
    assert span.parent is not None and format(span.parent.span_id, "016x") == foreign_span
    assert span.get_span_context().trace_state.get("v") == "1"
    links = [link for s in finished if s.name == f"store {ORDERS_INBOX}" for link in s.links]
    assert any(format(link.context.span_id, "016x") == foreign_span for link in links)

    span, finished = handled(spans, malformed)
    assert span.parent is None  # a new trace starts at the handler
