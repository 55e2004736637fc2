"""`txbox archive`: move processed and abandoned rows older than a cutoff to Parquet, as a Spark job.

The same job shape as `txbox analyze` (docs/explanation/analytics.md, "The Spark job on a
cluster"): the session of framework/analytics/session.py (local by default, or
``--master spark://HOST:7077``, or spark-submit), the partitioned JDBC reads of
framework/analytics/read.py, and a location that is a URI (``file://``, ``hdfs://``,
``s3a://`` or a plain path), written and read by the executors. No Python runs on the
executors: every step is a JDBC read, a DataFrame expression or a Parquet write.

Layout (Hive-style, read by `txbox analyze --history URI`, Spark and pyarrow.dataset)::

    URI/<service>/<outbox|inbox>/batch=<batch id>/day=YYYY-MM-DD/message_type=<T>/part-*.parquet

``day`` is the UTC day of ``created_at``; ``message_type`` lives in the path, not in the
file. uuid and jsonb columns are stored as strings (JSON text), timestamps as UTC
microseconds; ``metadata`` never holds an ``auth_token`` (docs/explanation/operations.md, "Secrets").

Crash safety without renames or fsync (which object stores and HDFS clients do not
offer): the manifest of every batch is a row of ``txbox.archive_batches``
(framework/sql/archive_batches.py), in the database whose rows it moves.

1. the batch's exact ids are recorded there (``pending``) before any file is written;
2. the batch's directory is written with ``overwrite`` from a partitioned read of those
   ids, then read back through Spark: as many rows as distinct ids, every id one of the
   manifest's, and the driver sees the files (storage the executors share);
3. one transaction locks the batch's rows, checks that the database holds exactly as
   many of them as the files do, deletes them — inbox rows through
   :func:`framework.dedup.forget`, which keeps a row finished within
   ``TXBOX_DEDUP_WINDOW`` as a tombstone — and marks the batch ``done``.

A rerun first finishes every ``pending`` batch of the service: nothing of it was deleted
(the delete and ``done`` commit together), so its directory is written again, with
overwrite, from the same rows, and the batch goes on from step 2. An interruption
anywhere — an exception, kill -9 of the driver, a lost executor — neither loses nor
duplicates a row. A tombstone is never archived again; the run ends by deleting the
tombstones whose window has passed, so any ``--older-than`` is safe.

``Archiver.move(table, where)`` archives and removes the finished rows a caller selects
(retention archiving to Parquet first); ``Archiver.run(older_than)`` is `txbox archive`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import Table
from sqlalchemy.dialects.postgresql import JSONB, UUID

from framework import dedup, names, tables
from framework.analytics.locations import Storage, join, location
from framework.analytics.read import Reader
from framework.analytics.session import job_session
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import Source
from framework.db import connect, database_errors
from framework.errors import ArchiveError
from framework.sql import archive_batches as archive_batches_sql
from framework.sql import retention as retention_sql
from framework.sql.archive_batches import Batch

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("txbox.archive")

PARTITION_COLUMNS = ("day", "message_type")  # in the path, not in the files
NOT_IN_FILES = ("archived_at",)  # always null in an archived row: the Parquet layout stays as it was
DEFAULT_DEDUP_WINDOW = timedelta(days=7)
Checkpoint = Callable[[str], None]


def _noop(stage: str) -> None:
    return None


@dataclass
class ArchiveResult:
    archived: dict[str, int] = field(default_factory=dict)  # table → rows written
    deleted: dict[str, int] = field(default_factory=dict)
    tombstoned: int = 0  # inbox rows archived but kept as ids for dedup
    purged: int = 0  # tombstones deleted once their dedup window passed
    batches: int = 0
    recovered: int = 0

    def summary(self, service: str, root: str) -> str:
        parts = [f"{t}: {self.archived.get(t, 0)} archived, {self.deleted.get(t, 0)} deleted" for t in _tables()]
        parts[-1] += (
            f", {self.tombstoned} kept as ids for dedup (TXBOX_DEDUP_WINDOW), {self.purged} expired ids deleted"
        )
        extra = f"; finished {self.recovered} interrupted batch(es)" if self.recovered else ""
        return f"txbox archive {service} → {root}: " + "; ".join(parts) + f" ({self.batches} batch(es){extra})"

    def add(self, table: str, archived: int, removed: dedup.Forgotten) -> None:
        self.archived[table] = self.archived.get(table, 0) + archived
        self.deleted[table] = self.deleted.get(table, 0) + removed.deleted
        self.tombstoned += removed.tombstoned


def _tables() -> tuple[str, str]:
    return (names.OUTBOX, names.INBOX)


def _table(name: str) -> Table:
    return tables.outbox if name == names.OUTBOX else tables.inbox


def select_list(table: Table) -> str:
    """Every column of the files, uuid and jsonb as text, plus the ``day`` of the path."""
    cols = []
    for c in table.columns:
        if c.name in NOT_IN_FILES:
            continue
        # Archives never hold an auth_token (docs/explanation/operations.md, "Secrets").
        name = f"({c.name} - 'auth_token')" if c.name == "metadata" else c.name
        cols.append(f"{name}::text AS {c.name}" if isinstance(c.type, UUID | JSONB) else c.name)
    cols.append("to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS day")
    return ", ".join(cols)


class Archiver:
    """One service's archive run; ``spark`` defaults to this process's session, else a local one."""

    def __init__(
        self,
        *,
        database_url: str,
        service: str,
        root: str | os.PathLike[str],
        schema: str = "txbox",
        batch_size: int = 50000,
        dedup_window: timedelta = DEFAULT_DEDUP_WINDOW,
        spark: SparkSession | None = None,
        settings: AnalyzeSettings | None = None,
        checkpoint: Checkpoint = _noop,
    ) -> None:
        self.url = database_url
        self.service = service
        self.root = location(os.fspath(root), "--to")
        self.schema = schema
        self.batch_size = batch_size
        self.dedup_window = dedup_window
        self.spark = spark
        self.settings = settings or AnalyzeSettings()
        self.checkpoint = checkpoint
        self.source = Source(service, database_url)

    # --- the run ---------------------------------------------------------------------
    def run(self, older_than: timedelta, now: datetime | None = None) -> ArchiveResult:
        """`txbox archive`: finish interrupted batches, archive rows older than the cutoff, purge expired ids."""
        cutoff = (now or datetime.now(UTC)) - older_than
        with self._session() as spark:
            result = self._recover(spark)
            for table in _tables():
                self._batches(spark, table, cutoff, result)
        result.purged = self._purge_expired()
        return result

    def move(self, table: str, before: datetime) -> ArchiveResult:
        """Archive and remove the finished rows of ``table`` created before ``before`` (no purge)."""
        with self._session() as spark:
            result = self._recover(spark)
            self._batches(spark, table, before, result)
        return result

    @contextlib.contextmanager
    def _session(self) -> Iterator[SparkSession]:
        """The Spark session, while this run holds the service's archive lock.

        The lock is released with ``pg_advisory_unlock`` when the run ends, however it
        ends, and the release is checked (stage ``unlocked`` of the checkpoint follows it,
        the lock's connection still open): a session lock left to the connection's end
        would outlive the run wherever that end is late (a pooler's server connection, a
        close that hangs).
        """
        key = {"key": names.archive_lock_key(self.service)}
        with database_errors("archive: cannot take its lock"), connect(self.url, autocommit=True) as lock:
            row = lock.execute(retention_sql.try_lock(), key).fetchone()
            if not (row and row[0]):
                # Two runs would archive the same rows twice before one of them failed.
                raise ArchiveError(
                    f"another `txbox archive` of {self.service} is running on this database; "
                    "wait for it to finish (its lock is released when it ends)"
                )
            try:
                if self.spark is not None:
                    yield self.spark
                else:
                    with job_session(self.settings, "txbox-archive") as spark:
                        yield spark
            finally:
                self._unlock(lock, key)

    def _unlock(self, lock: psycopg.Connection[Any], key: dict[str, int]) -> None:
        """Release the run's lock; never raises (it must not hide the run's own error)."""
        try:
            row = lock.execute(retention_sql.unlock(), key).fetchone()
        except psycopg.Error as exc:  # the connection is gone, and the lock with it
            log.warning("archive: could not release its lock of %s (%s)", self.service, type(exc).__name__)
            return
        if not (row and row[0]):
            log.warning("archive: its lock of %s was not held when the run ended", self.service)
        self.checkpoint("unlocked")

    def _recover(self, spark: SparkSession) -> ArchiveResult:
        result = ArchiveResult()
        with database_errors("archive: cannot read its batches"), connect(self.url, autocommit=True) as conn:
            pending = archive_batches_sql.unfinished(conn.cursor(), self.schema, self.service)
        for batch in pending:
            log.info("finishing interrupted archive batch %s", batch.batch_id)
            written, removed = self._finish(spark, batch)
            result.recovered += 1
            result.add(batch.table, written, removed)
        return result

    def _batches(self, spark: SparkSession, table: str, cutoff: datetime, result: ArchiveResult) -> None:
        after: tuple[datetime, str] | None = None
        while True:
            batch = self._open(table, cutoff, after)
            if batch is None:
                return
            self.checkpoint("manifest")
            assert batch.last_created_at is not None and batch.last_id is not None
            after = (batch.last_created_at, batch.last_id)
            written, removed = self._finish(spark, batch)
            result.batches += 1
            result.add(table, written, removed)
            if batch.size < self.batch_size or removed.deleted + removed.tombstoned == 0:
                return  # nothing removed: rows that keep changing state; leave them for the next run

    def _open(self, table: str, cutoff: datetime, after: tuple[datetime, str] | None) -> Batch | None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        batch_id = f"{table}-{stamp}-{uuid.uuid4().hex[:8]}"
        where = join(self.root, self.service, table, f"batch={batch_id}")
        with database_errors("archive: cannot record a batch"), connect(self.url) as conn:
            batch = archive_batches_sql.open_next(
                conn.cursor(),
                self.schema,
                batch_id=batch_id,
                service=self.service,
                table=table,
                location=where,
                cutoff=cutoff,
                after=after,
                limit=self.batch_size,
            )
            conn.commit()
        return batch

    # --- one batch -------------------------------------------------------------------
    def _finish(self, spark: SparkSession, batch: Batch) -> tuple[int, dedup.Forgotten]:
        """Write, verify, delete: drive a ``pending`` batch to ``done``; (rows written, rows removed)."""
        written = self._write(spark, batch)
        removed = self._delete(batch, written)
        self.checkpoint("deleted")
        done = removed.deleted + removed.tombstoned
        if done != written:
            log.warning(
                "archive batch %s: removed %d of %d rows (the others changed state since the batch was "
                "written: their archived copy is the older version)",
                batch.batch_id,
                done,
                written,
            )
        return written, removed

    def _write(self, spark: SparkSession, batch: Batch) -> int:
        """The batch's rows into its directory (overwritten), read back and checked; returns their count."""
        from pyspark.sql import functions as F

        reader = Reader(spark, self.settings, self.schema, "txbox-archive")
        ids = archive_batches_sql.ids_array(self.schema, batch.batch_id)
        where = f"id = ANY({ids}) AND {archive_batches_sql.NOT_ARCHIVED[batch.table]}"
        rows = reader.partitioned(self.source, batch.table, select_list(_table(batch.table)), where)
        storage = Storage(spark, batch.location, "--to")
        (
            rows.write.mode("overwrite")
            .partitionBy(*PARTITION_COLUMNS)
            .option("compression", "zstd")
            .parquet(batch.location)
        )
        self.checkpoint("written")
        if storage.parquet_files() == 0 and self._left(batch) == 0:
            return 0  # a recovered batch whose rows were all removed meanwhile: nothing to keep
        storage.check_written("")
        # Read back through Spark, as every reader will: each row once, each id the manifest's.
        manifest = reader.query(self.source, f"SELECT unnest({ids})::text AS id, TRUE AS listed")
        back = spark.read.parquet(batch.location).select("id")
        found = back.join(F.broadcast(manifest), "id", "left").agg(
            F.count(F.lit(1)).alias("rows"),
            F.countDistinct("id").alias("ids"),
            F.count("listed").alias("listed"),
        )
        check = found.first()
        assert check is not None
        count, distinct, listed = int(check["rows"]), int(check["ids"]), int(check["listed"])
        if not count == distinct == listed:
            raise ArchiveError(
                f"archive batch {batch.batch_id}: {batch.location} holds {count} rows, {distinct} ids, {listed} "
                "of them in the batch's manifest; nothing was deleted — rerun `txbox archive` to rewrite the batch"
            )
        return count

    def _left(self, batch: Batch) -> int:
        """How many of the batch's rows the database still holds to archive."""
        with database_errors("archive: cannot read"), connect(self.url, autocommit=True) as conn:
            return archive_batches_sql.count_left(conn.cursor(), self.schema, batch)

    def _delete(self, batch: Batch, written: int) -> dedup.Forgotten:
        """Delete the batch's rows and mark it done, in one transaction; inbox rows through the dedup memory."""
        with database_errors("archive: cannot delete"), connect(self.url) as conn:
            cur = conn.cursor()
            ids = archive_batches_sql.lock_rows(cur, self.schema, batch)
            if len(ids) != written:
                raise ArchiveError(
                    f"archive batch {batch.batch_id}: the database holds {len(ids)} of its rows, the files "
                    f"{written}; nothing was deleted — rerun `txbox archive` to rewrite the batch"
                )
            if batch.table == names.INBOX:
                removed = dedup.forget(cur, self.schema, ids, self.dedup_window)
            else:
                removed = dedup.Forgotten(
                    deleted=archive_batches_sql.delete_finished(cur, self.schema, batch.table, ids)
                )
            archive_batches_sql.finish(cur, self.schema, batch.batch_id, written, removed.deleted + removed.tombstoned)
            conn.commit()
        return removed

    def _purge_expired(self) -> int:
        """Delete the tombstones whose dedup window has passed, one batch per transaction."""
        total = 0
        while True:
            with database_errors("archive: cannot delete expired dedup ids"), connect(self.url) as conn:
                cur = conn.cursor()
                ids = dedup.expired_tombstones(cur, self.schema, self.dedup_window, self.batch_size)
                removed = dedup.forget(cur, self.schema, ids, self.dedup_window)
                conn.commit()
            total += removed.deleted
            if len(ids) < self.batch_size or removed.deleted == 0:
                return total
