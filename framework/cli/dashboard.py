"""`txbox dashboard`: the dead-letter and health dashboard (web), 127.0.0.1 by default.

Without TXBOX_DASHBOARD_TOKEN it binds loopback only and says at start that anyone on
this host can read every message; with one, viewing needs it too (framework.dashboard.security).
With a tenant registry (TXBOX_TENANTS_FILE or TXBOX_TENANTS_DATABASE_URL, as `txbox dlq`
reads it), every page takes ``?tenant=KEY`` (docs/how-to/tenants.md, "The dashboard per tenant").
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from framework import names
from framework.cli.common import add_service_options, add_tenant_options, load_service, tenant_defaults, tenant_settings
from framework.errors import ConfigurationError
from framework.settings import load

if TYPE_CHECKING:
    from framework.dashboard.app import DashboardSettings, Source
    from framework.tenants.follow import RegistryFollower

log = logging.getLogger("txbox.dashboard")


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    add_tenant_options(parser, pick=False)
    parser.add_argument("--host", help="address to bind (TXBOX_DASHBOARD_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (TXBOX_DASHBOARD_PORT, default 8470)")
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=DATABASE_URL",
        help="a service to show (repeat for several); default: the one service of --app / TXBOX_*",
    )
    parser.add_argument(
        "--view-requires-token",
        action="store_true",
        default=None,
        help="require TXBOX_DASHBOARD_TOKEN to view pages too (TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN; "
        "the default when a token is set)",
    )


def sources_of(args: argparse.Namespace) -> list[Source]:
    from framework.dashboard.app import Source

    if not args.source:
        settings = load_service(args).settings
        return [
            Source(
                settings.service, settings.database_url, schema=settings.schema, contracts_dir=settings.contracts_dir
            )
        ]
    schema = args.schema or os.environ.get("TXBOX_SCHEMA") or "txbox"
    contracts = args.contracts_dir or Path(os.environ.get("TXBOX_CONTRACTS_DIR") or "contracts")
    out = []
    for spec in args.source:
        name, sep, url = spec.partition("=")
        if not sep or not names.valid_service_id(name) or not url.startswith("postgresql"):
            raise ConfigurationError(
                f"--source {spec!r} must be NAME=DATABASE_URL. "
                "Example: --source order-service=postgresql+psycopg://postgres@127.0.0.1:5432/orders"
            )
        out.append(Source(name, url, schema=schema, contracts_dir=contracts))
    return out


def tenanted(args: argparse.Namespace) -> tuple[list[Source], RegistryFollower] | None:
    """With a tenant registry: the service (its name and contracts; each tenant names its
    database and schema) and the registry's follower, started (its first snapshot read:
    one that does not load fails here). None without a registry."""
    from framework.dashboard.app import Source
    from framework.tenants.follow import follow

    settings = tenant_settings(args)
    if not settings.configured:
        return None
    if args.source:
        raise ConfigurationError(
            "--source names one database per service; with a tenant registry each tenant names its own: "
            "drop --source, or unset TXBOX_TENANTS_FILE and TXBOX_TENANTS_DATABASE_URL"
        )
    url, schema = tenant_defaults(args)
    follower = follow(settings, default_database_url=url, default_schema=schema)
    service = load_service(args, database=False).settings
    # No database of its own: every page that reads one names a tenant.
    return [Source(service.service, "", schema=service.schema, contracts_dir=service.contracts_dir)], follower


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from framework.dashboard.app import DashboardSettings, create_app
    from framework.dashboard.server import config

    settings = load(
        DashboardSettings, None, host=args.host, port=args.port, view_requires_token=args.view_requires_token
    )
    with_tenants = tenanted(args)
    if with_tenants is None:
        app = create_app(sources_of(args), settings)
    else:
        app = create_app(with_tenants[0], settings, tenants=with_tenants[1])
    for line in warnings(settings):
        log.warning("%s", line)
    print(f"txbox dashboard on http://{settings.host}:{settings.port}/", flush=True)
    uvicorn.Server(
        config(
            app,
            settings.host,
            settings.port,
            max_connections=settings.max_connections,
            header_timeout=float(settings.header_timeout),
        )
    ).run()
    if with_tenants is not None:
        with_tenants[1].stop()
    return 0


def warnings(settings: DashboardSettings) -> list[str]:
    """What the operator must know at start about who can read the dashboard."""
    if not settings.token:
        return [
            f"no TXBOX_DASHBOARD_TOKEN: anyone on this host can read every message through "
            f"http://{settings.host}:{settings.port}/ (bound to loopback only; replay and discard are disabled). "
            "Set TXBOX_DASHBOARD_TOKEN=$(openssl rand -hex 24) to require a login."
        ]
    if not settings.views_need_token:
        return [
            "TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN=false: anyone who reaches "
            f"{settings.host}:{settings.port} can read every message without the token"
        ]
    return []
