"""One consuming receiver per inbox queue; other replicas stand by
(docs/architecture.md, "Replicas of every daemon").

The receiver stores deliveries in the order they arrive and the worker orders a segment
by that order, so two receivers consuming one queue would interleave a segment's
messages. RabbitMQ's ways to have one consumer do not fit: single-active-consumer is a
queue argument (Mosaic declares the inbox queue too, and differing arguments are refused)
and not a policy key on 3.x, and an ``exclusive`` consume is not enforced on quorum
queues. So the turn is a PostgreSQL session advisory lock: the receiver that holds it
consumes; the others stay connected, topology declared, and try again every
:data:`POLL_SECONDS`. The lock ends with the holder's session, so a killed receiver's
turn passes on as soon as PostgreSQL sees its connection close.
"""

from __future__ import annotations

import time

from framework import db, names
from framework.connections import ConnectionSlot

#: Seconds between two looks at the lock: how soon a standby takes over, and how soon a
#: holder that lost its session notices that another replica took its turn.
POLL_SECONDS = 1.0


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

    def check(self) -> bool:
        self._checked_at = time.monotonic()
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
        return self.held

    def due(self) -> bool:
        """Whether :data:`POLL_SECONDS` have passed since the last check."""
        return time.monotonic() - self._checked_at >= POLL_SECONDS

    def still_held(self) -> bool:
        """For the consuming holder: False only when another replica holds the turn now.

        A database that cannot be reached counts as held: nobody else can take the lock
        then either (a replica that still can must also wait for our consumer to leave
        the queue), and the receiver's own path for a database that is down — the retry
        chain — keeps working.
        """
        try:
            return self.check()
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                raise
            return True

    def release(self) -> None:
        """Close the session, which ends the lock (never raises)."""
        self._slot.close()
        self.held = False
