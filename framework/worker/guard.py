"""What keeps a handler from ending the worker's transaction (docs/explanation/handle.md, "Worker: handlers
that misbehave").

A handler's writes commit with its message's ``processed_at`` in the worker's batch
transaction. A handler that commits, rolls back or closes that transaction would break
the pairing: a COMMIT would make the batch's processed marks durable before the batch
mates after it ran (their work lost), a ROLLBACK would take the marks away while later
writes commit in a new transaction (their work applied twice). Three layers stop it:

- :class:`HandlerSession` refuses ``commit()``, ``rollback()`` and ``close()`` while a
  handler runs, before anything reaches PostgreSQL;
- the *commit guard*: every batch transaction inserts two equal keys into a temporary
  table whose unique constraint is checked at COMMIT, and deletes them just before its
  own COMMIT. A COMMIT from anywhere else (SQL, the driver) fails there and rolls the
  whole transaction back: nothing of the batch becomes durable half-done;
- the *batch mark*: the batch sets ``application_name`` for its transaction only
  (``SET LOCAL``). PostgreSQL reports every change of that setting to the client, so
  when the transaction ends by any means the driver learns it without a round trip,
  even if the handler went on in a new transaction.

:func:`misuse` reads those facts after each handler run, without a round trip.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, NestedTransaction, Transaction
from sqlalchemy.orm import Session

from framework import middleware
from framework.errors import HandlerMisuse
from framework.handlers import AWAITABLE_FIX, as_handled, is_coroutine_handler
from framework.worker import coroutines

if TYPE_CHECKING:
    from framework.envelope import Message
    from framework.handlers import Handler
    from framework.outbox import Outbox

# The transaction's application_name while a batch runs; the session's own name differs.
BATCH_MARK = "txbox-worker (batch)"
_BATCH_MARK = BATCH_MARK.encode()
GUARD_TABLE = "txbox_worker_commit_guard"
# Named in the error a refused COMMIT raises, so the handler's author sees why.
GUARD_CONSTRAINT = "txbox_handlers_must_not_commit"

FIX = (
    "the worker commits a handler's writes together with its message's processed mark. "
    "Do not commit, roll back or close the session or its connection in a handler: "
    "raise an exception to fail the message (RetryableError, PermanentError), "
    "use `with session.begin_nested():` to undo part of the work"
)


class HandlerSession(Session):
    """The ``Session`` a handler gets: ``commit()``, ``rollback()`` and ``close()`` are refused
    while the handler runs (they raise :class:`HandlerMisuse`, and the run fails even if
    the handler catches it). The worker calls them between runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.txbox_running = False  # set by run_handler while the handler runs
        self.txbox_refused = ""
        self._txbox_async: coroutines.HandlerAsyncSession | None = None

    def as_async(self) -> coroutines.HandlerAsyncSession:
        """This session as the ``AsyncSession`` an async handler gets (the same transaction)."""
        if self._txbox_async is None:
            self._txbox_async = coroutines.HandlerAsyncSession(self)
        return self._txbox_async

    def _refuse(self, what: str) -> None:
        if self.txbox_running:
            self.txbox_refused = f"the handler called session.{what}(): {FIX}"
            raise HandlerMisuse(self.txbox_refused)

    def commit(self) -> None:
        self._refuse("commit")
        super().commit()

    def rollback(self) -> None:
        self._refuse("rollback")
        super().rollback()

    def close(self) -> None:
        self._refuse("close")
        super().close()


def run_handler(
    handler: Handler,
    message: Message,
    session: HandlerSession,
    outbox: Outbox,
    conn: Connection,
    raw: psycopg.Connection[Any],
    transaction: Transaction,
    savepoint: NestedTransaction | None,
    chain: Sequence[middleware.Middleware] = (),
) -> None:
    """Run one handler for one message in the transaction the caller armed (:func:`arm`);
    raise :class:`HandlerMisuse` if it broke the transaction, or is a plain function that
    returned an awaitable. An ``async def handle`` gets the session as an ``AsyncSession``
    and runs to its end here (framework/worker/coroutines.py).

    The one way a handler is invoked: the worker and ``framework.testing`` both call it.
    The message reaches ``handle`` in a version the handler takes (upcast if need be;
    docs/explanation/receive.md, "Message versions"). ``chain`` is the service's middleware
    (``Service.middleware``), its hooks run around the handler, under the same guard
    (docs/explanation/handle.md, "Handler middleware and the permission guard").
    """
    message = as_handled(handler, message, outbox.registry.get(message.message_type))
    session.txbox_running, session.txbox_refused = True, ""
    try:
        if not chain:  # the hooks' context manager costs more than a small handler's work
            _invoke(handler, message, session, outbox, conn, raw, transaction, savepoint)
            return
        with middleware.hooks(chain, message, session, outbox):
            _invoke(handler, message, session, outbox, conn, raw, transaction, savepoint)
    finally:
        session.txbox_running = False


def _invoke(
    handler: Handler,
    message: Message,
    session: HandlerSession,
    outbox: Outbox,
    conn: Connection,
    raw: psycopg.Connection[Any],
    transaction: Transaction,
    savepoint: NestedTransaction | None,
) -> None:
    """``handle``, then what it did to the transaction (inside the hooks: a misuse is a failure they see)."""
    if is_coroutine_handler(handler):
        coroutines.run_handle(handler, message, session, outbox)
        result: object = None
    else:
        # Typed None, but a plain function may still hand back a coroutine.
        result = handler.handle(message, session, outbox)  # type: ignore[func-returns-value]
    if result is not None:
        _refuse_awaitable(result)
    found = misuse(session, conn, raw, transaction, savepoint)
    if found is not None:
        raise HandlerMisuse(found[0])


