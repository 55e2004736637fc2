"""The receiver's publishing side: retry and dead-letter copies on a connection of their own.

A broker under a memory or disk alarm blocks every connection that publishes
(``connection.blocked``) and keeps delivering on connections that only consume. So the
receiver consumes on one connection and publishes its copies through a
:class:`~framework.confirms.Publisher` on a second one: while publishing is blocked, the
deliveries whose copy waits for its confirm stay unacked, and every other delivery is
stored and acked as usual (docs/explanation/receive.md, "Publishing blocked by the broker").

Everything here but the completion hand-over runs on the consuming thread: a copy's
completion (on the publisher's I/O thread) is handed to the consuming thread with the
consuming connection's ``add_callback_threadsafe``, so acks and nacks stay where pika
wants them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions

from framework.confirms import Publisher
from framework.errors import BrokerUnavailable, PublishError
from framework.reasons import Reason
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

    ``waiting`` holds the delivery tags whose copy is not confirmed yet: the consuming
    thread must not ack them with a ``multiple`` ack of a later tag (:meth:`ack`). A copy
    the broker nacks or cannot route requeues its delivery (as a same-connection copy
    always did); one whose connection was lost, or timed out, is published again on a new
    connection, so a delivery waits as long as publishing does, never dropped, never acked
    early.
    """

    def __init__(
        self,
        amqp_url: str,
        *,
        name: str,
        max_unconfirmed: int,
        on_blocked: Callable[[str | None], None],
    ) -> None:
        self._url = amqp_url
        self._name = name
        self._channel: Any = None
        self._connection: pika.BlockingConnection | None = None
        self._max_unconfirmed = max_unconfirmed
        self._on_blocked = on_blocked
        self._publisher: Publisher | None = None
        self._retry_at = 0.0
        self._unsent: list[Copy] = []  # to publish (again) once a publisher is open
        self.waiting: dict[int, Copy] = {}  # delivery tag → its copy, until confirmed

    def begin(self, connection: pika.BlockingConnection, channel: Any) -> None:
        """Start a session beside the consuming ``connection`` and ``channel``: open the
        publishing connection (BrokerUnavailable if it cannot be)."""
        self._connection, self._channel = connection, channel
        self._open()

    def _open(self) -> None:
        self._publisher = Publisher(
            self._url,
            name=self._name,
            # A blocked connection confirms nothing until the alarm clears: the copy waits
            # (pika drops a connection blocked for longer than blocked_connection_timeout,
            # and the copy goes again on a new one).
            confirm_timeout=float("inf"),
            # Copies in flight never outnumber the unacked deliveries (the prefetch): a
            # publish never waits for room, which would stall the consuming thread.
            max_unconfirmed=self._max_unconfirmed,
            on_blocked=self._on_blocked,
        ).start()

    def close(self) -> None:
        """End the session: copies still unconfirmed are forgotten (their deliveries are requeued
        by the broker with the consuming channel, and a copy confirmed after all is a duplicate
        the inbox drops)."""
        self.close_publisher()
        self._unsent = []
        self.waiting = {}
        self._connection = self._channel = None

    def send(self, copy: Copy) -> None:
        """Publish ``copy``; its delivery waits unacked until :attr:`Copy.on_confirmed` ran."""
        self.waiting[copy.delivery.delivery_tag] = copy
        self._unsent.append(copy)
        self.flush()

    def flush(self) -> None:
        """Publish what waits for a connection; called on every turn of the consuming loop."""
        if not self._unsent:
            return
        publisher = self._publisher
        if publisher is None or not publisher.is_open:
            if time.monotonic() < self._retry_at:
                return
            if publisher is not None:
                log.warning("the publishing connection was lost (%s): opening a new one", publisher.error)
                self.close_publisher()
            try:
                self._open()
            except BrokerUnavailable as exc:
                self._retry_at = time.monotonic() + REOPEN_WAIT
                log.warning("cannot open a publishing connection (%s): the copies wait", exc)
                return
            publisher = self._publisher
            assert publisher is not None
        unsent, self._unsent = self._unsent, []
        for index, copy in enumerate(unsent):
            try:
                publisher.publish(
                    copy.exchange,
                    copy.routing_key,
                    copy.delivery.body,
                    properties=copy.properties,
                    callback=functools.partial(self._completed, copy),
                )
            except PublishError:  # closed meanwhile: these go on the next connection
                self._unsent = unsent[index:] + self._unsent
                return

    def drain(self, timeout: float) -> None:
        """On a clean stop: let the copies in flight settle (bounded: a blocked broker confirms nothing),
        so their deliveries are acked rather than requeued beside a confirmed copy."""
        connection = self._connection
        deadline = time.monotonic() + timeout
        while self.waiting and connection is not None and (remaining := deadline - time.monotonic()) > 0:
            self.flush()
            connection.process_data_events(time_limit=min(remaining, 0.2))

    def close_publisher(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            with contextlib.suppress(Exception):
                publisher.close(timeout=0)
            if publisher.blocked is not None:
                self._on_blocked(None)

    def ack(self, group: list[Delivery]) -> None:
        """Ack ``group`` (stored): one ``multiple`` ack, unless that would ack a delivery whose copy waits."""
        last = group[-1].delivery_tag
        if not self.waiting or min(self.waiting) > last:
            self._channel.basic_ack(last, multiple=True)
            return
        for delivery in group:
            self._channel.basic_ack(delivery.delivery_tag)

    # --- completions ------------------------------------------------------------------

    def _completed(self, copy: Copy, future: Any) -> None:
        """On the publisher's I/O thread: hand the outcome to the consuming thread."""
        error = future.exception()
        connection = self._connection
        if connection is None:
            return
        with contextlib.suppress(pika.exceptions.ConnectionWrongStateError):  # the session ended
            connection.add_callback_threadsafe(functools.partial(self._settle, copy, error))

    def _settle(self, copy: Copy, error: BaseException | None) -> None:
        """On the consuming thread: ack the delivery, requeue it, or publish its copy again."""
        tag = copy.delivery.delivery_tag
        if self.waiting.get(tag) is not copy:
            return  # from an earlier session
        if isinstance(error, PublishError) and error.reason not in (Reason.NACKED, Reason.UNROUTABLE):
            # Lost connection, or closed under it: not the message's fault, publish it again.
            self._unsent.append(copy)
            return
        del self.waiting[tag]
        if error is not None:
            # No queue took the copy: keep the delivery in the inbox queue rather than lose it.
            log.error("%s refused a copy (%r): requeueing the delivery", copy.exchange or "(default)", error)
            self._channel.basic_nack(tag, requeue=True)
            return
        self._channel.basic_ack(tag)
        copy.on_confirmed()
