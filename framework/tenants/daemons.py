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

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from framework.daemon import Daemon
from framework.service import Service
from framework.tenants.follow import RegistryFollower
from framework.tenants.model import Registry, Tenant

if TYPE_CHECKING:
    from framework.receiver import Receiver

log = logging.getLogger("txbox.tenants")

#: What a tenant has of its own in `txbox run`: its relay and its worker.
OWN = ("publisher", "worker")


def tenant_service(service: Service, tenant: Tenant) -> Service:
    """``service`` with the tenant's database and schema: its handlers and middleware, unchanged."""
    return service.with_settings(database_url=tenant.database_url, schema=tenant.schema)


class TenantDaemons:
    """The tenants' own daemons of one process, following the registry.

    ``make(tenant)`` builds a tenant's daemons (each with a stop event of its own); the
    supervisor that runs them tells it (:meth:`attach`) how to start one on its loop and
    to stop one without stopping the others. Everything here runs on that loop but the
    follower's thread, which only replaces the registry it holds.
    """

    def __init__(
        self,
        follower: RegistryFollower,
        make: Callable[[Tenant], Sequence[Daemon]],
        *,
        receiver: Receiver | None,
        interval: float,
        stop_event: threading.Event,
    ) -> None:
        self.follower = follower
        self.stop_event = stop_event  # the shared daemons' (the receiver's, the collector's): the process's
        self.registry: Registry = follower.registry
        self._make = make
        self._receiver = receiver
        self._add: Callable[[Daemon], None] | None = None
        self._retire: Callable[[Daemon], None] | None = None
        self.interval = interval
        self.daemons: dict[str, list[Daemon]] = {}  # by tenant key: those running now

    def attach(self, add: Callable[[Daemon], None], retire: Callable[[Daemon], None]) -> None:
        """How the supervisor starts a daemon beside the others, and stops one alone."""
        self._add, self._retire = add, retire

    def initial(self) -> list[Daemon]:
        """The daemons of every tenant of the registry in force (started by the supervisor)."""
        for tenant in self.registry:
            self.daemons[tenant.key] = list(self._make(tenant))
        return [d for ds in self.daemons.values() for d in ds]

    def look(self) -> None:
        """On the loop: take up the follower's snapshot if it is newer."""
        assert self._add is not None and self._retire is not None, "attach() first"
        latest = self.follower.registry
        if latest is self.registry:
            return
        change = self.registry.diff(latest)
        self.registry = latest
        if self._receiver is not None and self._receiver.tenancy is not None:
            self._receiver.tenancy.update(latest)  # a removed tenant's deliveries are lettered from now on
        for tenant in change.removed:
            self._stop(tenant.key)
        for _, tenant in change.changed:
            self._stop(tenant.key)
            self._start(tenant)
        for tenant in change.added:
            self._start(tenant)
        log.info("serving %s", change)

    def _start(self, tenant: Tenant) -> None:
        started = self.daemons[tenant.key] = list(self._make(tenant))
        for daemon in started:
            assert self._add is not None
            self._add(daemon)

    def _stop(self, key: str) -> None:
        for daemon in self.daemons.pop(key, []):
            assert self._retire is not None
            self._retire(daemon)

    def counts(self) -> dict[str, Any]:
        """How many tenants are served, and by how many daemons (for logs and the figures)."""
        return {"tenants": len(self.daemons), "daemons": sum(len(d) for d in self.daemons.values())}
