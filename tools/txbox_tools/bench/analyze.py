"""`txbox bench analyze`: the Spark job over 1M outbox + 1M inbox rows (bar: ≤ 120 s, local mode).

Two scratch databases (publisher ``order-service`` and subscriber ``inventory-service``)
are created, filled with ``INSERT ... SELECT generate_series`` (message ids derived from
the series number, so both databases agree on them without a round trip through Python),
vacuumed, analyzed, and dropped at the end. The data holds known defects: 0.1 % lost
messages, 10 stuck ones, foreign commands (unexpected), dead letters and redeliveries,
and the run checks the job found exactly them.

Raw limit, measured in the same run with the same Spark session: reading the same rows
and columns through the same partitioned JDBC reads, cached and counted — i.e. the
job's input phase alone. ``ratio`` is therefore "job time vs. just reading the data". That
read is done twice and the second is timed: the first warms the JVM up for both.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, LiteralString

import psycopg
from psycopg import sql

from framework import migrate
from framework.db import conninfo
from txbox_tools import repository
from txbox_tools.bench.result import Result

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from framework.analytics.settings import AnalyzeSettings
    from framework.analytics.sources import Source

ADMIN_URL = os.environ.get("TXBOX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
SPAN = timedelta(hours=6)

OUTBOX_SQL = """
INSERT INTO txbox.outbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
    segment, created_at, locked_until, started_attempts, finished_attempts, processed_at)
SELECT md5('m' || i)::uuid, 'OrderPlaced', 'order', (i %% 10000)::text, 'event', 'order-service.order.placed',
    jsonb_build_object('order_id', i, 'total', i %% 997), 'order-' || (i %% 10000),
    %(base)s + i * %(step)s, %(base)s + i * %(step)s,
    CASE WHEN i %% 100000 = 0 THEN 0 ELSE 1 END, CASE WHEN i %% 100000 = 0 THEN 0 ELSE 1 END,
    CASE WHEN i %% 100000 = 0 THEN NULL ELSE %(base)s + i * %(step)s + (5 + i %% 40) * interval '1 ms' END
FROM generate_series(1, %(n)s) AS i
"""

# Every published OrderPlaced except every 1000th (lost), plus foreign RestockItem commands
# to make up the count (unexpected: no source's outbox has them).
INBOX_SQL = """
INSERT INTO txbox.inbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload, segment,
    created_at, locked_until, started_attempts, finished_attempts, processed_at, message_timestamp, received_at,
    queue, redelivered)
SELECT md5('m' || i)::uuid, 'OrderPlaced', 'order', (i %% 10000)::text, 'event', 'order-service.order.placed',
    jsonb_build_object('order_id', i, 'total', i %% 997), 'order-' || (i %% 10000),
    %(base)s + i * %(step)s + (50 + i %% 30) * interval '1 ms', %(base)s + i * %(step)s,
    1 + (i %% 50 = 0)::int, 1 + (i %% 50 = 0)::int,
    %(base)s + i * %(step)s + (60 + i %% 90) * interval '1 ms', %(base)s + i * %(step)s,
    %(base)s + i * %(step)s + (50 + i %% 30) * interval '1 ms', 'inventory-service:inbox', i %% 997 = 0
FROM generate_series(1, %(n)s) AS i
WHERE i %% 1000 <> 0 AND i %% 100000 <> 0
UNION ALL
SELECT md5('r' || i)::uuid, 'RestockItem', 'item', i::text, 'command', 'inventory-service.item.restock',
    jsonb_build_object('sku', i), 'item-' || i,
    %(base)s + i * %(step)s, %(base)s + i * %(step)s, 1, 1, %(base)s + i * %(step)s + interval '5 ms',
    %(base)s + i * %(step)s, %(base)s + i * %(step)s, 'inventory-service:inbox', false
FROM generate_series(1, %(n)s / 1000) AS i
"""

DEAD_LETTERS_SQL = """
INSERT INTO txbox.dead_letters (message_id, source, reason, error, fingerprint, message_type, died_at)
SELECT md5('d' || i)::uuid, 'inbox', 'max_attempts', 'timeout after ' || i || ' ms', 'fp' || (i %% 7),
    'OrderPlaced', %(base)s + i * interval '10 s'
FROM generate_series(1, 500) AS i
"""

REDELIVERIES_SQL = """
INSERT INTO txbox.redeliveries (queue, message_id, count, first_seen, last_seen)
SELECT 'inventory-service:inbox', md5('m' || i)::uuid::text, 1 + i %% 4, %(base)s + i * %(step)s,
    %(base)s + i * %(step)s
FROM generate_series(1, %(n)s, 997) AS i
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="outbox rows, and inbox rows (default 1000000)")
    parser.add_argument("--admin-url", default=ADMIN_URL, help="PostgreSQL URL allowed to CREATE DATABASE")
    parser.add_argument("--master", help="Spark master (default local[*])")
    parser.add_argument("--contracts-dir", type=Path, help="contracts folder (default: the repository's contracts/)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch databases (prints their names)")


