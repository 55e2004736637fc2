"""Outbox rows that travel with the caller's COMMIT (docs/explanation/write.md, "Outbox writes").

A one-row business transaction is a few round trips: BEGIN, its statement and COMMIT.
An outbox INSERT of its own would be one more, and parsing and planning a wide INSERT
is a large part of what it costs PostgreSQL (benchmarks/README.md, "2026-11-24,
morning", the outbox write). So a row written at the top level of a transaction waits
here and goes out with the COMMIT in one libpq pipeline:
``[Close, Parse,] Bind/Execute ... COMMIT, Sync``, one round trip, executing a statement
prepared once per connection. It is still the caller's transaction: the rows commit
exactly when the business data does, and a failing INSERT aborts the pipeline, so the
COMMIT never runs and nothing commits without its messages. The setting
``TXBOX_OUTBOX_COMMIT_PIPELINE`` (default true) turns this off: then every row is the
plain INSERT at once, the fallback used wherever the pipeline cannot be.

A row is only held back where the commit is sure to pass SQLAlchemy's ``commit`` event:
a psycopg connection (libpq with pipeline mode) inside a plain (not two-phase)
transaction that is not in autocommit mode. Everywhere else the caller inserts it at
once (:func:`hold` says which). Rows still held when a SAVEPOINT starts are inserted
before it, so rolling back to the savepoint cannot take them along; rows written inside
a savepoint go in at once, after any held ones, so a segment keeps the order in which
its messages were written.

Rows are kept per transaction object, so a rolled-back transaction's rows can never
reach another transaction on the same pooled connection.

An asyncio connection (SQLAlchemy's ``AsyncConnection`` with psycopg) runs
these same listeners inside SQLAlchemy's greenlet; the pipeline then waits for the
socket on the event loop (docs/explanation/write.md, "Async outbox"). Its writer does no I/O
of its own, so rows written inside a savepoint are held too (``savepoints=True``): they
are inserted in one pipeline just before its RELEASE, and dropped when it rolls back.

The prepared statement lives in the database session, where others can drop it: psycopg
sends ``DEALLOCATE ALL`` after a rollback or DDL once it has prepared statements of its
own, and anyone may run ``DISCARD ALL``. Whenever one of those may have happened (seen
through SQLAlchemy's events) the statement is closed and prepared again with the next
commit, in the same round trip. Connections with ``prepare_threshold=None`` (psycopg's
setting for poolers in transaction mode) get an unnamed statement every time.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import select
import threading
import uuid
import weakref
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import capabilities, pq
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.base import RootTransaction, Transaction
from sqlalchemy.exc import DBAPIError
from sqlalchemy.util import await_only

from framework.sql import outbox as outbox_sql

_PIPELINE = capabilities.has_pipeline()
# Closing a statement that may or may not exist is no error only at the protocol level.
_NAMED = _PIPELINE and capabilities.has_send_close_prepared()
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
# Command tags after which the session's prepared statements may be gone: psycopg
# deallocates all of its own (and so ours) after these, and the last two do it outright.
_DEALLOCATING = re.compile(r"(?:DROP|ALTER|ROLLBACK|DISCARD ALL|DEALLOCATE)\b").match


@dataclass(frozen=True, slots=True)
class _Insert:
    """One INSERT with ``$n`` parameters (or another statement held for the COMMIT: the
    worker's commit guard DELETE) and the name it is prepared under."""

    name: bytes
    text: bytes

    @property
    def shown(self) -> str:
        """The statement as error messages name it: without values (payloads, tokens)."""
        head, values, _ = self.text.decode().partition(" VALUES ")
        return head + " VALUES (...)" if values else head


# A held row: its statement and its parameters in libpq's text format.
_Row = tuple[_Insert, list[bytes | None]]

_Raw = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
# Held rows per transaction: the root one, or (asyncio writers only) a savepoint.
_held: weakref.WeakKeyDictionary[Transaction, list[_Row]] = weakref.WeakKeyDictionary()
# Statements known to be prepared in each session; absent or empty: close and prepare.
_prepared: weakref.WeakKeyDictionary[_Raw, set[bytes]] = weakref.WeakKeyDictionary()
_hooked: weakref.WeakSet[Engine] = weakref.WeakSet()
_hook_lock = threading.Lock()


def hold(conn: Connection, insert: str, values: dict[str, Any], *, savepoints: bool = False) -> bool:
    """Keep one row for the COMMIT of ``conn``'s transaction; False: insert it now yourself.

    ``insert`` is the table's INSERT with ``$n`` parameters (framework/sql/outbox.py),
    ``values`` its parameters in that order (JSON columns already serialized to text).
    With ``savepoints`` a row written inside a savepoint is held for its RELEASE.
    """
    txn = conn.get_transaction()
    nested = conn.get_nested_transaction()
    if (
        not _PIPELINE
        or type(txn) is not RootTransaction
        or (nested is not None and not savepoints)
        or conn.dialect.driver != "psycopg"  # blocking or asyncio
    ):
        return False
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection | psycopg.AsyncConnection) or raw.autocommit:
        return False
    statement = _statement(insert)
    try:
        params = _params(raw, values.values())
    except psycopg.Error as exc:  # a value PostgreSQL cannot take, e.g. text with a NUL
        raise DBAPIError.instance(statement.shown, None, exc, psycopg.Error, dialect=conn.dialect) from exc
    _hook(conn.engine)
    _held.setdefault(nested or txn, []).append((statement, params))
    return True


