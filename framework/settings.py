"""Configuration: frozen keyword-only dataclasses read from ``TXBOX_*`` in one place.

Every field names its environment variable and an example value, so a missing or
malformed value fails at start with a message that says which variable and what a valid
value looks like. Daemon-specific settings (publisher, worker, ...) are dataclasses of
the same shape and are read with :func:`load`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, get_args, get_origin

from framework import db, names, redaction
from framework.errors import ConfigurationError

T = TypeVar("T")


def setting(env: str, example: str, default: Any = dataclasses.MISSING, help: str = "") -> Any:
    """A dataclass field bound to environment variable ``env``."""
    meta = {"env": env, "example": example, "help": help}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str) -> float:
    """`250ms`, `10s`, `5m`, `2h`, `7d` or a bare number of seconds → seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


class FromEnv:
    """What the daemons' ``*Config`` classes share: ``from_env(**overrides)``.

    Overrides (CLI flags; None means not given) win over the ``TXBOX_*`` variables, which
    win over the defaults; a bad value fails naming the variable (:func:`load`).
    """

    @classmethod
    def from_env(cls, **overrides: object) -> Self:
        return load(cls, None, **overrides)


class Seconds(float):
    """Marker type: a field of this type accepts durations like `10s` or `5m`."""


def _convert(raw: str, annotation: Any) -> Any:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return None if raw.strip() == "" else _convert(raw, inner[0])
    if origin is Literal:
        allowed = get_args(annotation)
        if raw not in allowed:
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}")
        return raw
    convert = _CONVERTERS.get(annotation)
    return raw if convert is None else convert(raw)


