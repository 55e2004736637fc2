"""Every tenant of a registry served by one process: what `txbox run` runs with a registry.

One receiver serves every tenant (framework/receiver/tenancy.py: each delivery goes to
its tenant's inbox); each tenant has a relay of its own, which publishes its outbox and
names the tenant on every message, and a worker of its own, which runs the handlers in
a session of the tenant's database, so what a handler sends goes into that tenant's
outbox. All of them run on the one loop of a
:class:`~framework.cli.run.Supervisor`. :class:`TenantDaemons` follows the registry
(a :class:`~framework.tenants.follow.RegistryFollower`, whose thread only replaces the
snapshot in force): on the loop, every poll interval, a tenant added gets its daemons,
one removed has them stopped (each finishing as it does alone: confirms, the running
batch), one moved to another database or schema gets new ones while the old ones
finish (docs/how-to/tenants.md, "One set of daemons for every tenant").
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from framework.backoff import backoff_seconds
from framework.daemon import Daemon
from framework.service import Service
from framework.tenants.follow import RegistryFollower
from framework.tenants.model import Registry, Tenant

if TYPE_CHECKING:
    from framework.receiver import Receiver

log = logging.getLogger("txbox.tenants")

RESTART_CAP = 60.0  # seconds at most between a failed tenant's restarts


def tenant_service(service: Service, tenant: Tenant) -> Service:
    """``service`` with the tenant's database and schema: its handlers and middleware, unchanged."""
    return service.with_settings(database_url=tenant.database_url, schema=tenant.schema)


class TenantDaemons:
    """The tenants' own daemons of one process, following the registry.

    ``make(tenant)`` builds a tenant's daemons (each with a stop event of its own); the
    supervisor that runs them tells it (:meth:`attach`) how to start one on its loop, how
    to stop one without stopping the others, and how to wait. Everything here runs on
    that loop but the follower's thread, which only replaces the registry it holds.
    """

    def __init__(
        self,
        follower: RegistryFollower,
        registry: Registry,
        make: Callable[[Tenant], Sequence[Daemon]],
        *,
        receiver: Receiver | None,
        stop_event: threading.Event,
    ) -> None:
        self.follower = follower
        self.registry = registry  # the one the receiver was given: changes are judged from it
        self.stop_event = stop_event  # the shared daemons' (the receiver's, the collector's): the process's
        self.interval = follower.interval
        self._make = make
        self._receiver = receiver
        self._add: Callable[[Daemon], None] | None = None
        self._retire: Callable[[Daemon], None] | None = None
        self._later: Callable[[float, Callable[[], None]], Any] | None = None
        self.daemons: dict[str, list[Daemon]] = {}  # by tenant key: those running now
        self._failures: dict[str, int] = {}  # by tenant key: failures in a row (the restart's backoff)

    def attach(
        self,
        add: Callable[[Daemon], None],
        retire: Callable[[Daemon], None],
        later: Callable[[float, Callable[[], None]], Any],
    ) -> None:
        """How the supervisor starts a daemon beside the others, stops one alone, and calls
        back after a delay, all on its loop."""
        self._add, self._retire, self._later = add, retire, later

    def initial(self) -> list[Daemon]:
        """The daemons of every tenant of the registry (started by the supervisor)."""
        for tenant in self.registry:
            self.daemons[tenant.key] = list(self._make(tenant))
        return [d for ds in self.daemons.values() for d in ds]

    def owner(self, daemon: Daemon) -> str | None:
        """The key of the tenant ``daemon`` is one of, or None (a daemon of the service)."""
        return next((key for key, ds in self.daemons.items() if daemon in ds), None)

    def look(self) -> None:
        """On the loop: take up the follower's snapshot if it is newer. Each tenant's change
        is its own: one that fails to start is logged, and the others are served."""
        latest = self.follower.registry
        if latest is self.registry:
            return
        change = self.registry.diff(latest)
        self.registry = latest
        if self._receiver is not None:
            self._receiver.serve(latest)  # a removed tenant's deliveries are lettered from now on
        for tenant in [*change.removed, *(new for _, new in change.changed)]:
            self._stop(tenant.key)
        for tenant in [*(new for _, new in change.changed), *change.added]:
            self._failures.pop(tenant.key, None)
            self._start(tenant)
        log.info("serving %s", change)

    def failed(self, key: str) -> None:
        """A daemon of tenant ``key`` failed (the supervisor logged it): its others stop, and
        all of them start again after a backoff, if the tenant is still listed then."""
        assert self._later is not None, "attach() first"
        self._stop(key)
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = backoff_seconds(failures, base=1.0, cap=RESTART_CAP, jitter=0.2)
        log.warning("tenant %s: its daemons start again in %.1fs; the other tenants go on", key, delay)
        self._later(delay, functools.partial(self._restart, key))

    def _restart(self, key: str) -> None:
        tenant = self.registry.get(key)
        if tenant is not None and key not in self.daemons and not self.stop_event.is_set():
            self._start(tenant)

    def _start(self, tenant: Tenant) -> None:
        assert self._add is not None, "attach() first"
        try:
            started = self.daemons[tenant.key] = list(self._make(tenant))
            for daemon in started:
                self._add(daemon)
        except Exception:  # a bug of ours or a misfit of this tenant's: the others go on
            log.exception("tenant %s: its daemons did not start; it is not served", tenant.key)
            self._stop(tenant.key)

    def _stop(self, key: str) -> None:
        assert self._retire is not None, "attach() first"
        for daemon in self.daemons.pop(key, []):
            self._retire(daemon)
