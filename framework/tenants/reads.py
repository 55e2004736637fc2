"""A read over several tenants' databases: a bounded thread pool, one result each.

What `txbox dlq list --all-tenants` needs (docs/how-to/tenants.md, "Dead letters per
tenant"): each tenant's rows, and a tenant whose database does not answer reported as
its own failure while the others are read all the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from framework.tenants.model import Tenant
from framework.tenants.runs import Outcome, engine_for, error_text

T = TypeVar("T")


@dataclass(frozen=True)
class Read(Generic[T]):
    """One tenant's read: ``value`` when it worked, else ``failure`` (a masked line for people)."""

    tenant: Tenant
    value: T | None = None
    failure: Outcome | None = None


def read_one(tenant: Tenant, read: Callable[[Tenant, Any], T]) -> Read[T]:
    """``read(tenant, engine)`` on an engine of the tenant's own, disposed of after;
    whatever it raises is the tenant's failure, never the caller's."""
    try:
        engine = engine_for(tenant.database_url)
        try:
            return Read(tenant, value=read(tenant, engine))
        finally:
            engine.dispose()
    except Exception as exc:  # the tenant's failure, whatever raised it (the last resort)
        return Read(tenant, failure=Outcome(tenant, False, error_text(exc)))


def read_each(tenants: Iterable[Tenant], read: Callable[[Tenant, Any], T], *, jobs: int) -> list[Read[T]]:
    """``read`` on every tenant, ``jobs`` at a time; the results in the order of ``tenants``."""
    tenants = list(tenants)
    if not tenants:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(tenants))), thread_name_prefix="txbox-read") as pool:
        return list(pool.map(lambda t: read_one(t, read), tenants))