def _boolean(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


# The field types read from text besides optionals and Literals; any other stays the text.
_CONVERTERS: dict[Any, Callable[[str], Any]] = {
    bool: _boolean,
    int: int,
    Seconds: lambda raw: Seconds(parse_duration(raw)),
    float: float,
    Path: Path,
}


def load(cls: type[T], environ: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from ``overrides`` (e.g. CLI flags, None = not given) then ``environ``.

    Raises :class:`ConfigurationError` naming the variable and a valid example.
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        var = f.metadata.get("env")
        example = f.metadata.get("example", "")
        if overrides.get(f.name) is not None:
            value = overrides[f.name]
            if isinstance(value, str) and hints[f.name] is not str:
                value = _convert_or_fail(value, hints[f.name], f"--{f.name.replace('_', '-')}", example)
            values[f.name] = value
        elif var and var in env and env[var] != "":
            values[f.name] = _convert_or_fail(env[var], hints[f.name], var, example)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigurationError(
                f"{var} is not set: it is required ({f.metadata.get('help') or f.name}). Example: {var}={example}"
            )
    try:
        return cls(**values)
    except ConfigurationError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(str(exc)) from exc


def _convert_or_fail(raw: str, annotation: Any, var: str, example: str) -> Any:
    try:
        return _convert(raw, annotation)
    except ValueError as exc:
        raise ConfigurationError(f"{var}={raw!r} is not valid ({exc}). Example: {var}={example}") from None


def describe(cls: type[Any]) -> list[tuple[str, str, str, str]]:
    """(variable, default, example, help) of every field: the configuration reference."""
    rows = []
    for f in dataclasses.fields(cls):
        default = "" if f.default is dataclasses.MISSING else str(f.default)
        rows.append((f.metadata["env"], default, f.metadata["example"], f.metadata.get("help", "")))
    return rows


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every part of a service needs: who it is and where its database and broker are."""

    service: str = setting("TXBOX_SERVICE", "order-service", help="the service id")
    database_url: str = setting(
        "TXBOX_DATABASE_URL",
        "postgresql+psycopg://postgres@127.0.0.1:5432/orders",
        help="SQLAlchemy URL of the service's database (several hosts: see PostgreSQL failover)",
    )
    amqp_url: str = setting(
        "TXBOX_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        default="amqp://guest:guest@127.0.0.1:5672/%2F",
        help="RabbitMQ URL; several, comma-separated, for the nodes of one cluster",
    )
    contracts_dir: Path = setting(
        "TXBOX_CONTRACTS_DIR",
        "contracts",
        default=Path("contracts"),
        help="folder of AsyncAPI + JSON Schema files",
    )
    schema: str = setting(
        "TXBOX_SCHEMA",
        names.DEFAULT_SCHEMA,
        default=names.DEFAULT_SCHEMA,
        help="PostgreSQL schema of the framework's tables",
    )
    queue_type: Literal["quorum", "classic"] = setting(
        "TXBOX_QUEUE_TYPE", "quorum", default="quorum", help="type of the inbox queue"
    )
    outbox_commit_pipeline: bool = setting(
        "TXBOX_OUTBOX_COMMIT_PIPELINE",
        "true",
        default=True,
        help="send outbox rows (and the worker's commit-guard DELETE) with the transaction's COMMIT in one round "
        "trip (false: a statement each)",
    )
    amqp_management_url: str | None = setting(
        "TXBOX_AMQP_MANAGEMENT_URL",
        "http://127.0.0.1:15672/api",
        default=None,
        help="RabbitMQ management API, where the receiver and `txbox topology` apply the inbox delivery-limit "
        "policy; default: the AMQP URL's host and credentials, port 15672 (15671 for amqps); `off`: operator sets it",
    )

    def __post_init__(self) -> None:
        if not names.valid_service_id(self.service):
            raise ConfigurationError(
                f"TXBOX_SERVICE={self.service!r} is not a valid service id (lower case letters, "
                "digits, '-' and '_'). Example: TXBOX_SERVICE=order-service"
            )
        if not names.valid_schema(self.schema):
            raise ConfigurationError(
                f"TXBOX_SCHEMA={self.schema!r} is not a valid schema name (lower case "
                "identifier). Example: TXBOX_SCHEMA=txbox"
            )
        if not self.database_url.startswith("postgresql"):
            raise ConfigurationError(
                f"TXBOX_DATABASE_URL={_mask(self.database_url)!r} is not a PostgreSQL URL. "
                "Example: TXBOX_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/orders"
            )
        db.conninfo(self.database_url)  # a bad host list or option fails now, with the fix
        amqp_urls(self.amqp_url)  # raises ConfigurationError naming the bad entry

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        return load(cls, environ, **overrides)

    @classmethod
    def without_database(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings for a command that never opens the database (`txbox topology`).

        TXBOX_DATABASE_URL may be unset: ``database_url`` then names no server
        (:data:`NO_DATABASE_URL`), so anything that did connect with it would fail
        naming that host rather than reach a database by chance.
        """
        env = os.environ if environ is None else environ
        if overrides.get("database_url") is None and not env.get("TXBOX_DATABASE_URL"):
            overrides = {**overrides, "database_url": NO_DATABASE_URL}
        return load(cls, env, **overrides)


# What `Settings.without_database` holds when no database URL is given: `.invalid` never resolves.
NO_DATABASE_URL = "postgresql+psycopg://txbox-uses-no-database.invalid/none"


# Hide the password of a URL in messages: the one masker (docs/explanation/operations.md, "Secrets").
mask_url = _mask = redaction.mask_credentials

MAX_AMQP_URLS = 64
"""More broker addresses than this is a pasting accident, not a cluster."""


def amqp_urls(value: str) -> list[str]:
    """The broker addresses in ``TXBOX_AMQP_URL``: one URL, or several separated by commas.

    Several URLs name the nodes of one RabbitMQ cluster; a daemon tries them in turn
    (docs/explanation/operations.md, "A RabbitMQ cluster"). Blanks around commas are ignored.
    """
    example = (
        "Example: TXBOX_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2F or, for a cluster, "
        "amqp://guest:guest@mq1:5672/%2F,amqp://guest:guest@mq2:5672/%2F"
    )
    urls = [part.strip() for part in value.split(",", maxsplit=MAX_AMQP_URLS)]
    if len(urls) > MAX_AMQP_URLS:
        raise ConfigurationError(f"TXBOX_AMQP_URL holds more than {MAX_AMQP_URLS} URLs. {example}")
    urls = [url for url in urls if url]
    if not urls:
        raise ConfigurationError(f"TXBOX_AMQP_URL is empty. {example}")
    for url in urls:
        if not url.startswith(("amqp://", "amqps://")):
            raise ConfigurationError(f"TXBOX_AMQP_URL: {_mask(url)!r} is not an AMQP URL. {example}")
    return urls


@dataclass(frozen=True, kw_only=True)
class DedupSettings:
    """How long the inbox remembers a finished message's id (framework/dedup.py)."""

    dedup_window: Seconds = setting(
        "TXBOX_DEDUP_WINDOW",
        "7d",
        default=Seconds(7 * 86400),
        help="a duplicate (or replay) of a message finished within this window is never applied again; "
        "txbox archive keeps the ids it needs for that long",
    )

    def __post_init__(self) -> None:
        if self.dedup_window <= 0:
            raise ConfigurationError(
                f"TXBOX_DEDUP_WINDOW={self.dedup_window:g}s must be positive: a duplicate can arrive days "
                "later (broker redelivery, a replay). Example: TXBOX_DEDUP_WINDOW=7d"
            )


@dataclass(frozen=True, kw_only=True)
class RetentionSettings(FromEnv):
    """How long finished rows stay: the publisher prunes the outbox, the worker the inbox
    (framework/retention.py; docs/explanation/operations.md, "Retention"). ``0`` turns a rule off."""

    outbox_retention: Seconds = setting(
        "TXBOX_OUTBOX_RETENTION",
        "1d",
        default=Seconds(86400),
        help="the publisher deletes outbox rows published longer ago than this; 0: never",
    )
    inbox_retention: Seconds | None = setting(
        "TXBOX_INBOX_RETENTION",
        "7d",
        default=None,
        help="the worker deletes inbox rows processed longer ago than this (default 7d, or TXBOX_DEDUP_WINDOW "
        "if longer; never shorter than it); 0: never",
    )
    abandoned_retention: Seconds = setting(
        "TXBOX_ABANDONED_RETENTION",
        "30d",
        default=Seconds(30 * 86400),
        help="an abandoned row goes after its table's retention once its dead letter is resolved or discarded, "
        "and after this whatever its letter (inbox: at least TXBOX_DEDUP_WINDOW); 0: only once resolved",
    )
    retention_interval: Seconds = setting(
        "TXBOX_RETENTION_INTERVAL", "1m", default=Seconds(60), help="one pruning pass this often"
    )
    retention_batch_size: int = setting(
        "TXBOX_RETENTION_BATCH_SIZE", "1000", default=1000, help="rows deleted per (short) transaction"
    )
    retention_vacuum: bool = setting(
        "TXBOX_RETENTION_VACUUM",
        "true",
        default=True,
        help="after a pass, VACUUM the table (skipped while autovacuum holds it) once its dead tuples exceed "
        "10,000 and a tenth of its live rows, so space is reused even where autovacuum lags or is off",
    )

    def __post_init__(self) -> None:
        for var, value in (
            ("TXBOX_OUTBOX_RETENTION", self.outbox_retention),
            ("TXBOX_INBOX_RETENTION", self.inbox_retention or 0),
            ("TXBOX_ABANDONED_RETENTION", self.abandoned_retention),
        ):
            if value < 0:
                raise ConfigurationError(f"{var}={value:g}s must not be negative (0 turns it off). Example: {var}=7d")
        if self.retention_interval <= 0 or self.retention_batch_size < 1:
            raise ConfigurationError(
                "TXBOX_RETENTION_INTERVAL must be positive and TXBOX_RETENTION_BATCH_SIZE at least 1. "
                "Example: TXBOX_RETENTION_INTERVAL=1m TXBOX_RETENTION_BATCH_SIZE=1000"
            )

    def inbox_horizon(self, dedup_window: float) -> float:
        """Seconds after which a processed inbox row goes (0: never); fails if set inside the window.

        Deleting a row forgets its id, so a retention shorter than ``TXBOX_DEDUP_WINDOW``
        would let a late duplicate run again (docs/explanation/guarantees.md, "Dedup memory").
        """
        if self.inbox_retention is None:
            return max(7 * 86400.0, dedup_window)
        if 0 < self.inbox_retention < dedup_window:
            raise ConfigurationError(
                f"TXBOX_INBOX_RETENTION={self.inbox_retention:g}s is shorter than TXBOX_DEDUP_WINDOW="
                f"{dedup_window:g}s: the worker would forget ids a duplicate may still arrive for. Set "
                f"TXBOX_INBOX_RETENTION={dedup_window:g}s or more, or shorten TXBOX_DEDUP_WINDOW."
            )
        return float(self.inbox_retention)


DEFAULT_SENSITIVE_KEYS = (
    "auth_token,token,password,passwd,secret,api_key,apikey,authorization,cookie,credential,private_key,"
    "signature,session_key"
)


@dataclass(frozen=True, kw_only=True)
class RedactionSettings:
    """Which keys hold secrets: masked in every view, redacted in stored raw bodies (framework.redaction).

    A key matches when its lower-case name (``-`` and ``_`` ignored) contains a listed word.
    The list replaces the defaults; ``auth_token`` is always on it.
    """

    sensitive_keys: str = setting(
        "TXBOX_SENSITIVE_KEYS",
        "token,password,secret,api_key,authorization,cookie,ssn",
        default=DEFAULT_SENSITIVE_KEYS,
        help="comma-separated words; a key containing one of them is masked",
    )

    def __post_init__(self) -> None:
        bad = [w for w in self.sensitive_keys.split(",") if w.strip() and not _SENSITIVE_WORD.fullmatch(w.strip())]
        if bad:
            raise ConfigurationError(
                f"TXBOX_SENSITIVE_KEYS has {', '.join(map(repr, bad))}: each word must be 2 to 64 letters, digits, "
                "'_' or '-'. Example: TXBOX_SENSITIVE_KEYS=token,password,secret,api_key,authorization,cookie"
            )

    @property
    def keys(self) -> tuple[str, ...]:
        words = {w.strip().lower().replace("-", "_") for w in self.sensitive_keys.split(",") if w.strip()}
        return tuple(sorted(words | {"auth_token"}))


_SENSITIVE_WORD = re.compile(r"[A-Za-z0-9_-]{2,64}")


MAX_TENANT_JOBS = 64
"""More tenants migrated or checked at once than this would only queue on the server."""


@dataclass(frozen=True, kw_only=True)
class TenantSettings(FromEnv):
    """Where a service's tenants are listed (framework.tenants; docs/explanation/operations.md,
    "Tenants: the registry").

    At most one source: a TOML file or a table in a control database. Neither: the
    service has one database, ``TXBOX_DATABASE_URL``, as it always had.
    """

    tenants_file: Path | None = setting(
        "TXBOX_TENANTS_FILE",
        "tenants.toml",
        default=None,
        help="TOML file listing the service's tenants as `[tenants.KEY]` tables; a RegistryWatcher reads it again "
        "when it changes",
    )
    tenants_database_url: str | None = setting(
        "TXBOX_TENANTS_DATABASE_URL",
        "postgresql+psycopg://postgres@127.0.0.1:5432/control",
        default=None,
        help="control database whose table `<TXBOX_TENANTS_SCHEMA>.tenants` lists the tenants (`txbox tenants init` "
        "creates it); a RegistryWatcher polls it for changes",
    )
    tenants_schema: str = setting(
        "TXBOX_TENANTS_SCHEMA",
        names.DEFAULT_TENANTS_SCHEMA,
        default=names.DEFAULT_TENANTS_SCHEMA,
        help="schema of the control table in TXBOX_TENANTS_DATABASE_URL",
    )
    tenants_poll_interval: Seconds = setting(
        "TXBOX_TENANTS_POLL_INTERVAL",
        "5s",
        default=Seconds(5),
        help="how often a watcher looks for a change of the registry (a stat of the file, one small row of the table)",
    )
    tenants_jobs: int = setting(
        "TXBOX_TENANTS_JOBS",
        "4",
        default=4,
        help=f"tenants `txbox migrate` and `txbox check` work on at once (1 to {MAX_TENANT_JOBS})",
    )

    def __post_init__(self) -> None:
        if self.tenants_file is not None and self.tenants_database_url is not None:
            raise ConfigurationError(
                "TXBOX_TENANTS_FILE and TXBOX_TENANTS_DATABASE_URL are both set: the tenants come from one "
                "source. Unset one of them. Example: TXBOX_TENANTS_FILE=tenants.toml"
            )
        url = self.tenants_database_url
        if url is not None:
            example = "Example: TXBOX_TENANTS_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/control"
            if not url.startswith("postgresql"):
                raise ConfigurationError(
                    f"TXBOX_TENANTS_DATABASE_URL={_mask(url)!r} is not a PostgreSQL URL. {example}"
                )
            try:
                db.conninfo(url)
            except ConfigurationError as exc:
                raise ConfigurationError(str(exc).replace("TXBOX_DATABASE_URL", "TXBOX_TENANTS_DATABASE_URL")) from None
        if not (names.valid_schema(self.tenants_schema) and len(self.tenants_schema) <= names.MAX_SCHEMA_CHARS):
            raise ConfigurationError(
                f"TXBOX_TENANTS_SCHEMA={self.tenants_schema[:80]!r} is not a valid schema name (a lower-case "
                f"identifier of at most {names.MAX_SCHEMA_CHARS} characters). "
                f"Example: TXBOX_TENANTS_SCHEMA={names.DEFAULT_TENANTS_SCHEMA}"
            )
        if not 0.05 <= self.tenants_poll_interval <= 3600:
            raise ConfigurationError(
                f"TXBOX_TENANTS_POLL_INTERVAL={self.tenants_poll_interval:g}s must be between 50ms and 1h. "
                "Example: TXBOX_TENANTS_POLL_INTERVAL=5s"
            )
        if not 1 <= self.tenants_jobs <= MAX_TENANT_JOBS:
            raise ConfigurationError(
                f"TXBOX_TENANTS_JOBS={self.tenants_jobs} must be between 1 and {MAX_TENANT_JOBS}. "
                "Example: TXBOX_TENANTS_JOBS=4"
            )

    @property
    def configured(self) -> bool:
        """Whether a registry is configured at all (a file or a control database)."""
        return self.tenants_file is not None or self.tenants_database_url is not None
