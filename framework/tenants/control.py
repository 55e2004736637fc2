"""The tenant registry in a control database: its tables' history (`txbox tenants init`)
and the reads of the watchers.

``<schema>.tenants`` holds one row a tenant (the columns of a file's entry, plus
``created_at``); ``<schema>.tenants_version`` one row, a counter every change of
``tenants`` bumps in its own transaction, with a NOTIFY on
:func:`framework.names.tenants_channel` (docs/explanation/operations.md, "Tenants: the registry").
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import psycopg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from psycopg import sql

from framework import db, names, redaction
from framework.db import database_errors
from framework.errors import DatabaseUnavailable, TenantRegistryError
from framework.tenants import migrations as _control_migrations
from framework.tenants.model import FIELDS, MAX_TENANTS, Entry, Registry, build

CONTROL_MIGRATIONS_DIR = Path(_control_migrations.__file__).parent
CONNECT_TIMEOUT = 10  # seconds: a control database that does not answer fails the poll, not the loop
STATEMENT_TIMEOUT_MS = 30_000  # a read of at most MAX_TENANTS small rows


def alembic_config(database_url: str, schema: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(CONTROL_MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    cfg.attributes["schema"] = schema
    return cfg


def head() -> str | None:
    """The newest revision of the control history."""
    return ScriptDirectory.from_config(
        alembic_config("postgresql+psycopg://", names.DEFAULT_TENANTS_SCHEMA)
    ).get_current_head()


def current(database_url: str, schema: str) -> str | None:
    """The control history's revision in ``database_url`` (None: never initialised)."""
    engine = db.create_engine(database_url)
    try:
        with database_errors("cannot read the tenant registry's version"), engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={"version_table": names.TENANTS_ALEMBIC_VERSION_TABLE, "version_table_schema": schema},
            )
            return ctx.get_current_revision()
    finally:
        engine.dispose()


def init(database_url: str, schema: str, revision: str = "head") -> tuple[str | None, str | None]:
    """Create (or upgrade) the registry's tables in the control database: (before, after)."""
    before = current(database_url, schema)
    with database_errors("cannot create the tenant registry's tables"):
        command.upgrade(alembic_config(database_url, schema), revision)
    return before, current(database_url, schema)


def describe(database_url: str, schema: str) -> str:
    """The control table as messages name it (no password)."""
    return f"table {schema}.{names.TENANTS} in {redaction.mask_credentials(database_url)}"


class TableSource:
    """The registry in ``<schema>.tenants`` of ``database_url``, for one thread.

    :meth:`version` is the cheap poll (one row); :meth:`load` reads every row in one
    snapshot with the version it belongs to. One connection, opened on first use and
    again after a failure; :meth:`close` closes it.
    """

    def __init__(
        self, database_url: str, schema: str, *, default_database_url: str | None, default_schema: str
    ) -> None:
        self.database_url = database_url
        self.schema = schema
        self.description = describe(database_url, schema)
        self._defaults = (default_database_url, default_schema)
        self._conn: psycopg.Connection[Any] | None = None
        table = sql.Identifier(schema, names.TENANTS)
        self._version_sql = sql.SQL("SELECT version FROM {}").format(sql.Identifier(schema, names.TENANTS_VERSION))
        self._rows_sql = sql.SQL("SELECT key, {} FROM {} ORDER BY key LIMIT {}").format(
            sql.SQL(", ").join(map(sql.Identifier, FIELDS)), table, sql.Literal(MAX_TENANTS + 1)
        )

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            conn = db.connect(self.database_url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
            try:
                conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(STATEMENT_TIMEOUT_MS)))
            except psycopg.Error:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _read(self, what: str, fn: Any) -> Any:
        try:
            return fn(self._connection())
        except psycopg.errors.UndefinedTable:
            self.close()
            raise TenantRegistryError(
                self.description,
                [
                    "does not exist: create it with `txbox tenants init` (TXBOX_TENANTS_DATABASE_URL, "
                    "TXBOX_TENANTS_SCHEMA name where)"
                ],
            ) from None
        except psycopg.Error as exc:
            self.close()
            raise DatabaseUnavailable(f"cannot {what} {self.description}: {exc}".strip()) from None

    def version(self) -> str:
        """The registry's change counter (one row): it moves with every change of the table."""
        row = self._read("read the version of", lambda c: c.execute(self._version_sql).fetchone())
        if row is None:
            raise TenantRegistryError(self.description, ["has lost its version row: run `txbox tenants init` again"])
        return str(row[0])

    def load(self) -> Registry:
        """Every tenant, validated whole (TenantRegistryError naming each row at fault)."""

        def read(conn: psycopg.Connection[Any]) -> tuple[Any, list[Any]]:
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                version = conn.execute(self._version_sql).fetchone()
                rows = conn.execute(self._rows_sql).fetchall()
            return version, rows

        version, rows = self._read("read", read)
        if len(rows) > MAX_TENANTS:
            raise TenantRegistryError(self.description, [f"holds more than {MAX_TENANTS} tenants: split the service"])
        entries = [
            Entry(
                where=f"{self.description}, row {redaction.mask_credentials(str(row[0]))[:80]!r}",
                key=row[0],
                values={name: value for name, value in zip(FIELDS, row[1:], strict=True) if value is not None},
            )
            for row in rows
        ]
        default_url, default_schema = self._defaults
        return build(
            entries,
            source=self.description,
            version=str(version[0] if version else "none"),
            default_database_url=default_url,
            default_schema=default_schema,
        )

    def fileno(self) -> int | None:
        """The connection's socket, once open (for a loop that LISTENs on it later)."""
        return self._conn.fileno() if self._conn is not None and not self._conn.closed else None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):  # a broken connection: nothing left to release
                self._conn.close()
            self._conn = None
