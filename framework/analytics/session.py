"""The Spark session of the job: local mode by default, nothing fetched from Maven.

The PostgreSQL JDBC driver comes from Debian (``/usr/share/java/postgresql.jar``) through
``spark.jars``; ``spark.jars.packages`` is never used because these machines reach no
Maven repository. UTC everywhere (session and JVM) so minute/hour buckets and the
timestamp literals of the partitioned reads mean the same thing on every executor.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from framework.analytics.settings import AnalyzeSettings
from framework.errors import ConfigurationError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def under_spark_submit() -> bool:
    """True when spark-submit started this Python driver (it then owns master and jars)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def check_jar(settings: AnalyzeSettings) -> None:
    if not settings.jdbc_jar.is_file():
        raise ConfigurationError(
            f"PostgreSQL JDBC driver not found at {settings.jdbc_jar}. Install it "
            "(apt-get install libpostgresql-jdbc-java) or point TXBOX_JDBC_JAR / --jdbc-jar at the jar"
        )


def spark_session(settings: AnalyzeSettings, app_name: str = "txbox-analyze") -> SparkSession:
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigurationError("pyspark is not installed: pip install 'txbox[spark]'") from None
    check_jar(settings)
    builder = SparkSession.builder.appName(app_name)
    if not under_spark_submit():
        builder = builder.master(settings.master or "local[*]")
        builder = builder.config("spark.driver.memory", settings.driver_memory)
        builder = builder.config("spark.driver.extraJavaOptions", "-Duser.timezone=UTC")
        builder = builder.config("spark.executor.extraJavaOptions", "-Duser.timezone=UTC")
    elif settings.master:
        builder = builder.master(settings.master)
    jars = str(settings.jdbc_jar)
    builder = (
        builder.config("spark.jars", jars)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        .config("spark.sql.adaptive.enabled", "true")
        # Tables cached hash-partitioned by id serve joins on (service, id) without a shuffle.
        .config("spark.sql.requireAllClusterKeysForCoPartition", "false")
    )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
