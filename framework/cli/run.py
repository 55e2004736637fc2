"""`txbox run`: publisher, receiver, worker (and dead-letter collector) of one service in one process.

The daemons run on one loop on the process's main thread (docs/explanation/daemons.md, "One
loop per process"), each with its usual configuration (``TXBOX_PUBLISHER_*``,
``TXBOX_RECEIVER_*``, ``TXBOX_WORKER_*``, ``TXBOX_COLLECTOR_*``). They share one stop
event: SIGTERM/SIGINT, or any daemon failing, stops all of them, each finishing the way
it does alone (the publisher waits for outstanding confirms, the worker for its running
batch). The exit code is 0 after a requested stop, 1 if a daemon failed. One loop means
one core and handlers that run between the other daemons' work: which deployment suits
which load is in docs/how-to/daemons.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from pika.adapters.select_connection import IOLoop

from framework.cli.common import add_probe_options, add_service_options, liveness_config, load_service
from framework.daemon import STOP_CHECK, Daemon
from framework.service import Service

log = logging.getLogger("txbox.run")

PARTS = ("publisher", "receiver", "worker", "collector")


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    add_probe_options(parser, "all daemons'")
    parser.add_argument(
        "--without",
        action="append",
        choices=PARTS,
        default=[],
        help="leave a daemon out (repeatable), e.g. --without collector",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the daemons to finish after a stop request (default 30)",
    )


def build(service: Service, without: list[str] | tuple[str, ...] = ()) -> list[Daemon]:
    """The daemons of ``service``, configured from the environment, sharing one stop event
    (one stop request reaches every daemon)."""
    service.check()  # fail at start, naming every misfit, before any thread starts
    stop = threading.Event()
    daemons: list[Daemon] = []
    if "publisher" not in without:
        from framework.relay import Relay, RelayConfig

        daemons.append(Relay(service, RelayConfig.from_env(), stop_event=stop))
    from framework.receiver import Receiver, ReceiverConfig
    from framework.worker import Worker, WorkerConfig

    receiver = None if "receiver" in without else Receiver(service, ReceiverConfig.from_env(), stop_event=stop)
    worker = None if "worker" in without else Worker(service, WorkerConfig.from_env(), stop_event=stop)
    if receiver is not None and worker is not None:
        from framework.receiver.handoff import Handoff

        # What the receiver stores goes to this worker in the same round trip
        # (docs/explanation/daemons.md, "The hand-off in one process").
        receiver.handoff = Handoff(worker)
    daemons += [d for d in (receiver, worker) if d is not None]
    if "collector" not in without and importlib.util.find_spec("framework.dead_letters.collector") is not None:
        from framework.dead_letters.collector import Collector, CollectorConfig

        daemons.append(Collector(service, CollectorConfig.from_env(), stop_event=stop))
    return daemons


class Supervisor:
    """Runs daemons on one loop, on the thread that calls :meth:`run`; the first failure,
    or a daemon ending unasked, stops them all (docs/explanation/daemons.md, "One loop per process").

    Everything here runs on that thread but :meth:`stop`, which any thread may call (a
    signal handler too: the daemons share one stop event, which each of them watches).
    """

    def __init__(self, daemons: list[Daemon]) -> None:
        self.daemons = daemons
        self.stop_event = daemons[0].stop_event if daemons else threading.Event()
        self.failures: list[tuple[str, BaseException]] = []
        self.stuck: list[str] = []  # the daemons still running when the stop timeout ran out
        self._loop = IOLoop()
        self._running: set[Daemon] = set()
        self._deadline: float | None = None  # monotonic: give up on the stragglers then
        self._stop_timeout = 30.0  # seconds after a stop request (run's argument)

    def run(self, stop_timeout: float = 30.0) -> None:
        """Start every daemon on the loop and run it until all of them have ended, or until
        ``stop_timeout`` seconds after the stop request (:attr:`stuck` names who is left)."""
        self._stop_timeout = stop_timeout
        try:
            for daemon in self.daemons:
                self._running.add(daemon)
                daemon.start_on(self._loop, functools.partial(self._ended, daemon))
            log.info("running %s on one loop", ", ".join(d.name for d in self.daemons))
            self._loop.call_later(STOP_CHECK, self._watch)
            while self._running and not self.stuck:
                try:
                    self._loop.start()
                except Exception as exc:  # a daemon's callback raised: a bug; the others still drain
                    log.exception("a daemon's callback failed: stopping every daemon")
                    self.failures.append(("loop", exc))
                    self.stop()
        finally:
            self._loop.close()

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.stop()  # sets the shared event, and wakes the loop from another thread

    def _ended(self, daemon: Daemon, exc: BaseException | None) -> None:
        self._running.discard(daemon)
        if exc is not None:
            log.error("%s failed: %s", daemon.name, exc, exc_info=not isinstance(exc, Exception) or None)
            self.failures.append((daemon.name, exc))
        elif not self.stop_event.is_set():
            log.error("%s ended without a stop request: stopping the others", daemon.name)
            self.failures.append((daemon.name, RuntimeError("returned early")))
        if not self.stop_event.is_set():
            self.stop()
        if not self._running:
            self._loop.stop()

    def _watch(self) -> None:
        """Every STOP_CHECK: once a stop was requested, give the daemons ``stop_timeout``."""
        if not self._running:
            return
        now = time.monotonic()
        if self.stop_event.is_set() and self._deadline is None:
            self._deadline = now + self._stop_timeout
        if self._deadline is not None and now >= self._deadline:
            self.stuck = sorted(d.name for d in self._running)
            self._loop.stop()
            return
        self._loop.call_later(STOP_CHECK, self._watch)


def run(args: argparse.Namespace) -> int:
    service = load_service(args)
    daemons = build(service, args.without)
    if not daemons:
        log.error("nothing to run: every daemon was left out")
        return 2
    supervisor = Supervisor(daemons)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: stopping %s", signal.Signals(signum).name, ", ".join(d.name for d in daemons))
        supervisor.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from framework.liveness import watch

    with watch(daemons, port=args.metrics_port, config=liveness_config(args)):
        supervisor.run(args.stop_timeout)
    if supervisor.stuck:
        log.error("still running after %.0fs: %s; exiting anyway", args.stop_timeout, ", ".join(supervisor.stuck))
        _exit_now(1)
    return 1 if supervisor.failures else 0


def _exit_now(code: int) -> Any:
    """Leave without waiting for non-daemon threads that ignored the stop request."""
    import os

    os._exit(code)
