"""What every daemon shares: its loop, stop on SIGTERM/SIGINT, state-change logging, progress and readiness.

A daemon runs on an event loop it does not own (docs/explanation/daemons.md, "One loop per
process"): :meth:`Daemon.start_on` registers its handlers and timers on a pika
:class:`~pika.adapters.select_connection.IOLoop` and returns; the loop's one thread then
runs everything the daemon does, and the daemon reports its end through the ``finished``
callback. :meth:`Daemon.run` is that on a loop of its own (`txbox publisher` and the
other one-daemon commands); `txbox run` starts several daemons on one loop. A stop
request (:meth:`Daemon.stop`, any thread) wakes the loop; one made on the loop's own
thread (a signal handler) is seen within :data:`STOP_CHECK`. Each turn of the loop calls
:meth:`Daemon.progress` (an idle turn too: the loop ticks at least every poll interval),
and the connect steps call :meth:`Daemon.set_ready`; the probes and the heartbeat read
both (docs/explanation/operations.md, "Probes, logs and liveness").
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from pika.adapters.select_connection import IOLoop

from framework import logs, metrics, tracing
from framework.drivers import tune_drivers

if TYPE_CHECKING:
    from framework.service import Service


#: The dependencies a daemon reports in ``/readyz``.
POSTGRESQL = "postgresql"
RABBITMQ = "rabbitmq"

STOP_CHECK = 0.25  # seconds between a started daemon's looks at its stop event (see Daemon.stop)

#: Called once, on the loop, when a started daemon has ended: None, or what ended it.
Finished = Callable[[BaseException | None], None]


class Daemon:
    """Base of the four daemons, which all take ``(service, config=None, *, stop_event=None)``.

    ``config`` is the daemon's ``*Config`` (``from_env()`` when not given); a shared
    ``stop_event`` lets ``txbox run`` stop several daemons with one request
    (docs/explanation/daemons.md, "Daemons: one shape").
    """

    name = "daemon"
    #: What :meth:`ready` requires: the worker talks to PostgreSQL only.
    needs: tuple[str, ...] = (POSTGRESQL, RABBITMQ)

    def __init__(
        self, service: Service, *, stop_event: threading.Event | None = None, tenant: str | None = None
    ) -> None:
        # Process-wide, so here and not at import (docs/explanation/daemons.md, "What txbox changes in a process").
        tune_drivers()
        # Also process-wide; fails at start on a misconfigured OTEL_* (docs/explanation/operations.md, "Tracing").
        tracing.setup(service.settings.service)
        self.service = service
        self.settings = service.settings
        logs.set_service(self.settings.service)
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        #: The registry key of the tenant this daemon serves alone (its ``service`` set to
        #: the tenant's database and schema), in its metrics' ``tenant`` label and its log
        #: lines; None: no tenant (docs/how-to/tenants.md, "Seen per tenant").
        self.tenant = tenant
        self.labels = metrics.labels(self.settings.service, tenant)
        self.log = logs.daemon_logger(f"txbox.{self.name}", tenant)
        self._state = ""
        self.started = time.time()
        self.last_progress = time.monotonic()  # monotonic: a clock step must not look like a hang
        self.last_progress_wall = self.started  # the same moment on the wall clock, for the heartbeat row
        self._ready = dict.fromkeys(self.needs, False)
        self.loop: IOLoop | None = None  # the loop it runs on, once started (start_on)
        self._loop_thread: threading.Thread | None = None  # the thread that started it there
        self._finished: Finished | None = None
        self._stop_seen = False

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    # --- the loop -------------------------------------------------------------------

    def start_on(self, loop: IOLoop, finished: Finished) -> None:
        """Begin on ``loop``, whose one thread (the caller's) then runs all the daemon does.

        Registers the daemon's handlers and timers and returns without waiting for the
        loop. Once the daemon has ended (a stop request and its drain, or a failure it does
        not outlive) it has closed what it opened, removed its handlers and timers, and
        calls ``finished`` once, on the loop, with None or what ended it.
        """
        if self.loop is not None:
            raise RuntimeError(f"the {self.name} was started already")
        self.loop = loop
        self._loop_thread = threading.current_thread()
        self._finished = finished
        loop.call_later(STOP_CHECK, self._check_stop)
        self._begin()

    def run(self) -> None:
        """Run on a loop of its own until the daemon has ended; re-raises what ended it."""
        loop = IOLoop()
        ended: list[BaseException | None] = []

        def finished(exc: BaseException | None) -> None:
            ended.append(exc)
            loop.stop()

        try:
            self.start_on(loop, finished)
            if not ended:
                loop.start()
        finally:
            loop.close()
        if ended and ended[0] is not None:
            raise ended[0]

    def _begin(self) -> None:
        """On the loop: connect and start working (each daemon defines it)."""
        raise NotImplementedError

    def _on_stop(self) -> None:
        """On the loop, once, after a stop request: begin the way out, then :meth:`_end`."""
        self._end()

    def _end(self, exc: BaseException | None = None) -> None:
        """On the loop: the daemon has ended and left nothing open; tell the runner, once."""
        finished, self._finished = self._finished, None
        if finished is not None:
            finished(exc)

    @property
    def ended(self) -> bool:
        """Started and ended (``finished`` was called)."""
        return self.loop is not None and self._finished is None

    def _check_stop(self) -> None:
        if self.ended:
            return
        if self.stopping:
            self._stop_requested()
        else:
            assert self.loop is not None
            self.loop.call_later(STOP_CHECK, self._check_stop)

    def _stop_requested(self) -> None:
        if not self._stop_seen and not self.ended:
            self._stop_seen = True
            self._on_stop()

    def stop(self) -> None:
        """Request a stop; safe from any thread and from a signal handler.

        From another thread it wakes the loop at once. On the loop's own thread (a signal
        handler interrupting it) it only sets the stop event, which the loop looks at every
        :data:`STOP_CHECK`: waking the loop takes a lock the interrupted loop may hold.
        """
        self.stop_event.set()
        loop = self.loop
        if loop is not None and threading.current_thread() is not self._loop_thread:
            with contextlib.suppress(Exception):  # a loop that has ended already needs no wake-up
                loop.add_callback_threadsafe(self._stop_requested)

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if a stop was requested meanwhile."""
        return self.stop_event.wait(seconds)

    def state(self, state: str, detail: str = "") -> None:
        """Log one line per state change (not per message)."""
        if state != self._state:
            self._state = state
            self.log.info("%s%s", state, f": {detail}" if detail else "")

    def progress(self) -> None:
        """The loop turned (work done, or an idle tick): the daemon is not stuck."""
        self.last_progress = time.monotonic()
        self.last_progress_wall = time.time()

    def set_ready(self, dependency: str, ok: bool) -> None:
        """``dependency`` (:data:`POSTGRESQL`, :data:`RABBITMQ` with the topology declared) is usable or not."""
        if dependency in self._ready:
            self._ready[dependency] = ok

    def readiness(self) -> dict[str, bool]:
        return dict(self._ready)

    def ready(self) -> bool:
        return all(self._ready.values())

    def waiting(self) -> dict[str, Any] | None:
        """What the daemon waits for instead of working although it is ready (a receiver's
        turn): ``state``, ``detail``, ``queue`` (whose turn) and ``seconds`` since the wait
        began; None when it is not waiting. Called from the probes' and the heartbeat's
        threads, so it must read state its own thread replaces whole."""
        return None

    def idle_for(self) -> float:
        """Seconds since the last :meth:`progress`."""
        return time.monotonic() - self.last_progress

    def stuck_for(self, bound: float) -> float | None:
        """Seconds since the last progress if that exceeds ``bound``, else None."""
        idle = self.idle_for()
        return idle if idle > bound else None

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT request a graceful stop; a second one is not needed to stop."""

        def handler(signum: int, frame: FrameType | None) -> None:
            self.log.info("received %s: stopping", signal.Signals(signum).name)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
