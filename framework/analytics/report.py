"""Output of a run: the ``analytics_*`` tables (JDBC), optional Parquet, a printed summary.

The tables are appended through Spark's JDBC writer into the reporting database; the
``analytics_runs`` row goes last, so a reader that only trusts runs listed there never
sees a half-written run (a crash mid-write leaves orphan rows with an unlisted run_id,
which the next run's readers ignore).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import BigInteger, DateTime, Double, Integer, Text

from framework import names, tables
from framework.analytics.locations import Storage, join
from framework.analytics.session import local_frame
from framework.analytics.sources import jdbc_target
from framework.db import connect, database_errors
from framework.errors import ConfigurationError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

RUNS = "analytics_runs"


def spark_type(sa_type: Any) -> str:
    """Spark SQL type of a column type of framework/tables.py (a class or an instance)."""
    kind = sa_type if isinstance(sa_type, type) else type(sa_type)
    for cls, name in ((BigInteger, "bigint"), (Integer, "int"), (Double, "double"), (DateTime, "timestamp")):
        if issubclass(kind, cls):
            return name
    if issubclass(kind, Text):
        return "string"
    raise TypeError(f"no Spark type for {sa_type!r}")


def check_report_database(url: str, schema: str) -> None:
    """Fail before the JVM starts when the report tables are missing."""
    with database_errors("cannot reach the report database"), connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass(%s)", (names.qualified(schema, RUNS),)).fetchone()
    if row is None or row[0] is None:
        raise ConfigurationError(
            f"the report database has no {schema}.{RUNS} table: run `txbox migrate` against it "
            "(TXBOX_DATABASE_URL=<report url> txbox migrate), or choose another with --report-url"
        )


def conform(df: DataFrame, table: str, run_id: str, run_at: datetime) -> DataFrame:
    """``df`` with exactly the columns of ``table`` (framework/tables.py), in order."""
    from pyspark.sql import functions as F

    cols = [F.lit(run_id).alias("run_id"), F.lit(run_at).cast("timestamp").alias("run_at")]
    cols += [F.col(name).cast(spark_type(t)).alias(name) for name, t in tables.ANALYTICS_COLUMNS[table]]
    return df.select(*cols)


@dataclass
class Writer:
    spark: SparkSession
    report_url: str | None
    schema: str
    parquet: Storage | None
    written: dict[str, int] = field(default_factory=dict)

    def _jdbc(self, df: DataFrame, table: str) -> None:
        assert self.report_url is not None
        writer = df.write.format("jdbc").mode("append")
        for key, value in jdbc_target(self.report_url).options().items():
            writer = writer.option(key, value)
        writer.option("dbtable", names.qualified(self.schema, table)).option("batchsize", "5000").option(
            "ApplicationName", "txbox-analyze"
        ).save()

    def table(self, table: str, df: DataFrame, run_id: str) -> None:
        # Report tables are small: one partition = one connection and one transaction per
        # table, instead of one per upstream partition (dozens after the unions).
        df = df.coalesce(1)
        if self.report_url is not None:
            self._jdbc(df, table)
        if self.parquet is not None:
            relative = f"{table}/run_id={run_id}"
            df.drop("run_id").write.mode("overwrite").parquet(join(self.parquet.uri, relative))
            self.parquet.check_written(relative)

    def run_row(self, row: dict[str, Any]) -> None:
        """The analytics_runs row: written last, it marks the run complete."""
        columns = [c for c in tables.analytics_runs.columns]
        schema = [(c.name, spark_type(c.type)) for c in columns]
        df = local_frame(self.spark, [[row[c.name] for c in columns]], schema)
        self.table(RUNS, df, str(row["run_id"]))
