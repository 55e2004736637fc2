"""`txbox archive --older-than 7d --to DIR`: old processed/abandoned rows → Parquet, then deleted.

Runs against one service's database (``--app`` or ``TXBOX_*``, as every command). No
Spark: see framework/analytics/archive.py for why and for the crash-safety protocol.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from framework.analytics.locations import local_directory
from framework.analytics.settings import ArchiveSettings
from framework.cli.common import add_service_options, settings_only
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
        "--to", required=True, metavar="DIR", help="archive root folder (Parquet, Hive layout): a path or file:///..."
    )
    parser.add_argument("--batch-size", type=int, help="rows per batch (TXBOX_ARCHIVE_BATCH_SIZE, default 50000)")
    add_service_options(parser)


def run(args: argparse.Namespace) -> int:
    from framework.analytics.archive import Archiver

    root = local_directory(args.to, "--to")
    try:
        older = parse_duration(args.older_than)
    except ValueError:
        raise ConfigurationError(f"--older-than {args.older_than!r} is not a duration (example: 7d)") from None
    opts = load(ArchiveSettings, None, batch_size=args.batch_size)
    if opts.batch_size <= 0:
        raise ConfigurationError("--batch-size must be positive (example: 50000)")
    window = load(DedupSettings).dedup_window
    settings = settings_only(args)
    archiver = Archiver(
        database_url=settings.database_url,
        service=settings.service,
        root=root,
        schema=settings.schema,
        batch_size=opts.batch_size,
        dedup_window=timedelta(seconds=window),
    )
    result = archiver.run(timedelta(seconds=older))
    print(result.summary(settings.service, root), flush=True)
    return 0
