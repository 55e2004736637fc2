"""A confirm-tracking publisher: many sends in flight, each completed by the broker's confirm.

Why a SelectConnection in a thread of its own: pika's ``BlockingConnection`` gives one
blocking round trip per confirmed publish (~1,700 msg/s here), while publisher confirms
streamed over an asynchronous connection reach ~18,000 msg/s. The I/O thread owns the
connection and channel; callers hand messages over through a queue and one
``ioloop.add_callback_threadsafe`` wake-up per burst (not per message), because that
call writes to a pipe.

Completion semantics (the Jakarta Messaging async-send rules, docs/architecture.md "Direct sends"):

- a send completes when the broker confirms it (``basic.ack``), or fails with
  :class:`~framework.errors.PublishError` when it is nacked, returned as unroutable
  (``mandatory``), not confirmed within ``confirm_timeout``, or the connection is lost;
- a streak of :data:`NACK_STREAK` nacks breaks the publisher as a lost connection
  does (the sends still waiting fail as ``connection_lost``): make a new one;
- completions run in send order, on the I/O thread (never on the sending thread), even
  if the broker confirms out of order: a confirm is recorded on its entry and entries
  are completed from the head of the send-ordered queue only;
- :meth:`Publisher.flush` and :meth:`Publisher.close` block until every incomplete send
  has completed; calling either from inside a completion callback raises, since it
  would wait for itself.

Bounds (docs/architecture.md, "Direct sends"): :meth:`Publisher.publish` lets at most
``max_unconfirmed`` sends await their confirm; beyond that it waits for room (overflow
``block``, up to ``overflow_timeout``) or raises :class:`PublisherOverflow` at once
(``fail``). What the caller passes is copied at the call: the caller may reuse or change
its properties, headers and body afterwards without changing what is sent.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pika
import pika.channel
import pika.exceptions
import pika.frame
import pika.spec

from framework import amqp, expiry, ids, names
from framework.errors import BrokerUnavailable, PublisherClosed, PublisherOverflow, PublishError
from framework.publisher.config import Overflow, PublisherConfig
from framework.reasons import Reason
from framework.settings import mask_url

log = logging.getLogger("txbox.publisher.confirms")

_PENDING: Any = object()  # outcome not known yet (None = confirmed)

TIMEOUT = "timeout"
OVERFLOW = "overflow"
CONNECTION_LOST = "connection_lost"
CLOSED = "closed"
UNENCODABLE = "unencodable"  # raised by publish() itself: nothing was sent

NACK_STREAK = 3
"""Nacks in a row (no ack between) after which a Publisher gives up its channel (_renew_after_nacks)."""


@dataclass(slots=True, eq=False)
class Outgoing:
    """One message on its way to the broker; ``token`` is the caller's handle (e.g. an outbox row)."""

    exchange: str
    routing_key: str
    body: bytes
    properties: pika.BasicProperties
    mandatory: bool = True
    token: Any = None
    on_done: Callable[[Outgoing, PublishError | None], None] | None = None
    tag: int = 0
    sent_at: float = 0.0
    returned: str | None = None
    outcome: Any = field(default=_PENDING)

    @property
    def message_id(self) -> str:
        return str(self.properties.message_id)