def write(conn: Connection, schema: str, values: dict[str, Any], *, pipeline: bool = True) -> None:
    """Write one outbox row in ``conn``'s transaction: held for the COMMIT where it can
    be (``pipeline``), else the plain INSERT at once."""
    if not (pipeline and hold(conn, outbox_sql.insert_text(schema), values)):
        write_held(conn)  # rows written earlier go first
        conn.exec_driver_sql(outbox_sql.insert_pyformat(schema), values)


def write_held(conn: Connection) -> None:
    """Insert the rows held for ``conn``'s innermost transaction now (without committing)."""
    txn = conn.get_nested_transaction() or conn.get_transaction()
    rows = _held.pop(txn, None) if txn is not None else None
    if rows:
        _send(conn, rows, commit=False)


def _hook(engine: Engine) -> None:
    # Listeners on the engine reach connections it already handed out: SQLAlchemy joins
    # a connection's events to its engine's and checks the engine at each commit.
    if engine in _hooked:
        return
    with _hook_lock:
        if engine not in _hooked:
            event.listen(engine, "commit", _on_commit)
            event.listen(engine, "savepoint", _on_savepoint)
            event.listen(engine, "release_savepoint", _on_release_savepoint)
            event.listen(engine, "rollback_savepoint", _on_rollback_savepoint)
            event.listen(engine, "rollback", _on_rollback)
            event.listen(engine, "after_cursor_execute", _on_statement)
            event.listen(engine, "reset", _on_reset)
            _hooked.add(engine)


def _on_commit(conn: Connection) -> None:
    txn = conn.get_transaction()
    rows = _held.pop(txn, None) if txn is not None else None
    if rows:
        # psycopg's own commit(), which SQLAlchemy calls next, finds the transaction
        # already closed and sends nothing.
        _send(conn, rows, commit=True)


def _on_savepoint(conn: Connection, name: str | None) -> None:
    # The new savepoint is not the connection's innermost transaction yet.
    write_held(conn)


def _on_release_savepoint(conn: Connection, name: str, context: None) -> None:
    write_held(conn)  # the savepoint being released is still the innermost transaction


def _on_rollback_savepoint(conn: Connection, name: str, context: None) -> None:
    nested = conn.get_nested_transaction()
    if nested is not None:
        _held.pop(nested, None)


def _on_rollback(conn: Connection) -> None:
    txn = conn.get_transaction()
    if txn is not None:
        _held.pop(txn, None)
    _forget_if_open(conn.connection.driver_connection)


def _on_reset(dbapi_connection: Any, record: Any, state: Any) -> None:
    # The pool rolls back what its borrower left open. An asyncio engine's pool holds
    # SQLAlchemy's adapter around the psycopg connection.
    _forget_if_open(getattr(dbapi_connection, "driver_connection", dbapi_connection))


