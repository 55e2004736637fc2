"""Sources of the registry and the watcher that reports what changed in one.

A :class:`RegistrySource` has a cheap ``version()`` (a stat of the file, one row of the
control table) and a full ``load()``. :class:`RegistryWatcher` polls it: ``poll()``
returns a :class:`~framework.tenants.model.RegistryChange` when tenants were added,
removed or changed, None otherwise. ``poll`` never blocks longer than one read of the
source, so a daemon's loop can call it on a timer (docs/explanation/operations.md, "Tenants: the
registry"); :meth:`RegistryWatcher.changes` and :meth:`RegistryWatcher.watch` do that
for a thread of their own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from framework import redaction
from framework.errors import TenantRegistryError, TxboxError
from framework.settings import TenantSettings
from framework.tenants import files
from framework.tenants.model import Registry, RegistryChange

log = logging.getLogger("txbox.tenants")


class RegistrySource(Protocol):
    """Where a registry is read: a file or a control table."""

    description: str

    def version(self) -> str:
        """Cheap: changes whenever the registry may have (it may also change when it did not)."""

    def load(self) -> Registry:
        """The whole registry, validated; TenantRegistryError if it does not load."""

    def close(self) -> None: ...


class FileSource:
    """A TOML registry file (framework/tenants/files.py); ``version`` is a stat."""

    def __init__(self, path: Path, *, default_database_url: str | None, default_schema: str) -> None:
        self.path = path
        self.description = f"file {path}"
        self._defaults = (default_database_url, default_schema)

    def version(self) -> str:
        return files.fingerprint(self.path)

    def load(self) -> Registry:
        url, schema = self._defaults
        return files.load_file(self.path, default_database_url=url, default_schema=schema)

    def close(self) -> None:
        pass


def open_source(
    tenants: TenantSettings, *, default_database_url: str | None, default_schema: str
) -> RegistrySource | None:
    """The source ``tenants`` configures (None: no registry). An entry without its own
    URL or schema takes these (the service's TXBOX_DATABASE_URL and TXBOX_SCHEMA)."""
    if tenants.tenants_file is not None:
        return FileSource(
            tenants.tenants_file, default_database_url=default_database_url, default_schema=default_schema
        )
    if tenants.tenants_database_url is not None:
        from framework.tenants.control import TableSource  # Alembic and psycopg only for a control table

        return TableSource(
            tenants.tenants_database_url,
            tenants.tenants_schema,
            default_database_url=default_database_url,
            default_schema=default_schema,
        )
    return None


def load_registry(tenants: TenantSettings, *, default_database_url: str | None, default_schema: str) -> Registry | None:
    """The registry ``tenants`` configures, read once (None: no registry configured)."""
    source = open_source(tenants, default_database_url=default_database_url, default_schema=default_schema)
    if source is None:
        return None
    try:
        return source.load()
    finally:
        source.close()


class RegistryWatcher:
    """Follows one source; owned by the one thread that calls it.

    :meth:`start` reads the first snapshot (its errors are the caller's: a registry that
    does not load at start stops the daemon with the fix). Afterwards a registry that
    stops loading (a half-saved file, a bad row) keeps the last good snapshot in force:
    :meth:`poll` raises its error once per new version of the source and stays quiet
    until the source changes again, so an edit in progress never removes every tenant.
    """

    def __init__(self, source: RegistrySource, *, interval: float) -> None:
        self.source = source
        self.interval = interval
        self._registry: Registry | None = None
        self._seen: str | None = None

    @property
    def registry(self) -> Registry:
        """The snapshot in force (after :meth:`start`)."""
        if self._registry is None:
            raise RuntimeError("RegistryWatcher.start() was not called")
        return self._registry

    def start(self) -> Registry:
        seen = self.source.version()
        self._registry = self.source.load()
        self._seen = seen
        return self._registry

    def poll(self) -> RegistryChange | None:
        """One look at the source: the change since the snapshot in force, or None.

        Raises the source's TxboxError (DatabaseUnavailable: the control database did not
        answer, tried again next poll; TenantRegistryError: the new version does not load,
        reported once). The snapshot in force is kept either way.
        """
        if self._registry is None:
            self.start()
            return None
        seen = self.source.version()
        if seen == self._seen:
            return None
        try:
            newer = self.source.load()
        except TenantRegistryError:
            self._seen = seen  # a version that does not load is reported once, not every poll
            raise
        self._seen = seen  # not on DatabaseUnavailable: the next poll reads this version again
        if newer.version == self._registry.version:
            return None  # touched, not changed
        change = self._registry.diff(newer)
        self._registry = newer
        return change if change else None

    def changes(self, stop: threading.Event) -> Iterator[RegistryChange]:
        """Every change until ``stop`` is set, polling every :attr:`interval` seconds.

        An error of one poll is logged (masked) and the next poll tries again: the
        iterator ends only when ``stop`` is set.
        """
        while not stop.is_set():
            try:
                change = self.poll()
            except TxboxError as exc:
                log.warning("tenant registry: %s", redaction.mask_credentials(str(exc)))
                change = None
            if change is not None:
                yield change
            stop.wait(self.interval)

    def watch(self, callback: Callable[[RegistryChange], None], stop: threading.Event) -> None:
        """Call ``callback`` with each change until ``stop`` is set (see :meth:`changes`)."""
        for change in self.changes(stop):
            callback(change)

    def close(self) -> None:
        self.source.close()
