"""The receiver's publishing side: retry and dead-letter copies on a connection of their own.

A broker under a memory or disk alarm blocks every connection that publishes
(``connection.blocked``) and keeps delivering on connections that only consume. So the
receiver consumes on one connection and publishes its copies on a
:class:`~framework.confirms.channel.ConfirmChannel` of their own, on the same loop:
while publishing is blocked, the deliveries whose copy waits for its confirm stay
unacked, and every other delivery is stored and acked as usual (docs/explanation/receive.md,
"Publishing blocked by the broker"). Everything here runs on the loop's thread, confirms
and acks included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
from pika.adapters.select_connection import IOLoop

from framework.confirms.channel import ConfirmChannel, Outgoing
from framework.errors import PublishError
from framework.reasons import Reason
from framework.receiver.consumer import Consumer
from framework.receiver.intake import Delivery

log = logging.getLogger("txbox.receiver.copies")

REOPEN_WAIT = 1.0
"""Seconds between tries to open a new publishing connection after one was lost."""


@dataclass(slots=True, eq=False)
class Copy:
    """One delivery's copy: where it goes, and what to do once the broker confirmed it."""

    delivery: Delivery
    exchange: str
    routing_key: str
    properties: pika.BasicProperties
    on_confirmed: Callable[[], None]


class Copies:
    """The copies of one consuming session, each holding its delivery unacked until confirmed.

    ``waiting`` holds the delivery tags whose copy is not confirmed yet: the receiver must
    not ack them with a ``multiple`` ack of a later tag (:meth:`ack`). A copy the broker
    nacks or cannot route requeues its delivery; one whose connection was lost is
    published again on a new connection, opened at most every :data:`REOPEN_WAIT`, so a
    delivery waits as long as publishing does, never dropped, never acked early.
    ``on_blocked`` hears RabbitMQ block (its reason) and unblock (None) the connection;
    ``on_settled`` runs after a copy's delivery was acked or requeued.
    """

    def __init__(
        self,
        amqp_url: str,
        loop: IOLoop,
        *,
        name: str,
        on_blocked: Callable[[str | None], None],
        on_settled: Callable[[], None],
    ) -> None:
        self._url = amqp_url
        self._loop = loop
        self._name = name
        self._on_blocked = on_blocked
        self._on_settled = on_settled
        self._consumer: Consumer | None = None
        self._channel: ConfirmChannel | None = None
        self._opened_at = float("-inf")  # monotonic: the last open, for REOPEN_WAIT
        self._reopen: Any = None  # the timer of the next open
        self._unsent: list[Copy] = []  # to publish (again) once a channel is open
        self.waiting: dict[int, Copy] = {}  # delivery tag → its copy, until confirmed

    def begin(self, consumer: Consumer) -> None:
        """Start a session beside ``consumer``, whose deliveries the copies settle; opens
        the publishing connection (its copies wait for it)."""
        self._consumer = consumer
        if self._channel is None or self._channel.state not in ("opening", "open"):
            self._open()

    def close(self) -> None:
        """End the session: copies still unconfirmed are forgotten (their deliveries are requeued
        by the broker with the consuming channel, and a copy confirmed after all is a duplicate
        the inbox drops)."""
        self._consumer = None
        self._unsent = []
        self.waiting = {}
        if self._reopen is not None:
            self._loop.remove_timeout(self._reopen)
            self._reopen = None
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
            if channel.blocked is not None:
                self._on_blocked(None)

    def send(self, copy: Copy) -> None:
        """Publish ``copy``; its delivery waits unacked until :attr:`Copy.on_confirmed` ran."""
        self.waiting[copy.delivery.delivery_tag] = copy
        self._unsent.append(copy)
        self.flush()

    def flush(self) -> None:
        """Publish what waits for a channel, opening one if none is open or opening."""
        if not self._unsent or self._consumer is None:
            return
        channel = self._channel
        if channel is None or channel.state not in ("opening", "open"):
            self._open_soon()
            return
        if not channel.is_open:
            return  # its opening publishes them (_changed)
        unsent, self._unsent = self._unsent, []
        channel.publish(
            [
                Outgoing(
                    copy.exchange, copy.routing_key, copy.delivery.body, copy.properties, token=copy, on_done=self._done
                )
                for copy in unsent
            ]
        )

    def ack(self, group: list[Delivery], below: int | None = None) -> None:
        """Ack ``group`` (stored): one ``multiple`` ack, unless that would ack a delivery whose
        copy waits, or one not yet stored (``below``: the lowest tag of those, if any)."""
        consumer = self._consumer
        if consumer is None:
            return
        last = group[-1].delivery_tag
        if (not self.waiting or min(self.waiting) > last) and (below is None or below > last):
            consumer.ack(last, multiple=True)
            return
        for delivery in group:
            consumer.ack(delivery.delivery_tag)

    # ---- the channel -------------------------------------------------------------------

    def _open(self) -> None:
        self._opened_at = time.monotonic()
        self._channel = ConfirmChannel(
            self._url,
            self._loop,
            name=self._name,
            # A blocked connection confirms nothing until the alarm clears: the copy waits
            # (pika drops a connection blocked for longer than blocked_connection_timeout,
            # and the copy goes again on a new one).
            confirm_timeout=float("inf"),
            on_change=self._changed,
            on_blocked=self._blocked,
        )
        self._channel.open()

    def _open_soon(self) -> None:
        if self._reopen is not None:
            return
        delay = self._opened_at + REOPEN_WAIT - time.monotonic()
        if delay <= 0:
            self._open()
        else:
            self._reopen = self._loop.call_later(delay, self._reopen_due)

    def _reopen_due(self) -> None:
        self._reopen = None
        if self._consumer is not None and self._unsent:
            self._open()

    def _changed(self, channel: ConfirmChannel) -> None:
        if channel is not self._channel:
            return
        if channel.is_open:
            self.flush()
            return
        if channel.state == "broken":
            if self._unsent or self.waiting:
                log.warning("the publishing connection was lost (%s): opening a new one", channel.error)
            else:
                log.warning("cannot open a publishing connection (%s): the copies wait", channel.error)
            self._channel = None
            self.flush()

    def _blocked(self, reason: str | None) -> None:
        self._on_blocked(reason)

    def _done(self, item: Outgoing, error: PublishError | None) -> None:
        """A copy's outcome: ack the delivery, requeue it, or publish its copy again."""
        copy: Copy = item.token
        tag = copy.delivery.delivery_tag
        if self.waiting.get(tag) is not copy or self._consumer is None:
            return  # from an earlier session
        if error is not None and error.reason not in (Reason.NACKED, Reason.UNROUTABLE):
            # Lost connection, or closed under it: not the message's fault, publish it again.
            self._unsent.append(copy)
            self.flush()
            return
        del self.waiting[tag]
        if error is not None:
            # No queue took the copy: keep the delivery in the inbox queue rather than lose it.
            log.error("%s refused a copy (%r): requeueing the delivery", copy.exchange or "(default)", error)
            self._consumer.nack(tag)
        else:
            self._consumer.ack(tag)
            copy.on_confirmed()
        self._on_settled()
