"""The receiver's last nets and bounds, against the real broker and database.

- Header tables nested deeper than pika's own decoder recursion are decoded (framework.amqp
  bounds it), so the delivery is judged and what is queued around it is stored.
- Body bytes held unacked are bounded, whatever the prefetch count allows.
- A body too deep or too large to parse whole still gives a dead letter with its id.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import pika
import psycopg
import pytest

from framework import names, topology
from framework.db import conninfo
from framework.receiver import Delivery, Intake, Receiver, ReceiverConfig
from framework.receiver import daemon as receiver_daemon
from framework.redaction import redact_bytes
from framework.service import Service
from framework.sql.inbox import InboxRow, insert_rows
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


def test_header_tables_deeper_than_pika_decodes_are_judged_and_the_rest_is_stored(
    service: Service, database_url: str, amqp_url: str
) -> None:
    """Prefetched beside it, the innocent deliveries are stored; the deep one ends in a defined outcome."""
    topology.declare(service.settings, service.registry)
    before = [place_order(aggregate_id=f"b{n}") for n in range(5)]
    after = [place_order(aggregate_id=f"a{n}") for n in range(5)]
    deep = place_order()
    publish(amqp_url, [json.dumps(m).encode() for m in before])
    _publish_deep_headers(amqp_url, json.dumps(deep).encode(), 2_000)
    publish(amqp_url, [json.dumps(m).encode() for m in after])
    ids = "SELECT id::text FROM txbox.inbox UNION ALL SELECT message_id::text FROM txbox.dead_letters"
    with running(Receiver(service, ReceiverConfig(prefetch=100, batch_size=50))):
        support.wait_until(lambda: len(query(database_url, ids)) == 11, 60, message="every delivery settled")
    assert sorted(r[0] for r in query(database_url, ids)) == sorted(m["message_id"] for m in (*before, deep, *after))
    assert queue_depth(amqp_url, names.inbox_queue(service.name)) == 0


def test_a_body_too_deep_or_too_large_to_parse_gives_a_dead_letter_with_its_id(
    service: Service, database_url: str, amqp_url: str
) -> None:
    """Raw bytes by plain pika, the envelope's fields in the order txbox writes them
    (payload first): the id comes from the AMQP property, else from the body's top level."""
    topology.declare(service.settings, service.registry)
    deep_text = '{"a":' * 10_000 + "1" + "}" * 10_000
    padding = "x" * 200_000
    cases = [
        ("deep payload field, no property", {"payload": "HOLE"}, False, "too_deep"),
        ("deep payload field, the property", {"payload": "HOLE"}, True, "too_deep"),
        ("deep context, no property", {"message_context": "HOLE"}, False, "too_deep"),
        ("too large, the property", {"payload": {"pad": padding}}, True, "too_large"),
        ("too large, id first, no property", {"message_context": {"pad": padding}}, False, "too_large"),
    ]
    bodies, properties, expected = [], [], {}
    for name, fields, property_id, reason in cases:
        message = place_order(**fields)
        if "id first" in name:
            message = {"message_id": message.pop("message_id"), **message}
        bodies.append(json.dumps(message).replace('"HOLE"', deep_text).encode())
        properties.append(
            pika.BasicProperties(
                content_type="application/json",
                message_id=message["message_id"] if property_id else None,
                headers={"x-case": name},
            )
        )
        expected[name] = (reason, message["message_id"])
    publish(amqp_url, bodies, properties=properties)
    letters = "SELECT headers->>'x-case', reason, message_id::text FROM txbox.dead_letters"
    with running(Receiver(service, ReceiverConfig(max_body_bytes=100_000))):  # type: ignore[arg-type]
        support.wait_until(lambda: len(query(database_url, letters)) == len(cases), 60, message="every letter")
    assert {name: (reason, message_id) for name, reason, message_id in query(database_url, letters)} == expected


def test_body_bytes_held_unacked_are_bounded_while_the_database_is_slow(
    service: Service, database_url: str, amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of the first batch stalls on a row lock; deliveries keep arriving meanwhile.
    The bound holds while the next batch is collected as one is written (every batch is
    sent without waiting, docs/explanation/daemons.md "The daemons and their threads")."""
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
                        " AND wait_event_type = 'Lock' AND datname = current_database()",
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

    topology.declare(service.settings, service.registry)
    real = receiver_daemon.InboxWrite.send
    calls = {"n": 0}

    def flaky(write: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug of ours")
        real(write)

    monkeypatch.setattr(receiver_daemon.InboxWrite, "send", flaky)
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
    assert raw.encode() == redact_bytes(json.dumps(victim).encode())  # as received, but for secrets
    assert [str(r[0]) for r in query(database_url, "SELECT id FROM txbox.inbox")] == [after["message_id"]]
    assert queue_depth(amqp_url, names.inbox_queue(service.name)) == 0


def _raise_runtime_error(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a bug of ours, again")
