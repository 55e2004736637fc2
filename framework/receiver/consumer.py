"""The receiver's consuming connection: a ``SelectConnection`` and its channel on a loop the caller runs.

:class:`Consumer` connects to the URL's nodes in turn (docs/explanation/operations.md, "A RabbitMQ
cluster"), and offers what the receiver asks of its channel: the prefetch, the count of
the queue's consumers, consuming, acks, and a pause in reading (:meth:`Consumer.pause`).
Every method and every callback runs on the loop's thread. A callback of the caller's
that raises is logged and closes the connection, which the caller then hears of as a
lost one: nothing escapes to the loop, where it would end every daemon on it
(docs/explanation/daemons.md, "One loop per process").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pika
import pika.channel
import pika.frame
from pika.adapters.select_connection import IOLoop

from framework import amqp, topology
from framework.contracts import Registry
from framework.errors import BrokerUnavailable
from framework.settings import Settings, mask_url
from framework.topology import QueueSpec

log = logging.getLogger("txbox.receiver")

#: ``on_delivery(method, properties, body)``: pika's delivery, on the loop.
OnDelivery = Callable[[Any, Any, bytes], None]


class Consumer:
    """One consuming connection on ``loop``: ``open()``, then ``on_open(consumer)`` once the
    channel is open, or ``on_gone(consumer, error)`` once, when it could not open, broke or
    was closed (``error`` is None after :meth:`close`)."""

    def __init__(
        self,
        amqp_url: str,
        loop: IOLoop,
        *,
        name: str,
        on_open: Callable[[Consumer], None],
        on_gone: Callable[[Consumer, BaseException | None], None],
        on_delivery: OnDelivery,
    ) -> None:
        self.amqp_url = amqp_url
        self.loop = loop
        self.name = name
        self.state = "new"  # new → opening → open → closing → gone
        self.error: BaseException | None = None
        self.closed_by: BaseException | None = None  # why RabbitMQ closed the open channel, if it did
        self.tag: str | None = None  # the consumer tag while consuming
        self._on_open = on_open
        self._on_gone = on_gone
        self._on_delivery = on_delivery
        self._nodes: Iterator[pika.ConnectionParameters] = iter(())
        self._conn: pika.SelectConnection | None = None
        self._channel: pika.channel.Channel | None = None
        self._paused: tuple[Any, int, Any] | None = None  # (transport, socket, reader) while reading is paused

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    # ---- opening and closing ---------------------------------------------------------

    def open(self) -> None:
        assert self.state == "new", "a Consumer opens once; make a new one"
        self.state = "opening"
        self._nodes = iter(amqp.parameters_list(self.amqp_url, name=self.name))
        self._connect_next()

    def _connect_next(self) -> None:
        conn, refused = amqp.connect_on(
            self.loop, self._nodes, on_open=self._opened, on_open_error=self._open_failed, on_close=self._closed
        )
        if conn is None:
            error = refused or self.error
            self._gone(BrokerUnavailable(f"cannot connect to RabbitMQ at {mask_url(self.amqp_url)}: {error!r}"))
            return
        self._conn = conn

    def close(self) -> None:
        """Close the connection (the broker requeues what it holds unacked); ``on_gone`` follows
        with None. One still opening is closed once it has opened, as pika cannot abort it."""
        if self.state in ("closing", "gone"):
            return
        was = self.state
        self.state = "closing"
        conn = self._conn
        if was == "open" and conn is not None and conn.is_open:
            self._resume()
            conn.close()
        elif conn is None or conn.is_closed:
            self._gone(None)

    def _opened(self, conn: pika.SelectConnection) -> None:
        if self.state == "closing":
            conn.close()
            return
        conn.channel(on_open_callback=self._channel_opened)

    def _open_failed(self, _conn: pika.SelectConnection, exc: BaseException) -> None:
        """This node did not answer: try the next one."""
        self.error = exc
        self._conn = None
        if self.state == "closing":
            self._gone(None)
            return
        self._connect_next()

    def _channel_opened(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._channel_closed)
        if self.state == "closing":
            self._close_connection()
            return
        self.state = "open"
        self._call(self._on_open, self)

    def _channel_closed(self, _channel: pika.channel.Channel, reason: BaseException) -> None:
        if self.state == "open":
            self.error = BrokerUnavailable(f"receiving: channel closed ({reason!r})")
            self.closed_by = reason
        self._close_connection()

    def _closed(self, _conn: pika.SelectConnection, reason: BaseException) -> None:
        if self.state == "closing":
            self._gone(None)
        else:
            error = self.error if isinstance(self.error, BrokerUnavailable) else None
            self._gone(error or BrokerUnavailable(f"receiving: connection lost ({reason!r})"))

    def _close_connection(self) -> None:
        conn = self._conn
        if conn is not None and conn.is_open:
            self._resume()
            conn.close()
        elif conn is None or conn.is_closed:
            self._gone(self.error if self.state != "closing" else None)

    def _gone(self, error: BaseException | None) -> None:
        if self.state == "gone":
            return
        self.state = "gone"
        self.error = error
        self.tag = None
        self._paused = None
        try:
            self._on_gone(self, error)
        except Exception:
            log.exception("the receiver's handler of a closed connection raised")

    def _call(self, callback: Callable[..., None], *args: Any) -> None:
        """Run a callback of the caller's; one that raises (a bug) closes the connection."""
        try:
            callback(*args)
        except Exception as exc:
            log.exception("the receiver failed in a broker callback: reconnecting")
            self.error = BrokerUnavailable(f"receiving: the receiver failed ({exc!r})")
            if self.state == "open":
                self.state = "failing"
            self._close_connection()

    # ---- the channel -----------------------------------------------------------------

    def declare(
        self, settings: Settings, registry: Registry, extra: Sequence[QueueSpec], then: Callable[[], None]
    ) -> None:
        """Declare the service's topology and the ``extra`` queues on this channel
        (:func:`framework.topology.declare_on`); ``then()`` once RabbitMQ answered the last.
        A declaration it refuses closes the channel: ``on_gone`` follows, and
        :attr:`closed_by` says why (:func:`framework.topology.mismatch` explains it)."""
        assert self._channel is not None
        topology.declare_on(settings, registry, self._channel, lambda: self._call(then), extra=extra)

    def qos(self, prefetch: int, then: Callable[[], None]) -> None:
        """Set the prefetch; ``then()`` once the broker took it."""
        assert self._channel is not None
        self._channel.basic_qos(prefetch_count=prefetch, callback=lambda _frame: self._call(then))

    def consumers(self, queue: str, then: Callable[[int], None]) -> None:
        """``then(n)`` with the consumers the broker counts on ``queue`` (a passive declare)."""
        assert self._channel is not None

        def counted(frame: pika.frame.Method) -> None:
            self._call(then, int(frame.method.consumer_count))

        self._channel.queue_declare(queue, passive=True, callback=counted)

    def consume(self, queue: str) -> None:
        assert self._channel is not None

        def delivered(_channel: Any, method: Any, properties: Any, body: bytes) -> None:
            self._call(self._on_delivery, method, properties, body)

        self.tag = self._channel.basic_consume(queue, delivered)

    def cancel(self, then: Callable[[], None] | None = None) -> None:
        """Stop consuming; a delivery that comes after this is requeued by pika itself."""
        tag, self.tag = self.tag, None
        if tag is None or self._channel is None or not self._channel.is_open:
            if then is not None:
                self._call(then)
            return
        self._channel.basic_cancel(tag, callback=(lambda _frame: self._call(then)) if then is not None else None)

    def ack(self, delivery_tag: int, *, multiple: bool = False) -> None:
        if self._channel is not None and self._channel.is_open:
            self._channel.basic_ack(delivery_tag, multiple=multiple)

    def nack(self, delivery_tag: int) -> None:
        """Requeue one delivery."""
        if self._channel is not None and self._channel.is_open:
            self._channel.basic_nack(delivery_tag, requeue=True)

    # ---- reading, paused -------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused is not None

    def pause(self) -> None:
        """Stop reading from the socket, so the broker's sends back up into TCP rather than
        into our memory; prefetch bounds deliveries, not their bytes.

        pika has no call for it: this takes the socket's reader out of pika's poller
        registration (``_nbio.remove_reader``) and shadows the transport's read callback,
        which pika's TLS transport also schedules by itself. With a pika that lacks these,
        nothing is paused, and the prefetch is the only bound. Bytes pika read already
        (at most one read's worth per turn) are still delivered.
        """
        if self._paused is not None or self.state != "open":
            return
        conn = self._conn
        transport: Any = getattr(conn, "_transport", None)
        nbio = getattr(conn, "_nbio", None)
        sock = getattr(transport, "_sock", None)
        reader = getattr(transport, "_on_socket_readable", None)
        if nbio is None or sock is None or reader is None:
            return
        try:
            fileno = sock.fileno()
            nbio.remove_reader(fileno)
        except Exception:  # closed meanwhile: nothing to pause
            return
        transport._on_socket_readable = _no_read
        self._paused = (transport, fileno, nbio)

    def resume(self) -> None:
        """Read again (:meth:`pause`)."""
        self._resume()

    def _resume(self) -> None:
        paused, self._paused = self._paused, None
        if paused is None:
            return
        transport, fileno, nbio = paused
        with contextlib.suppress(AttributeError):
            del transport._on_socket_readable
        conn = self._conn
        if conn is None or not conn.is_open:
            return
        with contextlib.suppress(Exception):  # a socket closed meanwhile has no reader to restore
            nbio.set_reader(fileno, transport._on_socket_readable)
            # What TLS read ahead sits in its buffer, with no readable socket to announce it.
            self.loop.call_later(0, transport._on_socket_readable)


def _no_read() -> None:
    """The transport's read callback while reading is paused: read nothing."""
