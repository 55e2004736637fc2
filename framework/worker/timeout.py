"""Per-message timeout: a watchdog thread that interrupts an overdue handler.

A handler runs in the worker's own thread (it needs the worker's transaction). When its
time is up the watchdog (1) cancels the statement running on the worker's connection,
which interrupts a handler waiting on PostgreSQL, and (2) raises :class:`HandlerTimeout`
inside the worker's loop thread, which interrupts a handler running Python code (an async
handler's task is cancelled instead, framework/worker/coroutines.py). A handler
stuck in C code that ignores both would outlive its lease; rather than let a second
worker run the message beside it, the watchdog ends the process at the lease's end
(the claim makes it count towards the poison threshold).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from framework import logs
from framework.errors import HandlerTimeout
from framework.worker import coroutines

log = logging.getLogger("txbox.worker")

HARD_EXIT_CODE = 70
TICK = 0.05  # how late a timeout may fire; arming does not wake the watchdog


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


@dataclass(frozen=True)
class _Arming:
    """One handler run under guard: which one, whose thread, its deadlines."""

    generation: int
    deadline: float
    hard_deadline: float
    thread_id: int
    cancel: Callable[[], None]


class Watchdog:
    """Interrupts the handler running on the worker's loop thread when its time is up.

    The one thread the worker keeps besides its loop (docs/explanation/daemons.md, "The daemons
    and their threads"), because it must be another thread: the handler runs on the loop
    thread and may be stuck there, in Python code, in a statement or in C, so nothing on
    that thread can act until the handler returns. Only another thread can cancel the
    statement the loop thread is blocked in, raise into it, or end the process at the
    lease's end. A timer signal (``setitimer``) would need the main thread, which the
    worker does not own under ``txbox run`` or an embedding application.

    What the two threads share is one condition and its arming: the loop thread alone
    writes the arming (:meth:`guard`, :meth:`disarm`, :meth:`close`), the watchdog alone
    writes which arming it fired for; both under the condition's lock.
    """

    def __init__(self, log: logs.Log = log) -> None:
        self.log = log  # the worker's (a tenant's names it)
        self._cond = threading.Condition()
        self._armed: _Arming | None = None  # written by the loop thread only
        self._generation = 0  # likewise: one per guard()
        self._closed = False  # likewise
        self._fired = 0  # written by the watchdog only: the generation it fired for
        self._thread = threading.Thread(target=self._watch, name="txbox-watchdog", daemon=True)
        self._thread.start()

    @property
    def fired(self) -> bool:
        """The current (or last) run's timeout fired."""
        return self._generation > 0 and self._fired == self._generation

    def guard(self, seconds: float, hard_seconds: float, cancel: Callable[[], None]) -> Watchdog:
        """Interrupt the calling thread after ``seconds``; end the process after ``hard_seconds``.
        Armed now, for a ``with`` block that disarms it at its end (the watchdog itself is the
        context manager: a generator's costs more, and this runs per message)."""
        with self._cond:
            now = time.monotonic()
            self._generation += 1
            # No notify: arming is per message and hot; the watchdog ticks.
            self._armed = _Arming(
                self._generation, now + seconds, now + max(hard_seconds, seconds), threading.get_ident(), cancel
            )
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.disarm()

    def disarm(self) -> None:
        """Idempotent; called again by the worker in case a timeout interrupted the first call."""
        with self._cond:
            armed, self._armed = self._armed, None
            if armed is not None and self._fired == armed.generation:
                _raise_in(armed.thread_id, None)  # drop a timeout not yet delivered

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                armed = self._armed
                fired = armed is not None and self._fired == armed.generation
                limit = None if armed is None else armed.hard_deadline if fired else armed.deadline
                if armed is None or limit is None or time.monotonic() < limit:
                    self._cond.wait(TICK)
                    continue
                if not fired:
                    self._fired = armed.generation
                    try:
                        armed.cancel()
                    except Exception as exc:  # the cancel is best effort, the async raise follows
                        self.log.debug("cancelling the running statement failed: %r", exc)
                    # An async handler's task is cancelled on its loop instead: a raise
                    # would not reach a thread blocked in the loop's select.
                    if not coroutines.cancel_running(armed.thread_id):
                        _raise_in(armed.thread_id, HandlerTimeout)
                    continue
                self.log.critical("a handler ignored its timeout and reached the end of its lease: exiting")
                logging.shutdown()
                os._exit(HARD_EXIT_CODE)
