"""Log records as text (the default) or one JSON object per line (``TXBOX_LOG_FORMAT=json``).

Fields beyond the record's own come from a context variable: :func:`bind` adds some for
a block (the worker binds ``batch_size`` around a batch and ``message_id`` around a
handler run), :func:`set_service` names the process's service once. ``daemon`` is the
bound one, else the daemon a ``txbox.<daemon>`` logger is named for. ``tenant`` is the
one a tenant's daemon logs with (:func:`daemon_logger`), else the bound one. ``trace_id`` comes
from the record (``extra={"trace_id": ...}``), the context, or the source that tracing
registers with :func:`set_trace_id_source`. Both formats pass the whole line through
:mod:`framework.redaction` and mask URL passwords, so no token or password reaches a log
(docs/explanation/operations.md, "Probes, logs and liveness").
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from framework import redaction
from framework.errors import ConfigurationError

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(txbox_tenant)s: %(message)s"
TENANT = "tenant"  # the field naming the tenant a line is about (docs/how-to/tenants.md)

#: A daemon's logger: itself, or one that puts the tenant on every record.
Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]
DAEMONS = ("publisher", "receiver", "worker", "collector")
#: Longest message text formatted: the redaction runs over bounded text, and a log line
#: holding a whole payload helps nobody.
MAX_MESSAGE_CHARS = 32_000

_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "txbox_log_context", default=MappingProxyType({})
)
_service = ""
_trace_id_source: Callable[[], str | None] | None = None


def set_service(service: str) -> None:
    """The process's service, in every JSON line (one service per process)."""
    global _service
    _service = service


def daemon_logger(name: str, tenant: str | None) -> Log:
    """The logger ``name``; with a ``tenant``, one whose every record names it (the ``tenant``
    field of a JSON line, ``[tenant <key>]`` after the logger's name in text)."""
    logger = logging.getLogger(name)
    return _TenantLog(logger, {TENANT: tenant}) if tenant else logger


class _TenantLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Adds the tenant to a record's ``extra``, keeping the caller's (``trace_id``): the
    standard adapter replaces them."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def set_trace_id_source(source: Callable[[], str | None] | None) -> None:
    """Where ``trace_id`` comes from when neither the record nor the context has one (tracing)."""
    global _trace_id_source
    _trace_id_source = source


def bind(**fields: Any) -> AbstractContextManager[None]:
    """Add ``fields`` to every record logged in this thread (or task) within the block. Values
    are kept as they are and turned into text only when a line is written (the worker binds
    each message's id, and most messages log nothing)."""
    return _Bound(fields)


class _Bound:
    """:func:`bind`'s block; a class, not a generator: the worker enters one per message."""

    __slots__ = ("_fields", "_token")

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        self._token = _context.set(MappingProxyType({**_context.get(), **self._fields}))

    def __exit__(self, *exc: object) -> None:
        _context.reset(self._token)


def scrub(text: str) -> str:
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + "… (cut)"
    # URL and DSN passwords too: redact_text is the one scrub (docs/explanation/operations.md, "Secrets").
    return redaction.redact_text(text)


class TextFormatter(logging.Formatter):
    """The classic one-line format, redacted."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        tenant = _tenant_of(record)
        record.txbox_tenant = f" [tenant {tenant}]" if tenant else ""
        return scrub(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, service, daemon and the bound fields."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _context.get()
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": scrub(record.getMessage()),
            "service": fields.get("service") or _service or None,
            "daemon": fields.get("daemon") or _daemon_of(record.name),
        }
        tenant = _tenant_of(record)
        if tenant:
            line[TENANT] = tenant
        line.update((k, v) for k, v in fields.items() if k not in line)
        trace_id = getattr(record, "trace_id", None) or fields.get("trace_id") or _current_trace_id()
        if trace_id:
            line["trace_id"] = trace_id
        if record.exc_info:
            line["exception"] = scrub(self.formatException(record.exc_info))
        elif record.exc_text:
            line["exception"] = scrub(record.exc_text)
        return json.dumps(line, ensure_ascii=False, default=str)


def _tenant_of(record: logging.LogRecord) -> str | None:
    """The tenant a record names: its own (a tenant's daemon logged it), else the bound one."""
    tenant = getattr(record, TENANT, None) or _context.get().get(TENANT)
    return str(tenant) if tenant else None


def _daemon_of(logger: str) -> str | None:
    parts = logger.split(".", 2)
    return parts[1] if len(parts) > 1 and parts[0] == "txbox" and parts[1] in DAEMONS else None


def _current_trace_id() -> str | None:
    if _trace_id_source is None:
        return None
    try:
        return _trace_id_source()
    except Exception:  # a log line must not fail for its trace id
        return None


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each record, like logging's own last resort.

    A command run in-process (``framework.cli.main`` from a test or an embedding program)
    would otherwise keep the stream that was ``sys.stderr`` when it configured logging: a
    capture that is later closed, so the lines of threads that outlive the call fail.
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> Any:  # read-only: setStream() fails rather than appear to switch
        return sys.stderr


def configure(level: int, log_format: str | None) -> None:
    """The root handler on stderr, in ``log_format`` (``TXBOX_LOG_FORMAT``; ``text`` when empty)."""
    chosen = (log_format or "text").strip().lower()
    if chosen not in FORMATS:
        raise ConfigurationError(f"TXBOX_LOG_FORMAT={log_format!r} is not valid: use text or json. Example: "
                                 "TXBOX_LOG_FORMAT=json")  # fmt: skip
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
