"""A batch's inbox INSERT, with its commit, sent without waiting, on the receiver's loop.

The receiver collects the next batch while this one is written (docs/explanation/daemons.md,
"The daemons and their threads"): :class:`InboxWrite` sends the statement with libpq's
asynchronous calls on the daemon's own psycopg connection and is driven by the readiness
of that connection's socket, which the loop the receiver runs on watches beside the
broker's sockets (:meth:`InboxWrite.watch`). It is the one place that sends a batch's
statements and reports their results.

A batch is one statement in one round trip: sent alone (libpq's extended protocol ends
it with a Sync), it runs in an implicit transaction that PostgreSQL commits before it
answers. The statement (:func:`framework.sql.inbox.insert_all_new_sql`) fails, and so
stores nothing, unless every row was new: a duplicate id may need an ``id_conflict``
letter in the same transaction, so such a batch (:attr:`InboxWrite.refused`) is written
again the ordinary way, as is one PostgreSQL refuses for its data. A failure of the
connection itself is :attr:`InboxWrite.error`.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.errors
from psycopg import pq

from framework import db

_IDLE = pq.TransactionStatus.IDLE


def prepare(conn: psycopg.Connection[Any], name: bytes, statement: bytes) -> None:
    """Prepare ``statement`` as ``name`` on ``conn`` (once per connection; blocking): a batch
    then sends only its parameters, and PostgreSQL does not parse it again each time."""
    result = conn.pgconn.prepare(name, statement)
    if result.status != pq.ExecStatus.COMMAND_OK:
        raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)


class InboxWrite:
    """One batch's INSERT (the statement prepared as ``name``, with its parameters
    ``params``) on ``conn``, in flight.

    With ``statement``, the connection has not prepared it yet: it is prepared first, sent
    without waiting too (one more round trip, once per connection: a lock on the table
    must not hold up the loop in a blocking PREPARE); :attr:`prepared` tells it was.

    Start it with :meth:`send`; :meth:`advance` reads what arrived, and is called whenever
    the socket is readable (or writable, while :attr:`wants_write`); :attr:`done` tells
    when it is over, and ``on_done`` is called then, once. Then at most one of
    :attr:`error` (the database failed: the connection must be dropped) and
    :attr:`refused` (PostgreSQL refused the statement: nothing was stored, the connection
    is idle and usable) is set; neither means the batch is committed. All on one thread;
    nothing here blocks but :meth:`wait`, which the receiver never calls (a tool's, a test's).
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        name: bytes,
        params: list[bytes],
        on_done: Callable[[], None],
        *,
        statement: bytes | None = None,
    ) -> None:
        self._conn = conn
        self._statement = statement
        self._preparing = False
        self.prepared = statement is None
        self._pg = conn.pgconn
        self._name = name
        self._params = params
        self._on_done = on_done
        self._result: pq.abc.PGresult | None = None
        self.done = False
        self.wants_write = False
        self.refused: psycopg.Error | None = None
        self.error: BaseException | None = None
        self._ioloop: Any = None
        self._fileno = -1

    @property
    def connection(self) -> psycopg.Connection[Any]:
        return self._conn

    @property
    def fileno(self) -> int:
        return int(self._pg.socket)

    def send(self) -> None:
        """Send the statement; the connection must be idle, outside a transaction."""
        try:
            if self._pg.transaction_status != _IDLE:
                self._conn.rollback()  # nothing of ours is open between batches; this is a guard
            if self._statement is not None:
                self._preparing = True
                self._pg.send_prepare(self._name, self._statement)
            else:
                self._pg.send_query_prepared(self._name, list(self._params))
            self._flush()
        except Exception as exc:
            self._fail(exc)

    def advance(self) -> None:
        """Read what the server sent; safe to call at any time."""
        if self.done:
            return
        try:
            if self.wants_write:
                self._flush()
            self._pg.consume_input()
            while not self._pg.is_busy():
                result = self._pg.get_result()
                if result is None:  # the statement's results are over
                    if self._preparing:
                        if not self._prepared():
                            return
                        continue
                    self._end()
                    return
                if self._result is None or result.status == pq.ExecStatus.FATAL_ERROR:
                    self._result = result
        except Exception as exc:  # called from the loop: never raises into it
            self._fail(exc)

    def watch(self, ioloop: Any) -> None:
        """Have ``ioloop`` (pika's ``IOLoop``, or :func:`framework.amqp.ioloop` of a blocking
        connection) call :meth:`advance` when the socket is ready, until :attr:`done`."""
        self._ioloop, self._fileno = ioloop, self.fileno
        ioloop.add_handler(self._fileno, self._ready, ioloop.READ | (ioloop.WRITE if self.wants_write else 0))

    def unwatch(self) -> None:
        """Stop watching the socket (before the connection may be closed); idempotent."""
        ioloop, self._ioloop = self._ioloop, None
        if ioloop is not None:
            # libpq closes the socket of a connection it found broken, which takes it out of
            # the poller already: pika forgets the handler first, then its unregister fails.
            with contextlib.suppress(OSError):
                ioloop.remove_handler(self._fileno)

    def wait(self, timeout: float = 1.0) -> None:
        """Block until :attr:`done`: for a caller that has nothing else to do meanwhile."""
        while not self.done:
            try:
                fileno = self.fileno
                select.select([fileno], [fileno] if self.wants_write else [], [], timeout)
            except Exception as exc:  # the connection is closed, or its socket
                self._fail(exc)
                return
            self.advance()

    # --- the steps ------------------------------------------------------------------

    def _ready(self, _fileno: int, _events: int) -> None:
        wanted = self.wants_write
        self.advance()
        if self.done:
            self.unwatch()
        elif self.wants_write != wanted and self._ioloop is not None:
            ioloop = self._ioloop
            try:
                ioloop.update_handler(self._fileno, ioloop.READ | (ioloop.WRITE if self.wants_write else 0))
            except Exception as exc:  # the last resort of a loop callback: the write fails, the loop goes on
                self.unwatch()
                self._fail(exc)

    def _prepared(self) -> bool:
        """The PREPARE answered: send the INSERT (True), or end as the INSERT would (False)."""
        result, self._result = self._result, None
        self._preparing = False
        if result is None or result.status != pq.ExecStatus.COMMAND_OK:
            self._result = result
            self._end()
            return False
        self.prepared = True
        self._pg.send_query_prepared(self._name, list(self._params))
        self._flush()
        return True

    def _end(self) -> None:
        result = self._result
        if result is None:
            self._fail(psycopg.OperationalError("the inbox INSERT returned no result"))
            return
        if result.status != pq.ExecStatus.TUPLES_OK:
            error = psycopg.errors.error_from_result(result, encoding=self._conn.info.encoding)
            if db.is_infrastructure_error(error):
                self._fail(error)
                return
            self.refused = error
        self._finish()

    def _flush(self) -> None:
        self.wants_write = self._pg.flush() == 1  # 1: the socket's buffer is full, more to send

    def _fail(self, exc: BaseException) -> None:
        """The write broke off: the connection's protocol state is unknown, so it must be dropped."""
        self.error = exc
        self._finish()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.wants_write = False
            self._on_done()