class Publisher:
    """Streamed-confirm publisher over one connection and channel.

    ``Publisher(url).start()`` (or ``with Publisher(url) as p:``), then
    ``p.publish(exchange, routing_key, body)`` → a Future. The relay uses
    :meth:`submit` with batches and a per-message callback instead of futures (and
    bounds its own batches: ``max_unconfirmed`` holds for :meth:`publish` only).

    ``max_unconfirmed``, ``overflow`` and ``overflow_timeout`` default to
    ``TXBOX_PUBLISHER_MAX_UNCONFIRMED`` (1000), ``TXBOX_PUBLISHER_OVERFLOW`` (``block``)
    and ``TXBOX_PUBLISHER_OVERFLOW_TIMEOUT`` (30s).

    ``on_blocked`` is called on the I/O thread with the broker's reason when RabbitMQ
    blocks the connection (a memory or disk alarm), and with None when it unblocks it or
    the connection ends; :attr:`blocked` holds the same.
    """

    def __init__(
        self,
        amqp_url: str,
        *,
        name: str = "txbox publisher",
        confirm_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        max_unconfirmed: int | None = None,
        overflow: Overflow | None = None,
        overflow_timeout: float | None = None,
        on_blocked: Callable[[str | None], None] | None = None,
    ) -> None:
        self.limits = PublisherConfig.from_env(
            max_unconfirmed=max_unconfirmed, overflow=overflow, overflow_timeout=overflow_timeout
        )
        self.amqp_url = amqp_url
        self.name = name
        self.confirm_timeout = confirm_timeout
        self.connect_timeout = connect_timeout
        self._on_blocked_change = on_blocked
        self._blocked: str | None = None
        self._lock = threading.Lock()
        self._outq: deque[Outgoing] = deque()
        self._scheduled = False
        self._state = "new"  # new → open → closing → closed; or → broken
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._done_cond = threading.Condition()
        self._incomplete = 0
        self._local = threading.local()
        self._thread: threading.Thread | None = None
        self._conn: pika.SelectConnection | None = None
        self._channel: pika.channel.Channel | None = None
        # I/O thread only:
        self._pending: deque[Outgoing] = deque()
        self._by_id: dict[str, Outgoing] = {}
        self._next_tag = 1
        self._nacks_in_a_row = 0

    # ---- caller side ---------------------------------------------------------------

    def start(self) -> Publisher:
        """Connect and enable confirms; BrokerUnavailable if that fails within the timeout."""
        if self._state != "new":
            raise PublisherClosed("a Publisher can be started once; create a new one", CLOSED)
        self._thread = threading.Thread(target=self._run, name=f"{self.name} io", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.connect_timeout):
            self._state = "broken"
            self._stop_io()
            raise BrokerUnavailable(
                f"RabbitMQ at {mask_url(self.amqp_url)} did not open a confirm channel within {self.connect_timeout}s"
            )
        if self._state != "open":
            self._thread.join(5)
            raise BrokerUnavailable(f"cannot connect to RabbitMQ at {mask_url(self.amqp_url)}: {self._error}")
        return self

    def __enter__(self) -> Publisher:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    @property
    def broken(self) -> bool:
        """The connection was lost (or nacks came in a streak): every incomplete send failed;
        make a new Publisher."""
        return self._state == "broken"

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def blocked(self) -> str | None:
        """While RabbitMQ blocks this connection's publishes (a memory or disk alarm): its reason; else None."""
        return self._blocked

    @property
    def in_flight(self) -> int:
        """Sends not completed yet (queued, published and waiting for a confirm)."""
        return self._incomplete

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes | bytearray | memoryview,
        *,
        properties: pika.BasicProperties | None = None,
        message_id: str | None = None,
        headers: dict[str, Any] | None = None,
        mandatory: bool = True,
        callback: Callable[[Future[None]], None] | None = None,
        ttl: timedelta | float | None = None,
    ) -> Future[None]:
        """Send one persistent message; the Future completes on confirm or fails with PublishError.

        ``callback`` (a completion listener) is attached before the message is
        sent, so it always runs on the I/O thread, in send order. One added later with
        ``add_done_callback`` runs at once, on the caller's thread, if the send has
        completed meanwhile.

        ``properties``, ``headers`` (added to the properties' own) and ``body`` are copied
        here: neither is changed, kept or read after the call. With ``max_unconfirmed``
        sends awaiting their confirm, it waits for room or raises PublisherOverflow (the
        overflow policy); PublisherClosed if the publisher is not open; PublishError
        ``unencodable`` if the properties or headers cannot go on the wire (nothing is sent).

        ``ttl`` (a timedelta or seconds) adds the ``x-txbox-expires-at`` header: a txbox
        receiver dead-letters the message as ``expired`` once that time has passed
        (docs/architecture.md, "Expiry and filters").
        """
        body = bytes(body)
        if ttl is not None:
            headers = {**(headers or {}), names.HEADER_EXPIRES_AT: expiry.header_value(expiry.deadline(ttl))}
        properties = _own_properties(properties, headers, message_id)
        _check_encodable(properties)
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        if callback is not None:
            future.add_done_callback(callback)

        def done(_: Outgoing, error: PublishError | None) -> None:
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        self._reserve()
        try:
            self._enqueue([Outgoing(exchange, routing_key, body, properties, mandatory, on_done=done)], reserved=True)
        except PublisherClosed:
            with self._done_cond:
                self._incomplete -= 1
                self._done_cond.notify_all()
            raise
        return future

    def submit(self, items: Iterable[Outgoing]) -> None:
        """Hand a batch to the I/O thread (one wake-up); each item's ``on_done`` runs on completion.

        Raises PublisherClosed (nothing was sent) when the publisher is not open.
        """
        self._enqueue(list(items), reserved=False)

    def _reserve(self) -> None:
        """Count one more incomplete send once there is room under ``max_unconfirmed``.

        Waiting and counting happen under one lock, so senders on several threads never
        overshoot the bound together.
        """
        limits = self.limits
        with self._done_cond:
            if self._incomplete >= limits.max_unconfirmed and self._state == "open":
                if limits.overflow == "fail":
                    raise PublisherOverflow(
                        f"{self._incomplete} sends await their confirm, the limit (max_unconfirmed="
                        f"{limits.max_unconfirmed}); nothing was sent. Wait for earlier futures or flush(), raise "
                        "TXBOX_PUBLISHER_MAX_UNCONFIRMED, or use overflow='block' to wait for room",
                        OVERFLOW,
                    )
                # The I/O thread completes sends; waiting on it from a callback would never end.
                self._refuse_in_callback("publish")
                deadline = time.monotonic() + limits.overflow_timeout
                while self._incomplete >= limits.max_unconfirmed and self._state == "open":
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PublisherOverflow(
                            f"no room for a send within {limits.overflow_timeout:g}s: {self._incomplete} sends "
                            f"still await their confirm (max_unconfirmed={limits.max_unconfirmed}); the broker is "
                            "slow or blocked. Nothing was sent: retry later, or raise "
                            "TXBOX_PUBLISHER_OVERFLOW_TIMEOUT or TXBOX_PUBLISHER_MAX_UNCONFIRMED",
                            OVERFLOW,
                        )
                    self._done_cond.wait(remaining)
            self._incomplete += 1

    def _enqueue(self, batch: list[Outgoing], *, reserved: bool) -> None:
        """Queue ``batch`` for the I/O thread; ``reserved``: it is counted already (:meth:`_reserve`)."""
        if not batch:
            return
        with self._lock:
            if self._state != "open":
                raise PublisherClosed(self._closed_text(), CONNECTION_LOST if self._state == "broken" else CLOSED)
            if not reserved:
                with self._done_cond:
                    self._incomplete += len(batch)
            self._outq.extend(batch)
            wake = not self._scheduled
            self._scheduled = True
        if wake and self._conn is not None:
            self._conn.ioloop.add_callback_threadsafe(self._drain)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every send so far has completed; False if ``timeout`` passed first."""
        self._refuse_in_callback("flush")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done_cond:
            while self._incomplete > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._done_cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting sends, wait (up to ``timeout``) for incomplete ones, close the connection.

        Sends still incomplete after the timeout fail with PublisherClosed (the broker may
        or may not have them).
        """
        self._refuse_in_callback("close")
        with self._lock:
            if self._state == "open":
                self._state = "closing"
        if self._state == "new":
            self._state = "closed"
            return
        self.flush(timeout)
        self._stop_io()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            if self._state != "broken":
                self._state = "closed"

    def _refuse_in_callback(self, what: str) -> None:
        if getattr(self._local, "in_callback", False):
            raise PublishError(
                f"Publisher.{what}() was called from inside a completion callback: it would wait for "
                "that callback itself. Call it from another thread (e.g. after the future completes).",
                "illegal_state",
            )

    def _closed_text(self) -> str:
        if self._state == "broken":
            return f"the publisher's connection was lost ({self._error}); create a new Publisher"
        return "the publisher is closed"

    def _stop_io(self) -> None:
        conn = self._conn
        if conn is None:
            return
        with contextlib.suppress(Exception):  # the ioloop may be gone already
            conn.ioloop.add_callback_threadsafe(self._close_io)

    # ---- I/O thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            # The nodes of a cluster in turn, until one opens (docs/architecture.md,
            # "A RabbitMQ cluster"); start() gives up after connect_timeout in all.
            for params in amqp.parameters_list(self.amqp_url, name=self.name):
                if self._state != "new":
                    return
                self._conn = pika.SelectConnection(
                    params,
                    on_open_callback=self._on_open,
                    on_open_error_callback=self._on_open_error,
                    on_close_callback=self._on_closed,
                )
                self._conn.ioloop.start()
                if self._ready.is_set():
                    return  # opened, then closed; or the broker refused the confirm channel
            self._state = "broken"
            self._ready.set()
        except Exception as exc:  # pragma: no cover - defensive: never die silently
            log.exception("publisher I/O thread failed")
            self._broken(exc)
            self._ready.set()

    def _on_open(self, conn: pika.SelectConnection) -> None:
        conn.add_on_connection_blocked_callback(self._on_connection_blocked)
        conn.add_on_connection_unblocked_callback(self._on_connection_unblocked)
        conn.channel(on_open_callback=self._on_channel)

    def _on_connection_blocked(self, _conn: pika.SelectConnection, frame: pika.frame.Method) -> None:
        """RabbitMQ stopped reading our publishes (``connection.blocked``): sends wait for their
        confirm until it unblocks, or pika drops the connection after ``blocked_connection_timeout``
        (docs/architecture.md, "Publishing blocked by the broker")."""
        reason = str(getattr(frame.method, "reason", "") or "resource alarm")
        log.warning("RabbitMQ blocks publishing on %s: %s", self.name, reason)
        self._set_blocked(reason)

    def _on_connection_unblocked(self, _conn: pika.SelectConnection, _frame: pika.frame.Method) -> None:
        log.info("RabbitMQ unblocked publishing on %s", self.name)
        self._set_blocked(None)

    def _set_blocked(self, reason: str | None) -> None:
        self._blocked = reason
        if self._on_blocked_change is not None:
            try:
                self._on_blocked_change(reason)
            except Exception:
                log.exception("a blocked-connection callback raised")

    def _on_open_error(self, conn: pika.SelectConnection, exc: BaseException) -> None:
        """This node did not answer: _run tries the next one."""
        self._error = exc
        conn.ioloop.stop()

    def _on_channel(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame: pika.frame.Method) -> None:
        with self._lock:
            self._state = "open"
        self._ready.set()
        assert self._conn is not None
        self._conn.ioloop.call_later(1.0, self._check_timeouts)

    def _on_closed(self, conn: pika.SelectConnection, reason: BaseException) -> None:
        if self._blocked is not None:
            self._set_blocked(None)
        if self._state not in ("closing", "closed"):
            self._broken(reason)
        else:
            self._fail_everything(PublisherClosed("the publisher closed before the broker confirmed", CLOSED))
        conn.ioloop.stop()

    def _on_channel_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        if self._state not in ("closing", "closed"):
            self._broken(reason)
        assert self._conn is not None
        if self._conn.is_open:
            self._conn.close()

    def _close_io(self) -> None:
        conn = self._conn
        if conn is None:
            return
        if conn.is_open:
            conn.close()
        elif conn.is_closed:
            conn.ioloop.stop()

    def _broken(self, reason: BaseException) -> None:
        with self._lock:
            if self._state == "broken":
                return
            self._state = "broken"
            self._error = reason
        log.warning("publisher connection lost: %s", reason)
        self._fail_everything(
            PublishError(f"connection to RabbitMQ lost before the confirm ({reason})", CONNECTION_LOST)
        )

    def _fail_everything(self, error: PublishError) -> None:
        with self._lock:
            queued = list(self._outq)
            self._outq.clear()
            self._scheduled = False
        for item in itertools.chain(self._pending, queued):
            if item.outcome is _PENDING:
                item.outcome = error
        self._pending.extend(queued)
        self._complete_head()

    def _drain(self) -> None:
        with self._lock:
            items = list(self._outq)
            self._outq.clear()
            self._scheduled = False
        channel = self._channel
        if channel is None or not channel.is_open:
            for item in items:
                item.outcome = PublishError("the channel is closed", CONNECTION_LOST)
            self._pending.extend(items)
            self._complete_head()
            return
        now = time.monotonic()
        publish = channel.basic_publish
        pending = self._pending
        by_id = self._by_id
        tag = self._next_tag
        sent = 0
        try:
            for item in items:
                publish(item.exchange, item.routing_key, item.body, item.properties, item.mandatory)
                item.tag = tag
                tag += 1
                item.sent_at = now
                pending.append(item)
                if item.mandatory:
                    by_id[item.message_id] = item
                sent += 1
        except Exception as exc:  # the channel or connection died under us
            error = PublishError(f"publishing failed: {exc!r}", CONNECTION_LOST)
            for item in items[sent:]:
                item.outcome = error
            pending.extend(items[sent:])
            self._broken(exc)
        finally:
            self._next_tag = tag
        if sent > 1:
            _coalesce_writes(self._conn)

    def _on_return(
        self,
        _channel: pika.channel.Channel,
        method: pika.spec.Basic.Return,
        properties: pika.BasicProperties,
        _body: bytes,
    ) -> None:
        # RabbitMQ sends basic.return before the basic.ack of the same message, so the
        # entry is still pending here and its ack will complete it as a failure.
        item = self._by_id.get(str(properties.message_id))
        if item is not None:
            item.returned = f"{method.reply_code} {method.reply_text}"

    def _on_confirm(self, frame: pika.frame.Method) -> None:
        method = frame.method
        nack = isinstance(method, pika.spec.Basic.Nack)
        tag: int = method.delivery_tag
        pending = self._pending
        if not pending:
            return
        first = pending[0].tag
        if method.multiple:
            selected: Iterable[Outgoing] = itertools.islice(pending, 0, max(0, tag - first + 1))
        elif 0 <= tag - first < len(pending):
            selected = (pending[tag - first],)
        else:
            return
        for item in selected:
            if item.outcome is not _PENDING:
                continue
            self._nacks_in_a_row = self._nacks_in_a_row + 1 if nack else 0
            if nack:
                item.outcome = PublishError(f"the broker nacked message {item.message_id}", Reason.NACKED)
            elif item.returned is not None:
                item.outcome = PublishError(
                    f"unroutable: no queue bound to {item.exchange!r} with {item.routing_key!r} ({item.returned})",
                    Reason.UNROUTABLE,
                )
            else:
                item.outcome = None
        self._complete_head()
        if self._nacks_in_a_row >= NACK_STREAK and self._state == "open":
            self._renew_after_nacks()

    def _renew_after_nacks(self) -> None:
        """Give up this channel after a streak of nacks; the caller opens a new Publisher.

        A RabbitMQ 3.10 channel whose first publish to a quorum queue met a dead leader
        kept getting nacks after a new leader was elected, while a new channel got acks
        at once (docs/architecture.md, "A RabbitMQ cluster"). The sends still waiting
        fail as connection_lost: not the messages' fault, so the relay releases them.
        """
        streak = self._nacks_in_a_row
        self._broken(PublishError(f"the broker nacked {streak} messages in a row; renewing the channel", Reason.NACKED))
        assert self._conn is not None
        if self._conn.is_open:
            self._conn.close()

    def _check_timeouts(self) -> None:
        if self._state not in ("open", "closing"):
            return
        limit = time.monotonic() - self.confirm_timeout
        for item in self._pending:
            if item.sent_at > limit:
                break
            if item.outcome is _PENDING:
                item.outcome = PublishError(
                    f"no confirm for message {item.message_id} within {self.confirm_timeout}s", TIMEOUT
                )
        self._complete_head()
        assert self._conn is not None
        self._conn.ioloop.call_later(1.0, self._check_timeouts)

    def _complete_head(self) -> None:
        """Complete entries in send order, stopping at the first one still waiting."""
        pending = self._pending
        completed = 0
        self._local.in_callback = True
        try:
            while pending and pending[0].outcome is not _PENDING:
                item = pending.popleft()
                if item.mandatory and self._by_id.get(item.message_id) is item:
                    del self._by_id[item.message_id]
                completed += 1
                if item.on_done is not None:
                    try:
                        item.on_done(item, item.outcome)
                    except Exception:
                        log.exception("a publish completion callback raised")
        finally:
            self._local.in_callback = False
        if completed:
            with self._done_cond:
                self._incomplete -= completed
                if self._incomplete <= 0:
                    self._done_cond.notify_all()


