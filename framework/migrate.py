"""`txbox migrate`: apply (or print) the framework's Alembic history."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection

from framework import migrations as _migrations_pkg  # type: ignore[attr-defined]
from framework.db import database_errors

MIGRATIONS_DIR = Path(_migrations_pkg.__file__).parent


def schema_of(context: MigrationContext) -> str:
    """The schema a migration script writes into (set by migrations/env.py)."""
    schema: str = context.opts["txbox_schema"]
    return schema


def alembic_config(
    database_url: str, schema: str, *, connection: Connection | None = None, output: Any = None
) -> Config:
    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    cfg.attributes["schema"] = schema
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(
    database_url: str, schema: str = "txbox", revision: str = "head", *, connection: Connection | None = None
) -> None:
    with database_errors("cannot migrate"):
        command.upgrade(alembic_config(database_url, schema, connection=connection), revision)


def downgrade(
    database_url: str, schema: str = "txbox", revision: str = "base", *, connection: Connection | None = None
) -> None:
    with database_errors("cannot migrate"):
        command.downgrade(alembic_config(database_url, schema, connection=connection), revision)


def upgrade_sql(schema: str = "txbox", revision: str = "head") -> str:
    """The SQL `txbox migrate --sql` prints (offline mode: nothing is executed)."""
    out = io.StringIO()
    command.upgrade(alembic_config("postgresql+psycopg://", schema, output=out), revision, sql=True)
    return out.getvalue()


def current(database_url: str, schema: str = "txbox") -> str | None:
    from framework import names
    from framework.db import create_engine

    engine = create_engine(database_url)
    try:
        with database_errors("cannot migrate"), engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={"version_table": names.ALEMBIC_VERSION_TABLE, "version_table_schema": schema}
            )
            return ctx.get_current_revision()
    finally:
        engine.dispose()
