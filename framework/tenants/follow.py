"""A registry followed in a thread of its own, for a server whose requests read it.

:class:`RegistryFollower` owns its :class:`~framework.tenants.watch.RegistryWatcher` and
the thread that polls it; the only state it shares is :attr:`RegistryFollower.registry`,
the snapshot in force, which that thread replaces whole and any thread may read
(docs/explanation/operations.md, "Tenants: the registry"). What `txbox dashboard` uses
to pick up tenants added, removed or changed without a restart.
"""

from __future__ import annotations

import logging
import threading

from framework.settings import TenantSettings
from framework.tenants.model import Registry, RegistryChange
from framework.tenants.watch import RegistryWatcher, open_source

log = logging.getLogger("txbox.tenants")


class RegistryFollower:
    """Polls ``watcher`` every ``watcher.interval`` seconds in a daemon thread of its own."""

    def __init__(self, watcher: RegistryWatcher) -> None:
        self._watcher = watcher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registry: Registry | None = None

    @property
    def interval(self) -> float:
        """Seconds between two looks at the source."""
        return self._watcher.interval

    @property
    def registry(self) -> Registry:
        """The snapshot in force (after :meth:`start`): the last that loaded."""
        if self._registry is None:
            raise RuntimeError("RegistryFollower.start() was not called")
        return self._registry

    def start(self) -> Registry:
        """Read the first snapshot here (its errors are the caller's: a registry that does not
        load stops the start with the fix), then follow the source in the thread."""
        self._registry = self._watcher.start()
        self._thread = threading.Thread(target=self._follow, name="txbox-tenants", daemon=True)
        self._thread.start()
        return self._registry

    def _follow(self) -> None:
        try:
            self._watcher.watch(self._changed, self._stop)
        finally:
            self._watcher.close()

    def _changed(self, change: RegistryChange) -> None:
        log.info("tenant registry changed: %s", change)
        self._registry = change.after

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (within one read of the source) and close the source."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def follow(tenants: TenantSettings, *, default_database_url: str | None, default_schema: str) -> RegistryFollower:
    """A follower of the registry ``tenants`` configures (one must be), started: a registry
    that does not load fails here. Entries without their own URL or schema take these."""
    source = open_source(tenants, default_database_url=default_database_url, default_schema=default_schema)
    if source is None:
        raise ValueError("follow() needs a configured registry (TenantSettings.configured)")
    follower = RegistryFollower(RegistryWatcher(source, interval=float(tenants.tenants_poll_interval)))
    follower.start()
    return follower
