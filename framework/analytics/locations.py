"""Where the Spark job reads and writes files: URIs that every executor resolves alike.

On a cluster the files of ``--parquet`` and ``--history`` are written and read by the
executors, each in a JVM of its own, usually on another machine: a path means nothing
unless it names storage the driver and every executor share. So a location is a URI
(``file:///shared/reports``, ``hdfs://nn:8020/txbox``, ``s3a://bucket/txbox``) handed to
Hadoop's file systems as it is, never through :class:`pathlib.Path` (which turns
``s3a://b/x`` into the local path ``s3a:/b/x``). A plain path is taken as a local file
on the driver's side and made absolute, because an executor's working directory is not
the driver's. See docs/explanation/analytics.md, "The Spark job on a cluster".

The pure part (parsing) needs no pyspark; the checks against the file system go through
the running session's Hadoop configuration, so they see exactly what the job will see.
"""

from __future__ import annotations

import os
import posixpath
import urllib.parse
from typing import TYPE_CHECKING, Any

from framework.analytics.session import java_error_line
from framework.errors import ConfigurationError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LISTING_LIMIT = 100_000  # entries looked at when searching a tree for a Parquet file
# Hadoop file systems people point the job at; any other scheme is most likely a typo.
SCHEMES = ("file", "hdfs", "s3a", "abfs", "abfss", "gs", "viewfs", "wasb", "wasbs")
EXAMPLES = "file:///srv/shared/txbox, hdfs://namenode:8020/txbox, s3a://bucket/txbox or a plain path"


def location(text: str, flag: str) -> str:
    """The URI of ``text`` (a URI or a plain path), checked; ``flag`` names it in errors."""
    text = text.strip()
    if not text:
        raise ConfigurationError(f"{flag} is empty. Examples: {EXAMPLES}")
    if "://" not in text and not text.startswith("file:"):
        # Not percent-encoded: Hadoop's Path takes the characters of a URI's path as they are.
        return "file://" + os.path.abspath(os.path.expanduser(text))
    parsed = urllib.parse.urlsplit(text)
    scheme = parsed.scheme.lower()
    if scheme == "s3":
        raise ConfigurationError(
            f"{flag} {text!r}: Hadoop reads S3 through the s3a:// scheme; write s3a://{parsed.netloc}{parsed.path}"
        )
    if scheme not in SCHEMES:
        raise ConfigurationError(f"{flag} {text!r}: unknown storage scheme {scheme!r}. Examples: {EXAMPLES}")
    if scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ConfigurationError(
                f"{flag} {text!r}: a file URI names an absolute path on every machine, "
                "e.g. file:///srv/shared/txbox (three slashes)"
            )
        return "file://" + parsed.path.rstrip("/") if parsed.path != "/" else "file:///"
    if not parsed.netloc:
        raise ConfigurationError(f"{flag} {text!r}: {scheme}:// needs a host or bucket, e.g. {scheme}://name/txbox")
    return text.rstrip("/")


def join(uri: str, *parts: str) -> str:
    """``uri`` with path segments appended (no normalisation of the URI's own part)."""
    return posixpath.join(uri, *parts) if uri.endswith("/") else "/".join((uri, *parts))


class Storage:
    """The Hadoop file system of a location, as the session's driver sees it."""

    def __init__(self, spark: SparkSession, uri: str, flag: str) -> None:
        self.uri = uri
        self.flag = flag
        jvm: Any = spark.sparkContext._jvm
        self._path_class = jvm.org.apache.hadoop.fs.Path
        try:
            self.fs: Any = self._path_class(uri).getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        except Exception as exc:
            raise ConfigurationError(
                f"{flag} {uri}: this Spark has no file system for it ({java_error_line(exc)}). For s3a:// add "
                "hadoop-aws and its AWS SDK bundle to the job (--conf spark.jars=... or spark-submit --packages "
                "org.apache.hadoop:hadoop-aws:<Hadoop version of pyspark/jars>)"
            ) from None

    def parquet_files(self, relative: str = "", limit: int = 1) -> int:
        """How many ``*.parquet`` files are under ``uri/relative`` (counting stops at ``limit``)."""
        path = self._path_class(join(self.uri, relative) if relative else self.uri)
        if not self.fs.exists(path):
            return 0
        found = seen = 0
        files = self.fs.listFiles(path, True)
        while found < limit and seen < LISTING_LIMIT and files.hasNext():
            seen += 1
            if str(files.next().getPath().getName()).endswith(".parquet"):
                found += 1
        return found

    def check_written(self, relative: str) -> None:
        """Fail when a finished write left no file the driver can see.

        On a cluster each executor writes its part, and the job's commit (on the driver)
        moves them into place; with a path that is local to each machine the executors'
        files stay on their disks and the driver commits an empty directory without error.
        """
        if self.parquet_files(relative) == 0:
            raise ConfigurationError(
                f"{self.flag} {join(self.uri, relative)}: Spark reported the write done but the driver sees no "
                "Parquet file there: the executors wrote to storage the driver does not share. On a cluster "
                "give a location every machine sees alike: a shared mount (file:///mnt/shared/...), hdfs:// or s3a://"
            )
