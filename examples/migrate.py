"""Migrate an example service's database: the framework's history, then its own.

Two Alembic histories share one database without touching each other: the framework's
(``txbox migrate``; version table ``txbox.txbox_alembic_version``) and the service's
business tables (``examples/<service>/migrations``; Alembic's default version table
``public.alembic_version``). Plain Alembic works too::

    TXBOX_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/txbox_demo_orders \\
        alembic -c examples/orders/alembic.ini upgrade head

or ``python -m examples.migrate orders`` for both histories at once.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, create_engine, text

from framework import migrate as framework_migrate

HERE = Path(__file__).resolve().parent
EXAMPLES = ("orders", "inventory")


def config(example: str, database_url: str) -> Config:
    cfg = Config(str(HERE / example / "alembic.ini"))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(example: str, database_url: str, *, schema: str = "txbox") -> None:
    """Both histories to head; idempotent."""
    framework_migrate.upgrade(database_url, schema)
    command.upgrade(config(example, database_url), "head")


def business_revision(database_url: str) -> str | None:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def run_env(metadata: MetaData) -> None:
    """Body of each example's ``migrations/env.py`` (online mode; offline prints SQL)."""
    from alembic import context

    cfg = context.config
    url = cfg.get_main_option("sqlalchemy.url") or os.environ.get("TXBOX_DATABASE_URL")
    if not url:
        raise SystemExit("set TXBOX_DATABASE_URL (or sqlalchemy.url) to the service's database")
    if context.is_offline_mode():
        context.configure(url=url, target_metadata=metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            # Two migrations started at once (two replicas) must not interleave.
            connection.execute(text("SELECT pg_advisory_xact_lock(hashtext('examples.migrate'))"))
            context.configure(connection=connection, target_metadata=metadata)
            with context.begin_transaction():
                context.run_migrations()
            connection.commit()
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("example", choices=EXAMPLES)
    parser.add_argument("--database-url", default=None, help="default: the example app's TXBOX_DATABASE_URL")
    args = parser.parse_args()
    import importlib

    service = importlib.import_module(f"examples.{args.example}.app").service
    url = args.database_url or service.settings.database_url
    upgrade(args.example, url, schema=service.settings.schema)
    print(f"{args.example}: framework and business migrations at head")


if __name__ == "__main__":
    main()
