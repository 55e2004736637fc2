"""The receiver against the real RabbitMQ and PostgreSQL: store, dedup, reject, ack."""

from __future__ import annotations

import json
import secrets
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pika
import psycopg
import pytest

from framework import dead_letters, names, topology
from framework.db import conninfo
from framework.dead_letters import decode_body
from framework.receiver import Receiver, ReceiverConfig
from framework.receiver import daemon as receiver_daemon
from framework.redaction import redact_bytes
from framework.service import Service
from tests import support
from tests.apps.helpers import encode, place_order, publish, query, queue_depth, running, scalar

QUEUE = names.inbox_queue("order-service")


def config(**overrides: Any) -> ReceiverConfig:
    values: dict[str, Any] = {"prefetch": 200, "batch_size": 100}
    values.update(overrides)
    return ReceiverConfig(**values)


def inbox_count(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM txbox.inbox"))


def test_stores_valid_deliveries_with_delivery_facts_and_acks_them(
    service: Service, database_url: str, amqp_url: str, vhost: str
) -> None:
    topology.declare(service.settings, service.registry)
    first = place_order(aggregate_id="7")
    second = place_order(aggregate_id="7", quantity=2)
    headers = {names.HEADER_SEGMENT: "custom-lane", "x-correlation-id": "c-1"}
    props = [
        pika.BasicProperties(content_type="application/json", delivery_mode=2, message_id=first["message_id"]),
        # user_id "guest" (the receiver's own broker user, checked by RabbitMQ): its lane headers count.
        pika.BasicProperties(
            content_type="application/json", delivery_mode=2, headers=headers, priority=3, user_id="guest"
        ),
    ]
    publish(amqp_url, [encode(first), encode(second)], properties=props)
    with running(Receiver(service, config())):
        support.wait_until(lambda: inbox_count(database_url) == 2, 20, message="both deliveries stored")
    assert queue_depth(amqp_url, QUEUE) == 0, "stored deliveries must have been acked"
    rows = {
        str(r[0]): r
        for r in query(
            database_url,
            "SELECT id, kind, routing_key, segment, priority, queue, redelivered, metadata, message_timestamp,"
            " payload, message_context, concurrency FROM txbox.inbox",
        )
    }
    row = rows[first["message_id"]]
    assert row[1:7] == ("command", "order-service.order.place", "order:7", 0, QUEUE, False)
    metadata = row[7]
    assert metadata["auth_token"] == "secret-token"
    assert metadata["properties"]["message_id"] == first["message_id"]
    assert metadata["fields"]["routing_key"] == "order-service.order.place"
    assert row[8].isoformat().startswith(first["timestamp"][:19])
    assert row[9] == first["payload"] and row[10] == first["message_context"]
    custom = rows[second["message_id"]]
    assert custom[3] == "custom-lane" and custom[4] == 3
    assert custom[7]["properties"]["headers"]["x-correlation-id"] == "c-1"


def test_an_idle_receiver_stores_a_lone_delivery_without_waiting_for_batch_mates(
    service: Service, database_url: str, amqp_url: str
) -> None:
    """Group commit: ``batch_wait`` applies only while the previous batch is being written."""
    topology.declare(service.settings, service.registry)
    with running(Receiver(service, config(batch_wait=60))):
        publish(amqp_url, [encode(place_order())])
        support.wait_until(lambda: inbox_count(database_url) == 1, 15, message="the lone delivery stored")


def test_the_end_of_a_write_acks_its_batch_at_once_not_after_the_wait(
    service: Service, database_url: str, amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With prefetch 1 the second delivery comes only after the first is acked: no
    delivery can end the receiver's wait, only the finished write, whose socket the
    broker connection's I/O loop watches (``InboxWrite.watch``) and whose end wakes it."""
    monkeypatch.setattr(receiver_daemon, "_IDLE_WAIT", 60.0)
    topology.declare(service.settings, service.registry)
    publish(amqp_url, [encode(place_order()), encode(place_order())])
    with running(Receiver(service, config(prefetch=1, batch_size=1, batch_wait=60))):
        support.wait_until(lambda: inbox_count(database_url) == 2, 20, message="the second delivery stored")
        # A delivery ends the long wait the receiver is in now, so it can see the stop.
        monkeypatch.undo()
        publish(amqp_url, [encode(place_order())])


def record_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(thread, rows) of each batch write the receiver sends without waiting from now on."""
    writes: list[tuple[str, int]] = []
    send = receiver_daemon.InboxWrite.send

    def recorded(self: Any) -> None:
        insert = next(step for step in self._steps if step.name.startswith(b"txbox_receiver_insert_"))
        rows = insert.params[1]
        assert rows is not None
        writes.append((threading.current_thread().name, int(rows)))  # $2: the batch's rows
        send(self)

    monkeypatch.setattr(receiver_daemon.InboxWrite, "send", recorded)
    return writes


def test_one_thread_writes_and_collects_the_next_batch_meanwhile(
    service: Service, database_url: str, amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every batch is written by the consuming thread itself, and while a write waits
    (here on a lock) that thread goes on collecting: the batch after it holds the backlog.
    No thread of the receiver's own is started (the copies' publishing connection, which
    only the retry chain uses, has its I/O thread)."""
    writes = record_writes(monkeypatch)
    topology.declare(service.settings, service.registry)
    before = {t.ident for t in threading.enumerate()}
    with running(Receiver(service, config())):
        publish(amqp_url, [encode(place_order())])
        support.wait_until(lambda: inbox_count(database_url) == 1, 15, message="the lone delivery stored")
        with psycopg.connect(conninfo(database_url)) as blocker:
            blocker.execute("LOCK TABLE txbox.inbox IN SHARE ROW EXCLUSIVE MODE")
            publish(amqp_url, [encode(place_order()) for _ in range(150)])
            support.wait_until(lambda: queue_depth(amqp_url, QUEUE) == 0, 15, message="the backlog delivered")
        support.wait_until(lambda: inbox_count(database_url) == 151, 20, message="the backlog stored")
        started = [t.name for t in threading.enumerate() if t.ident not in before]
    assert {name for name, _ in writes} == {"receiver"}, writes  # the thread of running()
    assert [name for name in started if name != "receiver" and not name.endswith(" io")] == [], started
    assert writes[0][1] == 1 and any(rows > 1 for _, rows in writes[2:]), writes
    assert sum(rows for _, rows in writes) == 151, writes


def test_a_duplicate_delivery_is_acked_but_stored_once(
    service: Service, database_url: str, amqp_url: str, vhost: str
) -> None:
    topology.declare(service.settings, service.registry)
    message = place_order()
    # A single receiver takes deliveries in queue order: once the last one is stored,
    # the three copies before it were settled.
    publish(amqp_url, [encode(message)] * 3 + [encode(place_order())])
    with running(Receiver(service, config(batch_size=2))):
        support.wait_until(lambda: inbox_count(database_url) == 2, 20, message="the marker message")
    assert queue_depth(amqp_url, QUEUE) == 0, "duplicates must be acked too"
    assert scalar(database_url, "SELECT count(*) FROM txbox.inbox WHERE id = %s", (message["message_id"],)) == 1


def _deep(levels: int) -> bytes:
    return b'{"payload":' + b"[" * levels + b"]" * levels + b"}"


def bad_inputs() -> dict[str, tuple[bytes, pika.BasicProperties, str]]:
    """case → (body, properties, expected reason)."""

    def json_props() -> pika.BasicProperties:
        return pika.BasicProperties(content_type="application/json", delivery_mode=2)

    no_id = place_order()
    del no_id["message_id"]
    no_type = place_order()
    del no_type["message_type"]
    return {
        "empty body": (b"", json_props(), "empty_body"),
        "not utf-8": (b"\xff\xfe\xfa{", json_props(), "not_utf8"),
        "not json": (b"hello, receiver", json_props(), "not_json"),
        "json array": (b"[1, 2, 3]", json_props(), "not_object"),
        "missing message_id": (encode(no_id), json_props(), "missing_field"),
        "non-uuid message_id": (encode(place_order(message_id="order-1")), json_props(), "invalid_field"),
        "missing message_type": (encode(no_type), json_props(), "missing_field"),
        "unknown message type": (
            encode(place_order(message_type="LaunchRocket")),
            json_props(),
            "unknown_message_type",
        ),
        "schema-invalid payload": (
            encode(place_order(payload={"customer": "ada", "sku": "lower", "quantity": 0})),
            json_props(),
            "schema_invalid",
        ),
        "over the size limit": (
            encode(place_order(payload={"customer": "x" * 1_100_000, "sku": "A", "quantity": 1})),
            json_props(),
            "too_large",
        ),
        "wrong content type": (
            encode(place_order()),
            pika.BasicProperties(content_type="text/plain", delivery_mode=2),
            "wrong_content_type",
        ),
        "10,000 levels of nesting": (_deep(10_000), json_props(), "too_deep"),
    }


def test_bad_input_is_rejected_into_dead_letters_and_the_receiver_goes_on(
    service: Service, database_url: str, amqp_url: str, vhost: str
) -> None:
    topology.declare(service.settings, service.registry)
    cases = bad_inputs()
    bodies, props = [], []
    for case, (body, prop, _) in cases.items():
        prop.headers = {**(prop.headers or {}), "x-test-case": case}
        bodies.append(body)
        props.append(prop)
    good = place_order()
    publish(amqp_url, [*bodies, encode(good)], properties=[*props, None])  # type: ignore[list-item]
    receiver = Receiver(service, config())
    with running(receiver):
        support.wait_until(lambda: inbox_count(database_url) == 1, 30, message="the good message after the bad ones")
        support.wait_until(
            lambda: scalar(database_url, "SELECT count(*) FROM txbox.dead_letters") == len(cases),
            30,
            message="dead letters",
        )
    assert queue_depth(amqp_url, QUEUE) == 0, "rejected deliveries must be acked"
    assert str(scalar(database_url, "SELECT id FROM txbox.inbox")) == good["message_id"]
    letters = query(
        database_url,
        "SELECT headers->>'x-test-case', source, reason, raw_body, raw_encoding, message_id, error"
        " FROM txbox.dead_letters",
    )
    found = {row[0]: row for row in letters}
    assert set(found) == set(cases)
    for case, (body, _, reason) in cases.items():
        _, source, got_reason, raw, encoding, _, error = found[case]
        assert (source, got_reason) == ("broker", reason), f"{case}: {got_reason} ({error})"
        # At most BODY_LIMIT bytes of a body are kept, and no secret (framework.redaction).
        kept = decode_body(raw, encoding)
        assert kept == redact_bytes(body)[: dead_letters.BODY_LIMIT], f"{case}: raw body not kept"
    assert found["not utf-8"][4] == "base64"
    # A parsed envelope keeps its id even when rejected, so it can be found by id later.
    assert found["schema-invalid payload"][5] is not None


@pytest.mark.parametrize(
    "make_poisoned",
    [
        # jsonb refuses \\u0000 inside a string (SQLSTATE 22P05).
        pytest.param(
            lambda: place_order(payload={"customer": "nul\u0000byte", "sku": "SKU-1", "quantity": 1}), id="nul"
        ),
        # An aggregate id too long for the segment index (program limit, SQLSTATE 54000):
        # an OperationalError to psycopg, yet the row's fault, not the database's.
        pytest.param(lambda: place_order(aggregate_id=secrets.token_urlsafe(30_000)), id="index-row-too-big"),
    ],
)
def test_unstorable_message_is_rejected_without_losing_its_batch_mates(
    service: Service, database_url: str, amqp_url: str, make_poisoned: Callable[[], dict[str, Any]]
) -> None:
    """PostgreSQL refuses one row of a batch: one savepoint per row finds it, the rest are stored."""
    topology.declare(service.settings, service.registry)
    poisoned = make_poisoned()
    mates = [place_order() for _ in range(5)]
    publish(amqp_url, [encode(m) for m in (*mates[:2], poisoned, *mates[2:])])
    with running(Receiver(service, config(batch_wait=0.5))):
        support.wait_until(lambda: inbox_count(database_url) == 5, 20, message="the five good messages")
        support.wait_until(
            lambda: scalar(database_url, "SELECT reason FROM txbox.dead_letters") == "unstorable",
            20,
            message="dead letter",
        )
    assert str(scalar(database_url, "SELECT message_id FROM txbox.dead_letters")) == poisoned["message_id"]


def test_stop_requeues_nothing_it_stored_and_loses_nothing(
    service: Service, database_url: str, amqp_url: str, vhost: str
) -> None:
    topology.declare(service.settings, service.registry)
    messages = [place_order(aggregate_id=str(i)) for i in range(300)]
    publish(amqp_url, [encode(m) for m in messages])
    with running(Receiver(service, config(batch_size=50, prefetch=100))):
        support.wait_until(lambda: inbox_count(database_url) > 0, 20, message="the first batch")
    stored = inbox_count(database_url)
    # Everything not stored went back to the queue (nothing held, nothing lost).
    assert stored + queue_depth(amqp_url, QUEUE) == 300
    with running(Receiver(service, config())):
        support.wait_until(lambda: inbox_count(database_url) == 300, 30, message="the rest after a restart")
    ids = {str(r[0]) for r in query(database_url, "SELECT id FROM txbox.inbox")}
    assert ids == {m["message_id"] for m in messages}


def test_json_of_metadata_is_valid_for_binary_headers(service: Service, database_url: str, amqp_url: str) -> None:
    topology.declare(service.settings, service.registry)
    message = place_order()
    props = pika.BasicProperties(content_type="application/json", headers={"blob": b"\xff\x00", "n": 5})
    publish(amqp_url, [encode(message)], properties=[props])
    with running(Receiver(service, config())):
        support.wait_until(lambda: inbox_count(database_url) == 1, 20, message="stored")
    metadata = scalar(database_url, "SELECT metadata FROM txbox.inbox")
    assert metadata["properties"]["headers"]["n"] == 5
    assert json.dumps(metadata)
    assert uuid.UUID(str(scalar(database_url, "SELECT id FROM txbox.inbox"))) == uuid.UUID(message["message_id"])


def test_a_second_receiver_without_standby_is_warned_about_ordering(
    service: Service, database_url: str, amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """TXBOX_RECEIVER_STANDBY=false: every replica consumes (test_receiver_replicas.py: the default)."""
    topology.declare(service.settings, service.registry)
    caplog.set_level("WARNING", logger="txbox.receiver")
    with running(Receiver(service, config(standby=False))):
        support.wait_until(lambda: _consumers(amqp_url) == 1, 20, message="the first receiver consuming")
        assert "out of order" not in caplog.text  # alone on the queue
        with running(Receiver(service, config(standby=False))):
            support.wait_until(lambda: _consumers(amqp_url) == 2, 20, message="the second receiver consuming")
    assert "1 other consumer(s) on order-service:inbox" in caplog.text


def _consumers(amqp_url: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(connection.channel().queue_declare(QUEUE, passive=True).method.consumer_count)
    finally:
        connection.close()
