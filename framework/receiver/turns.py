"""Whose turn it is to consume a service's inbox queue, and when a new holder may start
(docs/explanation/operations.md, "Replicas of every daemon" and "A RabbitMQ cluster").

The receiver stores deliveries in the order they arrive and the worker orders a segment
by that order, so two receivers consuming one queue would interleave a segment's
messages. RabbitMQ's ways to have one consumer do not fit: single-active-consumer is a
queue argument (Mosaic declares the inbox queue too, and differing arguments are refused)
and not a policy key on 3.x, and an ``exclusive`` consume is not enforced on quorum
queues. So the turn is a PostgreSQL session advisory lock (:class:`ConsumerTurn`): the
receiver that holds it consumes; the others stay connected, topology declared, and try
again every :data:`POLL_SECONDS`. The lock ends with the holder's session, so a killed
receiver's turn passes on as soon as PostgreSQL sees its connection close.

A new holder must not store anything before the deliveries the last holder still held
are back in the queue, so it waits while the broker counts another consumer — but only
for :attr:`Takeover.bound` seconds (:func:`takeover_seconds`): a quorum queue keeps the
consumer of a node that died until that node returns, which may be never. The bound
holds because a holder stops consuming on its own once it could not confirm its turn for
:data:`LEASE_SECONDS` (:meth:`ConsumerTurn.still_held`), and the broker closes a
connection it stopped hearing from after the heartbeat timeout; a node that died
returned its consumers' deliveries to the queue when the others saw it go.

The rule is plain state and arithmetic on a monotonic clock, owned by the thread that
consumes; nothing here blocks but the lock's own queries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from framework import db, names
from framework.connections import ConnectionSlot

#: Seconds between two looks at the lock: how soon a standby takes over, and how soon a
#: holder that lost its session notices that another replica took its turn.
POLL_SECONDS = 1.0
#: A holder that could not confirm its turn for this long (the database cannot be
#: reached) stops consuming, so that a replica that can reach it may take over.
LEASE_SECONDS = 5.0


def takeover_seconds(*, connect_timeout: float, drain_seconds: float, heartbeat_seconds: float) -> float:
    """How long a new holder waits at most for the other consumers the broker counts.

    The longest a receiver that lost its turn may still hold deliveries: it stops at its
    first check past :data:`LEASE_SECONDS` (one :data:`POLL_SECONDS` apart, each taking up
    to ``connect_timeout``), then waits up to ``drain_seconds`` for its copies' confirms
    and closes its channel; or, cut off from the broker too, until the broker closes its
    connection after ``heartbeat_seconds``. Every replica of a deployment is assumed to
    run with the same settings.
    """
    fenced = LEASE_SECONDS + POLL_SECONDS + connect_timeout + drain_seconds
    return max(fenced, heartbeat_seconds) + POLL_SECONDS


class ConsumerTurn:
    """The advisory lock of one service's inbox queue, on a connection of its own.

    :meth:`check` takes the lock when it is free and tells whether this process holds
    it. A lost session loses the lock with it: the next check connects again and tries
    to take it afresh, so a holder whose connection broke learns whether another replica
    took over meanwhile. Database errors propagate (the slot is closed first).
    """

    def __init__(self, database_url: str, service: str, *, connect_timeout: int) -> None:
        self.key = names.receiver_lock_key(service)
        self.held = False
        self._slot = ConnectionSlot(
            database_url, autocommit=True, connect_timeout=connect_timeout, application_name="txbox-receiver-turn"
        )
        self._checked_at = float("-inf")
        # When a check that found the turn ours began; None once it was found not ours,
        # or once the holder gave it up for want of a confirmation (still_held).
        self._confirmed_at: float | None = None

    def check(self) -> bool:
        started = self._checked_at = time.monotonic()
        try:
            conn = self._slot.get()
            if self.held:
                conn.execute("SELECT 1")  # the session is alive, so the lock is still ours
            else:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
                self.held = bool(row and row[0])
        except BaseException:
            self.release()
            raise
        self._confirmed_at = started if self.held else None
        return self.held

    def due(self) -> bool:
        """Whether :data:`POLL_SECONDS` have passed since the last check."""
        return time.monotonic() - self._checked_at >= POLL_SECONDS

    def still_held(self) -> bool:
        """For the consuming holder: False when another replica holds the turn now, or when
        the turn could not be confirmed for :data:`LEASE_SECONDS`.

        A database that cannot be reached counts as held for that long: nobody else can
        take the lock then either, and the receiver's own path for a database that is
        down — the retry chain — keeps working. Past it another replica may hold the
        turn without our knowing, and it starts within :func:`takeover_seconds` whatever
        the broker says, so we stop. A receiver that consumes without ever having
        confirmed its turn (it started while the database was down) is not stopped: it
        consumed only because the queue had no other consumer.
        """
        try:
            return self.check()
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                raise
            if self._confirmed_at is not None and time.monotonic() - self._confirmed_at >= LEASE_SECONDS:
                self._confirmed_at = None
                return False
            return True

    def release(self) -> None:
        """Close the session, which ends the lock (never raises)."""
        self._slot.close()
        self.held = False


@dataclass
class Takeover:
    """A holder's wait for the other consumers the broker counts on the queue.

    :meth:`ready` is asked on every look while the turn is held; :meth:`reset` when it
    is not (standing by, or the database cannot be reached, where the broker's count is
    the only guard and is waited for without a bound).
    """

    bound: float
    #: When this holder first saw the turn ours and another consumer on the queue.
    since: float | None = None

    def ready(self, others: int, now: float | None = None) -> bool:
        """Whether the holder may consume: no other consumer, or :attr:`bound` seconds of them."""
        if not others:
            self.since = None
            return True
        now = time.monotonic() if now is None else now
        if self.since is None:
            self.since = now
        return now - self.since >= self.bound

    def waited(self, now: float | None = None) -> float:
        """Seconds waited so far (0 when not waiting)."""
        if self.since is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.since

    def reset(self) -> None:
        self.since = None
