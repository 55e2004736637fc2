"""Options every command shares: which service (``--app`` or ``TXBOX_*``) and overrides."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from framework.errors import ConfigurationError
from framework.service import Service
from framework.settings import Settings

if TYPE_CHECKING:
    from framework.liveness import LivenessConfig
    from framework.settings import TenantSettings
    from framework.tenants import Registry, Tenant


def add_service_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service (default: the TXBOX_* environment)")
    group.add_argument(
        "--app", default=os.environ.get("TXBOX_APP"), help="module:attribute of a txbox Service (env TXBOX_APP)"
    )
    group.add_argument("--service", help="service id (TXBOX_SERVICE)")
    group.add_argument("--database-url", help="SQLAlchemy URL (TXBOX_DATABASE_URL)")
    group.add_argument("--amqp-url", help="RabbitMQ URL (TXBOX_AMQP_URL)")
    group.add_argument("--contracts-dir", type=Path, help="contracts folder (TXBOX_CONTRACTS_DIR)")
    group.add_argument("--schema", help="schema of the framework's tables (TXBOX_SCHEMA)")
    group.add_argument("--queue-type", choices=("quorum", "classic"), help="inbox queue type (TXBOX_QUEUE_TYPE)")


def add_spark_options(group: argparse._ArgumentGroup) -> None:
    """The Spark job's options, the same for `txbox analyze` and `txbox archive` (both read
    their defaults from the TXBOX_ANALYZE_* settings)."""
    group.add_argument("--master", help="Spark master, e.g. spark://HOST:7077 (TXBOX_ANALYZE_MASTER; default local[*])")
    group.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="spark.KEY=VALUE",
        help="a Spark setting, as spark-submit takes it (repeatable), e.g. spark.executor.memory=512m",
    )
    group.add_argument("--jdbc-jar", type=Path, help="PostgreSQL JDBC jar (TXBOX_JDBC_JAR)")
    group.add_argument("--partition-rows", type=int, help="rows per JDBC read partition (TXBOX_ANALYZE_PARTITION_ROWS)")


def add_probe_options(parser: argparse.ArgumentParser, what: str = "the daemon's") -> None:
    """``--metrics-port`` / ``--metrics-addr``: where :func:`framework.liveness.watch` serves the probes."""
    parser.add_argument("--metrics-port", type=int, help=f"serve {what} /metrics, /healthz and /readyz on this port")
    parser.add_argument(
        "--metrics-addr", help="address to bind the --metrics-port to (TXBOX_METRICS_ADDR; default 127.0.0.1)"
    )


def liveness_config(args: argparse.Namespace) -> LivenessConfig:
    from framework.liveness import LivenessConfig  # daemon commands only: `txbox migrate` stays light

    return LivenessConfig.from_env(metrics_addr=args.metrics_addr)


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    return {
        "service": args.service,
        "database_url": args.database_url,
        "amqp_url": args.amqp_url,
        "contracts_dir": args.contracts_dir,
        "schema": args.schema,
        "queue_type": args.queue_type,
    }


def load_service(args: argparse.Namespace, *, database: bool = True) -> Service:
    """The Service named by ``--app``, else one built from the environment and flags.

    ``database=False``: the command never opens the database, so TXBOX_DATABASE_URL
    need not be set (Settings.without_database).
    """
    if args.app:
        service = import_app(args.app)
        given = {k: v for k, v in _overrides(args).items() if v is not None}
        if given:
            import dataclasses

            service.settings = dataclasses.replace(service.settings, **given)  # type: ignore[arg-type]
        return service
    settings = (
        Settings.from_env(None, **_overrides(args)) if database else Settings.without_database(None, **_overrides(args))
    )
    return Service(settings=settings)


def import_app(spec: str) -> Service:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--app {spec!r} must be module:attribute. Example: --app examples.orders.app:service")
    # `--app` names the user's module relative to where txbox runs, as uvicorn's and gunicorn's
    # do; a console script's sys.path starts at its bin folder, not at the cwd.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"--app {spec!r}: cannot import {module_name!r} ({exc})") from None
    try:
        service = getattr(module, attr)
    except AttributeError:
        raise ConfigurationError(f"--app {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(service, Service):
        raise ConfigurationError(f"--app {spec!r} is a {type(service).__name__}, not a txbox Service")
    return service


def check_assembly(service: Service, command: str, *, runs_handlers: bool) -> None:
    """The assembly check every daemon command runs at start (``Service.check``): raises
    AssemblyError naming every misfit and its fix before anything connects; prints the
    warnings. ``runs_handlers``: whether this command runs the service's handlers."""
    for warning in service.check(runs_handlers=runs_handlers):
        print(f"txbox {command}: {warning}")


