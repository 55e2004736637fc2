"""The daemons' connection lifecycle: one PostgreSQL connection opened on demand and closed quietly.

Reconnecting is the daemon loop's business: it schedules the next try on a timer
(:func:`framework.backoff.reconnect_seconds`), and the next :meth:`ConnectionSlot.get`
connects again. Each daemon's loop LISTENs on a connection it
owns (docs/explanation/daemons.md, "One thread per daemon").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import psycopg

from framework import db


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
