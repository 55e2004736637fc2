"""`txbox analyze`: the Spark reconciliation and analytics job.

Sources: ``--source service=url`` (repeatable), ``--sources-file FILE`` (which may name a
service's tenant registry), else the service of ``TXBOX_SERVICE`` / ``TXBOX_DATABASE_URL``
or, with a tenant registry (``TXBOX_TENANTS_*``, ``--tenants-file``), each of its tenants
(docs/how-to/tenants.md, "Analyze every tenant"). Everything is validated before
the JVM starts, so a typo fails without waiting for it (benchmarks/code-choices.md,
"Spark: the JVM's start and an action").
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from framework.analytics.locations import location
from framework.analytics.session import parse_master, spark_conf
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import (
    Source,
    check_history,
    check_unique,
    load_sources_file,
    parse_source,
    tenant_sources,
    warn_if_loopback,
)
from framework.cli.common import add_spark_options, add_tenant_options, tenant_settings
from framework.errors import ConfigurationError
from framework.settings import load, parse_duration

if TYPE_CHECKING:
    from framework.analytics.job import RunResult

log = logging.getLogger("txbox.analyze")


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    src = parser.add_argument_group("sources")
    src.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="SERVICE=URL",
        help="a service's database (repeatable); default TXBOX_SERVICE=TXBOX_DATABASE_URL",
    )
    src.add_argument(
        "--sources-file",
        type=Path,
        help="YAML: `sources: {service: url}` (or, for a service with tenants, `{tenants_file: path}`) and "
        "optional `report: url`",
    )
    src.add_argument("--contracts-dir", type=Path, help="contracts folder (TXBOX_CONTRACTS_DIR, default contracts)")
    src.add_argument("--schema", help="schema of the framework's tables (TXBOX_SCHEMA, default txbox)")
    src.add_argument(
        "--history", metavar="URI", help="also read rows archived by `txbox archive --to DIR` (a URI or a path)"
    )
    add_tenant_options(parser, pick=False)
    job = parser.add_argument_group("job")
    add_spark_options(job)
    job.add_argument("--window", help="analyze rows created within this window, e.g. 24h (TXBOX_ANALYZE_WINDOW, 7d)")
    job.add_argument("--grace", help="published but not received after this → lost (TXBOX_ANALYZE_GRACE, 5m)")
    job.add_argument("--sla", help="pending/leased longer than this → stuck (TXBOX_ANALYZE_SLA, 15m)")
    job.add_argument("--every", help="repeat every DURATION (e.g. 5m); SIGTERM/SIGINT stop it after the current run")
    out = parser.add_argument_group("output")
    out.add_argument("--report-url", help="database of the analytics_* tables (default: the first source)")
    out.add_argument("--no-report", action="store_true", help="do not write the analytics_* tables")
    out.add_argument(
        "--parquet",
        metavar="URI",
        help="also write the report tables as Parquet under URI: file:///shared/dir, hdfs://…, s3a://… or a path",
    )
    out.add_argument("--fail-on-lost", action="store_true", help="exit 1 when lost messages exist (cron, alerting)")


def sources_of(args: argparse.Namespace) -> tuple[list[Source], str | None]:
    """The sources and the sources file's report URL: ``--source`` and ``--sources-file``;
    TXBOX_SERVICE's tenants when ``--tenants-file`` is given, or when neither is and the
    environment configures a registry; else TXBOX_SERVICE at TXBOX_DATABASE_URL."""
    sources = [parse_source(s) for s in args.source]
    report: str | None = None
    if args.sources_file:
        more, report = load_sources_file(args.sources_file)
        sources += more
    if args.tenants_file is not None or not sources:
        sources += _tenants_of_the_service(args)
    if not sources and os.environ.get("TXBOX_SERVICE") and os.environ.get("TXBOX_DATABASE_URL"):
        sources = [Source(os.environ["TXBOX_SERVICE"], os.environ["TXBOX_DATABASE_URL"])]
    return check_unique(sources), report


def _tenants_of_the_service(args: argparse.Namespace) -> list[Source]:
    """A source per tenant of TXBOX_SERVICE's registry; none without a registry."""
    from framework import names
    from framework.tenants import load_registry

    settings = tenant_settings(args)
    if not settings.configured:
        return []
    service = os.environ.get("TXBOX_SERVICE", "")
    if not names.valid_service_id(service):
        raise ConfigurationError(
            "a tenant registry is configured: set TXBOX_SERVICE to the service whose tenants it lists "
            f"(now {service[:80]!r}). Example: TXBOX_SERVICE=order-service"
        )
    registry = load_registry(
        settings, default_database_url=os.environ.get("TXBOX_DATABASE_URL") or None, default_schema=_schema(args)
    )
    assert registry is not None  # configured (above)
    return tenant_sources(service, registry)


