"""The direct-send client for application code: many sends in flight from any thread.

Why a loop thread of its own: pika's ``BlockingConnection`` gives one blocking round
trip per confirmed publish, while publisher confirms streamed over an asynchronous
connection keep many in flight and reach a far higher rate (benchmarks/code-choices.md,
"Publisher confirms: blocking against streamed"). The loop thread runs a
:class:`~framework.confirms.channel.ConfirmChannel` (which owns the connection and the
channel); callers hand messages over through a queue and one
``ioloop.add_callback_threadsafe`` wake-up per burst (not per message), because that
call writes to a pipe. The relay does not use this class: it runs a ConfirmChannel on
its own loop (docs/explanation/daemons.md, "One thread per daemon").

Completion semantics are the channel's (framework/confirms/channel.py); here in addition:

- completions run on the loop thread (never on the sending thread);
- :meth:`Publisher.flush` and :meth:`Publisher.close` block until every incomplete send
  has completed; calling either from inside a completion callback raises, since it
  would wait for itself.

Bounds (docs/explanation/write.md, "Direct sends"): :meth:`Publisher.publish` lets at most
``max_unconfirmed`` sends await their confirm; beyond that it waits for room (overflow
``block``, up to ``overflow_timeout``) or raises :class:`PublisherOverflow` at once
(``fail``). What the caller passes is copied at the call: the caller may reuse or change
its properties, headers and body afterwards without changing what is sent.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pika
from pika.adapters.select_connection import IOLoop

from framework import expiry, ids, names
from framework.confirms.channel import (
    CLOSED,
    CONNECTION_LOST,
    NACK_STREAK,
    OVERFLOW,
    TIMEOUT,
    UNENCODABLE,
    ConfirmChannel,
    Outgoing,
)
from framework.confirms.config import DirectSendConfig, Overflow
from framework.errors import BrokerUnavailable, PublisherClosed, PublisherOverflow, PublishError
from framework.settings import mask_url

__all__ = [
    "CLOSED",
    "CONNECTION_LOST",
    "NACK_STREAK",
    "OVERFLOW",
    "TIMEOUT",
    "UNENCODABLE",
    "Outgoing",
    "Publisher",
]

log = logging.getLogger("txbox.confirms")


class Publisher:
    """The direct-send client: streamed confirms over one connection and channel.

    ``Publisher(url).start()`` (or ``with Publisher(url) as p:``), then
    ``p.publish(exchange, routing_key, body)`` → a Future. :meth:`submit` takes batches
    with a per-message callback instead of futures (and its caller bounds them:
    ``max_unconfirmed`` holds for :meth:`publish` only).

    ``max_unconfirmed``, ``overflow`` and ``overflow_timeout`` default to
    ``TXBOX_PUBLISHER_MAX_UNCONFIRMED`` (1000), ``TXBOX_PUBLISHER_OVERFLOW`` (``block``)
    and ``TXBOX_PUBLISHER_OVERFLOW_TIMEOUT`` (``30s``).

    ``on_blocked`` is called on the I/O thread with the broker's reason when RabbitMQ
    blocks the connection (a memory or disk alarm), and with None when it unblocks it or
    the connection ends; :attr:`blocked` holds the same.
    """

    def __init__(
        self,
        amqp_url: str,
        *,
        name: str = "txbox direct sends",
        confirm_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        max_unconfirmed: int | None = None,
        overflow: Overflow | None = None,
        overflow_timeout: float | None = None,
        on_blocked: Callable[[str | None], None] | None = None,
    ) -> None:
        self.limits = DirectSendConfig.from_env(
            max_unconfirmed=max_unconfirmed, overflow=overflow, overflow_timeout=overflow_timeout
        )
        self.amqp_url = amqp_url
        self.name = name
        self.confirm_timeout = confirm_timeout
        self.connect_timeout = connect_timeout
        self._on_blocked_change = on_blocked
        self._lock = threading.Lock()  # _outq, _scheduled, _state: written by callers and the loop thread
        self._outq: deque[Outgoing] = deque()
        self._scheduled = False
        self._state = "new"  # new → open → closing → closed; or → broken
        self._ready = threading.Event()
        self._done_cond = threading.Condition()
        self._incomplete = 0
        self._thread: threading.Thread | None = None
        self._ioloop: IOLoop | None = None
        self._channel: ConfirmChannel | None = None  # the loop thread's

    # ---- caller side ---------------------------------------------------------------

    def start(self) -> Publisher:
        """Connect and enable confirms; BrokerUnavailable if that fails within the timeout."""
        if self._state != "new":
            raise PublisherClosed("a Publisher can be started once; create a new one", CLOSED)
        self._ioloop = IOLoop()
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
            raise BrokerUnavailable(f"cannot connect to RabbitMQ at {mask_url(self.amqp_url)}: {self.error}")
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
        channel = self._channel
        return channel.error if channel is not None else None

    @property
    def blocked(self) -> str | None:
        """While RabbitMQ blocks this connection's publishes (a memory or disk alarm): its reason; else None."""
        channel = self._channel
        return channel.blocked if channel is not None else None

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
        sent, so it always runs on the loop thread, in send order. One added later with
        ``add_done_callback`` runs at once, on the caller's thread, if the send has
        completed meanwhile.

        ``properties``, ``headers`` (added to the properties' own) and ``body`` are copied
        here: neither is changed, kept or read after the call. With ``max_unconfirmed``
        sends awaiting their confirm, it waits for room or raises PublisherOverflow (the
        overflow policy); PublisherClosed if the Publisher is not open; PublishError
        ``unencodable`` if the properties or headers cannot go on the wire (nothing is sent).

        ``ttl`` (a timedelta or seconds) adds the ``x-txbox-expires-at`` header: a txbox
        receiver dead-letters the message as ``expired`` once that time has passed
        (docs/explanation/receive.md, "Expiry and filters").
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
        """Hand a batch to the loop thread (one wake-up); each item's ``on_done`` runs on completion.

        Raises PublisherClosed (nothing was sent) when the Publisher is not open.
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
                # The loop thread completes sends; waiting on it from a callback would never end.
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
        """Queue ``batch`` for the loop thread; ``reserved``: it is counted already (:meth:`_reserve`)."""
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
        if wake and self._ioloop is not None:
            # The loop may have ended since the lock was let go: then the items were refused
            # (_on_change), and their futures say so.
            with contextlib.suppress(Exception):
                self._ioloop.add_callback_threadsafe(self._drain)

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
        channel = self._channel
        if channel is not None and channel.in_callback and threading.current_thread() is self._thread:
            raise PublishError(
                f"Publisher.{what}() was called from inside a completion callback: it would wait for "
                "that callback itself. Call it from another thread (e.g. after the future completes).",
                "illegal_state",
            )

    def _closed_text(self) -> str:
        if self._state == "broken":
            return f"the Publisher's connection was lost ({self.error}); create a new Publisher"
        return "the Publisher is closed"

    def _stop_io(self) -> None:
        ioloop = self._ioloop
        if ioloop is None:
            return
        with contextlib.suppress(Exception):  # the ioloop may be gone already
            ioloop.add_callback_threadsafe(self._close_io)

    # ---- loop thread -----------------------------------------------------------------

    def _run(self) -> None:
        ioloop = self._ioloop
        assert ioloop is not None
        try:
            self._channel = ConfirmChannel(
                self.amqp_url,
                ioloop,
                name=self.name,
                confirm_timeout=self.confirm_timeout,
                on_change=self._on_change,
                on_completed=self._completed,
                on_blocked=self._on_blocked_change,
            )
            self._channel.open()
            ioloop.start()
        except Exception:  # pragma: no cover - defensive: never die silently
            log.exception("the loop thread of %s failed", self.name)
            with self._lock:
                self._state = "broken"
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                ioloop.close()

    def _on_change(self, channel: ConfirmChannel) -> None:
        """The channel opened, broke or closed."""
        if channel.state == "open":
            with self._lock:
                if self._state == "new":
                    self._state = "open"
            self._ready.set()
            return
        with self._lock:
            queued = list(self._outq)
            self._outq.clear()
            self._scheduled = False
            if channel.state == "broken":
                self._state = "broken"
        if queued:  # handed over but never published
            if channel.state == "broken":
                channel.refuse(queued, PublishError(f"connection to RabbitMQ lost ({channel.error})", CONNECTION_LOST))
            else:
                channel.refuse(queued, PublisherClosed("the Publisher closed before the broker confirmed", CLOSED))
        with self._done_cond:  # senders waiting for room see the state (_reserve)
            self._done_cond.notify_all()
        self._ready.set()
        assert self._ioloop is not None
        self._ioloop.stop()

    def _completed(self, n: int) -> None:
        # Every completion frees room: a sender waiting under max_unconfirmed (_reserve) must
        # hear of it, not only flush() at zero.
        with self._done_cond:
            self._incomplete -= n
            self._done_cond.notify_all()

    def _close_io(self) -> None:
        channel = self._channel
        if channel is None or channel.state in ("closed", "broken"):
            if self._ioloop is not None:
                self._ioloop.stop()
            return
        channel.close()

    def _drain(self) -> None:
        with self._lock:
            items = list(self._outq)
            self._outq.clear()
            self._scheduled = False
        if items and self._channel is not None:
            self._channel.publish(items)


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
    field for). Encoding here is small next to the send itself (docs/explanation/write.md,
    "Direct sends").
    """
    try:
        properties.encode()
    except Exception as exc:  # struct.error, OverflowError, UnsupportedAMQPFieldException: whatever pika raises
        raise PublishError(f"the message's properties cannot be sent over AMQP: {exc!r}", UNENCODABLE) from exc
