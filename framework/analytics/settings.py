"""Tuning of `txbox analyze` and `txbox archive`: ``TXBOX_ANALYZE_*`` / ``TXBOX_ARCHIVE_*``.

Kept free of pyspark imports so the CLI can parse and validate configuration (and fail
naming the fix) before paying the JVM's start (benchmarks/code-choices.md, "Spark: the
JVM's start and an action").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from framework.settings import Seconds, setting

DEFAULT_JDBC_JAR = Path("/usr/share/java/postgresql.jar")


@dataclass(frozen=True, kw_only=True)
class AnalyzeSettings:
    master: str | None = setting(
        "TXBOX_ANALYZE_MASTER",
        "local[*]",
        default=None,
        help="Spark master; default local[*] (under spark-submit: whatever spark-submit was given)",
    )
    jdbc_jar: Path = setting(
        "TXBOX_JDBC_JAR",
        "/usr/share/java/postgresql.jar",
        default=DEFAULT_JDBC_JAR,
        help="PostgreSQL JDBC driver jar (Debian: libpostgresql-jdbc-java); passed as spark.jars",
    )
    window: Seconds = setting(
        "TXBOX_ANALYZE_WINDOW",
        "7d",
        default=Seconds(7 * 86400),
        help="rows created within this window are analyzed (pending rows always are)",
    )
    grace: Seconds = setting(
        "TXBOX_ANALYZE_GRACE",
        "5m",
        default=Seconds(300),
        help="a published message missing from a subscriber's inbox for longer than this is lost",
    )
    sla: Seconds = setting(
        "TXBOX_ANALYZE_SLA",
        "15m",
        default=Seconds(900),
        help="a pending or leased row older than this is stuck",
    )
    fetch_size: int = setting("TXBOX_ANALYZE_FETCH_SIZE", "10000", default=10000, help="JDBC fetch size")
    partition_rows: int = setting(
        "TXBOX_ANALYZE_PARTITION_ROWS",
        "100000",
        default=100000,
        help="rows per JDBC read partition: each partition is one short statement",
    )
    max_partitions: int = setting(
        "TXBOX_ANALYZE_MAX_PARTITIONS", "64", default=64, help="upper bound of JDBC read partitions per table"
    )
    shuffle_partitions: int = setting(
        "TXBOX_ANALYZE_SHUFFLE_PARTITIONS", "8", default=8, help="spark.sql.shuffle.partitions"
    )
    driver_memory: str = setting("TXBOX_ANALYZE_DRIVER_MEMORY", "2g", default="2g", help="spark.driver.memory")
    report_url: str | None = setting(
        "TXBOX_ANALYZE_REPORT_URL",
        "postgresql+psycopg://postgres@127.0.0.1:5432/reports",
        default=None,
        help="database the analytics_* tables are written to (default: the first source)",
    )
    ids_per_group: int = setting(
        "TXBOX_ANALYZE_IDS_PER_GROUP", "100", default=100, help="message ids listed per fingerprint row"
    )


@dataclass(frozen=True, kw_only=True)
class ArchiveSettings:
    batch_size: int = setting(
        "TXBOX_ARCHIVE_BATCH_SIZE",
        "50000",
        default=50000,
        help="rows per archive batch (one manifest row, one Parquet directory, one delete transaction)",
    )