def run(args: argparse.Namespace) -> int:
    from framework.analytics.report import check_report_database
    from framework.contracts import load_registry

    settings = load(
        AnalyzeSettings,
        None,
        master=args.master,
        jdbc_jar=args.jdbc_jar,
        window=args.window,
        grace=args.grace,
        sla=args.sla,
        partition_rows=args.partition_rows,
        report_url=args.report_url,
    )
    sources, file_report = sources_of(args)
    schema = _schema(args)
    registry = load_registry(args.contracts_dir or os.environ.get("TXBOX_CONTRACTS_DIR") or "contracts")
    report_url = None if args.no_report else (settings.report_url or file_report or sources[0].url)
    if report_url is not None:
        check_report_database(report_url, schema)
    parquet = location(args.parquet, "--parquet") if args.parquet else None
    history = location(args.history, "--history") if args.history else None
    if history is not None:
        check_history(sources)
    conf = dict(spark_conf(c) for c in args.conf)
    master = parse_master(settings.master) if settings.master else None
    if master is not None and not master.on_loopback:
        for url in [s.url for s in sources] + ([report_url] if report_url else []):
            warn_if_loopback(url)
    every = _every(args)

    from framework.analytics.job import run_once
    from framework.analytics.session import job_session

    logging.getLogger("py4j").setLevel(logging.WARNING)  # py4j narrates every gateway connection
    stop = threading.Event()
    if every is not None:
        _stop_on_signals(stop)
    with job_session(settings, "txbox-analyze", conf) as spark:
        once = functools.partial(
            run_once,
            spark,
            sources=sources,
            registry=registry,
            settings=settings,
            schema=schema,
            report_url=report_url,
            parquet=parquet,
            history=history,
        )
        return _repeat(once, every, stop, fail_on_lost=args.fail_on_lost)


def _schema(args: argparse.Namespace) -> str:
    from framework import names

    schema: str = args.schema or os.environ.get("TXBOX_SCHEMA") or "txbox"
    if not names.valid_schema(schema):
        raise ConfigurationError(f"--schema {schema!r} is not a valid schema name (example: txbox)")
    return schema


def _every(args: argparse.Namespace) -> float | None:
    """``--every`` in seconds (None: run once)."""
    every = parse_duration(args.every) if args.every else None
    if every is not None and every <= 0:
        raise ConfigurationError(f"--every {args.every!r} must be a positive duration (example: --every 5m)")
    return every


def _stop_on_signals(stop: threading.Event) -> None:
    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def _repeat(once: Callable[[], RunResult], every: float | None, stop: threading.Event, *, fail_on_lost: bool) -> int:
    """Run ``once``, then every ``every`` seconds until ``stop``; the last run's status.

    Run once (``every`` None), a failure raises; repeating, a failed run is logged and the
    next one comes at its time: a repeating job outlives a source that is down for one period.
    """
    status = 0
    while True:
        try:
            result = once()
        except Exception as exc:
            if every is None:
                raise
            log.error("analyze run failed, next try in %s s: %s", every, str(exc).splitlines()[0][:500])
            status = 2
        else:
            print(result.summary(), flush=True)
            status = 1 if (fail_on_lost and result.lost) else 0
        if every is None or stop.wait(every):
            return status
