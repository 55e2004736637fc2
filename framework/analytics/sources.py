"""Where the job reads from: one PostgreSQL database per service, through JDBC.

A source is ``name=url`` (the service id and its SQLAlchemy URL), given on the command
line (``--source``) or in a YAML file (``--sources-file``)::

    sources:
      order-service: postgresql+psycopg://postgres@127.0.0.1:5432/orders
      inventory-service: postgresql+psycopg://postgres@127.0.0.1:5432/inventory
    report: postgresql+psycopg://postgres@127.0.0.1:5432/orders   # optional

A service with many tenants is one source per tenant (its database and schema): in the
file, a mapping naming the service's tenant registry instead of a URL
(:data:`TENANT_FIELDS`; docs/how-to/tenants.md, "Analyze every tenant").

No pyspark import here: the CLI validates sources before the JVM starts.
"""

from __future__ import annotations

import ipaddress
import logging
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from sqlalchemy.engine import make_url

from framework import db, names
from framework.errors import ConfigurationError

if TYPE_CHECKING:
    from framework.tenants import Registry

JDBC_DRIVER = "org.postgresql.Driver"
log = logging.getLogger("txbox.analyze")

#: What a sources file's entry for a service with tenants may say (the TXBOX_TENANTS_*
#: and TXBOX_DATABASE_URL / TXBOX_SCHEMA settings of that service).
TENANT_FIELDS = ("tenants_file", "tenants_database_url", "tenants_schema", "database_url", "schema")


@dataclass(frozen=True)
class Source:
    """One database the job reads: a service's, or one tenant's of a service.

    ``schema`` None: the job's ``--schema``; a tenant's source names its own.
    """

    service: str
    url: str = field(repr=False)  # SQLAlchemy URL, password included
    tenant: str | None = None
    schema: str | None = None

    @property
    def jdbc(self) -> JdbcTarget:
        return jdbc_target(self.url)

    @property
    def name(self) -> str:
        """How messages name it: ``order-service``, or ``order-service/acme`` for a tenant."""
        return self.service if self.tenant is None else f"{self.service}/{self.tenant}"


def tenant_sources(service: str, registry: Registry) -> list[Source]:
    """One source per tenant of ``registry``, each its tenant's database and schema."""
    return [Source(service, t.database_url, tenant=t.key, schema=t.schema) for t in registry]


@dataclass(frozen=True)
class JdbcTarget:
    """A JDBC URL without credentials plus the credentials as connection properties.

    Credentials stay out of the URL so Spark's plan strings and logs never show them.
    """

    url: str
    user: str | None
    password: str | None

    def options(self) -> dict[str, str]:
        opts = {"url": self.url, "driver": JDBC_DRIVER}
        if self.user:
            opts["user"] = self.user
        if self.password:
            opts["password"] = self.password
        return opts


# libpq's target_session_attrs → pgjdbc's targetServerType (pgjdbc ignores the former).
_JDBC_SERVER_TYPE = {
    "any": "any",
    "read-write": "primary",
    "primary": "primary",
    "read-only": "secondary",
    "standby": "secondary",
    "prefer-standby": "preferSecondary",
}


def jdbc_target(database_url: str) -> JdbcTarget:
    """``postgresql+psycopg://u:p@h:5432/db?sslmode=x`` → ``jdbc:postgresql://h:5432/db?sslmode=x``.

    Several hosts (``?host=a:5432&host=b:5432&target_session_attrs=read-write``) become
    pgjdbc's ``jdbc:postgresql://a:5432,b:5432/db?targetServerType=primary``, so the job
    follows a failover as the daemons do (docs/explanation/operations.md, "PostgreSQL failover").
    """
    try:
        url = make_url(database_url)
    except Exception as exc:  # sqlalchemy raises ArgumentError, but be liberal about input
        raise ConfigurationError(
            f"{database_url!r} is not a database URL ({exc}). "
            "Example: postgresql+psycopg://postgres@127.0.0.1:5432/orders"
        ) from None
    if not url.drivername.startswith("postgres"):
        raise ConfigurationError(f"{url.drivername}: only PostgreSQL sources are supported")
    if not url.database:
        raise ConfigurationError(f"{url.render_as_string()}: the URL names no database")
    params = db.connect_params(database_url)
    hosts = params.pop("host", "localhost").split(",")
    ports = params.pop("port", "").split(",")  # as many as hosts: SQLAlchemy checks
    addresses = ",".join(f"{_bracketed(h or 'localhost')}:{p or 5432}" for h, p in zip(hosts, ports, strict=True))
    query = {k: v for k, v in params.items() if k not in ("dbname", "user", "password", "target_session_attrs")}
    if "target_session_attrs" in params:
        query["targetServerType"] = _JDBC_SERVER_TYPE[params["target_session_attrs"]]
    suffix = f"?{urllib.parse.urlencode(query)}" if query else ""
    return JdbcTarget(
        url=f"jdbc:postgresql://{addresses}/{urllib.parse.quote(url.database)}{suffix}",
        user=url.username,
        password=url.password if isinstance(url.password, str) else None,
    )


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6 literal