def _refuse_awaitable(result: object) -> None:
    """A plain ``handle`` that returned an awaitable did nothing yet: its message fails."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()  # no "never awaited" warning; nothing of it ran
        raise HandlerMisuse(AWAITABLE_FIX)


def misuse(
    session: HandlerSession,
    conn: Connection,
    raw: psycopg.Connection[Any],
    transaction: Transaction,
    savepoint: NestedTransaction | None,
) -> tuple[str, bool] | None:
    """What the handler just did to the batch transaction, if anything: (why, whether the
    transaction is gone). Gone: every write of the batch so far is lost or doomed."""
    if raw.broken:
        return None  # the server went away: not the handler's doing (the worker reconnects)
    if conn.closed or conn.invalidated or raw.closed:
        return f"the handler closed the worker's database connection: {FIX}", True
    # libpq's own answers (raw.info builds an object and decodes text per call: this runs per message).
    aborted = raw.pgconn.transaction_status == TransactionStatus.INERROR
    # An error outside any savepoint reverts the batch mark at once (PostgreSQL undoes
    # the transaction's settings when it aborts it, not at the ROLLBACK), so the mark
    # speaks only when the transaction is not aborted, or inside the worker's savepoint.
    if (not aborted or savepoint is not None) and (
        raw.pgconn.parameter_status(b"application_name") != _BATCH_MARK or not transaction.is_active
    ):
        return f"the handler ended the worker's transaction (a COMMIT or ROLLBACK): {FIX}", True
    why = _left_behind(session, conn, savepoint, aborted=aborted)
    return None if why is None else (why, False)


def _left_behind(
    session: HandlerSession, conn: Connection, savepoint: NestedTransaction | None, *, aborted: bool
) -> str | None:
    """What the handler left in a batch transaction that is still there (see :func:`misuse`)."""
    if session.txbox_refused:
        return session.txbox_refused
    if aborted:
        return (
            "the handler left the transaction aborted (a statement failed and the handler went on); "
            "let the error propagate, or run the statement inside `with session.begin_nested():`"
        )
    if session.in_nested_transaction() or conn.get_nested_transaction() is not savepoint:
        return (
            "the handler left a savepoint open (session.begin_nested() not committed or rolled back); "
            "use `with session.begin_nested():` so it always ends"
        )
    return None


# Batches between two TRUNCATEs of the guard's table on one connection: the DELETE before
# each COMMIT leaves two dead rows and their index entries, which a temporary table's
# owner alone can clear (autovacuum never visits it). With none the cost grew with every
# batch; any interval in a wide range around this one cost the same per batch
# (benchmarks/cpu-per-message.md, "The commit guard's table without `ON COMMIT DELETE ROWS`").
TRUNCATE_EVERY = 100


def create_guard() -> sql.Composed:
    """The commit guard's table, once per connection (temporary: it vanishes with the session).

    Not ``ON COMMIT DELETE ROWS``: PostgreSQL then truncates the table and rebuilds its
    index at every COMMIT that touched it, which cost the server more CPU per batch than
    the rest of a small batch's guard and presumption together (benchmarks/cpu-per-message.md,
    "The commit guard's table without `ON COMMIT DELETE ROWS`"). The worker
    empties it every :data:`TRUNCATE_EVERY` batches and after a failed pass instead
    (:func:`truncate`; docs/explanation/handle.md, "Worker: handlers that misbehave"). The
    test kit's connections run too few deliveries for their dead keys to matter.
    """
    return sql.SQL(
        "CREATE TEMP TABLE IF NOT EXISTS {table} (k int, CONSTRAINT {constraint} UNIQUE (k) "
        "DEFERRABLE INITIALLY DEFERRED)"
    ).format(table=sql.Identifier(GUARD_TABLE), constraint=sql.Identifier(GUARD_CONSTRAINT))


def truncate() -> sql.Composed:
    """Clear the dead rows the guard's DELETEs left; first statement of a batch (TRUNCATE
    refuses a table with deferred checks pending, as it has once armed)."""
    return sql.SQL("TRUNCATE pg_temp.{table}").format(table=sql.Identifier(GUARD_TABLE))


def arm() -> sql.Composed:
    """First statement of a batch: the batch mark, and two equal keys that a COMMIT refuses."""
    return sql.SQL(
        "INSERT INTO pg_temp.{table} SELECT 1 FROM (SELECT set_config('application_name', {mark}, true)) m, "
        "(VALUES (1), (2)) v"
    ).format(table=sql.Identifier(GUARD_TABLE), mark=sql.Literal(BATCH_MARK))


def armed(statement: sql.Composable) -> sql.Composed:
    """``statement`` (a batch's first) and :func:`arm` in one statement, one round trip: a
    data-modifying WITH runs to its end whether or not the statement reads it."""
    return sql.SQL("WITH txbox_guard AS ({arm}) {statement}").format(arm=arm(), statement=statement)


def disarm() -> sql.Composed:
    """Last statement before the worker's own COMMIT."""
    return sql.SQL("DELETE FROM pg_temp.{table}").format(table=sql.Identifier(GUARD_TABLE))


def refused_commit(exc: BaseException) -> bool:
    """``exc`` is the commit guard refusing a COMMIT the handler sent."""
    current: BaseException | None = exc
    for _ in range(5):  # the driver's error, maybe wrapped by SQLAlchemy or by the handler
        if current is None:
            return False
        diag = getattr(current, "diag", None)
        if diag is not None and getattr(diag, "constraint_name", None) == GUARD_CONSTRAINT:
            return True
        current = getattr(current, "orig", None) or current.__cause__
    return False
