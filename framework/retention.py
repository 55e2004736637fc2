"""Retention: the publisher prunes the outbox, the worker the inbox, so both stay small.

A :class:`Pruner` runs in a thread of its own beside its daemon's loop, on a connection
of its own: every ``TXBOX_RETENTION_INTERVAL`` one *pass*, if it takes the table's
advisory lock (one pruner per table and service however many replicas run), deletes the
rows that may go in pages of ``TXBOX_RETENTION_BATCH_SIZE``, each page its own short
transaction, so no lock and no snapshot lasts longer than one page. Which rows go
(framework/sql/retention.py; docs/explanation/operations.md, "Retention"):

- processed (outbox: published) longer ago than the table's retention;
- abandoned longer ago than the table's retention once no dead letter of the message
  is open or replayed-but-unresolved; or abandoned longer ago than
  ``TXBOX_ABANDONED_RETENTION`` whatever its letter (a replay then stores it again).

Inbox rows go through :func:`framework.dedup.forget`, and the inbox's retention is never
shorter than ``TXBOX_DEDUP_WINDOW``, so a duplicate is dedup'd whatever was pruned.
After each pass the table's size, its indexes' size and its dead tuples go to the
gauges. A failing pass is logged and the next one tries again: pruning is never worth
stopping the daemon for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from prometheus_client import Counter, Gauge

from framework import dedup, metrics, names
from framework.connections import ConnectionSlot
from framework.settings import DedupSettings, RetentionSettings, load
from framework.sql import retention as retention_sql

if TYPE_CHECKING:
    from framework.daemon import Daemon

EARLIEST = datetime.fromisoformat("0001-01-01T00:00:00+00:00")
# A pass VACUUMs its table when the dead tuples exceed both (TXBOX_RETENTION_VACUUM): below
# autovacuum's default share (0.2), so where autovacuum works it usually came first.
VACUUM_AT_LEAST = 10_000
VACUUM_SHARE = 0.1


@dataclass(frozen=True)
class Rules:
    """What one pruner deletes: seconds after which a finished row goes (0: never)."""

    table: str
    retention: float
    abandoned: float  # 0: abandoned rows go only once their dead letter is resolved
    dedup_window: float | None = None  # the inbox's: rows go through dedup.forget

    @classmethod
    def outbox(cls, settings: RetentionSettings) -> Rules:
        return cls(names.OUTBOX, float(settings.outbox_retention), float(settings.abandoned_retention))

    @classmethod
    def inbox(cls, settings: RetentionSettings, dedup_window: float) -> Rules:
        """The inbox's rules; a retention set shorter than the dedup window fails here, at start."""
        abandoned = float(settings.abandoned_retention)
        return cls(
            names.INBOX,
            settings.inbox_horizon(dedup_window),
            max(abandoned, dedup_window) if abandoned else 0.0,
            dedup_window,
        )

    @property
    def active(self) -> bool:
        return self.retention > 0 or self.abandoned > 0


@dataclass
class Pass:
    """What one pass did."""

    processed: int = 0
    abandoned: int = 0
    pages: int = 0
    locked_out: bool = False  # another instance held the table's lock: nothing done
    vacuumed: bool = False


@dataclass(frozen=True)
class Meters:
    pruned: Counter
    table_bytes: Gauge
    index_bytes: Gauge
    dead_tuples: Gauge


PUBLISHER = Meters(
    metrics.PUBLISHER_PRUNED,
    metrics.PUBLISHER_OUTBOX_TABLE,
    metrics.PUBLISHER_OUTBOX_INDEXES,
    metrics.PUBLISHER_OUTBOX_DEAD,
)
WORKER = Meters(
    metrics.WORKER_PRUNED, metrics.WORKER_INBOX_TABLE, metrics.WORKER_INBOX_INDEXES, metrics.WORKER_INBOX_DEAD
)