def _on_statement(conn: Connection, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
    # SQLAlchemy's asyncio cursor adapter does not pass psycopg's command tag on: the
    # statement's first word tells the same for the statements that matter.
    status = getattr(cursor, "statusmessage", None) or statement[:64].lstrip().upper()
    if status and _DEALLOCATING(status):
        _forget(conn.connection.driver_connection)


def _forget_if_open(raw: Any) -> None:
    # psycopg sends ROLLBACK (and may then deallocate) only for an open transaction.
    if (
        isinstance(raw, psycopg.Connection | psycopg.AsyncConnection)
        and raw.info.transaction_status != pq.TransactionStatus.IDLE
    ):
        _forget(raw)


def _forget(raw: Any) -> None:
    if isinstance(raw, psycopg.Connection | psycopg.AsyncConnection):
        _prepared.pop(raw, None)


def _send(conn: Connection, rows: list[_Row], *, commit: bool) -> None:
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection | psycopg.AsyncConnection)
    shown = ";\n".join(dict.fromkeys(statement.shown for statement, _ in rows)) + (";\nCOMMIT" if commit else "")
    try:
        if isinstance(raw, psycopg.AsyncConnection):
            # Inside SQLAlchemy's greenlet (every listener of an AsyncConnection runs
            # there): wait on the event loop, as the driver's own statements do.
            results, names = await_only(_pipeline_async(raw, rows, commit=commit))
        else:
            with raw.lock:
                results, names = _drive(raw.pgconn, _pipeline(raw, rows, commit=commit))
    except BaseException as exc:
        # Cut off mid-pipeline (connection lost, interrupt): the session's state is
        # unknown, and the commit's outcome unknowable, as with any interrupted COMMIT.
        _forget(raw)
        _run(raw, raw.close())
        if isinstance(exc, psycopg.Error):
            raise DBAPIError.instance(shown, None, exc, psycopg.Error, dialect=conn.dialect) from exc
        raise
    failed = next((result for result in results if result.status not in _OK), None)
    if failed is None:
        _prepared.setdefault(raw, set()).update(names)
        return
    _forget(raw)  # which statements the aborted pipeline prepared is not worth knowing
    if commit and raw.info.transaction_status != pq.TransactionStatus.IDLE:
        # An INSERT failed, so the COMMIT never ran; SQLAlchemy counts the transaction
        # as ended all the same, so end it here too.
        _run(raw, raw.rollback())
    error = psycopg.errors.error_from_result(failed, encoding=raw.info.encoding)
    wrapped = DBAPIError.instance(shown, None, error, psycopg.Error, dialect=conn.dialect)
    if isinstance(error, psycopg.errors.InvalidSqlStatementName):
        wrapped.add_note(
            "txbox prepares its outbox INSERT once per connection, and something dropped it where "
            "SQLAlchemy's events could not see (DEALLOCATE or DISCARD ALL on the driver connection, "
            "or a pooler in transaction mode: give it connect_args={'prepare_threshold': None}). "
            "The transaction rolled back and nothing committed; a retry prepares it again."
        )
    raise wrapped from error


def _run(raw: _Raw, result: Any) -> None:
    """Finish a call of ``raw`` that returns a coroutine on an asyncio connection."""
    if isinstance(raw, psycopg.AsyncConnection):
        await_only(result)


async def _pipeline_async(
    raw: psycopg.AsyncConnection[Any], rows: list[_Row], *, commit: bool
) -> tuple[list[pq.abc.PGresult], set[bytes]]:
    async with raw.lock:
        exchange = _pipeline(raw, rows, commit=commit)
        try:
            mask = next(exchange)
            while True:
                await _ready(raw.pgconn.socket, mask)
                mask = exchange.send(None)
        except StopIteration as done:
            result: tuple[list[pq.abc.PGresult], set[bytes]] = done.value
            return result


