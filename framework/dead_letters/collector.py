"""The collector daemon: drains ``<service>:dead_letter`` into ``txbox.dead_letters``.

RabbitMQ dead-letters a message when the receiver could not store it (the delay/retry
chain ran out, or a delivery limit was hit); those messages never reach the inbox, so
without the collector they would sit in a queue nobody reads. Each delivery becomes one
row with the broker's ``x-death`` facts and our own headers, inserted *before* the ack:
a crash in between redelivers it, and the row's ``delivery_key`` (unique, see migration
0004) makes the second insert a no-op, so a delivery is never lost and never doubled.

The collector also runs the resolve sweep (:func:`framework.dead_letters.replay.resolve_replayed`)
every few seconds, so replayed letters turn resolved once their message is processed.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import psycopg

from framework import amqp, jsoncodec, metrics, names, reasons, topology
from framework.connections import ConnectionSlot
from framework.daemon import RABBITMQ, Daemon, Reconnect
from framework.dead_letters import (
    BODY_LIMIT,
    ERROR_LIMIT,
    DeadLetter,
    fingerprint,
    internal_error_letter,
    stored_body,
)
from framework.dead_letters.replay import resolve_replayed
from framework.envelope import decode_json
from framework.errors import BrokerUnavailable, DatabaseUnavailable, DeadLetterUnstorable, EnvelopeError
from framework.reasons import Reason
from framework.service import Service
from framework.settings import FromEnv, Seconds, setting
from framework.sql import dead_letters as dead_letters_sql


@dataclass(frozen=True, kw_only=True)
class CollectorConfig(FromEnv):
    """How the collector batches and how often it resolves replayed letters (``TXBOX_COLLECTOR_*``)."""

    batch_size: int = setting(
        "TXBOX_COLLECTOR_BATCH_SIZE", "200", default=200, help="deliveries stored per transaction (and prefetch)"
    )
    flush_interval: Seconds = setting(
        "TXBOX_COLLECTOR_FLUSH_INTERVAL", "200ms", default=Seconds(0.2), help="longest wait before a partial batch"
    )
    resolve_interval: Seconds = setting(
        "TXBOX_COLLECTOR_RESOLVE_INTERVAL", "2s", default=Seconds(2.0), help="how often replayed letters are resolved"
    )


# Our reason header names a code: anything else there (a forged or garbled value) is
# kept among the headers but not taken for the reason. Judged on at most 64 characters.
_REASON_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _uuid(value: Any) -> uuid.UUID | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def _text(value: Any) -> str | None:
    """A header or property value that should be text, as text (None when absent or not scalar)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return None


def _reason_code(value: Any) -> str | None:
    text = _text(value)
    if text is None or len(text) > 64 or not _REASON_CODE.fullmatch(text):
        return None
    return text


