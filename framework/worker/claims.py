"""The worker's claim connection: claims sent and collected on the worker's own thread.

A claim is one statement in autocommit, so it commits in the round trip that returns its
rows (docs/explanation/handle.md, "Worker batches"). Under a backlog the worker sends the next
claim before it runs the batch in hand and collects the rows after it, so PostgreSQL
claims while Python handles: libpq's asynchronous calls (send, then read the result
when the batch is done) instead of a thread that would block in the call. At most one
claim is in flight, and nothing else runs on this connection meanwhile.

The two claim statements are prepared once per connection under names of their own, so
PostgreSQL parses them once; psycopg's own statement preparation is off on this
connection (``prepare_threshold=None``), so it never deallocates them.
"""

from __future__ import annotations

import select
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer

from framework.connections import ConnectionSlot
from framework.errors import DatabaseUnavailable
from framework.sql import positional
from framework.worker import decode

_OK = pq.ExecStatus.TUPLES_OK


@dataclass(frozen=True)
class Statement:
    """A claim statement prepared under ``name``; parameters ``$1`` limit, ``$2`` lease seconds."""

    name: bytes
    text: bytes


def statement(name: str, rendered: bytes) -> Statement:
    """A rendered claim (``%(limit)s``, ``%(lease)s``) as a statement with ``$n`` parameters."""
    return Statement(name.encode(), positional(rendered, ("limit", "lease"), {"limit": "int8", "lease": "float8"}))


@dataclass(frozen=True)
class _InFlight:
    conn: psycopg.Connection[Any]
    statement: Statement
    claimed_at: float  # time.monotonic() before it was sent: the lease runs from here


class Claims:
    """Claims on one autocommit connection (``synchronous_commit`` off: a claim is a lease,
    not a result; a lost one only leaves the row to be claimed again, and the batch's own
    commit, synchronous and later in the WAL, makes it durable before any handler's writes
    are). :meth:`claim` runs one now; :meth:`send` and :meth:`collect` run one ahead."""

    def __init__(self, database_url: str, lease: float) -> None:
        self._slot = ConnectionSlot(
            database_url,
            on_connect=self._prepare,
            autocommit=True,
            synchronous_commit=False,
            prepare_threshold=None,
            application_name="txbox-worker-claim",
        )
        self._lease = str(float(lease)).encode()
        self._statements: list[Statement] = []
        self._transformer: Any = None  # psycopg.adapt.Transformer (a variable, not a type, to mypy)
        self._in_flight: _InFlight | None = None

    def register(self, *statements: Statement) -> None:
        """Statements to prepare on each new connection (before the first claim)."""
        self._statements.extend(statements)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def is_open(self) -> bool:
        return self._slot.is_open

    def connection(self) -> psycopg.Connection[Any]:
        """The claim connection (opened if need be); not while a claim is in flight."""
        assert self._in_flight is None, "a claim is in flight on the claim connection"
        return self._slot.get()

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        # One row that does not decode must not fail the claim (decode.register).
        decode.register(conn.adapters)
        for s in self._statements:
            result = conn.pgconn.prepare(s.name, s.text)
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        self._transformer = Transformer(conn)

    def claim(self, which: Statement, limit: int) -> tuple[float, list[tuple[Any, ...]]]:
        """Claim now: (the moment the lease began, the rows in priority then arrival order)."""
        self.send(which, limit)
        return self.collect()

    def send(self, which: Statement, limit: int) -> None:
        """Send a claim and return at once; :meth:`collect` reads its rows."""
        conn = self.connection()
        claimed_at = time.monotonic()
        pgconn = conn.pgconn
        try:
            pgconn.send_query_prepared(which.name, [str(limit).encode(), self._lease])
            while pgconn.flush():  # a claim is small: the socket takes it at once but under pressure
                _wait(pgconn, select.POLLOUT, None)
        except psycopg.OperationalError:
            self.close()
            raise
        self._in_flight = _InFlight(conn, which, claimed_at)

    def collect(self, timeout: float | None = None) -> tuple[float, list[tuple[Any, ...]]]:
        """The rows of the claim in flight (waiting for them at most ``timeout``, then the
        connection is dropped and the claim's rows wait out their lease)."""
        sent, self._in_flight = self._in_flight, None
        assert sent is not None, "no claim in flight"
        conn = sent.conn  # the one the claim went out on, even if it broke since
        pgconn = conn.pgconn
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        try:
            pgconn.consume_input()
            while True:
                while pgconn.is_busy():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise DatabaseUnavailable(f"no answer to a claim within {timeout:g}s")
                    _wait(pgconn, select.POLLIN, left)
                    pgconn.consume_input()
                result = pgconn.get_result()
                if result is None:
                    break
                results.append(result)
        except (psycopg.OperationalError, DatabaseUnavailable):
            self.close()
            raise
        if len(results) != 1:
            self.close()
            raise DatabaseUnavailable(f"a claim got {len(results)} results instead of one")
        [result] = results
        if result.status != _OK:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        assert self._transformer is not None
        self._transformer.set_pgresult(result)
        rows: list[tuple[Any, ...]] = self._transformer.load_rows(0, result.ntuples, tuple)
        rows.sort(key=_claim_order)
        return sent.claimed_at, rows

    def close(self) -> None:
        self._in_flight = None
        self._transformer = None
        self._slot.close()


def _wait(pgconn: pq.abc.PGconn, events: int, timeout: float | None) -> None:
    poll = select.poll()
    poll.register(pgconn.socket, events)
    poll.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))


def _claim_order(row: tuple[Any, ...]) -> tuple[Any, Any]:
    return -row[-2], row[-1]  # priority, created_at (the last two of CLAIM_COLUMNS)
