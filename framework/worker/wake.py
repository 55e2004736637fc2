"""What wakes the worker between batches: its LISTEN connection, read on the loop it runs on.

No listener thread (docs/explanation/daemons.md, "Wake-ups"): the worker holds ``LISTEN
<schema>_inbox_insert`` on a connection of its own, whose socket is a handler of the
loop the worker was given (docs/explanation/daemons.md, "One loop per process"); the loop
calls the worker when NOTIFYs arrive, and :meth:`Notifications.drain` reads them
without blocking. When to claim after them is :class:`framework.wakeup.Pace`'s (the
window and the hold), kept by the worker as timers of that loop. Before each claim the
worker reads the NOTIFYs already on the socket: the claim's snapshot covers their rows,
so they wake no claim after it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from framework import db
from framework.worker.counts import Counts


class Notifications:
    """``LISTEN`` on a connection the loop owns, read without blocking; with ``help_channel``
    and ``lock_key``, one replica of a service listens on ``channel`` and the others on
    ``help_channel`` (docs/explanation/daemons.md, "Wake-ups" and "Replicas of every daemon").

    The *listener* is the replica whose LISTEN session holds the session advisory lock
    ``lock_key``: it LISTENs on ``channel`` (the inserts) and, when a claim of its came
    back full, :meth:`call_for_help` NOTIFYs ``help_channel``. The others LISTEN on
    ``help_channel`` only, claim at their poll interval, and :meth:`take_turn` takes the
    lock when it is free (the listener's session ended: a stop, a crash, a ``kill -9``,
    a broken connection), moving their LISTEN to ``channel``.

    A NOTIFY is only a hint to look now: the worker still polls, so one lost while the
    connection is down costs at most a poll interval. :meth:`open` says when it just
    (re)connected, since rows may have come while nobody listened. Every statement here
    is followed by a claim before the loop waits again, so a NOTIFY psycopg reads during
    one of them (and does not hand on) is for a row that claim sees.
    """

    def __init__(
        self,
        database_url: str,
        channel: str,
        *,
        help_channel: str | None = None,
        lock_key: int | None = None,
        counts: Counts | None = None,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self._url = database_url
        self._on_close = on_close  # called before the connection closes: its socket is still the one watched
        self._channel = sql.Identifier(channel)
        self._help = None if help_channel is None else sql.Identifier(help_channel)
        self._key = lock_key if help_channel is not None else None
        self._counts = counts or Counts()  # the statements sent here count with the worker's
        self._conn: psycopg.Connection[Any] | None = None
        self.leading = False  # this session holds the lock: it LISTENs on ``channel``
        self.tried_at = float("-inf")  # monotonic: the last try for the lock

    @property
    def listening(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def open(self) -> bool:
        """LISTEN if not listening (on ``channel`` if the lock was free or there is none,
        else on ``help_channel``); True if it just began (raises DatabaseUnavailable)."""
        if self.listening:
            return False
        self.close()
        conn = db.connect(self._url, autocommit=True, application_name="txbox-worker-listen")
        try:
            leading = self._key is None or self._try_lock(conn)
            self._execute(conn, sql.SQL("LISTEN {}").format(self._channel if leading else self._help))
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self.leading = leading
        return True

    def take_turn(self, every: float) -> bool:
        """For a replica that is not the listener, at most once per ``every`` seconds: take
        the lock if it is free and LISTEN on ``channel`` instead of ``help_channel``. True
        if this replica just became the listener (it must claim now: rows may have come
        while nobody listened). A broken connection is closed (:meth:`open` again)."""
        conn = self._conn
        now = time.monotonic()
        if self.leading or conn is None or self._help is None or now - self.tried_at < every:
            return False
        try:
            if not self._try_lock(conn):
                return False
            self._execute(conn, sql.SQL("UNLISTEN {}").format(self._help))
            self._execute(conn, sql.SQL("LISTEN {}").format(self._channel))
        except psycopg.OperationalError:
            self.close()
            return False
        self.leading = True
        return True

    def call_for_help(self) -> None:
        """The listener's claim came back full: NOTIFY ``help_channel``, so the others claim
        too. Nothing for a replica that is not the listener, or with no help channel."""
        conn = self._conn
        if not self.leading or conn is None or self._help is None:
            return
        try:
            self._execute(conn, sql.SQL("NOTIFY {}").format(self._help))
        except psycopg.OperationalError:  # the next open() listens again; the next poll claims
            self.close()

    def _try_lock(self, conn: psycopg.Connection[Any]) -> bool:
        self.tried_at = time.monotonic()
        row = self._execute(conn, sql.SQL("SELECT pg_try_advisory_lock({})").format(sql.Literal(self._key)))
        return bool(row and row[0])

    def _execute(self, conn: psycopg.Connection[Any], statement: sql.Composed) -> tuple[Any, ...] | None:
        self._counts.statements += 1
        cur = conn.execute(statement)
        return cur.fetchone() if cur.description else None

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
        """Close the session (which ends the lock, if it held it); ``on_close`` first."""
        if self._conn is not None:
            self._on_close()
            with contextlib.suppress(Exception):  # a broken connection may fail to close: gone either way
                self._conn.close()
            self._conn = None
        self.leading = False
