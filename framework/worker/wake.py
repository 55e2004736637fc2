"""What the worker's loop sleeps on, on its own thread: its LISTEN connection and a stop alarm.

No listener thread (docs/architecture.md, "Wake-ups"): the loop holds ``LISTEN
<schema>_inbox_insert`` on a connection of its own and, between batches, waits with
``poll`` on that connection's socket and on :class:`Alarm`, a socket pair whose one
cross-thread use is :meth:`Alarm.ring` (a stop from a signal handler or from ``txbox
run``'s supervisor writes one byte). :class:`LoopWakeup` is :class:`framework.wakeup.Wakeup`
(its windows and holds) waiting on those sockets instead of on an event another thread
sets. Before each claim the loop reads the NOTIFYs already on the socket and clears the
wake-up: the claim's snapshot covers their rows, so they wake no claim after it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from framework import db
from framework.wakeup import HOLD_MAX, Wakeup


class Alarm:
    """A socket pair: :meth:`ring` from any thread (a signal handler too) makes :meth:`fileno` readable."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def ring(self) -> None:
        with contextlib.suppress(OSError):  # full (a byte is there already) or closed (stopped)
            self._write.send(b"\0")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while self._read.recv(512):
                pass

    def close(self) -> None:
        self._read.close()
        self._write.close()


class Notifications:
    """``LISTEN channel`` on a connection the loop owns, read without blocking.

    A NOTIFY is only a hint to look now: the worker still polls, so one lost while the
    connection is down costs at most a poll interval. :meth:`open` says when it just
    (re)connected, since rows may have come while nobody listened.
    """

    def __init__(self, database_url: str, channel: str) -> None:
        self._url = database_url
        self._statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def listening(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def open(self) -> bool:
        """LISTEN if not listening; True if it just began (raises DatabaseUnavailable)."""
        if self.listening:
            return False
        self.close()
        conn = db.connect(self._url, autocommit=True, application_name="txbox-worker-listen")
        try:
            conn.execute(self._statement)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return True

    def fileno(self) -> int | None:
        return self._conn.pgconn.socket if self.listening and self._conn is not None else None

    def drain(self) -> int:
        """The NOTIFYs that arrived; on a broken connection it is closed and -1 returned."""
        conn = self._conn
        if conn is None:
            return 0
        pgconn = conn.pgconn
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            self.close()
            return -1
        count = 0
        while pgconn.notifies() is not None:
            count += 1
        return count

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close: gone either way
                self._conn.close()
            self._conn = None


class LoopWakeup(Wakeup):
    """:class:`Wakeup` for a loop that reads its own NOTIFYs and alarm (module docstring).

    :meth:`poll` blocks at most its seconds on the loop's sockets and turns what came into
    :meth:`notify` (one per NOTIFY, for the gaps' running mean) and :meth:`set` (the
    alarm); :meth:`wait` keeps :meth:`Wakeup.wait`'s meaning, waiting with :meth:`poll`.
    Everything here runs on the loop's thread.
    """

    def __init__(
        self,
        stop_event: threading.Event,
        notifications: Notifications,
        alarm: Alarm,
        *,
        hold_max: float = HOLD_MAX,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(stop_event, hold_max=hold_max)
        self._notifications = notifications
        self._alarm = alarm
        self._on_lost = on_lost

    def poll(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a NOTIFY or the alarm; take in what came."""
        poller = select.poll()
        poller.register(self._alarm.fileno(), select.POLLIN)
        listen = self._notifications.fileno()
        if listen is not None:
            poller.register(listen, select.POLLIN)
        ready = poller.poll(max(0, int(seconds * 1000 + 0.999)) if seconds > 0 else 0)
        for fd, _ in ready:
            if fd == listen:
                self.take_notifies()
            else:
                self._alarm.drain()
                self.set()

    def take_notifies(self) -> None:
        """Read the NOTIFYs on the socket now (without waiting)."""
        count = self._notifications.drain()
        if count < 0:  # the LISTEN connection broke: look now, and listen again before the next wait
            self._on_lost()
            self.set()
        for _ in range(count):
            self.notify()

    def wait(self, timeout: float) -> bool:
        """As :meth:`Wakeup.wait`: until a NOTIFY (after the hold, then the window), a
        :meth:`set`, a stop or ``timeout``; False if the timeout ran out."""
        deadline = time.monotonic() + timeout
        self.poll(0)  # what came during the cycle: it makes this no sleep
        slept = not self._event.is_set()
        self.woken_from_sleep = False
        while not self._event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(left)
        if self._kicked or self._stop.is_set():
            return True
        self.woken_from_sleep = slept
        now = time.monotonic()
        delay = self.pace.delay(now, from_sleep=slept)  # woken from sleep: let the burst grow a little
        if delay > 0:
            end = now + min(delay, max(0.0, deadline - now))
            while not self._stop.is_set() and not self._kicked:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.poll(left)
        return True
