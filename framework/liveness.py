"""Liveness of a daemon process: its heartbeat row and its probes, started by :func:`watch`.

The heartbeat thread upserts one row per daemon into ``daemon_heartbeats`` every
``TXBOX_HEARTBEAT_INTERVAL`` on a connection of its own, in a transaction of its own
(never the business one), and prunes rows of processes gone for a day. Whether that
write succeeds is the daemons' PostgreSQL readiness: one small query, the same for all
daemons, instead of each loop reporting on its own connections — which some hold only
while they have work (docs/explanation/operations.md, "Probes, logs and liveness").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from framework import metrics
from framework.connections import ConnectionSlot
from framework.daemon import POSTGRESQL, Daemon
from framework.errors import ConfigurationError, DatabaseUnavailable
from framework.probes import ProbeServer
from framework.settings import FromEnv, Seconds, setting
from framework.sql import heartbeats as heartbeats_sql

log = logging.getLogger("txbox.liveness")

#: Prune on every 60th beat (5 minutes at the default interval): rows live for a day anyway.
_PRUNE_EVERY = 60


@dataclass(frozen=True, kw_only=True)
class LivenessConfig(FromEnv):
    """Every daemon: where its probes listen, when it counts as stuck, how often it beats."""

    metrics_addr: str = setting(
        "TXBOX_METRICS_ADDR",
        "0.0.0.0",
        default="127.0.0.1",
        help="address of --metrics-port (/metrics, /healthz, /readyz); 0.0.0.0 in a pod",
    )
    stuck_after: Seconds = setting(
        "TXBOX_STUCK_AFTER", "60s", default=Seconds(60), help="no progress for this long: /healthz answers 503"
    )
    heartbeat_interval: Seconds = setting(
        "TXBOX_HEARTBEAT_INTERVAL", "5s", default=Seconds(5), help="heartbeat row (dashboard) and readiness check"
    )

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0 or self.stuck_after <= self.heartbeat_interval:
            raise ConfigurationError(
                f"TXBOX_STUCK_AFTER ({self.stuck_after:g}s) must be longer than TXBOX_HEARTBEAT_INTERVAL "
                f"({self.heartbeat_interval:g}s), which must be positive. Example: TXBOX_STUCK_AFTER=60s "
                "TXBOX_HEARTBEAT_INTERVAL=5s"
            )


class Heartbeat:
    """The heartbeat thread of ``daemons`` (one process, one service)."""

    def __init__(self, daemons: Sequence[Daemon], config: LivenessConfig) -> None:
        self.daemons = list(daemons)
        self.config = config
        settings = self.daemons[0].settings
        self.schema = settings.schema
        self.service = settings.service
        self.host = socket.gethostname()
        self.pid = os.getpid()
        interval = float(config.heartbeat_interval)
        # Short timeouts: a beat that hangs would report a dead database as ready.
        self._db = ConnectionSlot(
            settings.database_url,
            autocommit=True,
            connect_timeout=max(1, int(interval)),
            application_name="txbox-heartbeat",
            options=f"-c statement_timeout={int(interval * 1000)}",
        )
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="txbox heartbeat", daemon=True)
        self._beats = 0
        self._warned = False
        self._waits = True  # False once the table turned out to predate migration 0010

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(float(self.config.heartbeat_interval) + 5)
        try:
            conn = self._db.get()
            for daemon in self.daemons:
                conn.execute(heartbeats_sql.remove(self.schema), self._key(daemon))
        except (psycopg.Error, DatabaseUnavailable) as exc:  # the row is pruned later instead
            log.debug("could not remove the heartbeat rows: %r", exc)
        self._db.close()

    def _run(self) -> None:
        while True:
            self.beat()
            if self._closed.wait(float(self.config.heartbeat_interval)):
                return

    def beat(self) -> None:
        """Write every daemon's row; set their PostgreSQL readiness from the outcome."""
        try:
            conn = self._db.get()
            try:
                self._write(conn)
            except psycopg.errors.UndefinedColumn:
                if not self._waits:
                    raise
                # A table of migration 0008 without 0010's columns: beat without the waits.
                self._waits = False
                log.warning("%s.daemon_heartbeats lacks the waiting columns: run `txbox migrate` to see a "
                            "receiver's wait for its turn on the dashboard", self.schema)  # fmt: skip
                self._write(conn)
            self._beats += 1
            ok = True
        except psycopg.errors.UndefinedTable:
            # PostgreSQL answers: the daemons can work; only the dashboard lacks the rows.
            if not self._warned:
                self._warned = True
                log.warning("no %s.daemon_heartbeats table: run `txbox migrate` to see daemons on the dashboard",
                            self.schema)  # fmt: skip
            ok = True
        except (psycopg.Error, DatabaseUnavailable) as exc:
            log.debug("heartbeat failed: %r", exc)
            self._db.close()
            ok = False
        for daemon in self.daemons:
            daemon.set_ready(POSTGRESQL, ok)

    def _write(self, conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            for daemon in self.daemons:
                conn.execute(heartbeats_sql.upsert(self.schema, waits=self._waits), self._row(daemon))
            if self._beats % _PRUNE_EVERY == 0:
                conn.execute(heartbeats_sql.prune(self.schema), {"seconds": heartbeats_sql.PRUNE_AFTER_SECONDS})

    def _key(self, daemon: Daemon) -> dict[str, object]:
        return {"service": self.service, "kind": daemon.name, "host": self.host, "pid": self.pid}

    def _row(self, daemon: Daemon) -> dict[str, object]:
        return {
            **self._key(daemon),
            "started_at": datetime.fromtimestamp(daemon.started, UTC),
            "last_progress": datetime.fromtimestamp(daemon.last_progress_wall, UTC),
            "beat_interval": float(self.config.heartbeat_interval),
            "stuck_after": float(self.config.stuck_after),
            # This very write shows PostgreSQL reachable; the flag itself is set after it.
            "ready": all(ok for dependency, ok in daemon.readiness().items() if dependency != POSTGRESQL),
            **_wait(daemon),
        }


def _wait(daemon: Daemon) -> dict[str, object]:
    """The wait columns of ``daemon``'s row, all None while it does not wait.

    :meth:`Daemon.waiting` reads a snapshot the daemon's own thread replaces whole, so
    this thread only reads it (docs/explanation/daemons.md, "The daemons and their threads").
    """
    waiting = daemon.waiting()
    if waiting is None:
        return {"waiting_seconds": None, "waiting_queue": None, "waiting_detail": None}
    queue = waiting.get("queue")
    detail = ": ".join(str(part) for part in (waiting.get("state"), waiting.get("detail")) if part)
    return {
        "waiting_seconds": max(0.0, float(waiting["seconds"])),
        "waiting_queue": None if queue is None else str(queue)[: heartbeats_sql.MAX_QUEUE_CHARS],
        "waiting_detail": detail[: heartbeats_sql.MAX_DETAIL_CHARS] or None,
    }


def show_progress(daemon: Daemon) -> None:
    """Serve ``txbox_<daemon>_since_progress_seconds`` of ``daemon`` (its service and tenant),
    read from it at scrape time."""
    gauge = metrics.SINCE_PROGRESS.get(daemon.name)
    if gauge is not None:
        gauge.labels(**daemon.labels).set_function(daemon.idle_for)


@contextmanager
def watch(
    daemons: Sequence[Daemon], *, port: int | None = None, config: LivenessConfig | None = None
) -> Iterator[ProbeServer | None]:
    """Heartbeat ``daemons`` and, with a ``port``, serve their probes, for the ``with`` block.

    The commands run each daemon inside one; code that embeds daemons can do the same.
    """
    config = config or LivenessConfig.from_env()
    for daemon in daemons:
        show_progress(daemon)
    server = ProbeServer(daemons, port, config.metrics_addr, float(config.stuck_after)).start() if port else None
    heartbeat = Heartbeat(daemons, config).start()
    try:
        yield server
    finally:
        heartbeat.close()
        if server is not None:
            server.close()
