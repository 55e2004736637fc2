"""Helpers for tests that drive the receiver and worker: envelopes, raw publishing, daemon threads."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pika
import psycopg

from framework import names
from framework.daemon import Daemon
from framework.envelope import Message


def place_order(aggregate_id: str = "42", quantity: int = 1, **fields: Any) -> dict[str, Any]:
    message = Message(
        message_id=uuid.uuid4(),
        message_type="PlaceOrder",
        aggregate_type="order",
        aggregate_id=aggregate_id,
        payload={"customer": "ada", "sku": "SKU-1", "quantity": quantity},
        message_context={"example_correlation_id": str(uuid.uuid4())},
        auth_token="secret-token",
    )
    data = message.to_dict()
    data.update(fields)
    return data


def publish(
    amqp_url: str,
    bodies: list[bytes],
    *,
    routing_key: str = "order-service.order.place",
    exchange: str = names.COMMAND_EXCHANGE,
    properties: list[pika.BasicProperties] | None = None,
) -> None:
    """Publish raw bodies with confirms (so the test knows the broker has them)."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for i, body in enumerate(bodies):
            props = (properties or [None] * len(bodies))[i] or pika.BasicProperties(
                content_type="application/json", delivery_mode=2
            )
            channel.basic_publish(exchange, routing_key, body, props, mandatory=True)
    finally:
        connection.close()


def encode(data: Any) -> bytes:
    return json.dumps(data).encode()


@contextmanager
def running(daemon: Daemon) -> Iterator[Daemon]:
    """Run ``daemon.run()`` in a thread for the duration of the block; re-raise its crash."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            daemon.run()
        except BaseException as exc:
            failure.append(exc)
            raise

    thread = threading.Thread(target=target, name=daemon.name, daemon=True)
    thread.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        thread.join(30)
        assert not thread.is_alive(), f"{daemon.name} did not stop within 30 s"
    if failure:
        raise failure[0]


def query(database_url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    from framework.db import conninfo

    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        cur = conn.execute(statement, params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description is not None else []


def scalar(database_url: str, statement: str, params: Any = None) -> Any:
    rows = query(database_url, statement, params)
    return rows[0][0] if rows else None


def queue_depth(amqp_url: str, queue: str) -> int:
    """Ready messages right now (passive declare: exact, unlike the management API's 5 s stats)."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def store_in_inbox(service: Any, envelopes: list[dict[str, Any]], headers: dict[str, Any] | None = None) -> None:
    """Put envelopes straight into txbox.inbox the way the receiver would (worker tests)."""
    from framework.db import connect
    from framework.receiver import Delivery, Intake
    from framework.sql.inbox import InboxRow, insert_rows

    intake = Intake(service.registry, service.name, max_body_bytes=1 << 20)
    rows = []
    for i, envelope in enumerate(envelopes):
        row = intake.admit(
            Delivery(
                delivery_tag=i + 1,
                body=json.dumps(envelope).encode(),
                properties={"content_type": "application/json"},
                headers=dict(headers or {}),
            )
        )
        assert isinstance(row, InboxRow), row
        rows.append(row)
    with connect(service.settings.database_url) as conn, conn.cursor() as cur:
        insert_rows(cur, service.settings.schema, rows)
