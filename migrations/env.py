"""Alembic environment of the framework's own history.

It keeps its version in ``<schema>.txbox_alembic_version`` so a service's own Alembic
history (default ``public.alembic_version``) lives beside it in the same database.
Run through ``txbox migrate`` (framework.migrate), which passes the schema and URL.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from framework import names
from framework.db import create_engine

config = context.config
schema: str = config.attributes.get("schema") or context.get_x_argument(as_dictionary=True).get("schema", "txbox")
if not names.valid_schema(schema):
    raise SystemExit(f"invalid schema name {schema!r}")
# Every serious migration lock: two `txbox migrate` at once must not interleave.
LOCK = f"SELECT pg_advisory_xact_lock(hashtext('txbox.migrate.{schema}'))"


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url") or "postgresql://",
        literal_binds=True,
        version_table=names.ALEMBIC_VERSION_TABLE,
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
            version_table=names.ALEMBIC_VERSION_TABLE,
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
