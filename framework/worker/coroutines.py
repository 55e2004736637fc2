"""Async handlers: an ``async def handle`` run to the end in the worker's thread
(docs/explanation/handle.md, "Async handlers").

The batch transaction lives on the worker's synchronous psycopg connection, and a
handler's writes must commit with its message's processed mark. So the ``AsyncSession``
an async handler gets is not a second connection: it is SQLAlchemy's own
``AsyncSession`` proxying the very ``HandlerSession`` a plain handler would get. Its
awaitables run the sync session's methods through SQLAlchemy's greenlet bridge, which
with a synchronous driver just calls them: the statement runs on the worker's
connection, in the batch transaction, and the handler's refusals (commit, rollback,
close) hold unchanged.

Each worker keeps one event loop (an ``asyncio.Runner``) for its life: a loop
per message would cost more than a small handler's work. The coroutine runs as a task
of that loop, in a copy of the caller's context (the handler's span and log fields).
The task's first step gets one pass of the loop, which is all a handler whose awaits
never suspend needs (its session's never do); only a task still pending after it gets
``run_until_complete`` (docs/explanation/handle.md, "Async handlers", "The loop").
On timeout the watchdog cancels the running statement and the task
(:func:`cancel_running`), since an exception raised into a thread blocked in the
loop's ``select`` would not arrive before the loop wakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Result
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from framework.errors import HandlerMisuse, HandlerTimeout

if TYPE_CHECKING:
    from framework.envelope import Message
    from framework.handlers import Handler
    from framework.outbox import Outbox
    from framework.worker.guard import HandlerSession

_STREAM_FIX = (
    "an async handler's session runs on the worker's synchronous connection, which has no server-side "
    "cursors to stream from: use `await session.execute(...)` (rows are buffered)"
)
_CONNECTION_FIX = (
    "an async handler's session runs on the worker's synchronous connection, which SQLAlchemy cannot hand "
    "out as an AsyncConnection: use `await session.execute(...)`, or "
    "`await session.run_sync(lambda s: s.connection().execute(...))`"
)


class HandlerAsyncSession(AsyncSession):
    """The ``AsyncSession`` of an async handler: a proxy of the worker's ``HandlerSession``.

    ``execute`` skips SQLAlchemy's async cursor close, which only an async driver has; the
    rows are fetched already (``prebuffer_rows``, as ``AsyncSession`` asks for). Streaming
    and ``connection()`` need an async driver and are refused with the fix.
    """

    def __init__(self, session: Session) -> None:
        # The "class" is called once, to make the proxied session: hand it the worker's.
        super().__init__(sync_session_class=lambda **_: session)  # type: ignore[arg-type]

    async def execute(self, *args: Any, **kwargs: Any) -> Result[Any]:
        options = dict(kwargs.pop("execution_options", None) or {})
        options["prebuffer_rows"] = True
        return await self.run_sync(lambda s: s.execute(*args, execution_options=options, **kwargs))

    async def stream(self, *args: Any, **kwargs: Any) -> Any:
        raise HandlerMisuse(_STREAM_FIX)

    async def stream_scalars(self, *args: Any, **kwargs: Any) -> Any:
        raise HandlerMisuse(_STREAM_FIX)

    async def connection(self, *args: Any, **kwargs: Any) -> AsyncConnection:
        raise HandlerMisuse(_CONNECTION_FIX)


class _Loop:
    """One thread's event loop and the handler task running on it, if any."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.task: asyncio.Task[None] | None = None
        self.cancelled = False


_loops: dict[int, _Loop] = {}  # by thread id
_loops_lock = threading.Lock()


def run_handle(handler: Handler, message: Message, session: HandlerSession, outbox: Outbox) -> None:
    """Run an ``async def handle`` to its end on this thread's loop, with ``session`` as an
    ``AsyncSession``; a cancel by the watchdog surfaces as :class:`HandlerTimeout`."""
    handle: Callable[..., Coroutine[Any, Any, None]] = handler.handle  # type: ignore[assignment]
    run(handle(message, session.as_async(), outbox))


def run(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to its end on this thread's loop (see :func:`run_handle`)."""
    if _running_loop() is not None:
        coro.close()
        raise HandlerMisuse(
            "an async handler was run from inside a running event loop; the worker's transaction is "
            "synchronous, so run it from plain (non-async) code, e.g. a plain test function"
        )
    loop = _loop()
    loop.cancelled = False
    try:
        _run_task(loop, coro)
    except asyncio.CancelledError:
        if loop.cancelled:
            raise HandlerTimeout("the handler's task was cancelled at its timeout") from None
        raise
    except BaseException:
        if loop.task is None or not loop.task.done():
            # Interrupted outside the task (a timeout raised into the thread just before the
            # task began): the task is still pending on the loop and must never run with a
            # later message. Drop the loop unrun; the next run gets a new one.
            _drop(loop)
        raise
    finally:
        loop.task = None


def _run_task(loop: _Loop, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` as a task of ``loop`` to its end; raise what it raised.

    ``Runner.run`` would cost two passes of the loop per message (the task's step, then
    the callback that stops the loop) and, on the main thread, swapping the SIGINT
    handler twice: more than a small handler's own work. A loop stopped before it runs
    makes exactly one pass (asyncio's documented ``stop()`` before ``run_forever()``),
    which runs the task's first step; a handler that never suspends is done then.
    """
    events = loop.runner.get_loop()
    # Known to the watchdog before the step starts: a cancel that comes first still
    # reaches the task (it then never starts, and the run is a timeout).
    task = loop.task = events.create_task(coro, context=contextvars.copy_context())
    events.stop()
    events.run_forever()
    if not task.done():  # it awaits something real (a sleep, a socket): run the loop for it
        events.run_until_complete(task)
    task.result()


def cancel_running(thread_id: int) -> bool:
    """Cancel the handler task running on ``thread_id``'s loop (from another thread); False
    when none runs there (a plain handler: interrupt it the other way)."""
    loop = _loops.get(thread_id)
    task = loop.task if loop is not None else None
    if loop is None or task is None or task.done():
        return False
    loop.cancelled = True
    try:
        loop.runner.get_loop().call_soon_threadsafe(task.cancel)
    except RuntimeError:  # the loop was closed meanwhile (dropped): nothing of it runs
        return False
    return True


def _loop() -> _Loop:
    ident = threading.get_ident()
    loop = _loops.get(ident)
    if loop is None:
        with _loops_lock:
            # Threads end (a worker per test, say): their loops go when a new one is made.
            alive = {t.ident for t in threading.enumerate()}
            for dead in [i for i in _loops if i not in alive]:
                _close_unrun(_loops.pop(dead))
            loop = _loops[ident] = _Loop()
    return loop


def _drop(loop: _Loop) -> None:
    with _loops_lock:
        if _loops.get(threading.get_ident()) is loop:
            del _loops[threading.get_ident()]
    _close_unrun(loop)


def _close_unrun(loop: _Loop) -> None:
    """Close without running what is pending (``Runner.close`` would run the cancelled
    tasks' cleanup: a handler's code, outside any transaction)."""
    with contextlib.suppress(Exception):
        loop.runner.get_loop().close()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
