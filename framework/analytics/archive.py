"""`txbox archive`: move processed and abandoned rows older than a cutoff to Parquet.

Why pyarrow + psycopg and not Spark: archiving is a row mover bound by PostgreSQL, done
in batches that must each be written, verified and deleted in a strict order; a JVM
adds ~10 s of start-up and nothing to that. One batch of 50,000 rows is one short
SELECT, a few Parquet files and one DELETE by primary key.

Layout (Hive-style, readable by Spark and pyarrow.dataset; `txbox analyze --history DIR`)::

    DIR/<service>/<outbox|inbox>/day=YYYY-MM-DD/message_type=<T>/<batch id>.parquet
    DIR/_manifests/<service>/<batch id>.json
    DIR/_staging/<batch id>/...                 (only while a batch is being written)

``day`` is the UTC day of ``created_at``; ``message_type`` lives in the path, not in the
file. uuid and jsonb columns are stored as strings (JSON text), timestamps as UTC
microseconds.

Crash safety — one manifest per batch, states ``pending → written → done``:

1. the batch's exact ids are recorded in the manifest (``pending``) before any file;
2. its files are written to the staging dir, read back and checked (row count and the
   exact id set match the manifest), then renamed into place (``os.replace``, atomic per
   file) and checked again → ``written``;
3. only then ``DELETE ... WHERE id = ANY(<manifest ids>)`` (and still processed or
   abandoned) → ``done``. Inbox rows go through :func:`framework.dedup.forget` instead:
   a row finished within ``TXBOX_DEDUP_WINDOW`` is not deleted but stripped to a
   tombstone that keeps its id, so a late duplicate or a replay is still recognized.
   A tombstone is never archived again; the run ends by deleting the tombstones whose
   window has passed (so any ``--older-than`` is safe, the window decides what is kept).

A rerun first finishes every unfinished manifest: a ``pending`` batch drops its staged
and already-renamed files (file names carry the batch id, so they are exactly known) and
is written again from the rows, which are still in the database because nothing is
deleted before ``written``; a ``written`` batch repeats its delete, which is idempotent.
So an interruption anywhere neither loses nor duplicates a row.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Boolean, DateTime, Integer, SmallInteger, Table
from sqlalchemy.dialects.postgresql import JSONB, UUID

from framework import dedup, names, tables
from framework.db import connect, database_errors
from framework.errors import ArchiveError
from framework.sql import inbox as inbox_sql

log = logging.getLogger("txbox.archive")

PARTITION_COLUMNS = ("message_type",)  # in the path; `day` is derived from created_at
DONE_STATES = ("done",)
ARCHIVED = inbox_sql.FINISHED
# Tombstones (inbox rows kept for dedup) are archived already and stay out of the files.
NOT_ARCHIVED = {names.OUTBOX: "TRUE", names.INBOX: "archived_at IS NULL"}
NOT_IN_FILES = ("archived_at",)  # always null in an archived row: the Parquet layout stays as it was
DEFAULT_DEDUP_WINDOW = timedelta(days=7)
Checkpoint = Callable[[str], None]


def _noop(stage: str) -> None:
    return None


@dataclass
class Manifest:
    batch_id: str
    service: str
    table: str
    cutoff: str
    ids: list[str]
    state: str = "pending"
    files: list[str] = field(default_factory=list)  # relative to the archive root
    rows: int = 0
    deleted: int | None = None
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())


@dataclass
class ArchiveResult:
    archived: dict[str, int] = field(default_factory=dict)  # table → rows written
    deleted: dict[str, int] = field(default_factory=dict)
    tombstoned: int = 0  # inbox rows archived but kept as ids for dedup
    purged: int = 0  # tombstones deleted once their dedup window passed
    batches: int = 0
    recovered: int = 0

    def summary(self, service: str, root: Path) -> str:
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


def _select_list(table: Table) -> str:
    """Every column; uuid and jsonb as text so Parquet holds plain strings."""
    cols = []
    for c in _file_columns(table):
        # Archives never hold an auth_token (docs/architecture.md, "Secrets").
        name = f"({c.name} - 'auth_token')" if c.name == "metadata" else c.name
        cols.append(f"{name}::text AS {c.name}" if isinstance(c.type, UUID | JSONB) else c.name)
    return ", ".join(cols)


def _file_columns(table: Table) -> list[Any]:
    return [c for c in table.columns if c.name not in NOT_IN_FILES]


def arrow_schema(table: Table) -> Any:
    """The Parquet schema of an archived table, derived from framework/tables.py."""
    import pyarrow as pa

    fields = []
    for c in _file_columns(table):
        if c.name in PARTITION_COLUMNS:
            continue
        t = c.type
        if isinstance(t, DateTime):
            typ = pa.timestamp("us", tz="UTC")
        elif isinstance(t, SmallInteger):
            typ = pa.int16()
        elif isinstance(t, BigInteger):
            typ = pa.int64()
        elif isinstance(t, Integer):
            typ = pa.int32()
        elif isinstance(t, Boolean):
            typ = pa.bool_()
        else:
            typ = pa.string()
        fields.append(pa.field(c.name, typ, nullable=bool(c.nullable)))
    return pa.schema(fields)


class Archiver:
    def __init__(
        self,
        *,
        database_url: str,
        service: str,
        root: Path,
        schema: str = "txbox",
        batch_size: int = 50000,
        dedup_window: timedelta = DEFAULT_DEDUP_WINDOW,
        checkpoint: Checkpoint = _noop,
    ) -> None:
        self.url = database_url
        self.service = service
        self.root = root
        self.schema = schema
        self.batch_size = batch_size
        self.dedup_window = dedup_window
        self.checkpoint = checkpoint
        self.manifests = root / "_manifests" / service

    # --- manifests -------------------------------------------------------------------
    def _save(self, m: Manifest) -> None:
        self.manifests.mkdir(parents=True, exist_ok=True)
        path = self.manifests / f"{m.batch_id}.json"
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(asdict(m), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.manifests)

    def unfinished(self) -> list[Manifest]:
        if not self.manifests.is_dir():
            return []
        found = [Manifest(**json.loads(p.read_text(encoding="utf-8"))) for p in sorted(self.manifests.glob("*.json"))]
        return [m for m in found if m.state not in DONE_STATES]

    # --- database ----------------------------------------------------------------------
    def _fetch(self, table: str, where: str, params: dict[str, Any], limit: str = "") -> list[dict[str, Any]]:
        from psycopg.rows import dict_row

        t = _table(table)
        sql = (
            f"SELECT {_select_list(t)} FROM {names.qualified(self.schema, table)} "
            f"WHERE {where} ORDER BY created_at, id {limit}"
        )
        with database_errors("archive: cannot read"), connect(self.url, autocommit=True, row_factory=dict_row) as conn:
            return list(conn.execute(sql, params).fetchall())

    def _delete(self, m: Manifest) -> dedup.Forgotten:
        """Delete the batch's rows; inbox rows through the dedup memory (kept as tombstones in the window)."""
        with database_errors("archive: cannot delete"), connect(self.url) as conn:
            if m.table == names.INBOX:
                removed = dedup.forget(conn.cursor(), self.schema, m.ids, self.dedup_window)
            else:
                table = names.qualified(self.schema, m.table)
                sql = f"DELETE FROM {table} WHERE id = ANY(%(ids)s::uuid[]) AND {ARCHIVED}"
                removed = dedup.Forgotten(deleted=conn.execute(sql, {"ids": m.ids}).rowcount)
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

    # --- files -------------------------------------------------------------------------
    def _write(self, m: Manifest, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        t = _table(m.table)
        schema = arrow_schema(t)
        staging = self.root / "_staging" / m.batch_id
        shutil.rmtree(staging, ignore_errors=True)
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in rows:
            day = r["created_at"].astimezone(UTC).strftime("%Y-%m-%d")
            groups.setdefault((day, r["message_type"]), []).append(r)
        files = []
        for (day, message_type), part in sorted(groups.items()):
            rel = Path(self.service) / m.table / f"day={day}" / f"message_type={_escape(message_type)}"
            rel = rel / f"{m.batch_id}.parquet"
            data = pa.table({f.name: [r[f.name] for r in part] for f in schema}, schema=schema)
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(data, target, compression="zstd")
            _fsync_file(target)
            files.append(str(rel))
        m.files = files
        m.rows = len(rows)
        self._verify(m, staging)
        self.checkpoint("staged")
        for i, name in enumerate(files):
            final = self.root / name
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, final)
            _fsync_dir(final.parent)
            if i == 0:
                self.checkpoint("renamed_one")
        self._verify(m, self.root)
        shutil.rmtree(staging, ignore_errors=True)

    def _verify(self, m: Manifest, base: Path) -> None:
        """The files hold exactly the manifest's ids, each once: else nothing is deleted."""
        import pyarrow.parquet as pq

        seen: list[str] = []
        for rel in m.files:
            seen += pq.read_table(base / rel, columns=["id"]).column("id").to_pylist()
        if len(seen) != len(m.ids) or set(seen) != set(m.ids):
            raise ArchiveError(
                f"archive batch {m.batch_id}: files hold {len(seen)} rows ({len(set(seen))} ids), "
                f"the manifest lists {len(m.ids)}; nothing was deleted — rerun `txbox archive` to redo the batch"
            )

    def _drop_files(self, m: Manifest) -> None:
        shutil.rmtree(self.root / "_staging" / m.batch_id, ignore_errors=True)
        for path in (self.root / self.service).rglob(f"{m.batch_id}.parquet"):
            path.unlink()

    # --- batches -----------------------------------------------------------------------
    def _finish(self, m: Manifest, rows: list[dict[str, Any]] | None = None) -> dedup.Forgotten:
        """Drive one batch to ``done``; returns the rows deleted (and kept as tombstones)."""
        if m.state == "pending":
            self._drop_files(m)
            if rows is None:
                rows = self._fetch(m.table, "id = ANY(%(ids)s::uuid[])", {"ids": m.ids})
                if len(rows) != len(m.ids):
                    # Not deleted by us (we delete only after `written`): someone else did.
                    m.ids = [r["id"] for r in rows]
                    self._save(m)
            self._write(m, rows)
            m.state = "written"
            self._save(m)
            self.checkpoint("written")
        removed = self._delete(m)
        self.checkpoint("deleted")
        done = removed.deleted + removed.tombstoned
        m.deleted = done if m.deleted is None else m.deleted + done
        m.state = "done"
        self._save(m)
        if done != len(m.ids):
            log.warning(
                "archive batch %s: removed %d of %d rows (the others were already removed by an interrupted "
                "run, or changed state since: their archived copy is the older version)",
                m.batch_id,
                done,
                len(m.ids),
            )
        return removed

    def run(self, older_than: timedelta, now: datetime | None = None) -> ArchiveResult:
        result = ArchiveResult()
        for m in self.unfinished():
            log.info("finishing interrupted archive batch %s (%s)", m.batch_id, m.state)
            removed = self._finish(m)
            result.recovered += 1
            result.add(m.table, m.rows, removed)
        cutoff = (now or datetime.now(UTC)) - older_than
        for table in _tables():
            after: dict[str, Any] = {}
            while True:
                # Keyset paging: tombstones stay in the created_at range, never scanned twice.
                rows = self._fetch(
                    table,
                    f"created_at < %(cutoff)s AND {ARCHIVED} AND {NOT_ARCHIVED[table]}"
                    + (
                        " AND created_at >= %(after_at)s AND (created_at, id::text) > (%(after_at)s, %(after_id)s)"
                        if after
                        else ""
                    ),
                    {"cutoff": cutoff, **after},
                    f"LIMIT {int(self.batch_size)}",
                )
                if not rows:
                    break
                after = {"after_at": rows[-1]["created_at"], "after_id": rows[-1]["id"]}
                stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
                m = Manifest(
                    batch_id=f"{table}-{stamp}-{uuid.uuid4().hex[:8]}",
                    service=self.service,
                    table=table,
                    cutoff=cutoff.isoformat(),
                    ids=[r["id"] for r in rows],
                )
                self._save(m)
                self.checkpoint("manifest")
                removed = self._finish(m, rows)
                result.batches += 1
                result.add(table, m.rows, removed)
                if len(rows) < self.batch_size or removed.deleted + removed.tombstoned == 0:
                    break  # nothing removed: rows that keep changing state; leave them for the next run
        result.purged = self._purge_expired()
        return result


def _escape(value: str) -> str:
    """Hive partition value escaping (as Spark does): keep the path one segment."""
    out = []
    for ch in value:
        out.append(f"%{ord(ch):02X}" if ch in "\"#%'*/:=?\\\x7f{[]^" or ord(ch) < 0x20 else ch)
    return "".join(out)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