def _own_properties(
    properties: pika.BasicProperties | None, headers: dict[str, Any] | None, message_id: str | None
) -> pika.BasicProperties:
    """Properties of this send alone: the caller's object is neither changed nor kept.

    A shallow copy suffices for every property but ``headers`` (strings and numbers);
    headers are copied deeply, since a caller may reuse nested tables.
    """
    if properties is None:
        own = pika.BasicProperties(content_type="application/json", delivery_mode=2, timestamp=int(time.time()))
    else:
        own = copy.copy(properties)
    if own.headers is not None or headers is not None:
        own.headers = copy.deepcopy({**(own.headers or {}), **(headers or {})})
    if own.message_id is None:
        own.message_id = message_id or str(ids.message_id())
    return own


def _check_encodable(properties: pika.BasicProperties) -> None:
    """Raise PublishError ``unencodable`` if pika cannot encode ``properties``.

    Found on the I/O thread instead, the encoder's exception looked like a dying channel:
    every send in flight failed as ``connection_lost`` and the connection was renewed, for
    one caller's bad header (say an int past 64 bits, or a value of a type AMQP has no
    field for). Encoding here costs a few microseconds per send (docs/architecture.md,
    "Direct sends").
    """
    try:
        properties.encode()
    except Exception as exc:  # struct.error, OverflowError, UnsupportedAMQPFieldException: whatever pika raises
        raise PublishError(f"the message's properties cannot be sent over AMQP: {exc!r}", UNENCODABLE) from exc


_COALESCED_CHUNK = 256 * 1024


def _coalesce_writes(conn: pika.SelectConnection | None) -> None:
    """Join the frames a burst of publishes queued into few large writes.

    pika queues every frame of a message (method, header, body) as a buffer of its own
    and sends each with its own ``send()``: three system calls per message, and as many
    small TCP segments for the broker to read. Joined into chunks of up to 256 KB, a
    burst of 2,000 messages is a handful of system calls. This reaches into pika's
    transport (``_transport._tx_buffers``); with another pika that lacks it, nothing is
    joined and sending works as before. Runs on the I/O thread, which owns the transport.
    """
    buffers = getattr(getattr(conn, "_transport", None), "_tx_buffers", None)
    if not isinstance(buffers, deque) or len(buffers) < 2:
        return
    chunks: list[bytes] = []
    part: list[bytes] = []
    size = 0
    for data in buffers:
        part.append(data)
        size += len(data)
        if size >= _COALESCED_CHUNK:
            chunks.append(b"".join(part))
            part, size = [], 0
    if part:
        chunks.append(b"".join(part))
    buffers.clear()
    buffers.extend(chunks)
