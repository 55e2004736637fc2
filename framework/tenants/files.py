"""The tenant registry from a TOML file (``TXBOX_TENANTS_FILE``).

One table per tenant, named by its key::

    [tenants.acme]                       # database per tenant
    database_url = "postgresql+psycopg://app@db-acme:5432/orders"
    mosaic_tenant_id = "9b2f0c7e-3d1a-4d8e-9a55-1c2b3d4e5f60"

    [tenants.globex]                     # schema per tenant, in TXBOX_DATABASE_URL
    schema = "tenant_globex"

The file is outside input: read up to :data:`MAX_FILE_BYTES`, decoded strictly, parsed by
:mod:`tomllib` (which refuses a key given twice, naming its line), then validated whole by
:func:`framework.tenants.model.build`. Every message names the file and, where it can, the
line of the tenant's table (docs/explanation/operations.md, "Tenants: the registry").
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tomllib
from pathlib import Path

from framework import redaction
from framework.errors import TenantRegistryError
from framework.tenants.model import EXAMPLE_ENTRY, MAX_TENANTS, Entry, Registry, build

MAX_FILE_BYTES = 1 << 20
"""A registry file's size at most: 10,000 tenants with long URLs fit in a third of it."""

# `[tenants.acme]` or `[ tenants . "acme" ]` at the start of a line: where a tenant's
# table starts, for messages. Bounded and anchored: linear on any line.
_HEADER = re.compile(
    r'\s{0,64}\[\s{0,16}tenants\s{0,16}\.\s{0,16}(?:"([^"\n]{1,128})"|([A-Za-z0-9_-]{1,128}))\s{0,16}\]'
)


def read_file(path: Path) -> tuple[bytes, str]:
    """The bytes of ``path`` (bounded) and a description of it for messages."""
    source = f"file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise TenantRegistryError(
            source, [f"cannot be read ({exc.strerror}): check TXBOX_TENANTS_FILE names the registry file"]
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TenantRegistryError(source, ["is not a regular file: TXBOX_TENANTS_FILE must name a TOML file"])
        if info.st_size > MAX_FILE_BYTES:
            raise TenantRegistryError(source, [_too_big(info.st_size)])
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_FILE_BYTES + 1)  # it may have grown since the fstat
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise TenantRegistryError(source, [_too_big(len(data))])
    return data, source


def _too_big(size: int) -> str:
    return (
        f"is {size} bytes, more than {MAX_FILE_BYTES} ({MAX_FILE_BYTES >> 20} MiB): a registry of "
        f"{MAX_TENANTS} tenants fits in far less; is it the right file?"
    )


def parse(data: bytes, source: str, *, default_database_url: str | None, default_schema: str) -> Registry:
    """The registry in ``data`` (a TOML document), or TenantRegistryError naming every problem."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TenantRegistryError(
            source, [f"line {line}: not UTF-8 (byte {exc.start}): save the file as UTF-8"]
        ) from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's text is "<what> (at line L, column C)"; a value it quotes may be a URL.
        detail = redaction.mask_credentials(str(exc))[:300]
        raise TenantRegistryError(source, [f"is not valid TOML: {detail}"]) from None
    unknown = [k for k in document if k != "tenants"]
    if unknown:
        shown = ", ".join(repr(redaction.mask_credentials(k)[:80]) for k in unknown[:5])
        raise TenantRegistryError(
            source,
            [f"has {shown} at the top: it holds only the tenants' tables, one per tenant:\n{EXAMPLE_ENTRY}"],
        )
    tenants = document.get("tenants")
    if tenants is None:
        tenants = {}  # an empty registry: a service with no tenant yet
    if not isinstance(tenants, dict):
        raise TenantRegistryError(
            source, [f"`tenants` must be tables named by each tenant's key ([tenants.KEY]), like:\n{EXAMPLE_ENTRY}"]
        )
    if len(tenants) > MAX_TENANTS:
        raise TenantRegistryError(source, [f"lists {len(tenants)} tenants, more than {MAX_TENANTS}: split the service"])
    lines = _header_lines(text)
    entries: list[Entry] = []
    problems: list[str] = []
    for key, values in tenants.items():
        at = f"line {lines[key]}, " if key in lines else ""
        where = f"{source}, {at}tenant {redaction.mask_credentials(key)[:80]!r}"
        if not isinstance(values, dict):
            problems.append(f"{where}: must be a table of the tenant's fields, like:\n{EXAMPLE_ENTRY}")
            continue
        entries.append(Entry(where=where, key=key, values=values))
    if problems:
        raise TenantRegistryError(source, problems[:20])
    version = hashlib.sha256(data).hexdigest()
    return build(
        entries,
        source=source,
        version=version,
        default_database_url=default_database_url,
        default_schema=default_schema,
    )


def _header_lines(text: str) -> dict[str, int]:
    """Line of each ``[tenants.KEY]`` header (the first, if a malformed file had two)."""
    found: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if "tenants" not in line:
            continue
        match = _HEADER.match(line)
        if match:
            found.setdefault(match.group(1) or match.group(2), number)
    return found


def load_file(path: Path, *, default_database_url: str | None, default_schema: str) -> Registry:
    """The registry of the TOML file ``path``: all or nothing (TenantRegistryError)."""
    data, source = read_file(path)
    return parse(data, source, default_database_url=default_database_url, default_schema=default_schema)


def fingerprint(path: Path) -> str:
    """What changes when the file does: device, inode (an editor's atomic rename), size and
    mtime in ns. A stat, not a read: the watcher's cheap poll. A missing file has its own."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"missing:{exc.errno}"
    return f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"
