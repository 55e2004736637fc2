"""The worker daemon: runs handlers exactly once per inbox row.

One cycle:

1. **Claim** (own committed transaction, on the claim connection): due rows at the head of
   their sequential segment, ``started_attempts + 1`` and the lease. A crash from here on
   is visible as ``started > finished``. Under a backlog the next batch is claimed while
   this one runs (PostgreSQL claims while Python handles).
2. **Process** (one transaction per batch): :class:`framework.worker.batch.BatchRunner`
   runs the handlers and settles every row (docs/architecture.md, "Worker batches").

Poison: a row whose earlier run never finished (the process died) is claimed *alone*,
with nothing claimed ahead beside it, so a batch mate of the killer is never blamed for
its crashes; the batch runner abandons it once the threshold is reached.

The daemon keeps the loop, the three connections (claim, processing, LISTEN) and the
gauges; what a batch does with its rows is the batch runner's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlalchemy import Connection

from framework import db, metrics, names
from framework.connections import ConnectionSlot, Listener
from framework.daemon import POSTGRESQL, Daemon, Reconnect
from framework.outcomes import WorkerOutcome
from framework.retention import inbox_pruner
from framework.service import Service
from framework.settings import RetentionSettings
from framework.sql import inbox as q
from framework.sql import rendered
from framework.wakeup import HOLD_MAX, Wakeup
from framework.worker import decode
from framework.worker.batch import BatchRunner, Claimed, driver
from framework.worker.config import WorkerConfig
from framework.worker.timeout import Watchdog

SUSPECT_CHECK_INTERVAL = 1.0  # seconds between looks for rows a dead worker left behind
ANALYZE_INTERVAL = 30.0  # seconds at least between two ANALYZEs of the inbox by one worker


class Worker(Daemon):
    """``Worker(service, config).run()`` until :meth:`stop` (or SIGTERM via the CLI)."""

    name = "worker"
    needs = (POSTGRESQL,)  # the worker never talks to RabbitMQ

    def __init__(
        self,
        service: Service,
        config: WorkerConfig | None = None,
        *,
        stop_event: threading.Event | None = None,
        retention: RetentionSettings | None = None,
    ) -> None:
        super().__init__(service, stop_event=stop_event)
        self.config = config or WorkerConfig.from_env()
        # Processed rows older than the inbox's retention (never inside TXBOX_DEDUP_WINDOW:
        # a shorter setting fails here) go, in a thread of their own (docs/architecture.md, "Retention").
        self.pruner = inbox_pruner(self, retention)
        self.schema = self.settings.schema
        park = self.config.segment_policy == "park"
        # Rendered once: run per claim (framework/sql/__init__.py, ``rendered``).
        self._claim_batch = rendered(q.claim(self.schema, suspects=False, park=park))
        self._claim_suspect = rendered(q.claim(self.schema, suspects=True, park=park))
        self._statistics = db.Statistics(self.schema, names.INBOX, min_interval=ANALYZE_INTERVAL)
        self._conn: Connection | None = None
        # Set by NOTIFY (the listener) and by stop(); a worker whose claim after a NOTIFY
        # found nothing (another replica took the rows) holds the next ones back, never
        # longer than the poll interval (docs/architecture.md, "Wake-ups").
        self._wake = Wakeup(self.stop_event, hold_max=min(HOLD_MAX, float(self.config.poll_interval)))
        self.listener = Listener(self, names.notify_channel(self.schema, names.INBOX), self._wake.notify)
        self._watchdog: Watchdog | None = None
        self._labels = {"service": self.settings.service}
        self._last_gauges = 0.0
        # A claim is a lease, not a result: one lost to a database crash leaves the row
        # unclaimed, to be claimed again, and the batch's own commit (synchronous, and
        # later in the WAL) makes the claim durable before any handler's writes are.
        # Not waiting for its fsync takes a disk flush off every message's path. The claim
        # is one statement, so in autocommit it commits in the round trip that returns its
        # rows (no BEGIN and COMMIT of their own). One row that does not decode must not
        # fail the claim (decode.register).
        self._claim_db = ConnectionSlot(
            self.settings.database_url,
            on_connect=decode.register,
            autocommit=True,
            synchronous_commit=False,
            application_name="txbox-worker-claim",
        )
        self._ahead: Future[list[Claimed]] | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._last_suspect_check = 0.0
        self._more = False  # claim again at once, not at the next NOTIFY (see run_once)
        self._batches = BatchRunner(
            service,
            self.config,
            connection=self._connection,
            drop_connection=self._drop_processing_connection,
            give_back=self._release_quietly,
            log=self.log,
        )

    # --- the loop -----------------------------------------------------------------

    def run(self) -> None:
        self.service.middleware  # noqa: B018 -- builds the permission guard: bad TXBOX_JWT_* stops the worker now
        self._watchdog = Watchdog()
        self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="txbox-claim")
        reconnect = Reconnect(self)
        self.listener.start()
        self.pruner.start()
        notified = False  # this claim answers a NOTIFY (see Wakeup.found)
        try:
            while not self.stopping:
                self.progress()
                # Cleared before the claim: a NOTIFY for a row the claim's snapshot missed
                # sets it again, so the wait below returns at once.
                self._wake.clear()
                # The gauges use a connection too: losing it there is the same outage, not a crash.
                try:
                    handled = self.run_once()
                    self._wake.found(handled, notified=notified)
                    notified = False
                    reconnect.succeeded()
                    self.state("processing")
                    self._update_gauges()
                    if not handled or not self._more:
                        notified = self._wait_for_work()
                except Exception as exc:
                    if not db.is_infrastructure_error(exc):
                        raise
                    self._drop_connections()  # the batch claimed ahead is given back first
                    if reconnect.failed("PostgreSQL", exc):
                        break
        finally:
            self._ahead_pool.shutdown(wait=True)
            self._watchdog.close()
            self.listener.close()
            self.pruner.close()
            self._drop_connections()
            self.state("stopped")

    def run_once(self) -> int:
        """One batch: claimed now (suspects first) or ahead during the previous one; processed."""
        if self._watchdog is None:  # called without run() (tests, embedding): timeouts still hold
            self._watchdog = Watchdog()
        if self._ahead is not None:
            future, self._ahead = self._ahead, None
            batch = future.result()
        else:
            # Suspects (rows whose run never finished) are rare, and the plain claim skips
            # them: looking once per interval, not at every wake-up, saves a round trip
            # per batch, which at a steady trickle was a quarter of the worker's time.
            if time.monotonic() - self._last_suspect_check >= SUSPECT_CHECK_INTERVAL:
                batch = self._claim(self._claim_suspect, 1)
                if batch:
                    # More may wait (a crash leaves its whole batch behind): look again
                    # at once, not in a second.
                    self._more = True
                    return self._process(batch)  # alone, and nothing claimed beside it (poison)
                self._last_suspect_check = time.monotonic()
            batch = self._claim(self._claim_batch, self.config.batch_size)
        if (
            len(batch) == self.config.batch_size
            and time.monotonic() - self._last_suspect_check < SUSPECT_CHECK_INTERVAL
            and self._ahead_pool is not None
            and not self.stopping
        ):
            # A backlog: claim the next batch on the claim connection while this one
            # runs, so PostgreSQL claims while Python handles.
            self._ahead = self._ahead_pool.submit(self._claim, self._claim_batch, self.config.batch_size)
        handled = self._process(batch)
        # A short batch took every due row nobody else holds, and a row committed since
        # comes with a NOTIFY. So claim again at once only for a full batch or for rows
        # that this batch made due and no NOTIFY announces: the next row of a segment,
        # the lane of an abandoned or given-back row. At a trickle this saves the empty
        # claim after every batch.
        self._more = (
            len(batch) >= self.config.batch_size
            or self._batches.freed
            or any(c.outcome not in (WorkerOutcome.PROCESSED, WorkerOutcome.FAILED) for c in batch)
        )
        return handled

    def _take_ahead(self) -> list[Claimed]:
        """Wait for the claim running ahead, if any, and take its batch (empty if it failed)."""
        if self._ahead is None:
            return []
        future, self._ahead = self._ahead, None
        try:
            return future.result()
        except Exception as exc:  # its rows were not claimed, or their lease runs out
            self.log.debug("the claim ahead failed: %r", exc)
            return []

    def _give_back_ahead(self) -> None:
        """Release a batch claimed ahead that will not be processed (stop, database trouble)."""
        batch = self._take_ahead()
        try:
            if batch:
                self._batches.release(batch)
        except Exception as exc:  # the lease runs out instead
            self.log.debug("could not release the batch claimed ahead: %r", exc)

    def stop(self) -> None:
        super().stop()
        self._wake.set()

    def _wait_for_work(self) -> bool:
        """Sleep until NOTIFY on an inbox insert, the poll interval, or a stop; True if a
        NOTIFY woke it from sleep (an empty claim after it means another replica took the
        rows: docs/architecture.md, "Wake-ups").

        One claim answers every NOTIFY since the last one: the listener only sets an event.
        """
        if self.stopping:
            return False
        return self._wake.wait(float(self.config.poll_interval)) and self._wake.woken_from_sleep

    # --- claim --------------------------------------------------------------------

    def _claim(self, statement: Any, limit: int) -> list[Claimed]:
        """Claim in a transaction of its own (the one statement, in autocommit), on the claim
        connection (also used ahead)."""
        claimed_at = time.monotonic()
        conn = self._claim_db.get()
        rows = q.fetch_claimed(conn, statement, {"limit": limit, "lease": float(self.config.lease)})
        self._statistics.after_claim(conn, time.monotonic() - claimed_at, len(rows), self.log)
        return [self._batches.claimed(r, claimed_at) for r in rows]

    # --- process ------------------------------------------------------------------

    def _process(self, batch: list[Claimed]) -> int:
        assert self._watchdog is not None
        return self._batches.run(batch, self._watchdog)

    def _release_quietly(self, batch: Sequence[Claimed]) -> None:
        ahead = self._take_ahead()  # given back with the batch, on the new connection
        # Not the claim whose handler was running: its run counts (toward poison).
        batch = [c for c in batch if not c.crashed]
        try:
            self._drop_connections()
            self._batches.release([*batch, *ahead])
        except Exception as exc:  # the database is gone: the lease will run out instead
            self.log.debug("could not release claims: %r", exc)
            self._drop_connections()

    # --- connections and gauges ------------------------------------------------------

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._conn = self.service.engine.connect()
        return self._conn

    def _drop_processing_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception as exc:
                self.log.debug("closing the connection failed: %r", exc)
            self._conn = None

    def _drop_connections(self) -> None:
        # A claim running ahead uses the claim connection: closed under it, its thread
        # waited forever on the socket's number, which the next connection reused (a
        # chaos run's worker hung so after a pg_terminate_backend in mid-batch).
        self._give_back_ahead()
        self._drop_processing_connection()
        self._claim_db.close()

    def _update_gauges(self, every: float = 5.0) -> None:
        now = time.monotonic()
        if now - self._last_gauges < every:
            return
        self._last_gauges = now
        conn = self._connection()
        with conn.begin():
            cur = driver(conn).cursor()
            # A burst since the last ANALYZE makes the planner pick slow claim plans;
            # under steady load rows change fast, so not more than twice a minute.
            self._statistics.refresh(cur, now)
            cur.execute(q.backlog(self.schema))
            row = cur.fetchone()
        if row is not None:
            metrics.WORKER_BACKLOG.labels(**self._labels).set(row[0])
            metrics.WORKER_OLDEST_DUE_AGE.labels(**self._labels).set(float(row[1]))
