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
   abandoned) → ``done``.

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

from framework import names, tables
from framework.db import connect, database_errors
from framework.errors import TxboxError

log = logging.getLogger("txbox.archive")

PARTITION_COLUMNS = ("message_type",)  # in the path; `day` is derived from created_at
DONE_STATES = ("done",)
ARCHIVED = "(processed_at IS NOT NULL OR abandoned_at IS NOT NULL)"
Checkpoint = Callable[[str], None]


class ArchiveError(TxboxError):
    """An archive batch could not be verified; nothing was deleted."""


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
    batches: int = 0
    recovered: int = 0

    def summary(self, service: str, root: Path) -> str:
        parts = [f"{t}: {self.archived.get(t, 0)} archived, {self.deleted.get(t, 0)} deleted" for t in _tables()]
        extra = f"; finished {self.recovered} interrupted batch(es)" if self.recovered else ""
        return f"txbox archive {service} → {root}: " + "; ".join(parts) + f" ({self.batches} batch(es){extra})"


def _tables() -> tuple[str, str]:
    return (names.OUTBOX, names.INBOX)


def _table(name: str) -> Table:
    return tables.outbox if name == names.OUTBOX else tables.inbox


def _select_list(table: Table) -> str:
    """Every column; uuid and jsonb as text so Parquet holds plain strings."""
    cols = []
    for c in table.columns:
        # Archives never hold an auth_token (docs/architecture.md, "Secrets").
        name = f"({c.name} - 'auth_token')" if c.name == "metadata" else c.name
        cols.append(f"{name}::text AS {c.name}" if isinstance(c.type, UUID | JSONB) else c.name)
    return ", ".join(cols)


def arrow_schema(table: Table) -> Any:
    """The Parquet schema of an archived table, derived from framework/tables.py."""
    import pyarrow as pa

    fields = []
    for c in table.columns:
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
        checkpoint: Checkpoint = _noop,
    ) -> None:
        self.url = database_url
        self.service = service
        self.root = root
        self.schema = schema
        self.batch_size = batch_size
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

    def _delete(self, m: Manifest) -> int:
        sql = f"DELETE FROM {names.qualified(self.schema, m.table)} WHERE id = ANY(%(ids)s::uuid[]) AND {ARCHIVED}"
        with database_errors("archive: cannot delete"), connect(self.url) as conn:
            count = conn.execute(sql, {"ids": m.ids}).rowcount
            conn.commit()
        return count

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
    def _finish(self, m: Manifest, rows: list[dict[str, Any]] | None = None) -> int:
        """Drive one batch to ``done``; returns the rows deleted."""
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
        deleted = self._delete(m)
        self.checkpoint("deleted")
        m.deleted = deleted if m.deleted is None else m.deleted + deleted
        m.state = "done"
        self._save(m)
        if deleted != len(m.ids):
            log.warning(
                "archive batch %s: deleted %d of %d rows (the others were already deleted by an interrupted "
                "run, or changed state since: their archived copy is the older version)",
                m.batch_id,
                deleted,
                len(m.ids),
            )
        return deleted

    def run(self, older_than: timedelta, now: datetime | None = None) -> ArchiveResult:
        result = ArchiveResult()
        for m in self.unfinished():
            log.info("finishing interrupted archive batch %s (%s)", m.batch_id, m.state)
            deleted = self._finish(m)
            result.recovered += 1
            result.archived[m.table] = result.archived.get(m.table, 0) + m.rows
            result.deleted[m.table] = result.deleted.get(m.table, 0) + deleted
        cutoff = (now or datetime.now(UTC)) - older_than
        for table in _tables():
            while True:
                rows = self._fetch(
                    table,
                    f"created_at < %(cutoff)s AND {ARCHIVED}",
                    {"cutoff": cutoff},
                    f"LIMIT {int(self.batch_size)}",
                )
                if not rows:
                    break
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
                deleted = self._finish(m, rows)
                result.batches += 1
                result.archived[table] = result.archived.get(table, 0) + m.rows
                result.deleted[table] = result.deleted.get(table, 0) + deleted
                if len(rows) < self.batch_size or deleted == 0:
                    break  # deleted == 0: rows that keep changing state; leave them for the next run
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