def _db_url(admin_url: str, name: str) -> str:
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{name}"


def _fill(url: str, statements: list[str], params: dict[str, object], tables: list[str]) -> None:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement, params)
        for table in tables:
            # What autovacuum does soon after a bulk load: statistics and the visibility map.
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier("txbox", table)))


def run(args: argparse.Namespace) -> Result:
    from pyspark.sql import SparkSession

    from framework.analytics import reconcile as rc
    from framework.analytics.job import run_once
    from framework.analytics.session import spark_session
    from framework.analytics.settings import AnalyzeSettings
    from framework.analytics.sources import Source
    from framework.contracts import load_registry
    from framework.settings import load

    n = int(args.rows)
    contracts = args.contracts_dir or repository.contracts()
    registry = load_registry(contracts)
    admin = conninfo(args.admin_url.replace("postgresql://", "postgresql+psycopg://", 1))
    names_ = {s: f"txbox_bench_an_{s.split('-')[0]}_{uuid.uuid4().hex[:6]}" for s in ("order-service", "inventory")}
    urls = {k: _db_url(args.admin_url, v) for k, v in names_.items()}
    _databases(admin, "CREATE DATABASE {}", names_.values())
    settings = load(AnalyzeSettings, None, master=args.master)
    owned = SparkSession.getActiveSession() is None
    spark = None
    try:
        for url in urls.values():
            migrate.upgrade(url)
        base = datetime.now(UTC) - SPAN - timedelta(minutes=20)  # every row older than the SLA
        params: dict[str, object] = {"base": base, "step": SPAN / max(n, 1), "n": n}
        t0 = time.perf_counter()
        _fill(urls["order-service"], [OUTBOX_SQL], params, ["outbox"])
        _fill(urls["inventory"], [INBOX_SQL, DEAD_LETTERS_SQL, REDELIVERIES_SQL], params, ["inbox"])
        generated = time.perf_counter() - t0

        t0 = time.perf_counter()
        spark = spark_session(settings, "txbox-bench-analyze")
        startup = time.perf_counter() - t0
        sources = [Source("order-service", urls["order-service"]), Source("inventory-service", urls["inventory"])]
        since = datetime.now(UTC) - timedelta(seconds=settings.window)

        raw_rows, raw_seconds = _raw_read(spark, settings, sources, since)

        t0 = time.perf_counter()
        result = run_once(
            spark,
            sources=sources,
            registry=registry,
            settings=settings,
            report_url=urls["order-service"],
        )
        seconds = time.perf_counter() - t0
        expected_lost = n // 1000 - n // 100000  # every 1000th, minus the unpublished ones among them
        if result.counts.get(rc.LOST, 0) != expected_lost or result.counts.get(rc.STUCK, 0) != n // 100000:
            raise RuntimeError(f"bench analyze: wrong findings {result.counts} (expected lost {expected_lost})")
        return Result(
            stage="analyze",
            messages=result.outbox_rows + result.inbox_rows,
            seconds=seconds,
            raw_limit_rate=raw_rows / raw_seconds if raw_seconds > 0 else 0.0,
            raw_limit="Spark JDBC read of the same rows+columns, same partitions, cached and counted",
            extra={
                "bar_seconds": 120,
                "outbox_rows": result.outbox_rows,
                "inbox_rows": result.inbox_rows,
                "raw_read_seconds": round(raw_seconds, 2),
                "spark_startup_seconds": round(startup, 2),
                "generate_seconds": round(generated, 2),
                "findings": result.counts,
                "phases_seconds": result.extra.get("phases", {}),
                "master": settings.master or "local[*]",
            },
        )
    finally:
        if spark is not None and owned:
            spark.stop()
        if args.keep:
            print(f"kept scratch databases: {', '.join(names_.values())}")
        else:
            _databases(admin, "DROP DATABASE IF EXISTS {} WITH (FORCE)", names_.values())


def _databases(admin: str, statement: LiteralString, names: Iterable[str]) -> None:
    """``statement`` (``CREATE DATABASE {}`` or a DROP) for each of ``names``."""
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL(statement).format(sql.Identifier(name)))


def _raw_read(
    spark: SparkSession, settings: AnalyzeSettings, sources: list[Source], since: datetime
) -> tuple[int, float]:
    """The raw limit: the same partitioned reads as the job's, cached and counted, nothing
    else (rows, seconds). Done twice, the first pass only warming up the JVM (class loading,
    JIT), so that neither the raw read nor the job pays for it."""
    from framework.analytics.read import Reader

    reader = Reader(spark, settings, "txbox")
    raw_rows, raw_seconds = 0, 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        raw_rows = 0
        for source, table in ((sources[0], "outbox"), (sources[1], "inbox")):
            df = reader.messages(source, table, since).persist()
            raw_rows += df.count()
            df.unpersist()
        raw_seconds = time.perf_counter() - t0
    return raw_rows, raw_seconds
