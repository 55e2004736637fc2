"""`txbox tenants init` (the control database's tables) and `txbox tenants list` (the
registry as the daemons will read it); docs/explanation/operations.md, "Tenants: the registry"."""

from __future__ import annotations

import argparse

from framework.cli.common import (
    add_service_options,
    add_tenant_options,
    load_tenants,
    quiet_alembic,
    tenant_settings,
)
from framework.cli.output import emit, table
from framework.errors import ConfigurationError


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "action",
        choices=("init", "list"),
        help="init: create or upgrade the registry's table in TXBOX_TENANTS_DATABASE_URL; "
        "list: the tenants of the registry, validated",
    )
    add_service_options(parser)
    add_tenant_options(parser, pick=False)


def run(args: argparse.Namespace) -> int:
    from framework.redaction import mask_credentials

    settings = tenant_settings(args)
    if args.action == "init":
        from framework.tenants import control

        if settings.tenants_database_url is None:
            raise ConfigurationError(
                "txbox tenants init creates the registry's table in the control database: set "
                "TXBOX_TENANTS_DATABASE_URL. Example: "
                "TXBOX_TENANTS_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/control"
            )
        before, after = control.init(settings.tenants_database_url, settings.tenants_schema)
        print(
            f"tenant registry {control.describe(settings.tenants_database_url, settings.tenants_schema)}: "
            f"{before or 'base'} → {after or 'base'}"
        )
        return 0
    quiet_alembic(args)
    registry = load_tenants(args, settings)
    rows = [
        [
            t.key,
            mask_credentials(t.display_url),
            t.schema,
            t.mosaic_tenant_id or "-",
            (t.mosaic_environment_id or "*") if t.mosaic_tenant_id else "-",
        ]
        for t in registry
    ]
    emit(table(rows, ["tenant", "database", "schema", "mosaic tenant", "mosaic environment"]))
    emit(f"{len(registry)} tenants in {registry.source}")
    return 0
