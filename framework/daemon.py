"""What every daemon shares: stop on SIGTERM/SIGINT, state-change logging, progress and readiness.

A daemon's loop checks :attr:`Daemon.stopping` between units of work and waits with
:meth:`Daemon.wait`, which returns early when a stop is requested, so shutdown is
prompt without sleeping in a busy loop. Each turn of the loop calls
:meth:`Daemon.progress` (an idle turn too: the loop ticks at least every poll interval),
and the connect steps call :meth:`Daemon.set_ready`; the probes and the heartbeat read
both (docs/explanation/operations.md, "Probes, logs and liveness").
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from framework import logs, tracing
from framework.backoff import backoff_seconds
from framework.drivers import tune_drivers

if TYPE_CHECKING:
    from framework.service import Service


#: The dependencies a daemon reports in ``/readyz``.
POSTGRESQL = "postgresql"
RABBITMQ = "rabbitmq"


class Daemon:
    """Base of the four daemons, which all take ``(service, config=None, *, stop_event=None)``.

    ``config`` is the daemon's ``*Config`` (``from_env()`` when not given); a shared
    ``stop_event`` lets ``txbox run`` stop several daemons with one request
    (docs/explanation/daemons.md, "Daemons: one shape").
    """

    name = "daemon"
    #: What :meth:`ready` requires: the worker talks to PostgreSQL only.
    needs: tuple[str, ...] = (POSTGRESQL, RABBITMQ)

    def __init__(self, service: Service, *, stop_event: threading.Event | None = None) -> None:
        # Process-wide, so here and not at import (docs/explanation/daemons.md, "What txbox changes in a process").
        tune_drivers()
        # Also process-wide; fails at start on a misconfigured OTEL_* (docs/explanation/operations.md, "Tracing").
        tracing.setup(service.settings.service)
        self.service = service
        self.settings = service.settings
        logs.set_service(self.settings.service)
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.log = logging.getLogger(f"txbox.{self.name}")
        self._state = ""
        self.started = time.time()
        self.last_progress = time.monotonic()  # monotonic: a clock step must not look like a hang
        self.last_progress_wall = self.started  # the same moment on the wall clock, for the heartbeat row
        self._ready = dict.fromkeys(self.needs, False)

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def run(self) -> None:
        """The daemon's loop, until :meth:`stop` (each daemon defines it)."""
        raise NotImplementedError

    def stop(self) -> None:
        self.stop_event.set()

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


class Reconnect:
    """Capped exponential backoff between reconnect attempts, reset after a success.

    The cap is short on purpose: a daemon holds one or two connections, so trying every
    second costs the server nothing, while a long cap keeps a daemon away for up to
    that long after the server is back. With a 30 s cap, after a 10 s RabbitMQ or a 4 s
    PostgreSQL restart the daemons came back 3 to 6 s after the server did.
    """

    def __init__(self, daemon: Daemon, *, base: float = 0.5, cap: float = 1.0) -> None:
        self.daemon = daemon
        self.base = base
        self.cap = cap
        self.failures = 0

    def failed(self, what: str, exc: BaseException) -> bool:
        """Record a failure and wait before the next try; True if the daemon is stopping."""
        self.failures += 1
        delay = backoff_seconds(self.failures, base=self.base, cap=self.cap, jitter=0.2)
        self.daemon.state(f"{what} unavailable", f"{exc}; retrying in {delay:.1f}s")
        return self.daemon.wait(delay)

    def succeeded(self) -> None:
        self.failures = 0
