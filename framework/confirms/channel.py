"""One confirm channel on an event loop its caller runs: the broker side of every send.

:class:`ConfirmChannel` owns one ``SelectConnection`` and its channel in confirm mode on an
``IOLoop`` that the caller's thread runs; every method and every callback runs on that
thread, so nothing in it is locked. The relay runs it on its own loop beside its database
socket (docs/explanation/daemons.md, "One thread per daemon"); :class:`~framework.confirms.Publisher`
runs it on a loop thread of its own for application code that sends from any thread.

Completion semantics (the Jakarta Messaging async-send rules, docs/explanation/write.md "Direct sends"):

- a send completes when the broker confirms it (``basic.ack``), or fails with
  :class:`~framework.errors.PublishError` when it is nacked, returned as unroutable
  (``mandatory``), not confirmed within ``confirm_timeout``, or the connection is lost;
- a streak of :data:`NACK_STREAK` nacks breaks the channel as a lost connection does
  (the sends still waiting fail as ``connection_lost``): open a new one;
- completions (each item's ``on_done``) run in send order even if the broker confirms
  out of order: a confirm is recorded on its entry and entries are completed from the
  head of the send-ordered queue only.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.channel
import pika.exceptions
import pika.frame
import pika.spec
from pika.adapters.select_connection import IOLoop

from framework import amqp
from framework.errors import PublishError
from framework.reasons import Reason

log = logging.getLogger("txbox.confirms")

_PENDING: Any = object()  # outcome not known yet (None = confirmed)

TIMEOUT = "timeout"
OVERFLOW = "overflow"
CONNECTION_LOST = "connection_lost"
CLOSED = "closed"
UNENCODABLE = "unencodable"  # raised by Publisher.publish() itself: nothing was sent

NACK_STREAK = 3
"""Nacks in a row (no ack between) after which a channel gives itself up (_renew_after_nacks)."""

TIMEOUT_CHECK = 1.0  # seconds between looks for sends past their confirm timeout


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


#: What a :class:`ConfirmChannel` runs on its new channel before confirm mode.
Prepare = Callable[[pika.channel.Channel, Callable[[], None]], None]


class ConfirmChannel:
    """A connection and a confirm channel on ``ioloop``; all of it runs on the loop's thread.

    ``open()`` connects to the URL's nodes in turn (docs/explanation/operations.md, "A RabbitMQ
    cluster") and returns at once; ``on_change(channel)`` runs when the channel opened,
    broke (connection lost, the nodes all refused, a nack streak) or closed. ``publish``
    sends at once; ``on_completed(n)`` runs after each round of completions with their
    count. ``on_blocked`` gets the broker's reason when RabbitMQ blocks the connection (a
    memory or disk alarm) and None when it unblocks it or the connection ends.
    ``prepare(channel, done)``, if given, runs on the new channel before it enters confirm
    mode, and calls ``done()`` once what it sent was answered (the relay declares its
    topology there); a declaration RabbitMQ refuses breaks the channel, ``error`` the reason.
    """

    def __init__(
        self,
        amqp_url: str,
        ioloop: IOLoop,
        *,
        name: str,
        confirm_timeout: float,
        on_change: Callable[[ConfirmChannel], None],
        on_completed: Callable[[int], None] | None = None,
        on_blocked: Callable[[str | None], None] | None = None,
        prepare: Prepare | None = None,
    ) -> None:
        self.amqp_url = amqp_url
        self._prepare = prepare
        self.ioloop = ioloop
        self.name = name
        self.confirm_timeout = confirm_timeout
        self.state = "new"  # new → opening → open → closing → closed; or → broken
        self.error: BaseException | None = None
        self.blocked: str | None = None
        self._on_change = on_change
        self._on_completed = on_completed
        self._on_blocked = on_blocked
        self._nodes: Iterator[pika.ConnectionParameters] = iter(())
        self._conn: pika.SelectConnection | None = None
        self._channel: pika.channel.Channel | None = None
        self._timer: Any = None
        self._pending: deque[Outgoing] = deque()
        self._by_id: dict[str, Outgoing] = {}
        self._next_tag = 1
        self._nacks_in_a_row = 0
        self.in_callback = False  # True while an on_done runs (Publisher refuses to wait there)

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    @property
    def in_flight(self) -> int:
        """Sends published and not completed yet."""
        return len(self._pending)

    # ---- opening and closing ---------------------------------------------------------

    def open(self) -> None:
        """Start connecting; :attr:`state` is ``opening`` until ``on_change`` says otherwise."""
        assert self.state == "new", "a ConfirmChannel opens once; make a new one"
        self.state = "opening"
        self._nodes = iter(amqp.parameters_list(self.amqp_url, name=self.name))
        self._connect_next()

    def _connect_next(self) -> None:
        if self.state != "opening":
            return
        self._conn, refused = amqp.connect_on(
            self.ioloop, self._nodes, on_open=self._on_open, on_open_error=self._on_open_error, on_close=self._on_closed
        )
        if refused is not None:
            self.error = refused
        if self._conn is None:
            self._become("broken")

    def close(self) -> None:
        """Close the connection; sends still incomplete fail as ``closed`` when it has closed
        (the broker may or may not have them). A channel still opening stops trying."""
        if self.state in ("closed", "broken"):
            return
        self.state = "closing"
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.close()
        elif conn is None or conn.is_closed:
            self._fail_everything(PublishError("the channel closed before the broker confirmed", CLOSED))
            self._become("closed")
        # Still opening: pika cannot abort its connection workflow cleanly (closing one
        # mid-way raised from inside the loop), so _on_open closes it once it has opened,
        # and _on_open_error ends a failed one.

    def _become(self, state: str) -> None:
        self.state = state
        if self._timer is not None:
            self.ioloop.remove_timeout(self._timer)
            self._timer = None
        try:
            self._on_change(self)
        except Exception:
            log.exception("a channel state callback raised")

    def _on_open(self, conn: pika.SelectConnection) -> None:
        if self.state == "closing":  # closed while it opened (close)
            conn.close()
            return
        conn.add_on_connection_blocked_callback(self._on_connection_blocked)
        conn.add_on_connection_unblocked_callback(self._on_connection_unblocked)
        conn.channel(on_open_callback=self._on_channel)

    def _on_open_error(self, _conn: pika.SelectConnection, exc: BaseException) -> None:
        """This node did not answer: try the next one."""
        self.error = exc
        self._conn = None
        if self.state == "closing":
            self._become("closed")
            return
        self._connect_next()

    def _on_channel(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        if self._prepare is None:
            self._confirm_mode(channel)
            return
        try:
            self._prepare(channel, lambda: self._confirm_mode(channel))
        except Exception as exc:  # a bug of the caller's: this channel cannot be used
            log.exception("preparing the channel of %s failed", self.name)
            self._broken(exc)
            channel.close()

    def _confirm_mode(self, channel: pika.channel.Channel) -> None:
        current = self._channel
        if current is None or current is not channel or not current.is_open:
            return  # closed meanwhile (its close callback has run)
        current.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame: pika.frame.Method) -> None:
        if self.state != "opening":  # closed while the channel opened
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
            return
        self._timer = self.ioloop.call_later(TIMEOUT_CHECK, self._check_timeouts)
        self._become("open")

    def _on_connection_blocked(self, _conn: pika.SelectConnection, frame: pika.frame.Method) -> None:
        """RabbitMQ stopped reading our publishes (``connection.blocked``): sends wait for their
        confirm until it unblocks, or pika drops the connection after ``blocked_connection_timeout``
        (docs/explanation/receive.md, "Publishing blocked by the broker")."""
        reason = str(getattr(frame.method, "reason", "") or "resource alarm")
        log.warning("RabbitMQ blocks publishing on %s: %s", self.name, reason)
        self._set_blocked(reason)

    def _on_connection_unblocked(self, _conn: pika.SelectConnection, _frame: pika.frame.Method) -> None:
        log.info("RabbitMQ unblocked publishing on %s", self.name)
        self._set_blocked(None)

    def _set_blocked(self, reason: str | None) -> None:
        self.blocked = reason
        if self._on_blocked is not None:
            try:
                self._on_blocked(reason)
            except Exception:
                log.exception("a blocked-connection callback raised")

    def _on_closed(self, _conn: pika.SelectConnection, reason: BaseException) -> None:
        if self.blocked is not None:
            self._set_blocked(None)
        if self.state == "opening":  # the connection opened, then closed before confirm mode
            self.error = reason
            self._become("broken")
        elif self.state != "closing":
            self._broken(reason)
        else:
            self._fail_everything(PublishError("the channel closed before the broker confirmed", CLOSED))
            self._become("closed")

    def _on_channel_closed(self, _channel: pika.channel.Channel, reason: BaseException) -> None:
        if self.state not in ("closing", "closed", "broken"):
            self._broken(reason)
        if self._conn is not None and self._conn.is_open:
            self._conn.close()

    def _broken(self, reason: BaseException) -> None:
        if self.state == "broken":
            return
        self.state = "broken"
        self.error = reason
        log.warning("RabbitMQ connection of %s lost: %s", self.name, reason)
        self._fail_everything(
            PublishError(f"connection to RabbitMQ lost before the confirm ({reason})", CONNECTION_LOST)
        )
        self._become("broken")

    def _fail_everything(self, error: PublishError) -> None:
        for item in self._pending:
            if item.outcome is _PENDING:
                item.outcome = error
        self._complete_head()

    # ---- sending ---------------------------------------------------------------------

    def publish(self, items: list[Outgoing]) -> None:
        """Send ``items`` now; each completes through its ``on_done``. On a channel that is not
        open they complete at once as ``connection_lost``."""
        channel = self._channel
        if channel is None or not channel.is_open or self.state not in ("open", "closing"):
            self.refuse(items, PublishError("the channel is closed", CONNECTION_LOST))
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
            coalesce_writes(self._conn)

    def refuse(self, items: list[Outgoing], error: PublishError) -> None:
        """Complete ``items``, never sent, with ``error`` (after every send before them)."""
        for item in items:
            item.outcome = error
        self._pending.extend(items)
        self._complete_head()

    def _on_return(
        self,
        _channel: pika.channel.Channel | None,
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
        if self._nacks_in_a_row >= NACK_STREAK and self.state == "open":
            self._renew_after_nacks()

    def _renew_after_nacks(self) -> None:
        """Give up this channel after a streak of nacks; the owner opens a new one.

        A RabbitMQ 3.10 channel whose first publish to a quorum queue met a dead leader
        kept getting nacks after a new leader was elected, while a new channel got acks
        at once (docs/explanation/operations.md, "A RabbitMQ cluster"). The sends still waiting
        fail as connection_lost: not the messages' fault, so the relay releases them.
        """
        streak = self._nacks_in_a_row
        self._broken(PublishError(f"the broker nacked {streak} messages in a row; renewing the channel", Reason.NACKED))
        if self._conn is not None and self._conn.is_open:
            self._conn.close()

    def _check_timeouts(self) -> None:
        self._timer = None
        if self.state not in ("open", "closing"):
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
        self._timer = self.ioloop.call_later(TIMEOUT_CHECK, self._check_timeouts)

    def _complete_head(self) -> None:
        """Complete entries in send order, stopping at the first one still waiting."""
        pending = self._pending
        completed = 0
        self.in_callback = True
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
            self.in_callback = False
        if completed and self._on_completed is not None:
            self._on_completed(completed)


_COALESCED_CHUNK = 256 * 1024


def coalesce_writes(conn: pika.SelectConnection | None) -> None:
    """Join the frames a burst of publishes queued into few large writes.

    pika queues every frame of a message (method, header, body) as a buffer of its own
    and sends each with its own ``send()``: three system calls per message, and as many
    small TCP segments for the broker to read. Joined into chunks of up to 256 KB, a
    burst of 2,000 messages is a handful of system calls. This reaches into pika's
    transport (``_transport._tx_buffers``); with another pika that lacks it, nothing is
    joined and sending works as before. Runs on the loop's thread, which owns the transport.
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
