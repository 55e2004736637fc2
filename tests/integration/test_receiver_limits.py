"""The receiver's last nets and bounds, against the real broker and database.

- A delivery the client library itself cannot decode (header tables nested deeper than
  pika's recursion allows) kills every connection that receives it; RabbitMQ's delivery
  limit on the inbox queue dead-letters it into ``<service>:dead_letter``, and the
  receiver, reconnecting each time, stores what is queued behind it.
- An inbox queue declared before the limit existed keeps working (RabbitMQ refuses to
  change a queue argument on redeclaration).
- Body bytes held unacked are bounded, whatever the prefetch count allows.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import pika
import psycopg

from framework import names, topology
from framework.db import conninfo
from framework.receiver import Delivery, Intake, Receiver, ReceiverConfig
from framework.receiver.intake import InboxRow
from framework.receiver.store import insert_rows
from framework.service import Service
from tests import support
from tests.apps.helpers import place_order, publish, query, queue_depth, running, scalar


def _deep_table(depth: int) -> dict[str, Any]:
    table: dict[str, Any] = {"bottom": 1}
    for _ in range(depth):
        table = {"t": table}
    return table


def _publish_deep_headers(amqp_url: str, body: bytes, depth: int) -> None:
    """Plain pika, in a thread whose recursion limit lets pika's encoder go that deep."""
    failure: list[BaseException] = []

    def send() -> None:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
            channel = connection.channel()
            channel.confirm_delivery()
            props = pika.BasicProperties(content_type="application/json", headers={"deep": _deep_table(depth)})
            channel.basic_publish(names.COMMAND_EXCHANGE, "order-service.order.place", body, props, mandatory=True)
            connection.close()
        except BaseException as exc:
            failure.append(exc)

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, depth * 3 + 1000))  # pure-Python recursion: no C stack in 3.11
    try:
        thread = threading.Thread(target=send)
        thread.start()
        thread.join(60)
    finally:
        sys.setrecursionlimit(old)
    assert not failure, failure


def test_a_delivery_no_client_can_decode_reaches_the_dead_letter_queue_by_the_delivery_limit(
    service: Service, database_url: str, amqp_url: str
) -> None:
    """Prefetched beside it, the innocent deliveries are stored, not dead-lettered with it."""
    topology.declare(service.settings, service.registry)
    before = [place_order(aggregate_id=f"b{n}") for n in range(5)]
    after = [place_order(aggregate_id=f"a{n}") for n in range(5)]
    publish(amqp_url, [json.dumps(m).encode() for m in before])
    _publish_deep_headers(amqp_url, json.dumps(place_order()).encode(), 2_000)
    publish(amqp_url, [json.dumps(m).encode() for m in after])
    dead_queue = names.dead_letter_queue(service.name)
    with running(Receiver(service, ReceiverConfig(prefetch=100, batch_size=50))):
        support.wait_until(
            lambda: queue_depth(amqp_url, dead_queue) == 1,
            120,
            message="RabbitMQ to dead-letter the undecodable delivery after its delivery limit",
        )
        support.wait_until(
            lambda: scalar(database_url, "SELECT count(*) FROM txbox.inbox") == 10,
            60,
            message="the messages around it to be stored",
        )
    stored = {str(r[0]) for r in query(database_url, "SELECT id FROM txbox.inbox")}
    assert stored == {m["message_id"] for m in before + after}
    assert queue_depth(amqp_url, names.inbox_queue(service.name)) == 0
    assert queue_depth(amqp_url, dead_queue) == 1, "only the undecodable delivery is dead-lettered"


def test_an_inbox_queue_declared_without_the_limit_keeps_working(
    service: Service, database_url: str, amqp_url: str
) -> None:
    plan = topology.plan(service.settings, service.registry)
    inbox = next(q for q in plan.queues if q.name == names.inbox_queue(service.name))
    assert inbox.arguments[topology.DELIVERY_LIMIT_ARG] == topology.INBOX_DELIVERY_LIMIT
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    old = {k: v for k, v in inbox.arguments.items() if k != topology.DELIVERY_LIMIT_ARG}
    connection.channel().queue_declare(inbox.name, durable=True, arguments=old)
    connection.close()
    topology.declare(service.settings, service.registry)  # no 406: the queue is kept as it is
    message = place_order()
    with running(Receiver(service, ReceiverConfig(prefetch=10, batch_size=5))):
        publish(amqp_url, [json.dumps(message).encode()])
        support.wait_until(lambda: scalar(database_url, "SELECT count(*) FROM txbox.inbox") == 1, 30, message="stored")


