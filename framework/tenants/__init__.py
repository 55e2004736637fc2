"""The tenant registry: a service's tenants and where each one's framework tables live.

A registry is listed in a TOML file (``TXBOX_TENANTS_FILE``, framework/tenants/files.py)
or in a table of a control database (``TXBOX_TENANTS_DATABASE_URL``,
framework/tenants/control.py). Either is read into an immutable :class:`Registry` of
:class:`Tenant` values, validated whole; a :class:`RegistryWatcher` reports each
:class:`RegistryChange` without a restart. `txbox migrate` and `txbox check` work on every
tenant (framework/tenants/runs.py). See docs/explanation/operations.md, "Tenants: the registry".
"""

from __future__ import annotations

from framework.tenants.model import MAX_TENANTS, Registry, RegistryChange, Tenant
from framework.tenants.watch import FileSource, RegistrySource, RegistryWatcher, load_registry, open_source

__all__ = [
    "MAX_TENANTS",
    "FileSource",
    "Registry",
    "RegistryChange",
    "RegistrySource",
    "RegistryWatcher",
    "Tenant",
    "load_registry",
    "open_source",
]
