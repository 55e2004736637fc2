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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pika
import pika.channel
import pika.exceptions
import pika.spec
import psycopg
from pika.adapters.select_connection import IOLoop

from framework import amqp, jsoncodec, metrics, names, reasons, topology
from framework.backoff import reconnect_seconds
from framework.connections import ConnectionSlot
from framework.daemon import RABBITMQ, Daemon
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
from framework.settings import FromEnv, Seconds, mask_url, setting
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


Delivery = tuple[pika.BasicProperties, bytes, str]  # properties, body, routing key


def _cause(exc: BaseException) -> str:
    """What a session failure is, as the collector's state names it."""
    if isinstance(exc, BrokerUnavailable | pika.exceptions.AMQPError):
        return "broker"
    if isinstance(exc, DatabaseUnavailable | psycopg.OperationalError):
        return "database"
    return "collector"


class Collector(Daemon):
    """The collector daemon (`txbox collector`), a guest of the loop it is started on.

    A session is one connection to RabbitMQ (the nodes of ``TXBOX_AMQP_URL`` in turn) and
    one to PostgreSQL: it declares the topology, consumes with a prefetch of ``batch_size``,
    stores a batch when it is full or its first delivery has waited ``flush_interval``
    (:func:`store`, synchronous: short statements may run on the loop, docs/explanation/daemons.md,
    "One loop per process") and acks it after the commit; a tick every flush interval runs
    the resolve sweep when it is due. A failure ends the session (what it took and did not
    ack goes back to the queue) and a new one starts after a backoff. A stop stores and
    acks what it holds, cancels the consumer and closes. Everything runs on the loop's
    thread but :meth:`stop`.
    """

    name = "collector"

    def __init__(
        self, service: Service, config: CollectorConfig | None = None, *, stop_event: threading.Event | None = None
    ) -> None:
        super().__init__(service, stop_event=stop_event)
        self.config = config or CollectorConfig.from_env()
        self.queue = names.dead_letter_queue(self.settings.service)
        self._db = ConnectionSlot(self.settings.database_url, autocommit=True)
        self._amqp: pika.SelectConnection | None = None  # opening or open
        self._nodes: Iterator[pika.ConnectionParameters] = iter(())
        self._channel: pika.channel.Channel | None = None
        self._consumer: str | None = None  # the consumer tag while consuming
        self._batch: list[Delivery] = []
        self._last_tag = 0
        self._flush_timer: Any = None
        self._tick_timer: Any = None
        self._retry_timer: Any = None
        self._next_resolve = 0.0  # monotonic
        self._failures = 0
        self._ended_by: tuple[str, BaseException] | None = None  # why the session is closing
        self._leaving = False  # a stop was requested
        self.collected = 0
        self.finished = threading.Event()  # set once it has ended and its connections are closed

    @property
    def _loop(self) -> IOLoop:
        loop = self.loop
        assert loop is not None, "the collector runs only once started (start_on)"
        return loop

    # ---- lifecycle -----------------------------------------------------------------

    def _begin(self) -> None:
        self.state("starting", f"from {self.queue}")
        self._tick()
        self._connect()

    def _on_stop(self) -> None:
        """Store and ack what it holds, cancel the consumer, close; end once closed."""
        self._leaving = True
        self._cancel("_retry_timer")
        amqp_conn, channel = self._amqp, self._channel
        if amqp_conn is None:
            self._finish()
        elif self._consumer is not None and channel is not None and channel.is_open:
            self._guarded(self._flush)
            self._guarded(self._cancel_consumer)  # unless the flush ended the session
        elif amqp_conn.is_open:
            self._close()
        # Still opening: _on_open closes it, or _on_open_error ends the collector.

    def _cancel_consumer(self) -> None:
        channel, consumer = self._channel, self._consumer
        if channel is not None and consumer is not None and channel.is_open:
            channel.basic_cancel(consumer, callback=lambda _f: self._close())

    def _finish(self) -> None:
        """Closed: end, once."""
        if self.ended:
            return
        for timer in ("_flush_timer", "_tick_timer", "_retry_timer"):
            self._cancel(timer)
        self._batch = []
        self._db.close()
        self.set_ready(RABBITMQ, False)
        self.state("stopped", f"{self.collected} dead letters collected")
        self.finished.set()
        self._end()

    def _cancel(self, attribute: str) -> None:
        timer = getattr(self, attribute)
        if timer is not None:
            setattr(self, attribute, None)
            self._loop.remove_timeout(timer)

    def _guarded(self, call: Callable[[], None]) -> None:
        """Run one of the collector's steps with its last resort: a failure ends the session."""
        try:
            call()
        except Exception as exc:
            self._failed(exc)

    # ---- the session ---------------------------------------------------------------

    def _connect(self) -> None:
        """Start a session: PostgreSQL, then RabbitMQ's nodes in turn."""
        self._retry_timer = None
        if self._leaving:
            return
        self.progress()
        try:
            self._db.get()  # kept while the broker is down; closed with the session
        except (DatabaseUnavailable, psycopg.OperationalError) as exc:
            self._retry("database", exc)
            return
        self._nodes = iter(amqp.parameters_list(self.settings.amqp_url, name=f"{self.settings.service} collector"))
        self._connect_next()

    def _connect_next(self, refused: BaseException | None = None) -> None:
        self._amqp, error = amqp.connect_on(
            self._loop, self._nodes, on_open=self._on_open, on_open_error=self._on_open_error, on_close=self._on_closed
        )
        if self._amqp is None:
            url = mask_url(self.settings.amqp_url)
            self._retry("broker", BrokerUnavailable(f"cannot connect to RabbitMQ at {url}: {error or refused!r}"))

    def _on_open_error(self, connection: pika.SelectConnection, exc: BaseException) -> None:
        if connection is not self._amqp:
            return
        self._amqp = None
        if self._leaving:
            self._finish()
        else:
            self._connect_next(exc)

    def _on_open(self, connection: pika.SelectConnection) -> None:
        if self._leaving or self._ended_by is not None:  # given up while it opened (_close)
            connection.close()
            return
        connection.channel(on_open_callback=lambda channel: self._guarded(lambda: self._on_channel(channel)))

    def _on_channel(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_cancel_callback(lambda _f: self._failed(BrokerUnavailable("RabbitMQ cancelled the consumer")))
        topology.declare_on(self.settings, self.service.registry, channel, lambda: self._guarded(self._on_declared))

    def _on_declared(self) -> None:
        channel = self._channel
        if channel is None or self._leaving:
            return
        channel.basic_qos(prefetch_count=self.config.batch_size)
        self._consumer = channel.basic_consume(
            self.queue, self._on_message, callback=lambda _f: self._guarded(self._consuming)
        )

    def _consuming(self) -> None:
        if self._leaving:
            return
        self._failures = 0
        self._next_resolve = 0.0  # the first tick resolves
        self.set_ready(RABBITMQ, True)
        self.state("collecting", f"from {self.queue}")

    def _on_message(
        self,
        channel: pika.channel.Channel,
        method: pika.spec.Basic.Deliver,
        properties: pika.BasicProperties,
        body: bytes,
    ) -> None:
        try:
            if channel is not self._channel:
                return  # a session given up: RabbitMQ takes it back with the connection
            self.progress()
            self._batch.append((properties, body, method.routing_key))
            self._last_tag = method.delivery_tag
            if len(self._batch) >= self.config.batch_size:
                self._flush()
            elif self._flush_timer is None:
                self._flush_timer = self._loop.call_later(float(self.config.flush_interval), self._flush_due)
        except Exception as exc:  # the last resort: one delivery must never stop the collector
            self._failed(exc)

    def _flush_due(self) -> None:
        self._flush_timer = None
        self._guarded(self._flush)

    def _flush(self) -> None:
        """Store the batch in one transaction, then ack it (only after the commit)."""
        self._cancel("_flush_timer")
        batch, channel = self._batch, self._channel
        if not batch or channel is None:
            return
        new = store(self._db.get(), self.settings.schema, batch)
        self._batch = []
        channel.basic_ack(self._last_tag, multiple=True)
        self.collected += new
        metrics.COLLECTOR_DEAD_LETTERS.labels(**self.labels).inc(new)
        metrics.COLLECTOR_DUPLICATES.labels(**self.labels).inc(len(batch) - new)

    def _tick(self) -> None:
        """Every flush interval, connected or not (idle is not stuck): the resolve sweep when due."""
        self._tick_timer = self._loop.call_later(max(float(self.config.flush_interval), 0.01), self._tick)
        self.progress()
        if self._consumer is not None and not self._leaving and time.monotonic() >= self._next_resolve:
            self._next_resolve = time.monotonic() + self.config.resolve_interval
            self._guarded(self._resolve)

    def _resolve(self) -> None:
        resolve_replayed(self._db.get(), self.settings.schema)

    # ---- the end of a session --------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        """A step failed: end the session; a new one starts after a backoff (or the collector
        ends, when stopping). What it took and did not ack goes back to the queue."""
        cause = _cause(exc)
        if cause == "collector":  # a bug must not end the collector
            self.log.error("collector session failed; starting a new one", exc_info=exc)
        if self._ended_by is None:
            self._ended_by = (cause, exc)
        self._close()

    def _close(self) -> None:
        connection = self._amqp
        self._drop_session()
        if connection is not None and connection.is_open:
            try:
                connection.close()  # _on_closed goes on
                return
            except Exception as exc:  # closing already: its close callback goes on
                self.log.debug("closing the collector's connection: %r", exc)
                return
        if connection is None or connection.is_closed:
            self._on_closed(connection, None)
        # Still opening: _on_open closes it once it has opened.

    def _drop_session(self) -> None:
        """Forget what the session held: RabbitMQ requeues the unacked deliveries."""
        self._channel = None
        self._consumer = None
        self._batch = []
        self._cancel("_flush_timer")
        self.set_ready(RABBITMQ, False)

    def _on_channel_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        if channel is not self._channel or isinstance(reason, pika.exceptions.ConnectionClosed):
            return  # the connection's close callback comes next
        refusal = topology.mismatch(self.settings, reason)
        why = str(refusal) if refusal else f"channel closed ({reason!r})"
        self._failed(BrokerUnavailable(f"collector: {why}"))

    def _on_closed(self, connection: pika.SelectConnection | None, reason: BaseException | None) -> None:
        if connection is not self._amqp:
            return
        self._amqp = None
        self._drop_session()
        self._db.close()
        ended_by, self._ended_by = self._ended_by, None
        if self._leaving:
            self._finish()
            return
        if ended_by is None:
            ended_by = ("broker", BrokerUnavailable(f"collector: connection lost ({reason!r})"))
        self._retry(*ended_by)

    def _retry(self, what: str, exc: BaseException) -> None:
        """A new session after a backoff (:func:`framework.backoff.reconnect_seconds`)."""
        self._db.close()
        if self._leaving:
            self._finish()
            return
        self._failures += 1
        delay = reconnect_seconds(self._failures)
        self.state(f"{what} unavailable", f"{exc}; retrying in {delay:.1f}s")
        self._retry_timer = self._loop.call_later(delay, lambda: self._guarded(self._connect))
