"""Outbox writes into an asyncio transaction (docs/explanation/write.md, "Async outbox").

``service.outbox(session)`` also takes SQLAlchemy's ``AsyncSession`` and
``AsyncConnection``; ``send_command`` and ``publish_event`` stay plain calls, so they
do no I/O: every row waits until the caller's transaction commits and rides with it.

- An ``AsyncConnection`` holds its rows in :mod:`framework.outbox_commit`, whose
  listeners send them with the COMMIT (or, inside a savepoint, just before its RELEASE).
- An ``AsyncSession`` may have no connection yet when a row is written, so its rows wait
  here per session transaction: a released savepoint hands them to its parent, a rolled
  back one drops them, and the top-level ``before_commit`` passes them to the connection
  (the COMMIT pipeline, or the plain INSERT at that moment, in the same transaction).

Both run inside SQLAlchemy's greenlet, where blocking-style calls await the driver. The
psycopg 3 asyncio driver is required: the pipeline drives libpq, which asyncpg lacks.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from sqlalchemy import event, insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, SessionTransaction

from framework import outbox_commit, tables
from framework.errors import ConfigurationError
from framework.sql import outbox as outbox_sql

# Only shown to a Session to pick the bind of the outbox's table; never executed.
BIND_CLAUSE = insert(tables.outbox)

# Rows of an AsyncSession's transactions: (schema, values, pipeline) in write order.
_Pending = tuple[str, dict[str, Any], bool]
_pending: weakref.WeakKeyDictionary[SessionTransaction, list[_Pending]] = weakref.WeakKeyDictionary()
_listening = False
_listen_lock = threading.Lock()


def sync_bind(bind: object) -> Session | Connection | None:
    """The blocking Session/Connection inside an ``AsyncSession``/``AsyncConnection``;
    None when ``bind`` is neither."""
    try:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    except ImportError:  # pragma: no cover - part of SQLAlchemy itself
        return None
    if isinstance(bind, AsyncSession):
        session = bind.sync_session
        _check_driver(session.get_bind(clause=BIND_CLAUSE))
        return session
    if isinstance(bind, AsyncConnection):
        conn = bind.sync_connection
        if conn is None:
            raise ConfigurationError("the AsyncConnection is not started: `async with engine.connect() as conn:`")
        _check_driver(conn)
        return conn
    return None


def _check_driver(bind: Engine | Connection) -> None:
    driver = bind.dialect.driver
    if driver != "psycopg":
        raise ConfigurationError(
            f"an asyncio outbox needs the psycopg 3 driver, not {driver!r}: create the engine with a "
            "postgresql+psycopg:// URL (create_async_engine picks its asyncio side); txbox sends the "
            "outbox rows in the same round trip as the COMMIT through libpq, which asyncpg does not expose"
        )
    try:
        import greenlet  # noqa: F401
    except ImportError:
        raise ConfigurationError(
            "SQLAlchemy's asyncio support needs greenlet, a dependency of txbox: pip install greenlet"
        ) from None


def hold_in_session(session: Session, schema: str, values: dict[str, Any], *, pipeline: bool) -> None:
    """Keep one row for the commit of ``session``'s current transaction (no I/O)."""
    _listen()
    txn = session.get_nested_transaction() or session.get_transaction()
    if txn is None:
        txn = session.begin()  # what the session's next statement would begin anyway; no I/O
    _pending.setdefault(txn, []).append((schema, values, pipeline))


def hold_in_connection(conn: Connection, schema: str, values: dict[str, Any], *, pipeline: bool) -> None:
    """Keep one row for the commit (or savepoint release) of ``conn``'s transaction (no I/O)."""
    if conn.get_transaction() is None:
        conn.begin()  # psycopg sends its BEGIN with the first statement; nothing goes out here
    if not (pipeline and outbox_commit.hold(conn, outbox_sql.insert_text(schema), values, savepoints=True)):
        raise ConfigurationError(
            "an AsyncConnection's outbox rows can only ride its COMMIT: keep TXBOX_OUTBOX_COMMIT_PIPELINE "
            "on, use libpq 14 or later, and write inside a transaction (not autocommit); or write through "
            "an AsyncSession, whose rows fall back to a plain INSERT at commit"
        )


def _listen() -> None:
    global _listening
    if _listening:
        return
    with _listen_lock:
        if not _listening:
            # On the class: every Session (an AsyncSession's too) has the listeners,
            # which cost a dictionary look-up where no outbox row waits.
            event.listen(Session, "before_commit", _before_commit)
            event.listen(Session, "after_commit", _after_commit)
            event.listen(Session, "after_transaction_end", _after_transaction_end)
            _listening = True


def _before_commit(session: Session) -> None:
    if session.get_nested_transaction() is not None:
        return  # a savepoint's release: _after_commit hands its rows up
    txn = session.get_transaction()
    rows = _pending.pop(txn, None) if txn is not None else None
    if rows:
        conn = session.connection(bind_arguments={"clause": BIND_CLAUSE})
        for schema, values, pipeline in rows:
            outbox_commit.write(conn, schema, values, pipeline=pipeline)


def _after_commit(session: Session) -> None:
    nested = session.get_nested_transaction()
    if nested is None:
        return
    rows = _pending.pop(nested, None)
    if rows and nested.parent is not None:
        _pending.setdefault(nested.parent, []).extend(rows)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    _pending.pop(transaction, None)  # rolled back (committed ones were handed on already)
