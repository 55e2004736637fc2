"""The Spark session of the job: local mode by default, or a cluster; nothing fetched from Maven.

The PostgreSQL JDBC driver comes from Debian (``/usr/share/java/postgresql.jar``) through
``spark.jars``, which also ships it to every executor (they fetch it from the driver);
``spark.jars.packages`` is never used because these machines reach no Maven repository.
The job runs no Python on the executors (no UDF, no Python RDD), so they need Java and
network reach, not a Python environment (docs/explanation/analytics.md, "The Spark job on a
cluster"). UTC everywhere (session and JVM) so minute/hour buckets and the timestamp
literals of the partitioned reads mean the same thing on every executor.

Before the JVM starts (the slowest part of a run's start: benchmarks/code-choices.md,
"Spark: the JVM's start and an action") the master is checked: a malformed URL or an
unreachable ``spark://`` master fails at once with one line, where Spark itself retries
and prints pages of stack traces (docs/explanation/analytics.md, "The Spark job on a cluster").
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import is_loopback
from framework.errors import ConfigurationError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

MASTER_EXAMPLES = "local[*], local[4], spark://HOST:7077, k8s://https://HOST:6443, yarn"
CONNECT_TIMEOUT = 3.0  # seconds per master address
MAX_MASTER_LENGTH = 1000
LOCAL = re.compile(r"local(\[(\*|[1-9][0-9]*)(,[0-9]+)?\])?|local-cluster\[[0-9]+,[0-9]+,[0-9]+\]")
HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")

# The driver's log: warnings and errors only, stack traces cut to a few frames. Without a
# file Spark uses its own profile at INFO and narrates its start-up; its "native-hadoop
# library" warning concerns an optional speed-up the job does not use.
LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yyyy-MM-dd HH:mm:ss} %p spark %c{1}: %m%n%ex{3}
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.plan.name = org.apache.spark.util.SparkStringUtils
logger.plan.level = error
"""


@dataclass(frozen=True)
class Master:
    url: str
    addresses: tuple[tuple[str, int], ...] = ()  # spark:// masters only

    @property
    def local(self) -> bool:
        return self.url.startswith("local")

    @property
    def on_loopback(self) -> bool:
        """Local mode, or a standalone master on this machine's loopback interface."""
        return self.local or (bool(self.addresses) and all(is_loopback(h) for h, _ in self.addresses))


def under_spark_submit() -> bool:
    """True when spark-submit started this Python driver (it then owns master and jars)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def parse_master(url: str) -> Master:
    """Check the form of a master URL (no network)."""
    url = url.strip()
    if len(url) > MAX_MASTER_LENGTH:
        raise ConfigurationError(f"--master is {len(url)} characters long: not a Spark master URL")
    if LOCAL.fullmatch(url) or url == "yarn":
        return Master(url)
    if url.startswith("k8s://") and len(url) > len("k8s://"):
        return Master(url)
    if url.startswith("spark://"):
        addresses = []
        for part in url[len("spark://") :].split(","):
            m = HOST_PORT.fullmatch(part)
            if m is None or not 0 < int(m.group(2)) < 65536:
                raise ConfigurationError(
                    f"--master {url!r}: {part!r} is not HOST:PORT (a standalone master listens on 7077 by default, "
                    "e.g. spark://spark-master:7077)"
                )
            addresses.append((m.group(1).strip("[]"), int(m.group(2))))
        return Master(url, tuple(addresses))
    raise ConfigurationError(f"--master {url!r} is not a Spark master URL. Examples: {MASTER_EXAMPLES}")


def check_master(url: str, timeout: float = CONNECT_TIMEOUT) -> Master:
    """``parse_master`` plus, for ``spark://``, one TCP connection to some master address."""
    master = parse_master(url)
    failures = []
    for host, port in master.addresses:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return master
        except OSError as exc:
            failures.append(f"{host}:{port}: {exc.strerror or exc}")
    if failures:
        raise ConfigurationError(
            f"Spark master {url} is unreachable ({'; '.join(failures)}). Start it "
            "(spark-class org.apache.spark.deploy.master.Master --host HOST --port PORT) or pick another "
            "with --master / TXBOX_ANALYZE_MASTER"
        )
    return master


def check_jar(settings: AnalyzeSettings) -> None:
    if not settings.jdbc_jar.is_file():
        raise ConfigurationError(
            f"PostgreSQL JDBC driver not found at {settings.jdbc_jar}. Install it "
            "(apt-get install libpostgresql-jdbc-java) or point TXBOX_JDBC_JAR / --jdbc-jar at the jar"
        )


def local_frame(spark: SparkSession, rows: Sequence[Sequence[Any]], columns: Sequence[tuple[str, str]]) -> DataFrame:
    """Python values as a DataFrame the JVM builds from literals.

    ``createDataFrame`` of Python rows is a Python RDD: the executor that computes it
    starts a Python worker, and the executors then need a Python with pyspark. Literals
    keep the executors free of Python (docs/explanation/analytics.md, "The Spark job on a cluster").
    """
    from pyspark.sql import functions as F

    if not rows:
        return spark.range(0).select(*[F.lit(None).cast(t).alias(n) for n, t in columns])
    structs = [F.struct(*[F.lit(v).cast(t).alias(n) for v, (n, t) in zip(row, columns, strict=True)]) for row in rows]
    return spark.range(1).select(F.inline(F.array(*structs)))


