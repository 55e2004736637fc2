"""Per-message timeout: a watchdog thread that interrupts an overdue handler.

A handler runs in the worker's own thread (it needs the worker's transaction). When its
time is up the watchdog (1) cancels the statement running on the worker's connection,
which interrupts a handler waiting on PostgreSQL, and (2) raises :class:`HandlerTimeout`
inside the worker thread, which interrupts a handler running Python code (an async
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

from framework.errors import HandlerTimeout
from framework.worker import coroutines

log = logging.getLogger("txbox.worker")

HARD_EXIT_CODE = 70
TICK = 0.05  # how late a timeout may fire; arming does not wake the watchdog


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._hard_deadline: float | None = None
        self._thread_id = 0
        self._cancel: Callable[[], None] = lambda: None
        self.fired = False
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="txbox-watchdog", daemon=True)
        self._thread.start()

    def guard(self, seconds: float, hard_seconds: float, cancel: Callable[[], None]) -> Watchdog:
        """Interrupt the calling thread after ``seconds``; end the process after ``hard_seconds``.
        Armed now, for a ``with`` block that disarms it at its end (the watchdog itself is the
        context manager: a generator's costs more, and this runs per message)."""
        with self._cond:
            now = time.monotonic()
            self._deadline = now + seconds
            self._hard_deadline = now + max(hard_seconds, seconds)
            self._thread_id = threading.get_ident()
            self._cancel = cancel
            self.fired = False  # no notify: arming is per message and hot; the watchdog ticks
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.disarm()

    def disarm(self) -> None:
        """Idempotent; called again by the worker in case a timeout interrupted the first call."""
        with self._cond:
            if self._deadline is None:
                return
            self._deadline = self._hard_deadline = None
            if self.fired:
                _raise_in(self._thread_id, None)  # drop a timeout not yet delivered

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                limit = self._hard_deadline if self.fired else self._deadline
                if limit is None or now < limit:
                    self._cond.wait(TICK)
                    continue
                if not self.fired:
                    self.fired = True
                    try:
                        self._cancel()
                    except Exception as exc:  # the cancel is best effort, the async raise follows
                        log.debug("cancelling the running statement failed: %r", exc)
                    # An async handler's task is cancelled on its loop instead: a raise
                    # would not reach a thread blocked in the loop's select.
                    if not coroutines.cancel_running(self._thread_id):
                        _raise_in(self._thread_id, HandlerTimeout)
                    continue
                log.critical("a handler ignored its timeout and reached the end of its lease: exiting")
                logging.shutdown()
                os._exit(HARD_EXIT_CODE)
