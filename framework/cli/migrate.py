"""`txbox migrate`: apply the framework's migrations, or print their SQL."""

from __future__ import annotations

import argparse

from framework import migrate
from framework.cli.common import add_service_options, load_service
from framework.settings import mask_url


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--sql", action="store_true", help="print the SQL instead of executing it")
    parser.add_argument("--revision", default="head", help="target revision (default: head)")
    parser.add_argument("--downgrade", action="store_true", help="downgrade to --revision (e.g. base)")
    add_service_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.sql:
        schema = args.schema or (load_service(args).settings.schema if (args.app or args.service) else "txbox")
        print(migrate.upgrade_sql(schema, args.revision))
        return 0
    settings = load_service(args).settings
    before = migrate.current(settings.database_url, settings.schema)
    if args.downgrade:
        migrate.downgrade(settings.database_url, settings.schema, args.revision)
    else:
        migrate.upgrade(settings.database_url, settings.schema, args.revision)
    after = migrate.current(settings.database_url, settings.schema)
    print(
        f"migrated {mask_url(settings.database_url)} schema {settings.schema}: {before or 'base'} → {after or 'base'}"
    )
    return 0
