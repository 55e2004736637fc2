"""The collector daemon: drains ``<service>:dead_letter`` into ``txbox.dead_letters``.

RabbitMQ dead-letters a message when the receiver could not store it (the delay/retry
chain ran out, or a delivery limit was hit); those messages never reach the inbox, so
without the collector they would sit in a queue nobody reads. Each delivery becomes one
row with the broker's ``x-death`` facts and our own headers, inserted *before* the ack:
a crash in between redelivers it, and the row's ``delivery_key`` (unique, see migration
0004) makes the second insert a no-op, so a delivery is never lost and never doubled.

The collector also runs the resolve sweep (:func:`framework.dlq.replay.resolve_replayed`)
every few seconds, so replayed letters turn resolved once their message is processed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import pika
import pika.exceptions
import psycopg
from prometheus_client import Counter
from psycopg import sql

from framework import amqp, db, names, topology
from framework.contracts import Registry
from framework.daemon import Daemon, Reconnect
from framework.dead_letters import RETRIES_EXHAUSTED, DeadLetter, encode_body
from framework.dlq.replay import resolve_replayed
from framework.envelope import decode_json
from framework.errors import BrokerUnavailable, DatabaseUnavailable, EnvelopeError
from framework.settings import Seconds, Settings, setting

COLLECTED = Counter("txbox_collector_dead_letters_total", "Dead letters drained from the broker", ["service"])
DUPLICATES = Counter(
    "txbox_collector_duplicates_total", "Redelivered dead letters already stored (not inserted again)", ["service"]
)


@dataclass(frozen=True, kw_only=True)
class CollectorSettings:
    batch_size: int = setting(
        "TXBOX_COLLECTOR_BATCH_SIZE", "200", default=200, help="deliveries stored per transaction (and prefetch)"
    )
    flush_interval: Seconds = setting(
        "TXBOX_COLLECTOR_FLUSH_INTERVAL", "200ms", default=Seconds(0.2), help="longest wait before a partial batch"
    )
    resolve_interval: Seconds = setting(
        "TXBOX_COLLECTOR_RESOLVE_INTERVAL", "2s", default=Seconds(2.0), help="how often replayed letters are resolved"
    )


def jsonable(value: Any) -> Any:
    """AMQP header values (bytes, datetimes, decimals, nested tables) as JSON values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Infinity
    return value


_PROPERTIES = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
)


def _uuid(value: Any) -> uuid.UUID | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def letter_from_delivery(
    properties: pika.BasicProperties, body: bytes, routing_key: str | None = None
) -> tuple[DeadLetter, str]:
    """One dead-lettered delivery → (dead letter, delivery key). Pure, for unit tests."""
    headers = jsonable(dict(properties.headers or {}))
    deaths: list[dict[str, Any]] = headers.get("x-death") or []
    first_queue = headers.get("x-first-death-queue")
    first_reason = headers.get("x-first-death-reason")
    first = next((d for d in deaths if d.get("queue") == first_queue and d.get("reason") == first_reason), None)
    if first is None and deaths:
        first = deaths[-1]  # RabbitMQ prepends: the oldest entry is last
    if first is not None:
        first_queue = first_queue or first.get("queue")
        first_reason = first_reason or first.get("reason")
    total = sum(int(d.get("count") or 0) for d in deaths)
    reason = headers.get(names.HEADER_DEAD_REASON) or (f"broker_{first_reason}" if first_reason else "broker_unknown")
    error = headers.get(names.HEADER_DEAD_ERROR) or (
        f"RabbitMQ dead-lettered the message from queue {first_queue} ({first_reason}, {total} time(s))"
        if first_queue
        else "published to the dead_letter exchange without x-death facts"
    )
    if names.HEADER_DEAD_REASON not in headers and headers.get(names.HEADER_FINAL_ATTEMPT):
        # Receivers before 2026-11-23 rejected their flagged final try (DESIGN §5)
        # without our headers; today's publish the copy with HEADER_DEAD_REASON set.
        reason = RETRIES_EXHAUSTED
        error = (
            f"the receiver could not store it through the whole delay/retry chain "
            f"(attempt {headers.get(names.HEADER_ATTEMPT, '?')}); {error}"
        )

    envelope: dict[str, Any] | None = None
    try:
        decoded = decode_json(body)
        if isinstance(decoded, dict):
            envelope = decoded
    except EnvelopeError:
        pass
    message_id = _uuid(properties.message_id) or (_uuid(envelope.get("message_id")) if envelope else None)
    message_type = properties.type or (envelope.get("message_type") if envelope else None)
    if not isinstance(message_type, str):
        message_type = None
    original_keys = (first or {}).get("routing-keys") or []
    props = {p: jsonable(getattr(properties, p)) for p in _PROPERTIES if getattr(properties, p, None) is not None}
    headers["amqp_properties"] = props
    attempts = {
        "x_death": deaths,
        "first_death": {
            "queue": first_queue,
            "reason": first_reason,
            "exchange": headers.get("x-first-death-exchange"),
            "time": (first or {}).get("time"),
        },
        "deaths": total,
        "attempt": headers.get(names.HEADER_ATTEMPT),
    }
    letter = DeadLetter(
        source="broker",
        reason=str(reason),
        error=str(error),
        error_type=str(reason),
        message_id=message_id,
        message_type=message_type,
        routing_key=original_keys[0] if original_keys else routing_key,
        message=envelope,
        raw_body=None if envelope is not None else body,
        headers=headers,
        attempts=attempts,
    )
    key = hashlib.sha256()
    key.update(str(message_id or "").encode())
    key.update(hashlib.sha256(body).digest())
    key.update(json.dumps([deaths, first_queue, first_reason], sort_keys=True, default=str).encode())
    return letter, key.hexdigest()


