"""`txbox run`: publisher, receiver, worker (and dead-letter collector) of one service in one process.

The daemons run on one loop on the process's main thread (docs/explanation/daemons.md, "One
loop per process"), each with its usual configuration (``TXBOX_PUBLISHER_*``,
``TXBOX_RECEIVER_*``, ``TXBOX_WORKER_*``, ``TXBOX_COLLECTOR_*``). They share one stop
event: SIGTERM/SIGINT, or any daemon failing, stops all of them, each finishing the way
it does alone (the publisher waits for outstanding confirms, the worker for its running
batch). The exit code is 0 after a requested stop, 1 if a daemon failed. One loop means
one core and handlers that run between the other daemons' work: which deployment suits
which load is in docs/how-to/daemons.md.

With a tenant registry (``TXBOX_TENANTS_FILE``, ``--tenants-file`` or
``TXBOX_TENANTS_DATABASE_URL``) one process serves every tenant: one receiver and one
collector for all, a relay and a worker per tenant, picked up and stopped as the registry
changes (framework/tenants/daemons.py; docs/how-to/tenants.md, "One set of daemons for
every tenant").
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import signal
import threading
import time
from contextlib import nullcontext
from types import FrameType
from typing import Any

from pika.adapters.select_connection import IOLoop

from framework import liveness, metrics
from framework.cli.common import (
    add_probe_options,
    add_service_options,
    add_tenant_options,
    liveness_config,
    load_service,
    tenant_defaults,
    tenant_settings,
)
from framework.daemon import STOP_CHECK, Daemon
from framework.service import Service
from framework.tenants.daemons import TenantDaemons
from framework.tenants.follow import RegistryFollower, follow
from framework.tenants.model import Tenant

log = logging.getLogger("txbox.run")

PARTS = ("publisher", "receiver", "worker", "collector")


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    add_probe_options(parser, "all daemons'")
    add_tenant_options(parser, pick=False)
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
    collector = _collector(service, without, stop)
    return daemons + ([collector] if collector is not None else [])


def _collector(service: Service, without: list[str] | tuple[str, ...], stop: threading.Event) -> Daemon | None:
    if "collector" in without or importlib.util.find_spec("framework.dead_letters.collector") is None:
        return None
    from framework.dead_letters.collector import Collector, CollectorConfig

    return Collector(service, CollectorConfig.from_env(), stop_event=stop)


def build_tenants(
    service: Service, follower: RegistryFollower, without: list[str] | tuple[str, ...] = ()
) -> tuple[list[Daemon], TenantDaemons]:
    """The daemons serving every tenant of ``follower``'s registry: the receiver and the
    collector of the service (its own database: letters naming no tenant, heartbeats),
    sharing one stop event, and each tenant's relay and worker, each with a stop event of
    its own (a tenant that leaves stops alone). The second value adds and stops tenants'
    daemons as the registry changes, once the supervisor runs (:meth:`Supervisor.follow`)."""
    service.check()
    stop = threading.Event()
    from framework.receiver import Receiver, ReceiverConfig
    from framework.receiver.tenancy import Tenancy
    from framework.relay import Relay, RelayConfig
    from framework.tenants.daemons import tenant_service
    from framework.worker import Worker, WorkerConfig
    from framework.worker.wake import Listeners

    registry = follower.registry  # read once: the receiver and the tenants' daemons start from one snapshot
    receiver = None
    if "receiver" not in without:
        config = ReceiverConfig.from_env()
        tenancy = Tenancy(registry, service.registry, service.name, connect_timeout=config.db_connect_timeout)
        receiver = Receiver(service, config, stop_event=stop, tenancy=tenancy)
    relay_config, worker_config = RelayConfig.from_env(), WorkerConfig.from_env()
    # The workers of the tenants of one database share one LISTEN connection
    # (docs/how-to/tenants.md, "One set of daemons for every tenant").
    listeners = Listeners()

    def make(tenant: Tenant) -> list[Daemon]:
        own = tenant_service(service, tenant)
        made: list[Daemon] = []
        if "publisher" not in without:
            made.append(Relay(own, relay_config, stop_event=threading.Event(), tenant=tenant.key))
        if "worker" not in without:
            made.append(
                Worker(own, worker_config, stop_event=threading.Event(), tenant=tenant.key, listeners=listeners)
            )
        return made

    supervised: list[Daemon] = [receiver] if receiver is not None else []
    collector = _collector(service, without, stop)
    supervised += [collector] if collector is not None else []
    tenants = TenantDaemons(follower, registry, make, receiver=receiver, stop_event=stop)
    return supervised + tenants.initial(), tenants


class Supervisor:
    """Runs daemons on one loop, on the thread that calls :meth:`run`; the first failure,
    or a daemon ending unasked, stops them all (docs/explanation/daemons.md, "One loop per process").

    Serving tenants (:meth:`follow`), a tenant's own daemons come and go: one stopped
    because its tenant left ends as no failure, and one that fails takes only its tenant
    down, whose daemons start again after a backoff while the others go on. The process
    then runs until a stop request, even while no tenant is served.

    Everything here runs on that thread but :meth:`stop`, which any thread may call (a
    signal handler too: it only sets flags and events, which the loop watches).
    """

    def __init__(self, daemons: list[Daemon]) -> None:
        self.daemons = daemons
        self.stop_event = daemons[0].stop_event if daemons else threading.Event()
        self._retiring: set[Daemon] = set()  # stopped alone (their tenant left or failed)
        self._tenants: TenantDaemons | None = None
        self.failures: list[tuple[str, BaseException]] = []
        self.stuck: list[str] = []  # the daemons still running when the stop timeout ran out
        self._loop = IOLoop()
        self._running: set[Daemon] = set()
        # Each tenant daemon's gauges, by (daemon, tenant): the daemon they are of (a tenant
        # restarted or moved has new daemons before the old ones ended).
        self._shown: dict[tuple[str, str], Daemon] = {}
        self._deadline: float | None = None  # monotonic: give up on the stragglers then
        self._stop_timeout = 30.0  # seconds after a stop request (run's argument)

    @property
    def _stopping(self) -> bool:
        return self.stop_event.is_set()

    @property
    def _over(self) -> bool:
        """Nothing left to run: every daemon ended, and no tenant's may come (stopping, or none served)."""
        return not self._running and (self._tenants is None or self._stopping)

    def run(self, stop_timeout: float = 30.0) -> None:
        """Start every daemon on the loop and run it until all of them have ended, or until
        ``stop_timeout`` seconds after the stop request (:attr:`stuck` names who is left)."""
        self._stop_timeout = stop_timeout
        try:
            for daemon in self.daemons:
                self._start(daemon)
            log.info("running %s on one loop", ", ".join(d.name for d in self.daemons))
            self._loop.call_later(STOP_CHECK, self._watch)
            if self._tenants is not None:
                self._loop.call_later(self._tenants.interval, self._look)
            while not self._over and not self.stuck:
                try:
                    self._loop.start()
                except Exception as exc:  # a daemon's callback raised: a bug; the others still drain
                    log.exception("a daemon's callback failed: stopping every daemon")
                    self.failures.append(("loop", exc))
                    self.stop()
        finally:
            self._loop.close()

    def stop(self) -> None:
        self.stop_event.set()
        for daemon in list(self.daemons):
            daemon.stop()  # sets its event (most share one), and wakes the loop from another thread

    def follow(self, tenants: TenantDaemons) -> None:
        """Let ``tenants`` add and stop tenants' daemons on this supervisor's loop as the
        registry changes (before :meth:`run`)."""
        tenants.attach(self.add, self.retire, self._loop.call_later)
        self._tenants = tenants
        self.stop_event = tenants.stop_event  # the process's, not a tenant's own

    def add(self, daemon: Daemon) -> None:
        """On the loop: start ``daemon`` beside the others."""
        if self._stopping:
            return
        self.daemons.append(daemon)
        self._start(daemon)

    def _start(self, daemon: Daemon) -> None:
        self._running.add(daemon)
        if daemon.tenant is not None:  # its gauges come and go with it; the others' since-progress is watch()'s
            self._shown[(daemon.name, daemon.tenant)] = daemon
            liveness.show_progress(daemon)
        daemon.start_on(self._loop, functools.partial(self._ended, daemon))

    def retire(self, daemon: Daemon) -> None:
        """On the loop: stop ``daemon`` alone; its end stops no other."""
        if daemon in self._running:
            self._retiring.add(daemon)
            daemon.stop()

    def _look(self) -> None:
        if self._tenants is None or self._stopping:
            return
        try:
            self._tenants.look()
        except Exception:  # a bug of ours: the tenants served stay as they are
            log.exception("following the tenant registry failed: serving the tenants as they were")
        self._loop.call_later(self._tenants.interval, self._look)

    def _ended(self, daemon: Daemon, exc: BaseException | None) -> None:
        self._running.discard(daemon)
        if daemon.tenant is not None and self._shown.get((daemon.name, daemon.tenant)) is daemon:
            del self._shown[(daemon.name, daemon.tenant)]
            metrics.forget(daemon.name, daemon.labels)
        tenant = self._tenants.owner(daemon) if self._tenants is not None else None
        if daemon in self._retiring or (tenant is not None and exc is not None and not self._stopping):
            self._retiring.discard(daemon)
            self.daemons.remove(daemon)
            if exc is not None and tenant is not None and self._tenants is not None:
                log.error("%s of tenant %s failed: %s", daemon.name, tenant, exc, exc_info=True)
                self._tenants.failed(tenant)  # its other daemons stop; all start again after a backoff
            elif exc is not None:
                log.warning("%s failed while it stopped: %s", daemon.name, exc)
        else:
            if exc is not None:
                log.error("%s failed: %s", daemon.name, exc, exc_info=not isinstance(exc, Exception) or None)
                self.failures.append((daemon.name, exc))
            elif not self._stopping:
                log.error("%s ended without a stop request: stopping the others", daemon.name)
                self.failures.append((daemon.name, RuntimeError("returned early")))
            if not self._stopping:
                self.stop()
        if self._over:
            self._loop.stop()

    def _watch(self) -> None:
        """Every STOP_CHECK: once a stop was requested, give the daemons ``stop_timeout``."""
        if self._over:
            self._loop.stop()
            return
        now = time.monotonic()
        if self._stopping and self._deadline is None:
            self._deadline = now + self._stop_timeout
        if self._deadline is not None and now >= self._deadline:
            self.stuck = sorted(d.name for d in self._running)
            self._loop.stop()
            return
        self._loop.call_later(STOP_CHECK, self._watch)


