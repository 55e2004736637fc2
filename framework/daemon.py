"""What every daemon shares: stop on SIGTERM/SIGINT, state-change logging, metrics port.

A daemon's loop checks :attr:`Daemon.stopping` between units of work and waits with
:meth:`Daemon.wait`, which returns early when a stop is requested, so shutdown is
prompt without sleeping in a busy loop.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

from framework import tracing
from framework.backoff import backoff_seconds
from framework.drivers import tune_drivers

if TYPE_CHECKING:
    from framework.service import Service


class Daemon:
    """Base of the four daemons, which all take ``(service, config=None, *, stop_event=None)``.

    ``config`` is the daemon's ``*Config`` (``from_env()`` when not given); a shared
    ``stop_event`` lets ``txbox run`` stop several daemons with one request
    (docs/architecture.md, "Daemons: one shape").
    """

    name = "daemon"

    def __init__(self, service: Service, *, stop_event: threading.Event | None = None) -> None:
        # Process-wide, so here and not at import (docs/architecture.md, "What txbox changes in a process").
        tune_drivers()
        # Also process-wide; fails at start on a misconfigured OTEL_* (docs/architecture.md, "Tracing").
        tracing.setup(service.settings.service)
        self.service = service
        self.settings = service.settings
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.log = logging.getLogger(f"txbox.{self.name}")
        self._state = ""

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