def insert_sql(schema: str, columns: list[str]) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {t} ({cols}) VALUES ({vals}) ON CONFLICT (delivery_key) WHERE delivery_key IS NOT NULL DO NOTHING"
    ).format(
        t=sql.Identifier(schema, names.DEAD_LETTERS),
        cols=sql.SQL(", ").join(map(sql.Identifier, columns)),
        vals=sql.SQL(", ").join(map(sql.Placeholder, columns)),
    )


def store(conn: psycopg.Connection[Any], schema: str, deliveries: list[tuple[pika.BasicProperties, bytes, str]]) -> int:
    """Insert the deliveries' letters in one transaction; returns how many were new.

    A delivery PostgreSQL cannot store as it is (JSON with ``\\u0000``, which ``jsonb``
    refuses) must not wedge the collector: it is stored again, in its own savepoint, with
    the body as raw text and the JSON columns sanitized.
    """
    inserted = 0
    with conn.transaction(), conn.cursor() as cur:
        for properties, body, routing_key in deliveries:
            letter, key = letter_from_delivery(properties, body, routing_key)
            row = {**letter.row(), "delivery_key": key}
            query = insert_sql(schema, list(row))
            try:
                with conn.transaction():  # one statement each: rowcount tells duplicates apart
                    cur.execute(query, row)
            except psycopg.DataError as exc:
                raw, encoding = encode_body(body)
                row.update(
                    message=None,
                    raw_body=raw,
                    raw_encoding=encoding,
                    headers=_unstorable(row["headers"]),
                    attempts=_unstorable(row["attempts"]),
                    error=f"{row['error']} (stored as raw text: {exc.sqlstate} {str(exc).splitlines()[0]})",
                )
                for column in ("message_type", "routing_key", "error", "reason", "raw_body"):
                    if isinstance(row[column], str):
                        row[column] = row[column].replace("\x00", "\ufffd")
                cur.execute(query, row)
            inserted += cur.rowcount
    return inserted


def _unstorable(json_text: str) -> str:
    """A JSON column PostgreSQL refused, kept as one readable string instead."""
    return json.dumps({"unstorable": json_text.replace("\\u0000", "\\ufffd")[:20_000]})


class Collector(Daemon):
    name = "collector"

    def __init__(self, settings: Settings, registry: Registry, config: CollectorSettings | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.registry = registry
        self.config = config or CollectorSettings()
        self.queue = names.dead_letter_queue(settings.service)
        self.collected = 0
        self.finished = threading.Event()  # set once run() returned and the connections are closed

    def run(self) -> None:
        reconnect = Reconnect(self)
        try:
            while not self.stopping:
                try:
                    self._session(reconnect)
                except (BrokerUnavailable, pika.exceptions.AMQPError) as exc:
                    if reconnect.failed("broker", exc):
                        break
                except (DatabaseUnavailable, psycopg.OperationalError) as exc:
                    if reconnect.failed("database", exc):
                        break
            self.state("stopped", f"{self.collected} dead letters collected")
        finally:
            self.finished.set()

    def _session(self, reconnect: Reconnect) -> None:
        conn = db.connect(self.settings.database_url, autocommit=True)
        connection = amqp.connect(self.settings.amqp_url, name=f"{self.settings.service} collector")
        try:
            channel = connection.channel()
            with amqp.broker_errors("collector"):
                topology.declare(self.settings, self.registry, channel)
                channel.basic_qos(prefetch_count=self.config.batch_size)
            reconnect.succeeded()
            self.state("collecting", f"from {self.queue}")
            self._loop(conn, channel)
            with amqp.broker_errors("collector"):
                channel.cancel()  # requeues nothing: every delivery taken was stored and acked
        finally:
            conn.close()
            if connection.is_open:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    connection.close()

    def _loop(self, conn: psycopg.Connection[Any], channel: Any) -> None:
        batch: list[tuple[pika.BasicProperties, bytes, str]] = []
        last_tag = 0
        oldest = 0.0
        next_resolve = 0.0
        schema = self.settings.schema
        with amqp.broker_errors("collector"):
            deliveries = channel.consume(self.queue, inactivity_timeout=float(self.config.flush_interval))
            for method, properties, body in deliveries:
                if method is not None:
                    if not batch:
                        oldest = time.monotonic()
                    batch.append((properties, body, method.routing_key))
                    last_tag = method.delivery_tag
                due = time.monotonic() - oldest >= self.config.flush_interval
                if batch and (len(batch) >= self.config.batch_size or method is None or due):
                    new = store(conn, schema, batch)
                    channel.basic_ack(last_tag, multiple=True)  # only after the commit
                    self.collected += new
                    COLLECTED.labels(self.settings.service).inc(new)
                    DUPLICATES.labels(self.settings.service).inc(len(batch) - new)
                    batch = []
                if time.monotonic() >= next_resolve:
                    resolve_replayed(conn, schema)
                    next_resolve = time.monotonic() + self.config.resolve_interval
                if self.stopping and not batch:
                    return
