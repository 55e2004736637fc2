"""`txbox archive --older-than 7d --to URI`: old processed/abandoned rows → Parquet, then deleted.

Runs against one service's database (``--app`` or ``TXBOX_*``, as every command), as a
Spark job: local by default, ``--master spark://HOST:7077`` on a standalone cluster, or
under spark-submit (framework/analytics/job.py). See framework/analytics/archive.py for
the crash-safety protocol. Everything is validated before the JVM starts.
"""

from __future__ import annotations

import argparse
import logging
from datetime import timedelta

from framework.analytics.locations import location
from framework.analytics.session import parse_master, spark_conf
from framework.analytics.settings import AnalyzeSettings, ArchiveSettings
from framework.analytics.sources import Source, warn_if_loopback
from framework.cli.common import add_service_options, add_spark_options, settings_only
from framework.errors import ConfigurationError
from framework.settings import DedupSettings, load, parse_duration


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--older-than",
        required=True,
        help="archive rows created before now - DURATION (e.g. 7d); inbox ids finished within "
        "TXBOX_DEDUP_WINDOW stay in the inbox for dedup",
    )
    parser.add_argument(
        "--to",
        required=True,
        metavar="URI",
        help="archive root (Parquet, Hive layout): file:///shared/dir, hdfs://…, s3a://… or a path",
    )
    parser.add_argument("--batch-size", type=int, help="rows per batch (TXBOX_ARCHIVE_BATCH_SIZE, default 50000)")
    job = parser.add_argument_group("Spark job (as for txbox analyze)")
    add_spark_options(job)
    add_service_options(parser)


def run(args: argparse.Namespace) -> int:
    root = location(args.to, "--to")
    try:
        older = parse_duration(args.older_than)
    except ValueError:
        raise ConfigurationError(f"--older-than {args.older_than!r} is not a duration (example: 7d)") from None
    opts = load(ArchiveSettings, None, batch_size=args.batch_size)
    if opts.batch_size <= 0:
        raise ConfigurationError("--batch-size must be positive (example: 50000)")
    window = load(DedupSettings).dedup_window
    spark_settings = load(
        AnalyzeSettings, None, master=args.master, jdbc_jar=args.jdbc_jar, partition_rows=args.partition_rows
    )
    if spark_settings.partition_rows <= 0:
        raise ConfigurationError("--partition-rows must be positive (example: 100000)")
    conf = dict(spark_conf(c) for c in args.conf)
    master = parse_master(spark_settings.master) if spark_settings.master else None
    settings = settings_only(args)
    Source(settings.service, settings.database_url).jdbc  # noqa: B018 - validates the URL before the JVM starts
    if master is not None and not master.on_loopback:
        warn_if_loopback(settings.database_url)

    from framework.analytics.archive import Archiver
    from framework.analytics.session import job_session

    logging.getLogger("py4j").setLevel(logging.WARNING)  # py4j narrates every gateway connection
    with job_session(spark_settings, "txbox-archive", conf) as spark:
        archiver = Archiver(
            database_url=settings.database_url,
            service=settings.service,
            root=root,
            schema=settings.schema,
            batch_size=opts.batch_size,
            dedup_window=timedelta(seconds=window),
            spark=spark,
            settings=spark_settings,
        )
        result = archiver.run(timedelta(seconds=older))
    print(result.summary(settings.service, root), flush=True)
    return 0
