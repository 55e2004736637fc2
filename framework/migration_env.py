"""What an Alembic environment of txbox's runs: the framework's history (migrations/env.py)
and the control database's (framework/tenants/migrations/env.py) alike.

Each keeps its version in a table of its own in ``schema``, creates the schema first, and
runs under an advisory lock named by ``lock``, so two migrations of the same history and
schema at once do not interleave.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from framework import names
from framework.db import create_engine


def run(schema: str, *, version_table: str, lock: str) -> None:
    """Run the history of the current Alembic context into ``schema``, online or offline."""
    if not names.valid_schema(schema):
        raise SystemExit(f"invalid schema name {schema!r}")
    if context.is_offline_mode():
        _offline(schema, version_table)
    else:
        _online(schema, version_table, f"SELECT pg_advisory_xact_lock(hashtext('{lock}'))")


def _configure(schema: str, version_table: str, **how: object) -> None:
    """The context of either mode: its version table in ``schema``, DDL in one transaction."""
    context.configure(
        **how,  # type: ignore[arg-type]
        version_table=version_table,
        version_table_schema=schema,
        transactional_ddl=True,
        txbox_schema=schema,
    )


def _offline(schema: str, version_table: str) -> None:
    url = context.config.get_main_option("sqlalchemy.url") or "postgresql://"
    _configure(schema, version_table, url=url, literal_binds=True)
    with context.begin_transaction():
        context.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        context.run_migrations()


def _online(schema: str, version_table: str, lock: str) -> None:
    config = context.config
    connection = config.attributes.get("connection")
    engine = None
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "", poolclass=None)
        connection = engine.connect()
    try:
        connection.execute(text(lock))
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
        _configure(schema, version_table, connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        if engine is not None:
            connection.close()
            engine.dispose()
