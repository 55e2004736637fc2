"""The ordering lane a sender asks for holds at the receiving service.

inventory-service sends PlaceOrder commands through its outbox and relay; order-service's
receiver stores them and several of its workers handle them. The segment, concurrency
and priority given to ``send_command`` travel as headers (and the AMQP priority
property) and end in order-service's inbox rows, so:

- a segment's messages (of different aggregates) are handled in send order;
- a parallel lane (one aggregate) runs on several workers at once;
- a worker takes higher priorities first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, topology
from framework.receiver import Receiver, ReceiverConfig
from framework.relay import Relay, RelayConfig
from framework.service import Service
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import query, running, scalar

SLOW = 0.3  # seconds a slow handler takes


class Recorder(CommandHandler):
    """Records (tag, sequence number, start, end) in order-service's database."""

    message_type = "PlaceOrder"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        tag, seq = message.payload["customer"], message.payload["quantity"]
        started = time.time()
        if (tag == "lane" and seq == 1) or tag == "parallel":
            support.pause(SLOW)  # lets other workers overtake it, if the lane allows
        session.execute(
            text("INSERT INTO seen (tag, seq, started, ended) VALUES (:t, :s, :a, :b)"),
            {"t": tag, "s": seq, "a": started, "b": time.time()},
        )


@pytest.fixture
def sender(service: Service, template_db: str) -> Iterator[Service]:
    """inventory-service, with a database of its own, on the same vhost."""
    name = support.unique("txbox_sender")
    support.create_database(name, template=template_db)
    settings = replace(service.settings, service="inventory-service", database_url=support.db_url(name))
    other = Service(settings=settings)
    try:
        yield other
    finally:
        other.engine.dispose()
        support.drop_database(name)


@pytest.fixture
def receiving(service: Service, database_url: str) -> Service:
    query(
        database_url,
        "CREATE TABLE seen (n bigserial PRIMARY KEY, tag text, seq int, started float8, ended float8)",
    )
    service.register(Recorder())
    topology.declare(service.settings, service.registry)
    return service


def send(sender: Service, tag: str, seq: int, aggregate_id: str, **lane: Any) -> None:
    with Session(sender.engine) as session, session.begin():
        sender.outbox(session).send_command(
            "PlaceOrder",
            aggregate_id=aggregate_id,
            payload={"customer": tag, "sku": "SKU-1", "quantity": seq},
            **lane,
        )


def inbox(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM txbox.inbox"))


def handled(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL"))


def seen(url: str, tag: str) -> list[tuple[int, float, float]]:
    return [
        (r[0], r[1], r[2]) for r in query(url, "SELECT seq, started, ended FROM seen WHERE tag = %s ORDER BY n", (tag,))
    ]


def workers(service: Service, n: int) -> list[Worker]:
    config = WorkerConfig(batch_size=1, poll_interval=0.05, backoff_base=0.05, backoff_cap=0.1)  # type: ignore[arg-type]
    return [Worker(service, config) for _ in range(n)]


def test_segment_parallel_lane_and_priority_cross_the_wire(
    receiving: Service, sender: Service, database_url: str
) -> None:
    relay = Relay(sender, RelayConfig(poll_interval=0.05))  # type: ignore[arg-type]
    receiver = Receiver(receiving, ReceiverConfig(prefetch=100, batch_size=50))
    with running(relay), running(receiver):
        # One sequential segment across ten aggregates (each its own lane by default).
        for seq in range(1, 11):
            send(sender, "lane", seq, f"a{seq}", segment="one-lane")
        # Six messages of one aggregate (one sequential lane by default), sent parallel.
        for seq in range(1, 7):
            send(sender, "parallel", seq, "p", concurrency="parallel")
        support.wait_until(lambda: inbox(database_url) == 16, 60, message="16 messages in order-service's inbox")
        rows = query(database_url, "SELECT segment, concurrency FROM txbox.inbox WHERE aggregate_id = 'a5'")
        assert rows == [("one-lane", "sequential")]
        w1, w2, w3 = workers(receiving, 3)
        with running(w1), running(w2), running(w3):
            support.wait_until(lambda: handled(database_url) == 16, 60, message="all 16 handled")

        lane = seen(database_url, "lane")
        assert [seq for seq, _, _ in lane] == list(range(1, 11)), "the segment was handled out of send order"
        parallel = seen(database_url, "parallel")
        overlapping = max(sum(1 for _, s, e in parallel if s <= start < e) for _, start, _ in parallel)
        assert overlapping >= 2, f"the parallel lane ran one at a time: {parallel}"

        # Priorities, each stored before the next is sent, lowest-first; then one worker.
        order = [(1, 1), (2, -2), (3, 5), (4, 3), (5, 300)]
        for n, (seq, priority) in enumerate(order, start=1):
            send(sender, "priority", seq, f"q{seq}", priority=priority)
            support.wait_until(lambda n=n: inbox(database_url) == 16 + n, 30, message=f"priority message {seq} stored")
        (worker,) = workers(receiving, 1)
        with running(worker):
            support.wait_until(lambda: handled(database_url) == 21, 60, message="the priority messages handled")
    by_priority = [seq for seq, _ in sorted(order, key=lambda item: -item[1])]
    assert [seq for seq, _, _ in seen(database_url, "priority")] == by_priority
