"""Alembic environment of the control database's history (the tenant registry's tables).

A history of its own, not a branch of the framework's: the control database is not a
tenant's, so `txbox migrate` never creates these tables in a tenant's database, and
`upgrade head` stays one head in both (docs/explanation/operations.md, "Tenants: the registry").
Its version is kept in ``<TXBOX_TENANTS_SCHEMA>.txbox_tenants_alembic_version``. Run
through `txbox tenants init` (framework.tenants.control.init).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from framework import names
from framework.db import create_engine

config = context.config
schema: str = config.attributes.get("schema") or names.DEFAULT_TENANTS_SCHEMA
if not names.valid_schema(schema):
    raise SystemExit(f"invalid schema name {schema!r}")
# Two `txbox tenants init` at once must not interleave.
LOCK = f"SELECT pg_advisory_xact_lock(hashtext('txbox.tenants.migrate.{schema}'))"


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url") or "postgresql://",
        literal_binds=True,
        version_table=names.TENANTS_ALEMBIC_VERSION_TABLE,
        version_table_schema=schema,
        transactional_ddl=True,
        txbox_schema=schema,
    )
    with context.begin_transaction():
        context.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    engine = None
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "", poolclass=None)
        connection = engine.connect()
    try:
        connection.execute(text(LOCK))
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
        context.configure(
            connection=connection,
            version_table=names.TENANTS_ALEMBIC_VERSION_TABLE,
            version_table_schema=schema,
            transactional_ddl=True,
            txbox_schema=schema,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        if engine is not None:
            connection.close()
            engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
