"""Outbox rows that travel with the caller's COMMIT (issue 2: writing must be cheap).

A one-row business transaction is commit-bound: BEGIN, its statement and COMMIT are a
round trip each. An outbox INSERT of its own is one round trip more, measured at about
1.35 times the transaction alone on this VM. So a row written at the top level of a
transaction waits here and is sent together with the COMMIT, as one simple-protocol
query ``INSERT ...; INSERT ...; COMMIT``. It is still the caller's transaction: the rows
commit exactly when the business data does, and a failing INSERT makes the commit fail
(PostgreSQL skips the rest of the query), so nothing commits without its messages.

A row is only held back where the commit is sure to pass SQLAlchemy's ``commit`` event:
a psycopg connection inside a plain (not two-phase) transaction that is not in
autocommit mode. Everywhere else the caller inserts it at once (:func:`hold` says which).
Rows still held when a SAVEPOINT starts are inserted before it, so rolling back to the
savepoint cannot take them along; rows written inside a savepoint go in at once, after
any held ones, so a segment keeps the order in which its messages were written.

Rows are kept per transaction object, so a rolled-back transaction's rows can never
reach another transaction on the same pooled connection.
"""

from __future__ import annotations

import functools
import threading
import uuid
import weakref
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.base import RootTransaction
from sqlalchemy.exc import DBAPIError

# Complete INSERT statements, values bound, in the order written.
Held = list[str]

_held: weakref.WeakKeyDictionary[RootTransaction, Held] = weakref.WeakKeyDictionary()
_hooked: weakref.WeakSet[Engine] = weakref.WeakSet()
_hook_lock = threading.Lock()


def hold(conn: Connection, table: str, values: dict[str, Any]) -> bool:
    """Keep one row for the COMMIT of ``conn``'s transaction; False: insert it now yourself.

    ``table`` is the quoted table name, ``values`` maps column names to Python values
    (JSON columns already serialized to text).
    """
    txn = conn.get_transaction()
    if type(txn) is not RootTransaction or conn.in_nested_transaction() or conn.dialect.driver != "psycopg":
        return False
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection) or raw.autocommit:
        return False
    try:
        statement = _insert(raw, table, values)
    except psycopg.Error as exc:  # a value PostgreSQL cannot take, e.g. text with a NUL
        raise DBAPIError.instance(f"INSERT INTO {table}", None, exc, psycopg.Error, dialect=conn.dialect) from exc
    _hook(conn.engine)
    _held.setdefault(txn, []).append(statement)
    return True


def write_held(conn: Connection) -> None:
    """Insert the rows held for ``conn``'s transaction now (without committing)."""
    txn = conn.get_transaction()
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
            event.listen(engine, "rollback", _on_rollback)
            _hooked.add(engine)


def _on_commit(conn: Connection) -> None:
    txn = conn.get_transaction()
    rows = _held.pop(txn, None) if txn is not None else None
    if rows:
        # psycopg's own commit(), which SQLAlchemy calls next, finds the transaction
        # already closed and sends nothing.
        _send(conn, rows, commit=True)


def _on_savepoint(conn: Connection, name: str | None) -> None:
    write_held(conn)


def _on_rollback(conn: Connection) -> None:
    txn = conn.get_transaction()
    if txn is not None:
        _held.pop(txn, None)


def _send(conn: Connection, rows: Held, *, commit: bool) -> None:
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    # Without parameters psycopg sends the simple-protocol Query message, the one that
    # may carry several statements.
    try:
        raw.execute(";\n".join([*rows, "COMMIT"] if commit else rows))
    except psycopg.Error as exc:
        # Name the statement without its values: they hold payloads and auth tokens,
        # and errors get logged.
        shown = ";\n".join(row[: row.index(" VALUES ")] + " VALUES (...)" for row in rows)
        raise DBAPIError.instance(
            shown + (";\nCOMMIT" if commit else ""), None, exc, psycopg.Error, dialect=conn.dialect
        ) from exc


def _insert(raw: psycopg.Connection[Any], table: str, values: dict[str, Any]) -> str:
    # Bound here, client-side: a statement with server-side parameters cannot share its
    # Query message with others, and the point is one round trip.
    plain = raw.info.parameter_status("standard_conforming_strings") == "on"
    columns = ", ".join(_identifier(name) for name in values)
    literals = ", ".join(_literal(value, raw, plain) for value in values.values())
    return f"INSERT INTO {table} ({columns}) VALUES ({literals})"


@functools.cache
def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(value: object, raw: psycopg.Connection[Any], plain_strings: bool) -> str:
    # The common types by hand (psycopg's general quoting costs about as much as the
    # whole rest of a write); anything else, and any string with a NUL (which PostgreSQL
    # refuses), through psycopg. With standard_conforming_strings on, a quote is the
    # only special character inside '...'.
    if value is None:
        return "NULL"
    if isinstance(value, str):
        if plain_strings and "\x00" not in value:
            return "'" + value.replace("'", "''") + "'"
    elif isinstance(value, uuid.UUID):
        return f"'{value}'::uuid"
    elif type(value) is int:
        return str(value)
    elif isinstance(value, datetime) and value.tzinfo is not None:
        return f"'{value.isoformat()}'::timestamptz"
    return sql.Literal(value).as_string(raw)
