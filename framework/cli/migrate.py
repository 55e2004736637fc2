"""`txbox migrate`: apply the framework's migrations, or print their SQL; with a tenant
registry, to every tenant (docs/explanation/operations.md, "Tenants: the registry")."""

from __future__ import annotations

import argparse

from framework import migrate
from framework.cli.common import (
    add_service_options,
    add_tenant_options,
    load_service,
    load_tenants,
    picked_tenants,
    quiet_alembic,
    tenant_settings,
)
from framework.settings import TenantSettings, mask_url


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--sql", action="store_true", help="print the SQL instead of executing it")
    parser.add_argument("--revision", default="head", help="target revision (default: head)")
    parser.add_argument("--downgrade", action="store_true", help="downgrade to --revision (e.g. base)")
    add_service_options(parser)
    add_tenant_options(parser)


def run(args: argparse.Namespace) -> int:
    tenants = tenant_settings(args)
    if tenants.configured:
        return run_tenants(args, tenants)
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


def run_tenants(args: argparse.Namespace, settings: TenantSettings) -> int:
    """Every tenant (or those of ``--tenant``), ``TXBOX_TENANTS_JOBS`` at a time: a line
    each as it ends, a summary, and exit code 1 when any failed. The registry is read
    whole first: if it does not load, no tenant is migrated."""
    quiet_alembic(args)
    from framework.tenants.runs import migrate_all

    registry = load_tenants(args, settings)
    chosen = picked_tenants(registry, args.tenant)
    if args.sql:
        for tenant in chosen:
            print(f"-- tenant {tenant.key}: schema {tenant.schema}")
            print(migrate.upgrade_sql(tenant.schema, args.revision))
        return 0
    if not chosen:
        print(f"no tenants in {registry.source}: nothing to migrate")
        return 0
    verb = "downgrading" if args.downgrade else "migrating"
    jobs = min(settings.tenants_jobs, len(chosen))
    print(f"{verb} {len(chosen)} of {len(registry)} tenants of {registry.source} to {args.revision}, {jobs} at a time")
    outcomes = migrate_all(
        chosen,
        revision=args.revision,
        downgrade=args.downgrade,
        jobs=settings.tenants_jobs,
        report=lambda outcome: print(outcome, flush=True),
    )
    failed = sorted(o.tenant.key for o in outcomes if not o.ok)
    shown = ", ".join(failed[:20]) + (", …" if len(failed) > 20 else "")
    print(f"tenants: {len(outcomes) - len(failed)} migrated, {len(failed)} failed" + (f" ({shown})" if failed else ""))
    return 1 if failed else 0
