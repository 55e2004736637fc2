"""The tenant registry as a value: :class:`Tenant`, :class:`Registry` (an immutable snapshot)
and :class:`RegistryChange` (what differs between two snapshots).

Both sources (a TOML file, framework/tenants/files.py; a control table,
framework/tenants/control.py) hand their entries to :func:`build`, so a tenant is
validated the same way wherever it is listed (docs/explanation/operations.md, "Tenants: the registry").
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from framework import db, names, redaction
from framework.errors import ConfigurationError, TenantRegistryError

MAX_TENANTS = 10_000
"""Tenants one registry may list: past this, a registry is a mistake (or an attack), not a catalog."""
MAX_PROBLEMS = 20
"""Problems one error lists; the rest are counted."""
MAX_LISTED_KEYS = 20
"""Tenant keys one message lists; the rest are counted."""
MAX_URL_CHARS = 4096
FIELDS = ("database_url", "schema", "mosaic_tenant_id", "mosaic_environment_id")
"""What an entry may say besides its key."""
EXAMPLE_ENTRY = '[tenants.acme]\ndatabase_url = "postgresql+psycopg://app@db-acme:5432/orders"'


@dataclass(frozen=True)
class Tenant:
    """One tenant of the service: its key and where its framework tables live.

    ``key`` is the registry's own identity of the tenant (a flag value, a log field, a
    metric label). ``database_url`` and ``schema`` locate its tables: database per tenant
    (its own URL), schema per tenant (the service's URL, its own schema), or both.
    ``mosaic_tenant_id`` / ``mosaic_environment_id``: the ids Mosaic's multi-tenant
    messages carry for it (docs/explanation/receive.md, "Multi-tenant routing keys"); an
    environment id of None stands for every environment of that tenant id.

    ``repr`` and :attr:`display_url` mask the URL's password; the URL itself is the
    connection's, password included.
    """

    key: str
    database_url: str = field(repr=False)
    schema: str
    mosaic_tenant_id: str | None = None
    mosaic_environment_id: str | None = None

    def __repr__(self) -> str:
        mosaic = (
            f", mosaic={self.mosaic_tenant_id}/{self.mosaic_environment_id or '*'}" if self.mosaic_tenant_id else ""
        )
        return f"Tenant(key={self.key!r}, database={self.display_url!r}, schema={self.schema!r}{mosaic})"

    @property
    def display_url(self) -> str:
        """The database URL as it may be shown: its password masked."""
        return redaction.mask_credentials(self.database_url)

    @property
    def location(self) -> tuple[str, str, str, str]:
        """(hosts, ports, database, schema): two tenants here would share one outbox and inbox."""
        params = db.connect_params(self.database_url)
        return (
            params.get("host", "") or "",
            params.get("port", "5432") or "5432",
            params.get("dbname", "") or "",
            self.schema,
        )


@dataclass(frozen=True)
class RegistryChange:
    """What differs from ``before`` to ``after``: tenants added, removed, and changed (old, new)."""

    before: Registry
    after: Registry
    added: tuple[Tenant, ...]
    removed: tuple[Tenant, ...]
    changed: tuple[tuple[Tenant, Tenant], ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def __str__(self) -> str:
        parts = [
            *(f"+{t.key}" for t in self.added),
            *(f"-{t.key}" for t in self.removed),
            *(f"~{new.key}" for _, new in self.changed),
        ]
        return f"{self.after.source}: {len(self.after)} tenants ({' '.join(parts) or 'no change'})"


@dataclass(frozen=True)
class Registry:
    """An immutable snapshot of a service's tenants, sorted by key.

    ``source`` says where it was read (for messages; no password), ``version`` tells two
    readings apart (the file's SHA-256, the control table's change counter).
    """

    tenants: tuple[Tenant, ...]
    source: str
    version: str

    @cached_property
    def _by_key(self) -> dict[str, Tenant]:
        return {t.key: t for t in self.tenants}

    @cached_property
    def _by_mosaic(self) -> dict[tuple[str, str | None], Tenant]:
        return {(t.mosaic_tenant_id, t.mosaic_environment_id): t for t in self.tenants if t.mosaic_tenant_id}

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.tenants)

    def __len__(self) -> int:
        return len(self.tenants)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def keys(self) -> tuple[str, ...]:
        return tuple(t.key for t in self.tenants)

    def get(self, key: str) -> Tenant | None:
        return self._by_key.get(key)

    def tenant(self, key: str) -> Tenant:
        """The tenant ``key``; ConfigurationError naming the registry and some of its keys if none."""
        found = self._by_key.get(key)
        if found is None:
            close = difflib.get_close_matches(key[:80], self._by_key, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigurationError(f"no tenant {key[:80]!r} in {self.source}{hint}. Its tenants: {self.listed()}")
        return found

    def listed(self, limit: int = MAX_LISTED_KEYS) -> str:
        """The keys for a message: the first ``limit``, then how many more (``none`` if empty)."""
        keys = self.keys()
        shown = ", ".join(keys[:limit])
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        return (shown + more) or "none"

    def for_mosaic(self, tenant_id: str, environment_id: str) -> Tenant | None:
        """The tenant a Mosaic message of (``tenant_id``, ``environment_id``) belongs to:
        the entry naming both, else the one naming the tenant id for every environment."""
        return self._by_mosaic.get((tenant_id, environment_id)) or self._by_mosaic.get((tenant_id, None))

    def diff(self, newer: Registry) -> RegistryChange:
        """What changed from this snapshot to ``newer``."""
        old, new = self._by_key, newer._by_key
        return RegistryChange(
            before=self,
            after=newer,
            added=tuple(t for k, t in new.items() if k not in old),
            removed=tuple(t for k, t in old.items() if k not in new),
            changed=tuple((old[k], t) for k, t in new.items() if k in old and old[k] != t),
        )


@dataclass(frozen=True)
class Entry:
    """One tenant as a source lists it, before validation: where (for messages) and what it says."""

    where: str
    key: object
    values: Mapping[str, object]


def build(
    entries: Sequence[Entry], *, source: str, version: str, default_database_url: str | None, default_schema: str
) -> Registry:
    """The registry of ``entries``, or TenantRegistryError listing every entry at fault.

    An entry without ``database_url`` takes ``default_database_url`` (the service's
    TXBOX_DATABASE_URL: schema per tenant), one without ``schema`` takes ``default_schema``
    (TXBOX_SCHEMA). All or nothing: one bad entry and no registry is made, so nothing is
    ever migrated or served from half a registry.
    """
    problems: list[str] = []
    if len(entries) > MAX_TENANTS:
        raise TenantRegistryError(
            source, [f"it lists {len(entries)} tenants, more than {MAX_TENANTS}: split the service"]
        )
    found: list[tuple[Tenant, str]] = []
    for entry in entries:
        tenant = _tenant(entry, default_database_url, default_schema, problems)
        if tenant is not None:
            found.append((tenant, entry.where))
    tenants = _unique(found, problems)
    if problems:
        shown = problems[:MAX_PROBLEMS]
        if len(problems) > MAX_PROBLEMS:
            shown.append(f"… and {len(problems) - MAX_PROBLEMS} more")
        raise TenantRegistryError(source, shown)
    return Registry(tenants=tuple(sorted(tenants, key=lambda t: t.key)), source=source, version=version)


def _text(entry: Entry, name: str, problems: list[str], limit: int) -> str | None:
    value = entry.values.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        problems.append(f"{entry.where}: {name} must be a string, not {type(value).__name__}")
        return None
    if len(value) > limit:
        problems.append(f"{entry.where}: {name} is {len(value)} characters long, more than {limit}")
        return None
    return value


def _tenant(entry: Entry, default_url: str | None, default_schema: str, problems: list[str]) -> Tenant | None:
    """The tenant ``entry`` lists, or None with what is wrong with it appended to ``problems``
    (every problem of the entry, in the order of the checks below, not only the first)."""
    before = len(problems)
    _check_key(entry, problems)
    _check_fields(entry, problems)
    url = _text(entry, "database_url", problems, MAX_URL_CHARS)
    schema = _text(entry, "schema", problems, names.MAX_SCHEMA_CHARS)
    tenant_id = _text(entry, "mosaic_tenant_id", problems, names.MAX_TENANT_ID_CHARS)
    environment_id = _text(entry, "mosaic_environment_id", problems, names.MAX_TENANT_ID_CHARS)
    url = _database_url(entry, url, default_url, problems)
    schema = _schema(entry, schema, default_schema, problems)
    _check_mosaic_ids(entry.where, tenant_id, environment_id, problems)
    key = entry.key
    if len(problems) > before or url is None or schema is None or not isinstance(key, str):
        return None
    return Tenant(
        key=key,
        database_url=url,
        schema=schema,
        mosaic_tenant_id=tenant_id,
        mosaic_environment_id=environment_id,
    )


def _check_key(entry: Entry, problems: list[str]) -> None:
    """A problem unless the entry's key is a valid tenant key (shown masked and cut short)."""
    key = entry.key
    if not isinstance(key, str) or not names.valid_tenant_key(key):
        shown = redaction.mask_credentials(str(key))[:80]
        problems.append(
            f"{entry.where}: tenant key {shown!r} is not valid: 1 to {names.MAX_TENANT_KEY_CHARS} lower-case letters, "
            "digits, '_' or '-', starting with a letter or digit (example: acme, tenant-042)"
        )


def _check_fields(entry: Entry, problems: list[str]) -> None:
    """A problem for each field the entry says that is not one of :data:`FIELDS`."""
    for name in entry.values:
        if name not in FIELDS:
            close = difflib.get_close_matches(str(name)[:80], FIELDS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(
                f"{entry.where}: unknown field {redaction.mask_credentials(str(name))[:80]!r}{hint}; "
                f"an entry may say {', '.join(FIELDS)}"
            )


def _database_url(entry: Entry, url: str | None, default_url: str | None, problems: list[str]) -> str | None:
    """The tenant's database URL: ``url`` as the entry gave it (:func:`_text`), checked, or
    ``default_url`` if the entry says none; a problem if it is unusable or there is none."""
    if url is None and "database_url" not in entry.values:
        if default_url is None:
            problems.append(
                f"{entry.where}: no database_url, and TXBOX_DATABASE_URL is not set to stand in for it: give the "
                "tenant's database (database per tenant), or set TXBOX_DATABASE_URL (schema per tenant)"
            )
        return default_url
    if url is not None:
        problem = url_problem(url)
        if problem:
            problems.append(f"{entry.where}: database_url {redaction.mask_credentials(url)[:200]!r} {problem}")
    return url


def _schema(entry: Entry, schema: str | None, default_schema: str, problems: list[str]) -> str | None:
    """The tenant's schema: ``schema`` as the entry gave it (:func:`_text`), checked, or
    ``default_schema`` if the entry says none."""
    if schema is None and "schema" not in entry.values:
        return default_schema
    if schema is not None and not valid_tenant_schema(schema):
        problems.append(
            f"{entry.where}: schema {schema!r} is not a valid schema name: a lower-case identifier of at most "
            f"{names.MAX_SCHEMA_CHARS} characters, not starting with pg_ (example: tenant_acme)"
        )
    return schema


def _check_mosaic_ids(where: str, tenant_id: str | None, environment_id: str | None, problems: list[str]) -> None:
    """A problem for a Mosaic id that is not one routing-key word, and for an environment
    id without its tenant id."""
    for name, value in (("mosaic_tenant_id", tenant_id), ("mosaic_environment_id", environment_id)):
        if value is not None and not names.valid_mosaic_id(value):
            problems.append(
                f"{where}: {name} {value!r} is not one routing-key word (letters, digits, '_' or '-'; a UUID is one)"
            )
    if environment_id is not None and tenant_id is None:
        problems.append(f"{where}: mosaic_environment_id needs mosaic_tenant_id (the environment of which tenant?)")


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a tenant's database URL (masked text, with the fix), or None."""
    example = "example: postgresql+psycopg://app@db-acme:5432/orders"
    if not url.startswith("postgresql"):
        return f"is not a PostgreSQL URL ({example})"
    try:
        params = db.connect_params(url)
        db.conninfo(url)
    except ConfigurationError as exc:
        detail = redaction.mask_credentials(str(exc)).replace("TXBOX_DATABASE_URL", "database_url")
        return f"is not valid: {detail}"
    if not params.get("dbname"):
        return f"names no database: a tenant's URL says which ({example})"
    return None


def valid_tenant_schema(schema: str) -> bool:
    """A schema a tenant's framework tables may live in (PostgreSQL reserves ``pg_``)."""
    return names.valid_schema(schema) and len(schema) <= names.MAX_SCHEMA_CHARS and not schema.startswith("pg_")


def _unique(found: list[tuple[Tenant, str]], problems: list[str]) -> list[Tenant]:
    """The tenants, each once; a problem for a key listed twice, two tenants at one
    (database, schema), or two for one Mosaic (tenant, environment)."""
    seen_keys: dict[str, str] = {}
    seen_at: dict[tuple[str, str, str, str], Tenant] = {}
    seen_mosaic: dict[tuple[str, str | None], Tenant] = {}
    tenants: list[Tenant] = []
    for t, where in found:
        if t.key in seen_keys:
            problems.append(f"{where}: tenant {t.key!r} is listed twice (also at {seen_keys[t.key]})")
            continue
        seen_keys[t.key] = where
        tenants.append(t)
        other = seen_at.setdefault(t.location, t)
        if other is not t:
            problems.append(
                f"{where}: tenant {t.key!r} has the database and schema of tenant {other.key!r} "
                f"({t.display_url} schema {t.schema}): they would share one outbox and inbox; give each tenant "
                "its own database or schema"
            )
        if t.mosaic_tenant_id:
            pair = (t.mosaic_tenant_id, t.mosaic_environment_id)
            other = seen_mosaic.setdefault(pair, t)
            if other is not t:
                problems.append(
                    f"{where}: tenant {t.key!r} has the Mosaic ids of tenant {other.key!r} "
                    f"({t.mosaic_tenant_id}/{t.mosaic_environment_id or '*'}): a message could not tell them apart"
                )
    return tenants