def test_body_bytes_held_unacked_are_bounded_while_the_database_is_slow(
    service: Service, database_url: str, amqp_url: str
) -> None:
    """The write of the first batch stalls on a row lock; deliveries keep arriving meanwhile."""
    topology.declare(service.settings, service.registry)
    first = place_order(aggregate_id="first")
    padding = "x" * 100_000
    others = [place_order(aggregate_id=str(n), message_context={"pad": padding}) for n in range(40)]
    bodies = [json.dumps(m).encode() for m in (first, *others)]
    blocker = psycopg.connect(conninfo(database_url))
    row = Intake(service.registry, service.name, max_body_bytes=1 << 20).admit(Delivery(delivery_tag=1, body=bodies[0]))
    assert isinstance(row, InboxRow)
    with blocker.cursor() as cur:
        insert_rows(cur, "txbox", [row])
    limit = 1_000_000
    # A long batch_wait: while the first write is stalled the receiver would go on
    # collecting the next batch up to its 500 deliveries (4 MB here) but for the bound.
    config = ReceiverConfig(prefetch=1000, batch_size=500, batch_wait=30, max_unacked_bytes=limit)  # type: ignore[arg-type]
    receiver = Receiver(service, config)
    try:
        with running(receiver):
            try:
                publish(amqp_url, bodies[:1])
                support.wait_until(
                    lambda: scalar(
                        database_url,
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'txbox-receiver'"
                        " AND wait_event_type = 'Lock'",
                    ),
                    30,
                    message="the receiver's first write to wait on the lock",
                )
                publish(amqp_url, bodies[1:])
                support.wait_until(
                    lambda: receiver.peak_held_bytes >= limit, 30, message="the receiver to fill up to its limit"
                )
            finally:
                blocker.rollback()
            support.wait_until(
                lambda: scalar(database_url, "SELECT count(*) FROM txbox.inbox") == len(bodies),
                60,
                message="everything stored once the lock is gone",
            )
            assert queue_depth(amqp_url, names.inbox_queue(service.name)) == 0
    finally:
        blocker.close()
    largest = max(len(b) for b in bodies)
    assert receiver.peak_held_bytes < limit + 2 * largest, receiver.peak_held_bytes


def test_a_failure_of_our_own_while_settling_dead_letters_the_group_as_internal_error(
    service: Service, database_url: str, amqp_url: str, monkeypatch: Any
) -> None:
    """A bug in the write path (here: the batch INSERT raises something unforeseen, once) must not stop the receiver."""
    from framework.receiver import daemon as receiver_daemon

    topology.declare(service.settings, service.registry)
    real = receiver_daemon.store.insert_rows
    calls = {"n": 0}

    def flaky(cur: Any, schema: str, rows: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug of ours")
        return real(cur, schema, rows)

    monkeypatch.setattr(receiver_daemon.store, "insert_rows", flaky)
    monkeypatch.setattr(receiver_daemon.Receiver, "_store_carefully", _raise_runtime_error)
    victim = place_order(aggregate_id="victim")
    after = place_order(aggregate_id="after")
    with running(Receiver(service, ReceiverConfig(prefetch=10, batch_size=1))):
        publish(amqp_url, [json.dumps(victim).encode()])
        support.wait_until(
            lambda: scalar(database_url, "SELECT count(*) FROM txbox.dead_letters"), 30, message="the letter"
        )
        publish(amqp_url, [json.dumps(after).encode()])
        support.wait_until(
            lambda: scalar(database_url, "SELECT count(*) FROM txbox.inbox"), 30, message="the next one stored"
        )
    [(reason, raw, error)] = query(database_url, "SELECT reason, raw_body, error FROM txbox.dead_letters")
    assert reason == "internal_error" and "a bug of ours" in error
    assert json.loads(raw) == victim
    assert [str(r[0]) for r in query(database_url, "SELECT id FROM txbox.inbox")] == [after["message_id"]]
    assert queue_depth(amqp_url, names.inbox_queue(service.name)) == 0


def _raise_runtime_error(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a bug of ours, again")