class Pruner:
    """One table's pruner for one daemon: :meth:`start` its thread, :meth:`close` it; or
    call :meth:`run_pass` directly (tests, tools)."""

    def __init__(
        self,
        daemon: Daemon,
        rules: Rules,
        settings: RetentionSettings,
        meters: Meters,
    ) -> None:
        self.daemon = daemon
        self.rules = rules
        self.settings = settings
        self.schema = daemon.settings.schema
        service = daemon.settings.service
        self._key = names.pruner_lock_key(service, rules.table, self.schema)
        owner = daemon.labels
        self._pruned = {state: meters.pruned.labels(state=state, **owner) for state in ("processed", "abandoned")}
        self._sizes = (
            meters.table_bytes.labels(**owner),
            meters.index_bytes.labels(**owner),
            meters.dead_tuples.labels(**owner),
        )
        self._db = ConnectionSlot(daemon.settings.database_url, autocommit=True, application_name="txbox-pruner")
        inbox = rules.dedup_window is not None
        self._sql_page = (retention_sql.select_page if inbox else retention_sql.delete_page)(self.schema, rules.table)
        self._sql_costs = retention_sql.table_costs(self.schema, rules.table)
        self._sql_vacuum = retention_sql.vacuum(self.schema, rules.table)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Pruner:
        self._closed.clear()
        self._thread = threading.Thread(target=self._run, name=f"txbox {self.daemon.name} prune", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._db.close()

    def _stopping(self) -> bool:
        return self._closed.is_set() or self.daemon.stopping

    def _run(self) -> None:
        while not self._stopping():
            try:
                self.run_pass()
            except Exception as exc:  # the last resort: log, try again next interval
                self.daemon.log.warning("pruning %s failed (next pass in %gs): %r", self.rules.table,
                                        self.settings.retention_interval, exc)  # fmt: skip
            # A pass a minute does not need a connection held between: one fewer per daemon.
            self._db.close()
            if self._closed.wait(float(self.settings.retention_interval)):
                return

    def run_pass(self) -> Pass:
        """Prune what may go, page by page, if no other instance is pruning; then update the gauges."""
        done = Pass()
        conn = self._db.get()
        if self.rules.active:
            if not (conn.execute(retention_sql.try_lock(), {"key": self._key}).fetchone() or (False,))[0]:
                done.locked_out = True
            else:
                try:
                    self._prune(conn, done)
                finally:
                    conn.execute(retention_sql.unlock(), {"key": self._key})
        self._measure(conn, done)
        return done

    def _prune(self, conn: psycopg.Connection[Any], done: Pass) -> None:
        limit = self.settings.retention_batch_size
        params: dict[str, Any] = {
            "after": EARLIEST,
            "limit": limit,
            "retention": self.rules.retention or None,
            "abandoned": self.rules.abandoned or None,
            "sources": list(retention_sql.LETTER_SOURCES[self.rules.table]),
        }
        while not self._stopping():
            with conn.transaction(), conn.cursor() as cur:
                rows = cur.execute(self._sql_page, params).fetchall()
                if rows and self.rules.dedup_window is not None:
                    window = self.rules.dedup_window
                    dedup.forget(cur, self.schema, [r[0] for r in rows], timedelta(seconds=window))
                    rows = [r[1:] for r in rows]
            processed = sum(1 for r in rows if r[1])
            self._pruned["processed"].inc(processed)
            self._pruned["abandoned"].inc(len(rows) - processed)
            done.processed += processed
            done.abandoned += len(rows) - processed
            done.pages += 1
            if len(rows) < limit:
                return
            params["after"] = max(r[0] for r in rows)

    def _measure(self, conn: psycopg.Connection[Any], done: Pass) -> None:
        row = conn.execute(self._sql_costs).fetchone()
        if row is None:
            return
        dead, live = row[2], row[3]
        if self.settings.retention_vacuum and not done.locked_out and dead > max(VACUUM_AT_LEAST, live * VACUUM_SHARE):
            # Deleted rows (and the daemons' own updates) leave dead tuples that only VACUUM
            # makes space of again; where autovacuum lags behind or is off, the table would
            # grow whatever retention deletes. SKIP_LOCKED: an autovacuum at work is enough.
            conn.execute(self._sql_vacuum)
            done.vacuumed = True
            row = conn.execute(self._sql_costs).fetchone() or row
        for gauge, value in zip(self._sizes, row[:3], strict=True):
            gauge.set(float(value))


def outbox_pruner(daemon: Daemon, settings: RetentionSettings | None = None) -> Pruner:
    settings = settings or RetentionSettings.from_env()
    return Pruner(daemon, Rules.outbox(settings), settings, PUBLISHER)


def inbox_pruner(
    daemon: Daemon, settings: RetentionSettings | None = None, dedup_settings: DedupSettings | None = None
) -> Pruner:
    """The worker's pruner; fails (at start) if the inbox's retention is shorter than the dedup window."""
    settings = settings or RetentionSettings.from_env()
    window = float((dedup_settings or load(DedupSettings)).dedup_window)
    return Pruner(daemon, Rules.inbox(settings, window), settings, WORKER)