async def _ready(fd: int, mask: int) -> None:
    """Until ``fd`` is ready for what ``mask`` (poll's flags) asks."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    if mask & select.POLLOUT:
        loop.add_writer(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
        if mask & select.POLLOUT:
            loop.remove_writer(fd)


def _drive(pgconn: pq.abc.PGconn, exchange: _Exchange) -> tuple[list[pq.abc.PGresult], set[bytes]]:
    # Waiting in poll(), not inside libpq, leaves other threads the GIL for the round trip.
    poll = select.poll()
    try:
        mask = next(exchange)
        while True:
            poll.register(pgconn.socket, mask)  # registering again modifies
            poll.poll()
            mask = exchange.send(None)
    except StopIteration as done:
        result: tuple[list[pq.abc.PGresult], set[bytes]] = done.value
        return result


# Sends a pipeline and reads its results; yields the poll flags to wait for in between.
_Exchange = Generator[int, None, tuple[list[pq.abc.PGresult], set[bytes]]]


def _pipeline(raw: _Raw, rows: list[_Row], *, commit: bool) -> _Exchange:
    """Send ``rows`` (and COMMIT) in one pipeline: the results before its Sync, and the
    statements it prepared."""
    pgconn = raw.pgconn
    named = _NAMED and raw.prepare_threshold is not None
    known = _prepared.get(raw, set())
    preparing: set[bytes] = set()
    pgconn.enter_pipeline_mode()
    if pgconn.transaction_status == pq.TransactionStatus.IDLE:
        # Nothing ran in the transaction yet, so psycopg has not sent its BEGIN: without
        # one these statements would commit on their own at the Sync.
        pgconn.send_query_params(_begin(raw), None)
    for statement, params in rows:
        if not named:
            pgconn.send_query_params(statement.text, params)
            continue
        if statement.name not in known and statement.name not in preparing:
            pgconn.send_close_prepared(statement.name)
            pgconn.send_prepare(statement.name, statement.text)
            preparing.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
    if commit:
        pgconn.send_query_params(b"COMMIT", None)
    pgconn.pipeline_sync()
    results = yield from _results(pgconn)
    pgconn.exit_pipeline_mode()
    return results, preparing


def _begin(raw: _Raw) -> bytes:
    """The BEGIN psycopg would send, with the connection's transaction characteristics."""
    parts = ["BEGIN"]
    if raw.isolation_level is not None:
        parts.append("ISOLATION LEVEL " + raw.isolation_level.name.replace("_", " "))
    if raw.read_only is not None:
        parts.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        parts.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return " ".join(parts).encode()


def _results(pgconn: pq.abc.PGconn) -> Generator[int, None, list[pq.abc.PGresult]]:
    while pgconn.flush():  # psycopg's connections are non-blocking: send the rest
        yield select.POLLIN | select.POLLOUT
        pgconn.consume_input()
    results: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            yield select.POLLIN
            pgconn.consume_input()
        while (notify := pgconn.notifies()) is not None:  # as psycopg does: to the handlers
            if pgconn.notify_handler:
                pgconn.notify_handler(notify)
        result = pgconn.get_result()
        if result is None:  # the end of one statement's results
            if pgconn.status == pq.ConnStatus.BAD:
                raise psycopg.OperationalError("the connection was lost before the server answered")
            continue
        if result.status == pq.ExecStatus.PIPELINE_SYNC:
            return results
        results.append(result)


@functools.cache
def _statement(text: str) -> _Insert:
    # One name per statement text; a hash keeps it within 63 bytes.
    name = "txbox_outbox_" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return _Insert(name=name.encode(), text=text.encode())


def _params(raw: _Raw, values: Iterable[object]) -> list[bytes | None]:
    encoding = raw.info.encoding
    try:
        return [_text(value, encoding) for value in values]
    except UnicodeEncodeError as exc:
        name = raw.info.parameter_status("client_encoding")
        raise psycopg.DataError(f"client_encoding {name} cannot carry this text: {exc}") from None


def _text(value: object, encoding: str) -> bytes | None:
    # libpq's text format; PostgreSQL's input functions parse it by the column's type.
    if value is None:
        return None
    if isinstance(value, str):
        if "\x00" in value:
            raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
        return value.encode(encoding)
    if isinstance(value, uuid.UUID) or type(value) is int:
        return str(value).encode()
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.isoformat().encode()
    raise TypeError(f"an outbox column value of type {type(value).__name__} has no text format here")
