"""A batch's inbox INSERT and its commit, sent without waiting, on the consuming thread.

The receiver's one thread collects the next batch while this one is written
(docs/architecture.md, "The daemons and their threads"): :class:`InboxWrite` sends the
statement with libpq's pipeline mode on the daemon's own psycopg connection and is driven
by the readiness of that connection's socket, which the consuming loop watches on the
broker connection's own I/O loop beside the broker's socket (:meth:`InboxWrite.watch`).

A batch is one statement and one Sync: the INSERT runs in the implicit transaction of
the pipeline, and the Sync that follows it is its commit, so a batch costs two round
trips (the INSERT's result, then the commit) and no BEGIN or COMMIT statements. The Sync
is sent only once the INSERT's result is in and says every row was new. Anything else —
a duplicate id (an ``id_conflict`` letter may have to go into the same transaction), an
error the data caused — is not committed here: a ``BEGIN`` before the Sync turns the
implicit transaction into an ordinary open one (a duplicate: :attr:`InboxWrite.open`, the
rows inserted; the caller adds what else the batch needs and commits), or the Sync after
an error ends the aborted one (:attr:`InboxWrite.refused`: the caller writes the batch
again the careful way). A failure of the connection itself is :attr:`InboxWrite.error`.
"""

from __future__ import annotations

import select
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.errors
from psycopg import pq

from framework import db

_IDLE = pq.TransactionStatus.IDLE
_INSERT, _SYNC, _DONE = "insert", "sync", "done"


class InboxWrite:
    """One batch's INSERT (``statement``, one text parameter ``param``) on ``conn``, in flight.

    Start it with :meth:`send`; :meth:`advance` reads what arrived and sends the next step,
    and is called whenever the socket is readable (or writable, while :attr:`wants_write`);
    :attr:`done` tells when it is over. Then exactly one of: :attr:`error` (the database
    failed: the connection is broken and must be dropped), :attr:`refused` (PostgreSQL
    refused the statement: nothing was stored), or :attr:`new` (the ids inserted) with
    :attr:`open` telling whether the transaction still waits for the caller's commit.
    All on one thread; nothing here blocks but :meth:`wait`.
    """

    def __init__(self, conn: psycopg.Connection[Any], statement: bytes, param: bytes, on_done: Callable[[], None]):
        self._conn = conn
        self._pg = conn.pgconn
        self._statement = statement
        self._param = param
        self._on_done = on_done
        self._step = _INSERT
        self.wants_write = False
        self.new: set[uuid.UUID] = set()
        self.rows = 0  # rows in the batch, for the decision to commit
        self.open = False
        self.refused: psycopg.Error | None = None
        self.error: BaseException | None = None
        self.round_trips = 0
        self._ioloop: Any = None
        self._fileno = -1

    @property
    def fileno(self) -> int:
        return int(self._pg.socket)

    @property
    def done(self) -> bool:
        return self._step == _DONE

    def send(self, rows: int) -> None:
        """Send the INSERT and ask for its result; the connection must be idle, outside a transaction."""
        self.rows = rows
        try:
            if self._pg.transaction_status != _IDLE:
                self._conn.rollback()  # nothing of ours is open between batches; this is a guard
            self._pg.enter_pipeline_mode()
            self._pg.send_query_params(self._statement, [self._param])
            self._pg.send_flush_request()
            self.round_trips += 1
            self._flush()
        except psycopg.Error as exc:
            self._fail(exc)

    def advance(self) -> None:
        """Read what the server sent and take the next step; safe to call at any time."""
        if self._step == _DONE:
            return
        try:
            if self.wants_write:
                self._flush()
            self._pg.consume_input()
            ended = False  # the last result read was a query's end
            while self._step != _DONE and not self._pg.is_busy():
                result = self._pg.get_result()
                if result is None:
                    if self._step == _INSERT or ended:  # no result where one must come
                        raise psycopg.OperationalError("the pipelined inbox write lost its place")
                    ended = True
                    continue  # the end of the INSERT's results; the Sync was sent already
                ended = False
                self._result(result)
        except Exception as exc:  # called from the broker's I/O loop: never raises into it
            self._fail(exc)

    def watch(self, ioloop: Any) -> None:
        """Have ``ioloop`` (the broker connection's, :func:`framework.amqp.ioloop`) call
        :meth:`advance` when the socket is ready, until :attr:`done`."""
        self._ioloop, self._fileno = ioloop, self.fileno
        ioloop.add_handler(self._fileno, self._ready, ioloop.READ | (ioloop.WRITE if self.wants_write else 0))

    def unwatch(self) -> None:
        """Stop watching the socket (before the connection may be closed); idempotent."""
        ioloop, self._ioloop = self._ioloop, None
        if ioloop is not None:
            ioloop.remove_handler(self._fileno)

    def _ready(self, _fileno: int, _events: int) -> None:
        wanted = self.wants_write
        self.advance()
        if self.done:
            self.unwatch()
        elif self.wants_write != wanted and self._ioloop is not None:
            ioloop = self._ioloop
            ioloop.update_handler(self._fileno, ioloop.READ | (ioloop.WRITE if self.wants_write else 0))

    def wait(self, timeout: float = 1.0) -> None:
        """Block until :attr:`done`: for a caller that has nothing else to do meanwhile."""
        while not self.done:
            fileno = self.fileno
            select.select([fileno], [fileno] if self.wants_write else [], [], timeout)
            self.advance()

    # --- the steps ------------------------------------------------------------------

    def _result(self, result: pq.abc.PGresult) -> None:
        status = result.status
        if self._step == _INSERT:
            if status == pq.ExecStatus.TUPLES_OK:
                self.new = {uuid.UUID(bytes(result.get_value(i, 0) or b"").decode()) for i in range(result.ntuples)}
                if len(self.new) != self.rows:
                    # A duplicate: keep the transaction open for the caller's look at it.
                    self._pg.send_query_params(b"BEGIN", None)
                    self.open = True
            else:
                error = psycopg.errors.error_from_result(result, encoding=self._conn.info.encoding)
                if db.is_infrastructure_error(error):
                    raise error
                self.refused = error
            self._pg.pipeline_sync()
            self.round_trips += 1
            self._step = _SYNC
            self._flush()
        elif self._step == _SYNC and status == pq.ExecStatus.PIPELINE_SYNC:
            self._pg.exit_pipeline_mode()
            self._finish()
        elif status == pq.ExecStatus.FATAL_ERROR:  # the commit itself failed
            raise psycopg.errors.error_from_result(result, encoding=self._conn.info.encoding)

    def _flush(self) -> None:
        self.wants_write = self._pg.flush() == 1  # 1: the socket's buffer is full, more to send

    def _fail(self, exc: BaseException) -> None:
        """The write broke off: the connection's protocol state is unknown, so it must be dropped."""
        self.error = exc
        self._finish()

    def _finish(self) -> None:
        self._step = _DONE
        self.wants_write = False
        self._on_done()
