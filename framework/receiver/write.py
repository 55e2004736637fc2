"""A batch's inbox INSERT, with its commit, sent without waiting, on the receiver's loop.

The receiver collects the next batch while this one is written (docs/explanation/daemons.md,
"The daemons and their threads"): :class:`InboxWrite` sends the statement with libpq's
asynchronous calls on the daemon's own psycopg connection and is driven by the readiness
of that connection's socket, which the loop the receiver runs on watches beside the
broker's sockets (:meth:`InboxWrite.watch`). It is the one place that sends a batch's
statements and reports their results.

A batch is one round trip: its statements go out in one libpq pipeline ended by one
Sync, so they run in one implicit transaction that PostgreSQL commits before it answers.
Usually that is the INSERT alone; in `txbox run` also the hand-off's statements
(docs/explanation/daemons.md, "The hand-off in one process"). The INSERT
(:func:`framework.sql.inbox.insert_all_new_sql`) fails, and so stores nothing, unless
every row was new: a duplicate id may need an ``id_conflict`` letter in the same
transaction, so such a batch (:attr:`InboxWrite.refused`) is written again the ordinary
way, as is one PostgreSQL refuses for its data. A failure of the connection itself is
:attr:`InboxWrite.error`.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors
from psycopg import pq

from framework import db

_IDLE = pq.TransactionStatus.IDLE


@dataclass(frozen=True)
class Step:
    """One statement of a write: prepared as ``name`` from ``statement`` (the text, sent
    first on a connection that has not prepared it), run with ``params``."""

    name: bytes
    statement: bytes
    params: list[bytes | None]


class InboxWrite:
    """One batch's statements (``steps``: the INSERT, or in `txbox run` the hand-off's
    three) on ``conn``, in flight, in one round trip.

    They go out in one libpq pipeline ended by one Sync, so PostgreSQL runs them in one
    implicit transaction and commits it before it answers: all of them or none. A step
    whose name is not in ``prepared`` is prepared first, in the same pipeline (a lock on
    the table must not hold up the loop in a blocking PREPARE); :attr:`prepared` then
    names what the connection holds once the write is over.

    Start it with :meth:`send`; :meth:`advance` reads what arrived, and is called whenever
    the socket is readable (or writable, while :attr:`wants_write`); :attr:`done` tells
    when it is over, and ``on_done`` is called then, once. Then at most one of
    :attr:`error` (the database failed: the connection must be dropped) and
    :attr:`refused` (PostgreSQL refused a statement: nothing was stored, the connection
    is idle and usable) is set; neither means the batch is committed, and
    :attr:`results` holds each step's result, in order. All on one thread; nothing here
    blocks but :meth:`wait`, which the receiver never calls (a tool's, a test's).
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        steps: Sequence[Step],
        on_done: Callable[[], None],
        *,
        prepared: frozenset[bytes] = frozenset(),
    ) -> None:
        self._conn = conn
        self._pg = conn.pgconn
        self._steps = list(steps)
        self._preparing = [step for step in self._steps if step.name not in prepared]
        self.prepared = prepared  # and, once over, what this write prepared
        self._on_done = on_done
        self._answers: list[pq.abc.PGresult] = []  # one per command sent: the PREPAREs, then the steps
        self.results: list[pq.abc.PGresult] = []
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
        """Send the statements; the connection must be idle, outside a transaction."""
        try:
            if self._pg.transaction_status != _IDLE:
                self._conn.rollback()  # nothing of ours is open between batches; this is a guard
            self._pg.enter_pipeline_mode()
            for step in self._preparing:
                self._pg.send_prepare(step.name, step.statement)
            for step in self._steps:
                self._pg.send_query_prepared(step.name, list(step.params))
            self._pg.pipeline_sync()
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
            # In a pipeline each command's results end with a None; the Sync's result ends it all.
            while not self._pg.is_busy():
                result = self._pg.get_result()
                if result is None:
                    continue
                if result.status == pq.ExecStatus.PIPELINE_SYNC:
                    self._pg.exit_pipeline_mode()
                    self._end()
                    return
                self._answers.append(result)
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

    def _end(self) -> None:
        if len(self._answers) != len(self._preparing) + len(self._steps):
            self._fail(psycopg.OperationalError(f"the batch's pipeline returned {len(self._answers)} results"))
            return
        # A PREPARE outlives the transaction: the ones that took hold even if a step failed.
        answers = zip(self._preparing, self._answers, strict=False)
        self.prepared |= {step.name for step, answer in answers if answer.status == pq.ExecStatus.COMMAND_OK}
        failed = next((r for r in self._answers if r.status == pq.ExecStatus.FATAL_ERROR), None)
        if failed is not None:
            error = psycopg.errors.error_from_result(failed, encoding=self._conn.info.encoding)
            if db.is_infrastructure_error(error):
                self._fail(error)
                return
            self.refused = error
        else:
            self.results = self._answers[len(self._preparing) :]
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
