"""`txbox run`'s hand-off (docs/explanation/daemons.md, "The hand-off in one process"): the
receiver claims what it stores for the worker of its loop in the same round trip, with no
NOTIFY, and the worker runs the rows it is given exactly once; against the real RabbitMQ
and PostgreSQL, with raw deliveries published with plain pika."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from framework import names, topology
from framework.cli.run import Supervisor
from framework.db import conninfo
from framework.receiver import Receiver, ReceiverConfig
from framework.receiver.handoff import Handoff
from framework.service import Service
from framework.worker import Worker
from tests import support
from tests.apps.helpers import encode, place_order, publish
from tests.integration.test_worker import Recorder, business, done, row, worker  # noqa: F401 (business: fixture)

pytestmark = pytest.mark.integration

HOUR = 3600.0  # a poll interval no test waits out: only a NOTIFY or the hand-off brings rows


@pytest.fixture
def one_loop(service: Service, business: str) -> Iterator[tuple[Receiver, Worker, Recorder]]:  # noqa: F811
    """A receiver handing off to a worker, on one loop of a thread of the test's."""
    topology.declare(service.settings, service.registry)
    handler = service.register(Recorder())
    stop = threading.Event()
    receiver = Receiver(service, ReceiverConfig(prefetch=50, batch_size=20), stop_event=stop)
    w = worker(service, poll_interval=HOUR, batch_size=8)
    w.stop_event = stop
    receiver.handoff = Handoff(w)
    supervisor = Supervisor([receiver, w])
    thread = threading.Thread(target=supervisor.run, args=(30.0,), name="the one loop", daemon=True)
    thread.start()
    try:
        support.wait_until(lambda: receiver.consuming and w.idle, 30, message="both daemons started")
        yield receiver, w, handler
    finally:
        supervisor.stop()
        thread.join(40)
        assert not thread.is_alive() and supervisor.failures == [] and supervisor.stuck == []


def test_what_the_receiver_stores_its_worker_runs_once_without_a_notify_or_a_claim_of_its_own(
    one_loop: tuple[Receiver, Worker, Recorder],
    service: Service,
    business: str,  # noqa: F811
) -> None:
    _, w, handler = one_loop
    channel = names.notify_channel(service.settings.schema, names.INBOX)
    with psycopg.connect(conninfo(business), autocommit=True) as listener:
        listener.execute(f'LISTEN "{channel}"')
        claims, empty = w.counts.claims, w.counts.empty_claims
        messages = [place_order(aggregate_id=f"h{n}") for n in range(30)]
        for n, message in enumerate(messages, 1):  # one at a time: each its own batch, as at a moderate load
            publish(service.settings.amqp_url, [encode(message)])
            support.wait_until(lambda n=n: done(business) == n, 30, message=f"message {n} handled")
        listener.execute("SELECT 1")
        notifies = sum(1 for _ in listener.notifies(timeout=0.2, stop_after=100))
    assert sorted(call[0] for call in handler.calls) == sorted(m["message_id"] for m in messages)
    for message in messages:
        assert (row(business, message)["started"], row(business, message)["finished"]) == (1, 1)
    assert w.counts.handed == len(messages), "every row came through the hand-off"
    # One claim per batch, sent by the receiver and counted as the worker's: no other claim.
    assert (w.counts.claims - claims, w.counts.empty_claims - empty) == (len(messages), 0)
    assert notifies == 0, "no insert NOTIFY for rows handed over"


def test_a_busy_worker_gets_the_rows_the_ordinary_way(
    one_loop: tuple[Receiver, Worker, Recorder],
    service: Service,
    business: str,  # noqa: F811
) -> None:
    """While the worker is not asking for rows, the receiver stores with its NOTIFY and the
    worker claims: nothing waits for a hand-off that does not come."""
    receiver, w, handler = one_loop
    receiver.handoff = None  # as a receiver whose worker never wants rows
    messages = [place_order(aggregate_id=f"o{n}") for n in range(10)]
    publish(service.settings.amqp_url, [encode(m) for m in messages])
    support.wait_until(lambda: done(business) == len(messages), 30, message="handled after the NOTIFY")
    assert w.counts.handed == 0
    assert sorted(call[0] for call in handler.calls) == sorted(m["message_id"] for m in messages)