def join_jars(*lists: str) -> str:
    """Comma-separated jar lists joined, each jar once (by file name: spark-submit adds ``file:``)."""
    seen: dict[str, str] = {}
    for jar in (j.strip() for jars in lists for j in jars.split(",")):
        if jar:
            seen.setdefault(jar.rsplit("/", 1)[-1], jar)
    return ",".join(seen.values())


def _submitted_jars() -> str:
    """spark.jars as spark-submit set it (``--jars``, ``--packages``): kept, so executors get them too."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM, whose properties hold the conf
    return SparkConf().get("spark.jars", "") or ""


def spark_conf(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--conf`` (as spark-submit takes it)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().startswith("spark."):
        raise ConfigurationError(f"--conf {text!r} must be spark.KEY=VALUE, e.g. --conf spark.executor.memory=512m")
    return key.strip(), value.strip()


def spark_session(
    settings: AnalyzeSettings, app_name: str = "txbox-analyze", conf: dict[str, str] | None = None
) -> SparkSession:
    """The session of one job; ``conf`` (spark.* settings) is applied last, ``spark.jars`` extended."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigurationError("pyspark is not installed: pip install 'txbox[spark]'") from None
    check_jar(settings)
    submitted = under_spark_submit()
    master = check_master(settings.master or "local[*]") if settings.master or not submitted else None
    extra = dict(conf or {})
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master.url)
    # Executors are started after the session, even under spark-submit: their options still apply.
    builder = builder.config("spark.executor.extraJavaOptions", "-Duser.timezone=UTC")
    jars = join_jars(_submitted_jars() if submitted else "", extra.pop("spark.jars", ""), str(settings.jdbc_jar))
    builder = (
        builder.config("spark.jars", jars)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        .config("spark.sql.adaptive.enabled", "true")
        # Parquet timestamps as UTC microseconds (what every reader takes), not the legacy INT96.
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        # Tables cached hash-partitioned by id serve joins on (service, id) without a shuffle.
        .config("spark.sql.requireAllClusterKeysForCoPartition", "false")
    )
    with _driver_jvm(submitted, master) as java_options:
        if java_options is not None:
            # Only while we launch the driver JVM ourselves; spark-submit's driver is running.
            builder = builder.config("spark.driver.memory", settings.driver_memory)
            builder = builder.config("spark.driver.extraJavaOptions", java_options)
        for key, value in extra.items():
            builder = builder.config(key, value)
        try:
            session = builder.getOrCreate()
        except Exception as exc:
            # Py4J and the JVM wrap the cause in pages of trace; the first line names it.
            raise ConfigurationError(f"Spark did not start ({java_error_line(exc)})") from None
    session.sparkContext.setLogLevel("WARN")
    return session


@contextlib.contextmanager
def job_session(settings: AnalyzeSettings, app_name: str, conf: dict[str, str] | None = None) -> Iterator[SparkSession]:
    """The session already running in this process (left running), else a new one stopped at the end.

    A library call (``Archiver.run`` from a test or an application that has its session)
    must not stop a session it did not start. Spark allows one session per process, so a
    different master asked for meanwhile fails loudly instead of being ignored.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        active = None  # spark_session names the extra to install
    else:
        active = SparkSession.getActiveSession()
    if active is not None:
        running = active.sparkContext.master
        if settings.master and parse_master(settings.master).url != running:
            raise ConfigurationError(
                f"--master {settings.master}: this process already runs a Spark session on {running}, and a "
                "process has one; run the command in a process of its own"
            )
        yield active
        return
    session = spark_session(settings, app_name, conf)
    try:
        yield session
    finally:
        session.stop()


@contextlib.contextmanager
def _driver_jvm(submitted: bool, master: Master | None) -> Iterator[str | None]:
    """Java options of the driver JVM about to be launched (None under spark-submit).

    In local mode, and with a master on loopback, the driver binds 127.0.0.1: Spark
    otherwise looks for the machine's outside address and warns that the host name
    resolves to loopback. With a remote master that search is right (executors must reach
    the driver), and the warning names SPARK_LOCAL_IP, the setting that picks the address.
    """
    if submitted:
        yield None
        return
    fd, log_config = tempfile.mkstemp(prefix="txbox-log4j2-", suffix=".properties")
    before = os.environ.get("SPARK_LOCAL_IP")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(LOG4J2)
        if before is None and master is not None and master.on_loopback:
            os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # read by the JVM at launch; restored below
        yield f"-Duser.timezone=UTC -Dlog4j2.configurationFile={log_config}"
    finally:
        if before is None:
            os.environ.pop("SPARK_LOCAL_IP", None)
        os.unlink(log_config)  # log4j has read it when the JVM came up


def java_error_line(exc: BaseException) -> str:
    """The line of a Py4J error that names the Java exception (its first line names the call)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line.lstrip(": ") for line in lines if line.startswith(":")]
    return (named or lines or [type(exc).__name__])[0][:500]