def _deaths(headers: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``x-death`` entries that are tables; anything else there is kept in the headers only."""
    deaths = headers.get(names.HEADER_DEATH)
    if not isinstance(deaths, list):
        return []
    return [d for d in deaths if isinstance(d, dict)]


def _count(death: dict[str, Any]) -> int:
    count = death.get("count")
    return count if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 2**63 else 0


def letter_from_delivery(
    properties: pika.BasicProperties, body: bytes, routing_key: str | None = None
) -> tuple[DeadLetter, str]:
    """One dead-lettered delivery → (dead letter, delivery key). Pure, for unit tests; never raises.

    Whatever arrives (no, forged or malformed ``x-death`` and ``x-txbox-*`` headers,
    properties of the wrong type), the delivery becomes a letter: should judging it
    fail all the same, the letter of last resort (``internal_error``) with its body and
    headers (see docs/explanation/dead-letters.md, "Dead letters").
    """
    try:
        return _letter_from_delivery(properties, body, routing_key)
    except Exception as exc:  # the last resort: one delivery must never stop the collector
        return _last_resort(properties, body, routing_key, exc)


def _letter_from_delivery(
    properties: pika.BasicProperties, body: bytes, routing_key: str | None
) -> tuple[DeadLetter, str]:
    raw_headers = properties.headers
    headers = jsoncodec.to_storable(dict(raw_headers)) if isinstance(raw_headers, dict) else {}
    if raw_headers is not None and not isinstance(raw_headers, dict):
        headers["headers"] = jsoncodec.to_storable(raw_headers)
    deaths = _deaths(headers)
    first_queue = _text(headers.get(names.HEADER_FIRST_DEATH_QUEUE))
    first_reason = _text(headers.get(names.HEADER_FIRST_DEATH_REASON))
    first = next((d for d in deaths if d.get("queue") == first_queue and d.get("reason") == first_reason), None)
    if first is None and deaths:
        first = deaths[-1]  # RabbitMQ prepends: the oldest entry is last
    if first is not None:
        first_queue = first_queue or _text(first.get("queue"))
        first_reason = first_reason or _text(first.get("reason"))
    total = sum(_count(d) for d in deaths)
    # Why it is here is the latest death, the entry RabbitMQ puts first; the first death may
    # be a delay queue's expiry of our retry chain, or a sender's own x-death entry (RabbitMQ
    # sets no x-first-death-* then).
    latest = deaths[0] if deaths else {}
    died_in, died_for = _text(latest.get("queue")), _text(latest.get("reason"))
    if died_for is None:
        died_in, died_for = first_queue, first_reason
    reason = _reason_code(headers.get(names.HEADER_DEAD_REASON)) or reasons.broker(_reason_code(died_for))
    error = _text(headers.get(names.HEADER_DEAD_ERROR)) or (
        f"RabbitMQ dead-lettered the message from queue {died_in} ({died_for}, {total} time(s))"
        if died_in
        else "published to the dead_letter exchange without x-death facts"
    )
    if names.HEADER_DEAD_REASON not in headers and headers.get(names.HEADER_FINAL_ATTEMPT):
        # Receivers before 2026-11-23 rejected their flagged final try
        # without our headers; today's publish the copy with HEADER_DEAD_REASON set.
        reason = Reason.RETRIES_EXHAUSTED
        error = (
            f"the receiver could not store it through the whole delay/retry chain "
            f"(attempt {_text(headers.get(names.HEADER_ATTEMPT)) or '?'}); {error}"
        )

    envelope: dict[str, Any] | None = None
    try:
        # No depth bound of the receiver's here: whatever the parser takes keeps its id
        # and type, and the letter cuts the depth it stores (to_storable).
        decoded = decode_json(body, max_depth=sys.maxsize)
        if isinstance(decoded, dict):
            envelope = decoded
    except EnvelopeError:
        pass
    message_id = _uuid(properties.message_id) or (_uuid(envelope.get("message_id")) if envelope else None)
    message_type = _text(properties.type) or (envelope.get("message_type") if envelope else None)
    if not isinstance(message_type, str):
        message_type = None
    original_keys = (first or {}).get("routing-keys")
    original_key = _text(original_keys[0]) if isinstance(original_keys, list) and original_keys else None
    props = {
        p: jsoncodec.to_storable(getattr(properties, p))
        for p in names.BASIC_PROPERTIES
        if getattr(properties, p, None) is not None
    }
    headers["amqp_properties"] = props
    attempts = {
        "x_death": deaths,
        "first_death": {
            "queue": first_queue,
            "reason": first_reason,
            "exchange": _text(headers.get(names.HEADER_FIRST_DEATH_EXCHANGE)),
            "time": (first or {}).get("time"),
        },
        "deaths": total,
        "attempt": headers.get(names.HEADER_ATTEMPT),
    }
    letter = DeadLetter(
        source="broker",
        reason=reason,
        error=error,
        error_type=reason,
        message_id=message_id,
        message_type=message_type,
        routing_key=original_key or _text(routing_key),
        message=envelope,
        raw_body=body if _raw_needed(envelope, body) else None,
        headers=headers,
        attempts=attempts,
    )
    # The whole header table and the properties: two deliveries with one body and no
    # readable x-death (say, malformed in two ways) are two letters, a redelivery one.
    return letter, _delivery_key(str(message_id or ""), body, headers)


def _raw_needed(envelope: dict[str, Any] | None, body: bytes) -> bool:
    """The raw body is kept when the envelope alone would not show the delivery as it came:
    not an envelope, one the JSON columns store altered (NUL, depth…), or one too large."""
    return envelope is None or len(body) > BODY_LIMIT or jsoncodec.to_storable(envelope) != envelope


def _last_resort(
    properties: pika.BasicProperties, body: bytes, routing_key: str | None, exc: Exception
) -> tuple[DeadLetter, str]:
    headers = getattr(properties, "headers", None)
    letter = internal_error_letter(
        source="broker",
        error=f"the collector could not judge this delivery ({type(exc).__name__}: {exc})",
        raw_body=body if isinstance(body, bytes) else None,
        headers={"headers": headers},
        routing_key=routing_key if isinstance(routing_key, str) else None,
    )
    return letter, _delivery_key(Reason.INTERNAL_ERROR, body, headers)


def _delivery_key(message_id: str, body: bytes, facts: Any) -> str:
    """Same delivery, same key: a redelivery after a crash before the ack inserts nothing."""
    key = hashlib.sha256()
    key.update(message_id.encode())
    key.update(hashlib.sha256(body if isinstance(body, bytes) else b"").digest())
    key.update(json.dumps(jsoncodec.to_storable(facts), sort_keys=True, default=str).encode("utf-8", "surrogatepass"))
    return key.hexdigest()


def store(conn: psycopg.Connection[Any], schema: str, deliveries: list[tuple[pika.BasicProperties, bytes, str]]) -> int:
    """Insert the deliveries' letters in one transaction; returns how many were new.

    Each delivery is inserted in its own savepoint; a row PostgreSQL refuses is tried
    again in simpler forms (:func:`_rows`), down to one holding only the body's length
    and sha256. When even that is refused the database is at fault, not the delivery:
    :class:`DeadLetterUnstorable` (a :class:`DatabaseUnavailable`) leaves the batch
    unacknowledged, so RabbitMQ keeps it for the next try.
    """
    inserted = 0
    with conn.transaction(), conn.cursor() as cur:
        for properties, body, routing_key in deliveries:
            letter, key = letter_from_delivery(properties, body, routing_key)
            inserted += _insert(cur, schema, letter, key, body)
    return inserted


def _insert(cur: psycopg.Cursor[Any], schema: str, letter: DeadLetter, key: str, body: bytes) -> int:
    refusals: list[str] = []
    for row in _rows(letter, key, body, refusals):
        try:
            with cur.connection.transaction():  # one statement each: rowcount tells duplicates apart
                cur.execute(dead_letters_sql.insert_sql(schema), row)
            return cur.rowcount
        except psycopg.Error as exc:
            if cur.connection.broken or cur.connection.closed:
                raise
            refusals.append(f"{exc.sqlstate} {_first_line(exc)}")
    raise DeadLetterUnstorable(
        f"PostgreSQL refused even the minimal dead-letter row for a delivery of {len(body)} bytes "
        f"(sha256 {hashlib.sha256(body).hexdigest()}): {'; '.join(refusals)}. The delivery stays in "
        "the dead_letter queue; check the txbox.dead_letters table (migrations applied? privileges? disk?)"
    )


def _rows(letter: DeadLetter, key: str, body: bytes, refusals: list[str]) -> Iterator[dict[str, Any]]:
    """The forms a letter is stored in, each simpler than the one before (``refusals`` says why)."""
    row = {**letter.row(), "delivery_key": key}
    yield row
    stored = stored_body(body)
    yield {
        **row,
        "message": None,
        "raw_body": stored.text,
        "raw_encoding": stored.encoding,
        "headers": _unstorable(row["headers"]),
        "attempts": _unstorable(row["attempts"]),
        "error": f"{jsoncodec.clean_text(row['error'], ERROR_LIMIT)} (stored as raw text: {refusals[-1]})",
        **{c: jsoncodec.clean_text(row[c], 1000) for c in ("message_type", "routing_key", "reason")},
    }
    facts = {"length": len(body), "sha256": hashlib.sha256(body).hexdigest(), "refused": refusals}
    yield {
        **row,
        "message_id": None,
        "reason": Reason.INTERNAL_ERROR,
        "error": "PostgreSQL refused the dead letter: " + "; ".join(refusals).encode("ascii", "replace").decode(),
        "fingerprint": fingerprint(None, Reason.INTERNAL_ERROR, "refused dead letter"),
        "message_type": None,
        "routing_key": None,
        "message": None,
        "raw_body": None,
        "raw_encoding": None,
        "headers": json.dumps({names.BODY_FACTS: facts}, ensure_ascii=True).replace("\\u0000", "?"),
        "attempts": "{}",
    }


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__


def _unstorable(json_text: str) -> str:
    """A JSON column PostgreSQL refused, kept as one readable string instead."""
    return json.dumps({"unstorable": json_text.replace("\\u0000", "\\ufffd")[:20_000]})


class Collector(Daemon):
    name = "collector"

    def __init__(
        self, service: Service, config: CollectorConfig | None = None, *, stop_event: threading.Event | None = None
    ) -> None:
        super().__init__(service, stop_event=stop_event)
        self.config = config or CollectorConfig.from_env()
        self.queue = names.dead_letter_queue(self.settings.service)
        self._db = ConnectionSlot(self.settings.database_url, autocommit=True)
        self.collected = 0
        self.finished = threading.Event()  # set once run() returned and the connections are closed

    def run(self) -> None:
        reconnect = Reconnect(self)
        try:
            while not self.stopping:
                self.progress()
                try:
                    self._session(reconnect)
                except (BrokerUnavailable, pika.exceptions.AMQPError) as exc:
                    if reconnect.failed("broker", exc):
                        break
                except (DatabaseUnavailable, psycopg.OperationalError) as exc:
                    if reconnect.failed("database", exc):
                        break
                except Exception as exc:  # a bug must not end the collector: what it took is not acked
                    self.log.exception("collector session failed; starting a new one")
                    if reconnect.failed("collector", exc):
                        break
            self.state("stopped", f"{self.collected} dead letters collected")
        finally:
            self._db.close()
            self.finished.set()

    def _session(self, reconnect: Reconnect) -> None:
        conn = self._db.get()  # kept in the slot if the broker is down: closed when run() ends
        connection = amqp.connect(self.settings.amqp_url, name=f"{self.settings.service} collector")
        try:
            channel = connection.channel()
            with amqp.broker_errors("collector"):
                topology.declare(self.settings, self.service.registry, channel)
                channel.basic_qos(prefetch_count=self.config.batch_size)
            reconnect.succeeded()
            self.set_ready(RABBITMQ, True)
            self.state("collecting", f"from {self.queue}")
            self._loop(conn, channel)
            with amqp.broker_errors("collector"):
                channel.cancel()  # requeues nothing: every delivery taken was stored and acked
        finally:
            self.set_ready(RABBITMQ, False)
            self._db.close()
            amqp.close_quietly(connection)

    def _loop(self, conn: psycopg.Connection[Any], channel: Any) -> None:
        batch: list[tuple[pika.BasicProperties, bytes, str]] = []
        last_tag = 0
        oldest = 0.0
        next_resolve = 0.0
        schema = self.settings.schema
        with amqp.broker_errors("collector"):
            deliveries = channel.consume(self.queue, inactivity_timeout=float(self.config.flush_interval))
            for method, properties, body in deliveries:
                self.progress()  # an idle consume still yields None every flush_interval
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
                    metrics.COLLECTOR_DEAD_LETTERS.labels(self.settings.service).inc(new)
                    metrics.COLLECTOR_DUPLICATES.labels(self.settings.service).inc(len(batch) - new)
                    batch = []
                if time.monotonic() >= next_resolve:
                    resolve_replayed(conn, schema)
                    next_resolve = time.monotonic() + self.config.resolve_interval
                if self.stopping and not batch:
                    return