def settings_only(args: argparse.Namespace) -> Settings:
    """Settings without importing handlers (commands that do not run user code)."""
    return load_service(args).settings


def quiet_pika(args: argparse.Namespace) -> None:
    """Keep pika's own tracebacks of a failed connect out of a command's output (unless -v).

    txbox reports the failure itself, in one line naming the fix, and the daemons log one
    line per state change; pika's ERROR records would repeat it with a stack trace.
    """
    if not getattr(args, "verbose", False):
        logging.getLogger("pika").setLevel(logging.CRITICAL)


def add_tenant_options(parser: argparse.ArgumentParser, *, pick: bool = True) -> None:
    """The tenant registry's options (docs/explanation/operations.md, "Tenants: the registry")."""
    group = parser.add_argument_group("tenants (default: the TXBOX_TENANTS_* environment)")
    group.add_argument("--tenants-file", type=Path, help="TOML registry of the tenants (TXBOX_TENANTS_FILE)")
    if pick:
        group.add_argument(
            "--tenant", action="append", default=[], metavar="KEY", help="only this tenant of the registry (repeatable)"
        )
        group.add_argument("--jobs", type=int, help="tenants worked on at once (TXBOX_TENANTS_JOBS; default 4)")


def tenant_settings(args: argparse.Namespace) -> TenantSettings:
    from framework.settings import TenantSettings

    settings = TenantSettings.from_env(tenants_file=args.tenants_file, tenants_jobs=getattr(args, "jobs", None))
    flag = next((f"--{n.replace('_', '-')}" for n in ("tenant", "all_tenants") if getattr(args, n, None)), "")
    if flag and not settings.configured:
        raise ConfigurationError(
            f"{flag} needs a tenant registry: set TXBOX_TENANTS_FILE (or --tenants-file) or "
            "TXBOX_TENANTS_DATABASE_URL. Example: TXBOX_TENANTS_FILE=tenants.toml"
        )
    return settings


def tenant_defaults(args: argparse.Namespace) -> tuple[str | None, str]:
    """What a registry entry without its own ``database_url`` / ``schema`` takes: the
    service's (``--app``), else TXBOX_DATABASE_URL (may be unset: then every entry names
    its database) and TXBOX_SCHEMA, or their flags."""
    from framework import names
    from framework.tenants.model import url_problem

    if args.app:
        settings = import_app(args.app).settings
        url, schema = args.database_url or settings.database_url, args.schema or settings.schema
    else:
        url = args.database_url or os.environ.get("TXBOX_DATABASE_URL") or None
        schema = args.schema or os.environ.get("TXBOX_SCHEMA") or "txbox"
    if url is not None and (problem := url_problem(url)):
        from framework.redaction import mask_credentials

        raise ConfigurationError(f"TXBOX_DATABASE_URL {mask_credentials(url)!r} {problem}")
    if not names.valid_schema(schema):
        raise ConfigurationError(
            f"TXBOX_SCHEMA={schema[:80]!r} is not a valid schema name. Example: TXBOX_SCHEMA=txbox"
        )
    return url, schema


def load_tenants(args: argparse.Namespace, settings: TenantSettings) -> Registry:
    """The registry ``settings`` configures (one must be), read once."""
    from framework.tenants import load_registry

    url, schema = tenant_defaults(args)
    registry = load_registry(settings, default_database_url=url, default_schema=schema)
    if registry is None:
        raise ConfigurationError(
            "no tenant registry: set TXBOX_TENANTS_FILE (or --tenants-file) or TXBOX_TENANTS_DATABASE_URL. "
            "Example: TXBOX_TENANTS_FILE=tenants.toml"
        )
    return registry


def picked_tenants(registry: Registry, keys: list[str]) -> list[Tenant]:
    """The tenants ``--tenant`` names (each must be in the registry), else all of them."""
    if not keys:
        return list(registry)
    return [registry.tenant(key) for key in dict.fromkeys(keys)]


def quiet_alembic(args: argparse.Namespace) -> None:
    """Alembic's INFO lines off (unless -v) where a command prints one line per tenant."""
    if not getattr(args, "verbose", False):
        logging.getLogger("alembic").setLevel(logging.WARNING)