def parse_source(text: str) -> Source:
    name, sep, url = text.partition("=")
    name = name.strip()
    if not sep or not name or not url.strip():
        raise ConfigurationError(
            f"--source {text!r} must be service=url. "
            "Example: --source order-service=postgresql+psycopg://postgres@127.0.0.1:5432/orders"
        )
    if not names.valid_service_id(name):
        raise ConfigurationError(f"--source {text!r}: {name!r} is not a valid service id (e.g. order-service)")
    source = Source(name, url.strip())
    source.jdbc  # noqa: B018 - validates the URL now, not after the JVM started
    return source


def load_sources_file(path: Path) -> tuple[list[Source], str | None]:
    """(sources, report url or None) of a YAML sources file."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigurationError(f"--sources-file {path}: cannot read it ({exc})") from None
    entries = doc.get("sources") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise ConfigurationError(
            f"--sources-file {path}: needs a `sources:` mapping of service id → database URL "
            "(example: `sources: {order-service: postgresql+psycopg://postgres@127.0.0.1:5432/orders}`)"
        )
    sources: list[Source] = []
    for service, entry in entries.items():
        if isinstance(entry, dict):
            sources += _tenants_entry(path, str(service), entry)
        else:
            sources.append(parse_source(f"{service}={entry}"))
    report = doc.get("report")
    if report is not None and not isinstance(report, str):
        raise ConfigurationError(f"--sources-file {path}: `report` must be a database URL")
    return sources, report


def _tenants_entry(path: Path, service: str, entry: dict[Any, Any]) -> list[Source]:
    """The sources of a file's entry that names ``service``'s tenant registry."""
    from framework.redaction import mask_credentials
    from framework.settings import TenantSettings, load
    from framework.tenants import load_registry
    from framework.tenants.model import url_problem

    where = f"--sources-file {path}: sources.{service}"
    if not names.valid_service_id(service):
        raise ConfigurationError(f"{where}: {service!r} is not a valid service id (e.g. order-service)")
    unknown = sorted(str(k) for k in entry if k not in TENANT_FIELDS)
    if unknown or not any(entry.get(k) for k in ("tenants_file", "tenants_database_url")):
        raise ConfigurationError(
            f"{where}: a service with tenants names its registry, `tenants_file: PATH` or "
            f"`tenants_database_url: URL` (it may say {', '.join(TENANT_FIELDS)})"
            + (f"; unknown: {', '.join(unknown)[:200]}" if unknown else "")
        )
    if not all(isinstance(v, str) for v in entry.values()):
        raise ConfigurationError(f"{where}: every field is a string")
    registry_file = entry.get("tenants_file")
    default_url, schema = entry.get("database_url"), entry.get("schema") or "txbox"
    try:
        settings = load(
            TenantSettings,
            {},  # the entry says it all: the environment is the job's, not the service's
            tenants_file=(path.parent / registry_file) if registry_file else None,
            tenants_database_url=entry.get("tenants_database_url"),
            tenants_schema=entry.get("tenants_schema"),
        )
        if default_url is not None and (problem := url_problem(default_url)):
            raise ConfigurationError(f"database_url {mask_credentials(default_url)[:200]!r} {problem}")
        if not names.valid_schema(schema):
            raise ConfigurationError(f"schema {schema[:80]!r} is not a valid schema name (example: txbox)")
        registry = load_registry(settings, default_database_url=default_url, default_schema=schema)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
    assert registry is not None  # the entry names a registry (checked above)
    return tenant_sources(service, registry)


def check_unique(sources: list[Source]) -> list[Source]:
    """``sources``, unless a service (or one tenant of it) is given twice, or a service is
    given both as one database and as tenants (ConfigurationError)."""
    seen: set[tuple[str, str | None]] = set()
    for s in sources:
        if (s.service, s.tenant) in seen:
            raise ConfigurationError(f"{s.name!r} is given twice as a source")
        seen.add((s.service, s.tenant))
    for service in {s.service for s in sources if s.tenant is not None}:
        if (service, None) in seen:
            raise ConfigurationError(
                f"service {service!r} is given both as one database and as tenants: keep one "
                "(a tenant's messages would be judged against another database)"
            )
    if not sources:
        raise ConfigurationError(
            "no sources: give --source service=url (repeatable), --sources-file FILE, or set "
            "TXBOX_SERVICE and TXBOX_DATABASE_URL for a single service (or TXBOX_TENANTS_FILE for its tenants)"
        )
    return sources


def check_history(sources: list[Source]) -> None:
    """``--history`` reads `txbox archive`'s folders, one per service: a tenant has none."""
    tenants = [s.name for s in sources if s.tenant is not None]
    if tenants:
        raise ConfigurationError(
            f"--history cannot be read for tenants ({', '.join(tenants[:5])}{' …' if len(tenants) > 5 else ''}): "
            "`txbox archive` archives one database per service; leave out --history, or the tenants"
        )


def is_loopback(host: str | None) -> bool:
    """True for a host that names the machine it is resolved on (None: libpq's localhost)."""
    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_loopback(database_url: str) -> None:
    """On a cluster the executors open the JDBC connections: loopback is their own machine."""
    host = make_url(database_url).host
    if is_loopback(host):
        log.warning(
            "%s: the database host %s is a loopback address, which on a cluster means each executor's own "
            "machine; give the address the executors reach it at",
            make_url(database_url).render_as_string(),
            host or "localhost",
        )
