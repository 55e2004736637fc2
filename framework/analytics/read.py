"""Partitioned, short JDBC reads of every source's txbox tables (+ archived history).

Why the reads are short: a long-running snapshot on the service's database holds back
VACUUM of the queue tables (outbox/inbox churn fast), which then bloat and slow the
daemons' claims. So the job never opens one long transaction:

- each table is read in ``ceil(rows / partition_rows)`` partitions split on ``created_at``
  at its quantiles (one quick ``count`` and one ``percentile_disc``), each partition being
  one statement on its own connection, streamed with a fetch size — its snapshot lives
  only as long as that slice (``partition_rows`` rows) takes to stream. Quantiles, not
  equal strides between min and max: traffic comes in bursts and one old pending row
  stretches the range, and equal strides would then put nearly every row in one
  partition, read by one executor while the others wait (docs/explanation/analytics.md, "The Spark job on a cluster");
- only a bounded window is read (``created_at >= now - window``, plus rows still
  pending, which sit on the small partial index), so the cost does not grow with history;
- sessions are read-only and carry a statement timeout, so a stuck read cannot pin a
  snapshot for long.

``created_at`` never changes, so every row falls into exactly one partition even though
the partitions are read at slightly different times. All rows' outcomes are judged
against ``as_of``, taken before the first read, so later reads only ever see more.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from framework import names
from framework.analytics.locations import Storage, join
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import Source, check_history
from framework.db import connect, database_errors

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, DataFrameReader, SparkSession

# Only what the job uses: every column costs JDBC decoding and cache space per row.
OUTBOX_COLUMNS = (
    "id::text AS id, message_type, created_at, locked_until, "
    "started_attempts::int AS started_attempts, finished_attempts::int AS finished_attempts, "
    "processed_at, abandoned_at, "
    "CASE WHEN processed_at IS NULL AND abandoned_at IS NULL THEN left(last_error, 300) END AS last_error"
)
INBOX_COLUMNS = OUTBOX_COLUMNS + ", message_timestamp, received_at, queue, redelivered"
DEAD_LETTER_COLUMNS = (
    "id AS dead_letter_id, message_id::text AS message_id, source, reason, left(error, 300) AS error, "
    "fingerprint, message_type, died_at, replayed_at, discarded_at, resolved_at"
)
REDELIVERY_COLUMNS = "queue, message_id, count, first_seen, last_seen"
PENDING = "(processed_at IS NULL AND abandoned_at IS NULL)"
STATEMENT_TIMEOUT = "10min"


@dataclass
class Frames:
    """The rows of every source, each with a ``service`` column naming the service and a
    ``tenant`` column naming its tenant (null for a service without tenants)."""

    outbox: DataFrame
    inbox: DataFrame
    dead_letters: DataFrame
    redeliveries: DataFrame


def _ts(value: datetime) -> str:
    return f"'{value.isoformat()}'::timestamptz"


def range_predicates(column: str, bounds: list[datetime]) -> list[str]:
    """Disjoint predicates that together cover every row: ``< b1``, ``[b1, b2)``, …, ``>= bn``.

    ``bounds`` may repeat (many rows with one timestamp): a repeated bound would make an
    empty partition, so it is dropped.
    """
    cuts = sorted(set(bounds))
    if not cuts:
        return ["TRUE"]
    preds = [f"{column} < {_ts(cuts[0])}"]
    preds += [f"{column} >= {_ts(lo)} AND {column} < {_ts(hi)}" for lo, hi in itertools.pairwise(cuts)]
    preds.append(f"{column} >= {_ts(cuts[-1])}")
    return preds


def partition_count(rows: int, settings: AnalyzeSettings) -> int:
    return min(settings.max_partitions, max(1, math.ceil(rows / settings.partition_rows)))


class Reader:
    def __init__(
        self, spark: SparkSession, settings: AnalyzeSettings, schema: str, application: str = "txbox-analyze"
    ) -> None:
        self.spark = spark
        self.settings = settings
        self.schema = schema
        self.application = application

    def _jdbc(self, source: Source, query: str) -> DataFrameReader:
        reader = self.spark.read.format("jdbc")
        for key, value in source.jdbc.options().items():
            reader = reader.option(key, value)
        return (
            reader.option("dbtable", f"({query}) AS t")
            .option("fetchsize", str(self.settings.fetch_size))
            .option("ApplicationName", self.application)
            .option(
                "sessionInitStatement",
                f"SET default_transaction_read_only = on; SET statement_timeout = '{STATEMENT_TIMEOUT}'",
            )
        )

    def _table(self, source: Source, table: str) -> str:
        """``table`` of ``source``'s schema, qualified: a tenant's own, else the job's."""
        return names.qualified(source.schema or self.schema, table)

    def _cuts(self, source: Source, table: str, where: str) -> list[datetime]:
        """The ``created_at`` values that split the rows of ``where`` into equal partitions."""
        qualified = self._table(source, table)
        with database_errors(f"cannot read {source.name}"), connect(source.url, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM {qualified} WHERE {where}").fetchone()
            parts = partition_count(int(row[0]) if row else 0, self.settings)
            if parts == 1:
                return []
            fractions = [i / parts for i in range(1, parts)]
            row = conn.execute(
                f"SELECT percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY created_at) FROM {qualified} "
                f"WHERE {where}",
                (fractions,),
            ).fetchone()
        return [c for c in (row[0] if row and row[0] else []) if c is not None]

    def query(self, source: Source, query: str) -> DataFrame:
        """One unpartitioned read (small results: dead letters, an archive batch's ids)."""
        return self._jdbc(source, query).load()

    def partitioned(self, source: Source, table: str, columns: str, where: str) -> DataFrame:
        """``SELECT columns FROM table WHERE where``, read in partitions cut at quantiles of ``created_at``."""
        query = f"SELECT {columns} FROM {self._table(source, table)} WHERE {where}"
        reader = self._jdbc(source, query)
        cuts = self._cuts(source, table, where)
        if not cuts:
            return reader.load()
        # url and dbtable again because jdbc() takes them as arguments; the options
        # set above (credentials, fetch size, session init) still apply.
        return reader.jdbc(
            source.jdbc.url, f"({query}) AS t", predicates=range_predicates("created_at", cuts), properties={}
        )

    def messages(self, source: Source, table: str, since: datetime) -> DataFrame:
        """The outbox or inbox of ``source``: rows of the window plus every pending row."""
        columns = OUTBOX_COLUMNS if table == names.OUTBOX else INBOX_COLUMNS
        where = f"created_at >= {_ts(since)} OR {PENDING}"
        return whose(self.partitioned(source, table, columns, where), source)

    def dead_letters(self, source: Source, since: datetime) -> DataFrame:
        open_ = "replayed_at IS NULL AND discarded_at IS NULL AND resolved_at IS NULL"
        query = (
            f"SELECT {DEAD_LETTER_COLUMNS} FROM {self._table(source, names.DEAD_LETTERS)} "
            f"WHERE died_at >= {_ts(since)} OR ({open_})"
        )
        return whose(self._jdbc(source, query).load(), source)

    def redeliveries(self, source: Source, since: datetime) -> DataFrame:
        query = (
            f"SELECT {REDELIVERY_COLUMNS} FROM {self._table(source, names.REDELIVERIES)} "
            f"WHERE last_seen >= {_ts(since)}"
        )
        return whose(self._jdbc(source, query).load(), source)

    def history(self, storage: Storage, source: Source, table: str, like: DataFrame) -> DataFrame | None:
        """Archived rows of ``source`` (written by `txbox archive`), shaped like ``like``."""
        from pyspark.sql import functions as F

        relative = f"{source.service}/{table}"
        if storage.parquet_files(relative) == 0:
            return None
        path = join(storage.uri, relative)
        archived = self.spark.read.option("basePath", path).parquet(path)
        columns = [F.col(f.name).cast(f.dataType).alias(f.name) for f in like.schema.fields if f.name not in SOURCE]
        return whose(archived.select(*columns), source)


SOURCE = ("service", "tenant")
"""The columns :func:`whose` adds: every frame says which source each row came from."""


def whose(df: DataFrame, source: Source) -> DataFrame:
    """``df`` with the :data:`SOURCE` columns of ``source``."""
    from pyspark.sql import functions as F

    return df.withColumn("service", F.lit(source.service)).withColumn("tenant", F.lit(source.tenant).cast("string"))


def load(
    spark: SparkSession,
    sources: list[Source],
    settings: AnalyzeSettings,
    schema: str,
    since: datetime,
    history: Storage | None = None,
) -> Frames:
    from pyspark import StorageLevel

    if history is not None:
        check_history(sources)
    reader = Reader(spark, settings, schema)

    def union(frames: list[DataFrame]) -> DataFrame:
        out = frames[0]
        for f in frames[1:]:
            out = out.unionByName(f)
        return out

    tables: dict[str, DataFrame] = {}
    for table in (names.OUTBOX, names.INBOX):
        parts = [reader.messages(s, table, since) for s in sources]
        if history is not None:
            archived = [reader.history(history, s, table, parts[0]) for s in sources]
            kept = [a for a in archived if a is not None]
            if kept:
                # An interrupted archive may leave a row both archived and not yet deleted.
                parts = [union(parts + kept).dropDuplicates([*SOURCE, "id"])]
        # Hash-partitioned by id once: the joins on id that follow (lost, unexpected,
        # published → received) then need no further shuffle of the big tables.
        tables[table] = (
            union(parts).repartition(settings.shuffle_partitions, "id").persist(StorageLevel.MEMORY_AND_DISK)
        )
    return Frames(
        outbox=tables[names.OUTBOX],
        inbox=tables[names.INBOX],
        dead_letters=union([reader.dead_letters(s, since) for s in sources]).persist(StorageLevel.MEMORY_AND_DISK),
        redeliveries=union([reader.redeliveries(s, since) for s in sources]).persist(StorageLevel.MEMORY_AND_DISK),
    )
