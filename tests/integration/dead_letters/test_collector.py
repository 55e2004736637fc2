"""The collector drains <service>:dead_letter into txbox.dead_letters (real RabbitMQ + PG)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pika
import pytest

from framework import amqp, names, topology
from framework.dead_letters.collector import Collector, CollectorConfig, store
from framework.service import Service
from tests import support
from tests.integration.dead_letters import seed


@pytest.fixture
def collector(service: Service) -> Iterator[Collector]:
    daemon = Collector(service, CollectorConfig(resolve_interval=0.2))  # type: ignore[arg-type]
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        thread.join(timeout=15)
        assert not thread.is_alive(), "collector did not stop"


def _reject_from_inbox(service: Service, bodies: list[tuple[bytes, pika.BasicProperties]]) -> None:
    """Route messages into the inbox queue and reject them: RabbitMQ dead-letters them."""
    connection = amqp.connect(service.settings.amqp_url)
    try:
        channel = connection.channel()
        topology.declare(service.settings, service.registry, channel)
        for body, props in bodies:
            channel.basic_publish(names.COMMAND_EXCHANGE, "order-service.order.place", body, props)
        queue = names.inbox_queue(service.name)
        for _ in bodies:
            method = support.wait_until(lambda: channel.basic_get(queue)[0], message="a message in the inbox queue")
            channel.basic_reject(method.delivery_tag, requeue=False)
    finally:
        connection.close()


def _rows(conn: Any) -> list[dict[str, Any]]:
    return list(conn.execute("SELECT * FROM txbox.dead_letters ORDER BY id").fetchall())


def test_broker_dead_letters_become_rows_with_x_death_facts(service: Service, collector: Collector, conn: Any) -> None:
    m = seed.envelope()
    good = (m.to_json(), pika.BasicProperties(message_id=str(m.message_id), type=m.message_type, delivery_mode=2))
    garbage = (b"\xff\xfe not json", pika.BasicProperties(headers={names.HEADER_DEAD_REASON: "retries_exhausted"}))
    _reject_from_inbox(service, [good, garbage])

    rows = support.wait_until(lambda: len(_rows(conn)) == 2 and _rows(conn), message="two dead letters")

    first, second = rows
    assert first["source"] == "broker" and first["reason"] == "broker_rejected"
    assert first["message_id"] == m.message_id and first["message_type"] == "PlaceOrder"
    assert first["message"]["payload"] == m.payload and first["raw_body"] is None
    assert first["routing_key"] == "order-service.order.place"
    death = first["attempts"]["first_death"]
    assert (death["queue"], death["reason"]) == ("order-service:inbox", "rejected") and death["time"]
    assert first["attempts"]["deaths"] == 1 and first["attempts"]["x_death"][0]["exchange"] == "command"
    assert first["headers"]["amqp_properties"]["message_id"] == str(m.message_id)
    assert "order-service:inbox" in first["error"]
    assert second["reason"] == "retries_exhausted" and second["message"] is None
    assert second["raw_encoding"] == "base64" and second["message_id"] is None
    collector.stop()  # closing its channel would requeue anything stored but not acked
    assert collector.finished.wait(15), "collector did not stop"
    assert _ready(service) == 0


def _ready(service: Service) -> int:
    connection = amqp.connect(service.settings.amqp_url)
    try:
        declared = connection.channel().queue_declare(names.dead_letter_queue(service.name), passive=True)
        return int(declared.method.message_count)
    finally:
        connection.close()


def test_a_redelivered_delivery_is_not_stored_twice(service: Service, conn: Any) -> None:
    m = seed.envelope()
    props = pika.BasicProperties(
        message_id=str(m.message_id),
        headers={
            "x-death": [
                {
                    "count": 1,
                    "reason": "rejected",
                    "queue": "order-service:inbox",
                    "exchange": "command",
                    "routing-keys": ["order-service.order.place"],
                }
            ],
            "x-first-death-queue": "order-service:inbox",
            "x-first-death-reason": "rejected",
        },
    )
    delivery = (props, m.to_json(), "order-service.dead_letter")
    assert store(conn, "txbox", [delivery]) == 1
    assert store(conn, "txbox", [delivery]) == 0  # the collector crashed before its ack: redelivered
    assert len(_rows(conn)) == 1
    later = pika.BasicProperties(
        message_id=str(m.message_id),
        headers={**props.headers, "x-death": [{**props.headers["x-death"][0], "count": 2}]},
    )
    assert store(conn, "txbox", [(later, m.to_json(), "order-service.dead_letter")]) == 1  # died again: new row


def test_collector_resolves_replayed_letters(service: Service, collector: Collector, conn: Any) -> None:
    from framework.dead_letters import replay

    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m)
    replay.replay(conn, "txbox", service.registry, service.name, [lid])
    conn.execute("UPDATE txbox.inbox SET processed_at = now() WHERE id = %s", (m.message_id,))
    support.wait_until(
        lambda: conn.execute("SELECT resolved_at FROM txbox.dead_letters WHERE id = %s", (lid,)).fetchone()[
            "resolved_at"
        ],
        message="the collector's resolve sweep",
    )


def test_a_delivery_postgres_refuses_as_is_is_still_stored(conn: Any) -> None:
    """NUL characters (jsonb and text refuse them) must not wedge the collector."""
    body = b'{"message_id": "not-a-uuid", "payload": {"note": "nul \\u0000 inside"}}'
    props = pika.BasicProperties(type="Odd\x00Type", headers={"x-note": "also \x00 here"})
    assert store(conn, "txbox", [(props, body, "order-service.dead_letter")]) == 1
    [row] = _rows(conn)
    assert row["message"] is not None or row["raw_body"] == body.decode()
    assert "\x00" not in json.dumps(row["headers"]) + json.dumps(row["message"]) + (row["message_type"] or "")


def test_when_a_row_is_refused_the_delivery_is_kept_as_raw_text(conn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback: whatever PostgreSQL refuses in the JSON columns, the delivery is stored."""
    from framework.dead_letters import DeadLetter

    original = DeadLetter.row
    monkeypatch.setattr(DeadLetter, "row", lambda self: {**original(self), "headers": '{"bad": NaN}'})
    body = b'{"message_id": "x"}'
    assert store(conn, "txbox", [(pika.BasicProperties(headers={"n": Decimal("NaN")}), body, "rk")]) == 1
    [row] = _rows(conn)
    assert row["message"] is None and row["raw_body"] == body.decode()
    assert row["headers"] == {"unstorable": '{"bad": NaN}'} and "stored as raw text" in row["error"]