def run(args: argparse.Namespace) -> int:
    service = load_service(args)
    follower = _follower(args, service)
    tenants = None
    if follower is None:
        daemons = build(service, args.without)
    else:
        daemons, tenants = build_tenants(service, follower, args.without)
    if not daemons:
        log.error("nothing to run: every daemon was left out")
        return 2
    supervisor = Supervisor(daemons)
    if tenants is not None:
        supervisor.follow(tenants)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: stopping %s", signal.Signals(signum).name, ", ".join(d.name for d in daemons))
        supervisor.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Serving tenants, the probes and heartbeats follow the service's own daemons: a tenant's
    # come and go (docs/how-to/tenants.md, "One set of daemons for every tenant").
    watched = list(daemons) if tenants is None else [d for d in daemons if tenants.owner(d) is None]
    if not watched and args.metrics_port:
        log.warning("--metrics-port: no probes without a receiver or collector in this process")
    probes = liveness.watch(watched, port=args.metrics_port, config=liveness_config(args)) if watched else nullcontext()
    try:
        with probes:
            supervisor.run(args.stop_timeout)
    finally:
        if follower is not None:
            follower.stop()
    if supervisor.stuck:
        log.error("still running after %.0fs: %s; exiting anyway", args.stop_timeout, ", ".join(supervisor.stuck))
        _exit_now(1)
    return 1 if supervisor.failures else 0


def _follower(args: argparse.Namespace, service: Service) -> RegistryFollower | None:
    """The registry's follower, started (a registry that does not load fails here), or None."""
    settings = tenant_settings(args)
    if not settings.configured:
        return None
    _, schema = tenant_defaults(args)
    return follow(settings, default_database_url=service.settings.database_url, default_schema=schema)


def _exit_now(code: int) -> Any:
    """Leave without waiting for non-daemon threads that ignored the stop request."""
    import os

    os._exit(code)
