"""`txbox run`: publisher, receiver, worker (and dead-letter collector) of one service in one process.

For small deployments and development. Each daemon runs in a thread of its own with its
usual configuration (``TXBOX_PUBLISHER_*``, ``TXBOX_RECEIVER_*``, ``TXBOX_WORKER_*``,
``TXBOX_COLLECTOR_*``). The threads share one stop event: SIGTERM/SIGINT, or any daemon
dying, stops all of them, each finishing the way it does alone (the publisher waits for
outstanding confirms, the worker for its running batch). The exit code is 0 after a
requested stop, 1 if a daemon failed. One process means one GIL: for throughput run the
daemons as separate processes (`txbox publisher`, `txbox receiver`, `txbox worker`).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import threading
from types import FrameType
from typing import Any

from framework import logs
from framework.cli.common import add_probe_options, add_service_options, liveness_config, load_service
from framework.daemon import Daemon
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
    if "receiver" not in without:
        from framework.receiver import Receiver, ReceiverConfig

        daemons.append(Receiver(service, ReceiverConfig.from_env(), stop_event=stop))
    if "worker" not in without:
        from framework.worker import Worker, WorkerConfig

        daemons.append(Worker(service, WorkerConfig.from_env(), stop_event=stop))
    if "collector" not in without and importlib.util.find_spec("framework.dead_letters.collector") is not None:
        from framework.dead_letters.collector import Collector, CollectorConfig

        daemons.append(Collector(service, CollectorConfig.from_env(), stop_event=stop))
    return daemons


class Supervisor:
    """Runs daemons in threads; the first failure or signal stops them all."""

    def __init__(self, daemons: list[Daemon]) -> None:
        self.daemons = daemons
        self.stop_event = daemons[0].stop_event if daemons else threading.Event()
        self.failures: list[tuple[str, BaseException]] = []
        self._threads: list[threading.Thread] = []

    def _run(self, daemon: Daemon) -> None:
        try:
            with logs.bind(daemon=daemon.name):  # its helper threads' records name it by logger
                daemon.run()
        except BaseException as exc:  # any daemon dying takes the others down cleanly
            log.error("%s failed: %s", daemon.name, exc, exc_info=not isinstance(exc, Exception) or None)
            self.failures.append((daemon.name, exc))
        finally:
            if not self.stop_event.is_set():
                if not self.failures:
                    log.error("%s returned without a stop request: stopping the others", daemon.name)
                    self.failures.append((daemon.name, RuntimeError("returned early")))
                self.stop()

    def start(self) -> None:
        for daemon in self.daemons:
            thread = threading.Thread(target=self._run, args=(daemon,), name=f"txbox {daemon.name}")
            thread.start()
            self._threads.append(thread)
        log.info("running %s", ", ".join(d.name for d in self.daemons))

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.stop()  # sets the shared event and wakes the daemon's own waits

    def join(self, timeout: float) -> list[str]:
        """Wait for every thread after a stop; returns the names still running at the deadline."""
        import time

        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def wait(self) -> None:
        """Block until a stop is requested (signal) or a daemon ends."""
        while not self.stop_event.wait(0.5):
            pass


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
        supervisor.start()
        supervisor.wait()
        stuck = supervisor.join(args.stop_timeout)
    if stuck:
        log.error("still running after %.0fs: %s; exiting anyway", args.stop_timeout, ", ".join(stuck))
        _exit_now(1)
    return 1 if supervisor.failures else 0


def _exit_now(code: int) -> Any:
    """Leave without waiting for non-daemon threads that ignored the stop request."""
    import os

    os._exit(code)