def test_a_broker_letter_replayed_travels_outbox_broker_inbox_handler_once(
    service: Service, collector: Collector, conn: Any
) -> None:
    """The whole way with the real daemons: the outbox row, the relay, the receiver, the worker."""
    from sqlalchemy import text

    from framework import CommandHandler
    from framework.dead_letters import replay
    from framework.receiver import Receiver
    from framework.relay import Relay, RelayConfig
    from framework.worker import Worker, WorkerConfig
    from tests.apps.helpers import running

    class PlaceOrder(CommandHandler):
        message_type = "PlaceOrder"

        def handle(self, message: Any, session: Any, outbox: Any) -> None:
            session.execute(text("INSERT INTO effects (id) VALUES (:id)"), {"id": message.message_id})

    conn.execute("CREATE TABLE effects (n bigserial PRIMARY KEY, id uuid NOT NULL)")
    service.register(PlaceOrder())
    topology.declare(service.settings, service.registry)
    m = seed.envelope()
    lid = seed.rejected(conn, m)
    [outcome] = replay.replay(conn, "txbox", service.registry, service.name, [lid])
    assert outcome.action == "outbox-insert"
    relay = Relay(service, RelayConfig(poll_interval=0.2))  # type: ignore[arg-type]
    with running(relay), running(Receiver(service)), running(Worker(service, WorkerConfig(poll_interval=0.1))):  # type: ignore[arg-type]
        support.wait_until(
            lambda: conn.execute("SELECT resolved_at FROM txbox.dead_letters WHERE id = %s", (lid,)).fetchone()[
                "resolved_at"
            ],
            30,
            message="the replayed letter processed and resolved",
        )
    assert conn.execute("SELECT count(*) AS n FROM effects WHERE id = %s", (m.message_id,)).fetchone()["n"] == 1
