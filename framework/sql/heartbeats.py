"""The SQL of ``daemon_heartbeats``: a daemon's upsert and prune, the dashboard's read.

Only the schema (a validated identifier) is composed into the text; every value is a
bound parameter (docs/explanation/operations.md, "Probes, logs and liveness").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from framework import names

#: Rows of processes that have not beaten for this long are deleted (the dashboard shows
#: a vanished daemon as missing until then).
PRUNE_AFTER_SECONDS = 86400.0
#: Beats a daemon may miss before the dashboard calls it missing (a beat is one short
#: transaction: a busy database may delay one, not three).
MISSED_BEATS = 3

Status = Literal["alive", "stuck", "missing"]


def _table(schema: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(names.DAEMON_HEARTBEATS))


def upsert(schema: str, *, waits: bool = True) -> sql.Composed:
    """One row per (service, kind, host, pid); ``beat_at`` is the database's clock.

    With ``waits`` (migration 0010) the row also carries the daemon's wait:
    ``waiting_since`` is ``waiting_seconds`` before the database's clock, so that the
    dashboard measures it with the same clock as the rest; all three are null while the
    daemon does not wait. Without, the columns of migration 0008 only.
    """
    extra_columns = ", waiting_since, waiting_queue, waiting_detail" if waits else ""
    extra_values = (
        ", clock_timestamp() - make_interval(secs => %(waiting_seconds)s::float8), %(waiting_queue)s, "
        "%(waiting_detail)s"
        if waits
        else ""
    )
    extra_updates = (
        ", waiting_since = excluded.waiting_since, waiting_queue = excluded.waiting_queue, "
        "waiting_detail = excluded.waiting_detail"
        if waits
        else ""
    )
    return sql.SQL(
        "INSERT INTO {t} (service, kind, host, pid, started_at, last_progress, beat_at, beat_interval, "
        "stuck_after, ready" + extra_columns + ") VALUES (%(service)s, %(kind)s, %(host)s, %(pid)s, "
        "%(started_at)s, %(last_progress)s, clock_timestamp(), %(beat_interval)s, %(stuck_after)s, %(ready)s"
        + extra_values
        + ") ON CONFLICT (service, kind, host, pid) DO UPDATE SET started_at = excluded.started_at, "
        "last_progress = excluded.last_progress, beat_at = excluded.beat_at, "
        "beat_interval = excluded.beat_interval, stuck_after = excluded.stuck_after, ready = excluded.ready"
        + extra_updates
    ).format(t=_table(schema))


def prune(schema: str) -> sql.Composed:
    return sql.SQL("DELETE FROM {t} WHERE beat_at < clock_timestamp() - make_interval(secs => %(seconds)s)").format(
        t=_table(schema)
    )


def remove(schema: str) -> sql.Composed:
    """A daemon that stops cleanly takes its row away: stopped is not missing."""
    return sql.SQL("DELETE FROM {t} WHERE service = %(service)s AND kind = %(kind)s AND host = %(host)s "
                   "AND pid = %(pid)s").format(t=_table(schema))  # fmt: skip


#: Longest ``waiting_queue`` and ``waiting_detail`` a row holds (migration 0010's checks).
MAX_QUEUE_CHARS = 255
MAX_DETAIL_CHARS = 500


@dataclass(frozen=True)
class Beat:
    """One daemon process as the dashboard shows it."""

    service: str
    kind: str
    host: str
    pid: int
    started_at: datetime
    last_progress: datetime
    beat_at: datetime
    progress_age: float  # seconds since last_progress, by the database's clock
    beat_age: float
    stuck_after: float
    beat_interval: float
    ready: bool
    # What the daemon waits for instead of working (migration 0010); all None when not waiting.
    waiting_since: datetime | None = None
    waiting_queue: str | None = None
    waiting_detail: str | None = None
    waiting_age: float | None = None  # seconds since waiting_since, by the database's clock

    @property
    def status(self) -> Status:
        """missing: no beat for :data:`MISSED_BEATS` intervals; stuck: beating, no progress."""
        if self.beat_age > MISSED_BEATS * self.beat_interval:
            return "missing"
        if self.progress_age > self.stuck_after:
            return "stuck"
        return "alive"

    @property
    def waiting(self) -> dict[str, Any] | None:
        """The wait its last beat reported: ``queue``, ``detail``, ``since`` and ``seconds``
        (since then, by the database's clock, so it grows between beats); None when none."""
        if self.waiting_since is None or self.waiting_age is None:
            return None
        return {
            "queue": self.waiting_queue,
            "detail": self.waiting_detail,
            "since": self.waiting_since,
            "seconds": round(self.waiting_age, 3),
        }

    def view(self) -> dict[str, Any]:
        """The row with its status and its wait, for the dashboard's page and JSON API."""
        row = {k: v for k, v in asdict(self).items() if not k.startswith("waiting_")}
        return {**row, "status": self.status, "waiting": self.waiting}


_COLUMNS = (
    "service, kind, host, pid, started_at, last_progress, beat_at, "
    "extract(epoch FROM clock_timestamp() - last_progress)::float8, "
    "extract(epoch FROM clock_timestamp() - beat_at)::float8, stuck_after, beat_interval, ready"
)
_WAIT_COLUMNS = (
    ", waiting_since, waiting_queue, waiting_detail, extract(epoch FROM clock_timestamp() - waiting_since)::float8"
)


def read(conn: psycopg.Connection[Any], schema: str, service: str) -> list[Beat]:
    """The rows of ``service``, by kind, host and pid; none before migration 0008, no
    waits before migration 0010."""
    for columns in (_COLUMNS + _WAIT_COLUMNS, _COLUMNS):
        query = sql.SQL(
            "SELECT " + columns + " FROM {t} WHERE service = %(service)s ORDER BY kind, host, pid LIMIT 1000"
        ).format(t=_table(schema))
        try:
            with conn.cursor(row_factory=tuple_row) as cur:
                return [Beat(*row) for row in cur.execute(query, {"service": service}).fetchall()]
        except psycopg.errors.UndefinedColumn:
            if not conn.autocommit:
                conn.rollback()
        except psycopg.errors.UndefinedTable:
            if not conn.autocommit:
                conn.rollback()
            return []
    return []
