"""The daemons' connection lifecycle: one PostgreSQL connection opened on demand and closed
quietly, and the LISTEN thread that turns NOTIFY into a wake-up.

Reconnecting is the daemon loop's business (:class:`framework.daemon.Reconnect` waits
with capped backoff between tries; the next :meth:`ConnectionSlot.get` connects again);
these two keep the open/close and LISTEN code in one place for all daemons
(docs/architecture.md, "Daemons: one shape").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from framework import db
from framework.daemon import Daemon, Reconnect
from framework.errors import DatabaseUnavailable


class ConnectionSlot:
    """At most one raw psycopg connection: :meth:`get` (re)connects when there is none or it
    closed, :meth:`close` drops it without raising. ``options`` go to :func:`framework.db.connect`;
    ``on_connect`` prepares each new connection (say, registers loaders)."""

    def __init__(
        self,
        database_url: str,
        *,
        on_connect: Callable[[psycopg.Connection[Any]], None] | None = None,
        **options: Any,
    ) -> None:
        self._url = database_url
        self._on_connect = on_connect
        self._options = options
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def is_open(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def get(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            conn = db.connect(self._url, **self._options)
            if self._on_connect is not None:
                try:
                    self._on_connect(conn)
                except BaseException:
                    conn.close()
                    raise
            self._conn = conn
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection may fail: it is gone either way
                self._conn.close()
            self._conn = None


class Listener:
    """LISTEN on one channel in a thread of its own; each NOTIFY calls ``on_notify``.

    A notification is only a hint to look now: the daemon still polls, so a NOTIFY lost
    while the listener reconnects costs at most one poll interval. ``on_notify`` is also
    called right after each (re)connect, since rows may have arrived while nobody
    listened. :attr:`listening` is set while the LISTEN is in place. The thread ends when
    the daemon stops or :meth:`close` is called (a daemon whose loop failed).
    """

    def __init__(self, daemon: Daemon, channel: str, on_notify: Callable[[], None]) -> None:
        self._daemon = daemon
        self._statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
        self._on_notify = on_notify
        self.listening = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Listener:
        self._closed.clear()
        self._thread = threading.Thread(target=self._run, name=f"txbox {self._daemon.name} listen", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """End the thread (it notices within a second) and wait for it, at most ``timeout``."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _done(self) -> bool:
        return self._daemon.stopping or self._closed.is_set()

    def _run(self) -> None:
        retry = Reconnect(self._daemon)
        while not self._done():
            try:
                with db.connect(self._daemon.settings.database_url, autocommit=True) as conn:
                    conn.execute(self._statement)
                    retry.succeeded()
                    self.listening.set()
                    self._on_notify()
                    while not self._done():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self._on_notify()
            except (psycopg.Error, DatabaseUnavailable) as exc:
                self.listening.clear()
                if retry.failed("PostgreSQL (listen)", exc):
                    return
        self.listening.clear()
