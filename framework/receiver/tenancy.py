"""Which tenant a delivery belongs to, and where that tenant's deliveries are written.

A receiver given a :class:`Tenancy` serves every tenant of a registry from the service's
one inbox queue (docs/how-to/tenants.md, "One set of daemons for every tenant"). Each
delivery's tenant is read from the message itself, in this order:

1. the ``x-txbox-tenant`` header, a registry key, which a txbox relay serving tenants
   puts on every message of a tenant's outbox: a control header, honoured from trusted
   broker users only (``TXBOX_RECEIVER_TRUSTED_USERS`` and the receiver's own);
2. the tenant and environment ids a Mosaic multi-tenant routing key carries
   (``<tenant>.<environment>.entity.action``, the original key for a retry copy), the
   entry :meth:`~framework.tenants.Registry.for_mosaic` maps them to.

A delivery that names no tenant, or one the registry does not list, is an
``unknown_tenant`` dead letter in the service's own database (``TXBOX_DATABASE_URL``),
never a row in some tenant's inbox. Pure translation but for :class:`Store`, which holds
a tenant's connection: both are the receiver loop's, made on first use and closed when
the tenant leaves the registry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from framework import names
from framework.connections import ConnectionSlot
from framework.contracts import Registry as Contracts
from framework.receiver.intake import Delivery
from framework.sql import inbox as inbox_sql
from framework.tenants.model import Registry

APPLICATION_NAME = "txbox-receiver"


@dataclass(eq=False)
class Link:
    """One connection to a database, shared by the stores of every tenant there.

    ``prepared``: the connection the batch INSERTs were prepared on and their names
    (each schema's INSERT has a name of its own).
    """

    slot: ConnectionSlot
    prepared: tuple[Any, frozenset[bytes]] = (None, frozenset())

    def close(self) -> None:
        self.slot.close()
        self.prepared = (None, frozenset())


def link(database_url: str, connect_timeout: float) -> Link:
    return Link(ConnectionSlot(database_url, connect_timeout=connect_timeout, application_name=APPLICATION_NAME))


@dataclass(eq=False)
class Store:
    """Where one tenant's deliveries are written (``key`` None: the service's own database):
    a schema, over the connection of its database."""

    key: str | None
    schema: str
    link: Link
    sql_insert: bytes = field(init=False)
    insert_name: bytes = field(init=False)  # the INSERT's prepared name on the connection

    def __post_init__(self) -> None:
        self.sql_insert = inbox_sql.insert_all_new_sql(self.schema)
        # Within PostgreSQL's 63 bytes, whatever the schema's length: longer names are cut,
        # and two schemas alike in their first 41 characters would then share one.
        self.insert_name = f"txbox_receiver_insert_{hashlib.sha1(self.schema.encode()).hexdigest()[:16]}".encode()

    @property
    def slot(self) -> ConnectionSlot:
        return self.link.slot

    def close(self) -> None:
        """Drop the connection (after an error: the other tenants of the database reconnect too)."""
        self.link.close()


def store(key: str | None, database_url: str, schema: str, connect_timeout: float) -> Store:
    """A store over a connection of its own."""
    return Store(key, schema, link(database_url, connect_timeout))


@dataclass(frozen=True)
class Resolved:
    """A delivery's tenant: its key, or None with why it has none (the dead letter's text)."""

    key: str | None
    error: str | None = None


class Tenancy:
    """The registry in force and the tenants' stores, for one receiver's loop."""

    def __init__(self, registry: Registry, contracts: Contracts, service: str, *, connect_timeout: float) -> None:
        self.registry = registry
        self.service = service
        self._connect_timeout = connect_timeout
        # The multi-tenant routing keys the service receives: a key that fits one names a tenant.
        self._patterns = sorted({s.routing_key for s in contracts.accepted_types(service) if s.tenant_scoped})
        self._stores: dict[str, Store] = {}
        self._links: dict[str, Link] = {}  # by database URL: one connection a database
        self._retired: list[Link] = []  # no store uses them any more: closed by tidy()

    def resolve(self, delivery: Delivery) -> Resolved:
        """The tenant ``delivery`` names (see the module's docstring), or why it names none.

        Never raises: a failure of ours judging the delivery is a letter saying so, so one
        odd delivery cannot end the session and come back forever.
        """
        try:
            return self._resolve(delivery)
        except Exception as exc:  # last resort: a bug of ours, not the input's fault
            return Resolved(None, f"the receiver could not tell the tenant: {type(exc).__name__}: {exc}"[:500])

    def _resolve(self, delivery: Delivery) -> Resolved:
        by_header = self._by_header(delivery)
        routing_key = delivery.original_routing_key(self.service)[: names.MAX_ROUTING_KEY_CHARS]
        by_key = self._by_routing_key(routing_key)
        if by_header is not None:
            if by_header.key is not None and by_key is not None and by_key.key != by_header.key:
                return Resolved(
                    None,
                    f"header {names.HEADER_TENANT} names tenant {by_header.key!r} but routing key {routing_key!r} "
                    f"names {'tenant ' + repr(by_key.key) if by_key.key else 'no tenant of the registry'}: "
                    "a message stored on either would be stored on a guess",
                )
            return by_header
        if by_key is not None:
            return by_key
        untrusted = not delivery.trusted and names.HEADER_TENANT in delivery.headers
        why = (
            f"its {names.HEADER_TENANT} header counts only from a trusted broker user (TXBOX_RECEIVER_TRUSTED_USERS)"
            if untrusted
            else f"no {names.HEADER_TENANT} header"
        )
        return Resolved(
            None,
            f"the delivery names no tenant: {why}, and its routing key {routing_key[:200]!r} is no multi-tenant "
            f"key of {self.service}; a service with a tenant registry stores only what names one of its tenants",
        )

    def _by_header(self, delivery: Delivery) -> Resolved | None:
        """What a trusted ``x-txbox-tenant`` header says (None: there is none)."""
        header = delivery.control(names.HEADER_TENANT)
        if header is None:
            return None
        if isinstance(header, bytes):
            header = header.decode("utf-8", "replace")
        key = header[: names.MAX_TENANT_KEY_CHARS + 1] if isinstance(header, str) else repr(header)[:80]
        if isinstance(header, str) and key in self.registry:
            return Resolved(key)
        return Resolved(
            None,
            f"header {names.HEADER_TENANT} names tenant {key!r}, which {self.registry.source} does not list "
            f"(its tenants: {self.registry.listed()})",
        )

    def _by_routing_key(self, routing_key: str) -> Resolved | None:
        """What the Mosaic ids of a multi-tenant routing key say (None: it is none)."""
        for pattern in self._patterns:
            ids = names.tenancy(pattern, routing_key)
            if ids is None:
                continue
            tenant = self.registry.for_mosaic(*ids)
            if tenant is not None:
                return Resolved(tenant.key)
            return Resolved(
                None,
                f"routing key {routing_key!r} names Mosaic tenant {ids[0]!r} environment {ids[1]!r}, which no "
                f"tenant of {self.registry.source} has (mosaic_tenant_id, mosaic_environment_id)",
            )
        return None

    def store(self, key: str) -> Store:
        """The store of tenant ``key`` (in the registry in force), made on first use."""
        made = self._stores.get(key)
        if made is None:
            tenant = self.registry.tenant(key)
            shared = self._links.get(tenant.database_url)
            if shared is None:
                shared = self._links[tenant.database_url] = link(tenant.database_url, self._connect_timeout)
            made = self._stores[key] = Store(key, tenant.schema, shared)
        return made

    def update(self, registry: Registry) -> None:
        """Serve ``registry`` from now on (a delivery read from now on is judged by it): the
        stores of tenants it no longer lists, or lists elsewhere, go; a connection no store
        uses any more is retired, and closed by :meth:`tidy` once no write is on it."""
        for key in [k for k in self._stores if registry.get(k) != self.registry.get(k)]:
            del self._stores[key]
        self.registry = registry
        used = {id(kept.link) for kept in self._stores.values()}
        for url in [u for u, shared in self._links.items() if id(shared) not in used]:
            self._retired.append(self._links.pop(url))

    def tidy(self, busy: Link | None = None) -> None:
        """Close the retired connections but ``busy`` (the one a write is in flight on)."""
        kept = []
        for retired in self._retired:
            if retired is busy:
                kept.append(retired)
            else:
                retired.close()
        self._retired = kept

    def close(self) -> None:
        for shared in [*self._links.values(), *self._retired]:
            shared.close()
        self._links.clear()
        self._retired.clear()
        self._stores.clear()
