"""The worker daemon: runs handlers exactly once per inbox row.

One thread owns the worker's state and its three connections (claim, processing,
LISTEN); besides it only the timeout watchdog (framework/worker/timeout.py, which must
interrupt a handler from outside) and the pruner (framework/retention.py, its own
connection) run. One cycle of the loop:

1. **Claim** (own committed transaction, on the claim connection,
   framework/worker/claims.py): due rows at the head of their sequential segment,
   ``started_attempts + 1`` and the lease. A crash from here on is visible as
   ``started > finished``. Under a backlog the next claim is sent before this batch runs
   and collected after it (PostgreSQL claims while Python handles), without a thread.
2. **Decode** (framework/worker/decode.py): each row a :class:`Claimed`, pure.
3. **Process** (one transaction per batch): :class:`framework.worker.batch.BatchRunner`
   runs the handlers; framework/worker/settle.py settles every row
   (docs/explanation/handle.md, "Worker batches").
4. **Wait** (framework/worker/wake.py): ``poll`` on the LISTEN socket and the stop alarm,
   for a NOTIFY, the poll interval or a stop. One replica of the service, the holder of
   an advisory lock on its LISTEN session, listens on the inbox's inserts and NOTIFYs
   the others (on a help channel) when its claim comes back full; the others claim at
   their poll interval too, and take the lock when its holder's session ends
   (docs/explanation/operations.md, "Replicas of every daemon").

Poison: a row whose earlier run never finished (the process died) is claimed *alone*,
with nothing claimed ahead beside it, so a batch mate of the killer is never blamed for
its crashes; the batch runner abandons it once the threshold is reached.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from sqlalchemy import Connection

from framework import db, metrics, names
from framework.daemon import POSTGRESQL, Daemon, Reconnect
from framework.outcomes import WorkerOutcome
from framework.retention import inbox_pruner
from framework.service import Service
from framework.settings import RetentionSettings
from framework.sql import inbox as inbox_sql
from framework.sql import rendered
from framework.wakeup import HOLD_MAX
from framework.worker import decode
from framework.worker.batch import BatchRunner, Claimed, driver
from framework.worker.claims import Claims, Statement, statement
from framework.worker.config import WorkerConfig
from framework.worker.counts import Counts, counting_cursor
from framework.worker.timeout import Watchdog
from framework.worker.wake import Alarm, LoopWakeup, Notifications

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
        # a shorter setting fails here) go, in a thread of their own (docs/explanation/operations.md, "Retention").
        self.pruner = inbox_pruner(self, retention)
        self.schema = self.settings.schema
        self.counts = Counts()  # statements and claims, written by the loop only (framework/worker/counts.py)
        park = self.config.segment_policy == "park"
        # Rendered and prepared once per connection: run per claim (framework/worker/claims.py).
        self._claim_batch = statement("txbox_claim", rendered(inbox_sql.claim(self.schema, suspects=False, park=park)))
        self._claim_suspect = statement(
            "txbox_claim_suspect", rendered(inbox_sql.claim(self.schema, suspects=True, park=park))
        )
        self._claims = Claims(self.settings.database_url, float(self.config.lease))
        self._claims.register(self._claim_batch, self._claim_suspect)
        self._statistics = db.Statistics(self.schema, names.INBOX, min_interval=ANALYZE_INTERVAL)
        self._conn: Connection | None = None
        self._alarm = Alarm()  # stop() rings it: the one write from another thread
        # One replica of the service LISTENs on the inserts; the others on the help channel
        # (docs/explanation/daemons.md, "Wake-ups" and "Replicas of every daemon").
        self._listen = Notifications(
            self.settings.database_url,
            names.notify_channel(self.schema, names.INBOX),
            help_channel=names.inbox_help_channel(self.schema),
            lock_key=names.worker_listener_lock_key(self.schema),
            counts=self.counts,
        )
        # A worker whose claim after a NOTIFY found nothing (another replica took the rows)
        # holds the next ones back, never longer than the poll interval (docs/explanation/daemons.md, "Wake-ups").
        self._wake = LoopWakeup(
            self.stop_event,
            self._listen,
            self._alarm,
            hold_max=min(HOLD_MAX, float(self.config.poll_interval)),
        )
        self._watchdog: Watchdog | None = None
        self._labels = {"service": self.settings.service}
        self._last_gauges = 0.0
        self._last_suspect_check = 0.0
        self._more = False  # claim again at once, not at the next NOTIFY (see run_once)
        self._polled = False  # the last wait ran out its poll interval (no NOTIFY, no stop)
        self._batches = BatchRunner(
            service,
            self.config,
            connection=self._connection,
            drop_connection=self._drop_processing_connection,
            give_back=self._release_quietly,
            log=self.log,
            counts=self.counts,
        )

    @property
    def listening(self) -> bool:
        """The LISTEN is in place (a NOTIFY now wakes the loop)."""
        return self._listen.listening

    @property
    def leading(self) -> bool:
        """This replica is its service's listener: it LISTENs on the inbox's inserts
        (docs/explanation/daemons.md, "Wake-ups" and "Replicas of every daemon")."""
        return self._listen.leading

    # --- the loop -----------------------------------------------------------------

    def run(self) -> None:
        self.service.middleware  # noqa: B018 -- builds the permission guard: bad TXBOX_JWT_* stops the worker now
        self._watchdog = Watchdog()
        reconnect = Reconnect(self)
        self.pruner.start()
        notified = False  # this claim answers a NOTIFY (see Wakeup.found)
        try:
            while not self.stopping:
                self.progress()
                # The gauges use a connection too: losing it there is the same outage, not a crash.
                try:
                    # (Re)connected before the claim, which finds what came while nobody listened.
                    if not self._listen.open():
                        self._take_turn()
                    handled = self.run_once()
                    self.counts.publish(self._labels)
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
            self._watchdog.close()
            self.pruner.close()
            self._drop_connections()
            self._listen.close()
            self.state("stopped")

    def run_once(self) -> int:
        """One batch: claimed now (suspects first) or ahead during the previous one; processed."""
        if self._watchdog is None:  # called without run() (tests, embedding): timeouts still hold
            self._watchdog = Watchdog()
        # The NOTIFYs on the socket now are for rows this claim's snapshot sees: they must
        # not wake the loop again after it (docs/explanation/daemons.md, "Wake-ups").
        self._wake.take_notifies()
        self._wake.clear()
        if self._claims.in_flight:
            batch = self._collect_ahead()
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
        full = len(batch) == self.config.batch_size
        if full and time.monotonic() - self._last_suspect_check < SUSPECT_CHECK_INTERVAL and not self.stopping:
            # A backlog: send the next claim now and collect it after this batch, so
            # PostgreSQL claims while Python handles.
            self._claims.send(self._claim_batch, self.config.batch_size)
        if full:
            # Work for more than one replica: the listener wakes the others, once per full
            # claim (docs/explanation/operations.md, "Replicas of every daemon"). A full batch is
            # followed by a claim at once, which sees any row whose NOTIFY this statement read.
            self._listen.call_for_help()
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

    def stop(self) -> None:
        super().stop()
        self._alarm.ring()

    def _wait_for_work(self) -> bool:
        """Sleep until NOTIFY on an inbox insert, the poll interval, or a stop; True if a
        NOTIFY woke it from sleep (an empty claim after it means another replica took the
        rows: docs/explanation/daemons.md, "Wake-ups"). One claim answers every NOTIFY since the last one.
        """
        self._polled = False
        if self.stopping:
            return False
        woke = self._wake.wait(float(self.config.poll_interval))
        self._polled = not woke
        return woke and self._wake.woken_from_sleep

    def _take_turn(self) -> None:
        """A replica that is not the listener takes the turn when it is free: after every
        wait that ran out its poll interval (so a dead listener's turn passes within one
        poll interval of its session's end), and at most once a poll interval besides."""
        every = 0.0 if self._polled else float(self.config.poll_interval)
        if self._listen.take_turn(every):
            self.log.info("listening for the inbox's inserts: the service's listener had gone")

    # --- claim --------------------------------------------------------------------

    def _claim(self, which: Statement, limit: int) -> list[Claimed]:
        """Claim now, in a transaction of its own (the one statement, in autocommit)."""
        claimed_at, rows = self._claims.claim(which, limit)
        return self._claimed(claimed_at, rows)

    def _collect_ahead(self, timeout: float | None = None) -> list[Claimed]:
        claimed_at, rows = self._claims.collect(timeout)
        return self._claimed(claimed_at, rows)

    def _claimed(self, claimed_at: float, rows: Sequence[tuple[object, ...]]) -> list[Claimed]:
        self.counts.claim(len(rows), self._labels)
        self._statistics.after_claim(self._claims.connection(), time.monotonic() - claimed_at, len(rows), self.log)
        limit = self.config.max_attempts
        return [decode.claimed(r, claimed_at, self._max_attempts, limit) for r in rows]

    def _max_attempts(self, message_type: str) -> int | None:
        handler = self.service.handler_for(message_type)
        return handler.max_attempts if handler else None

    def _take_ahead(self) -> list[Claimed]:
        """Collect the claim in flight, if any (empty if it failed, or took longer than the
        lease: its rows come back after it)."""
        if not self._claims.in_flight:
            return []
        try:
            return self._collect_ahead(timeout=float(self.config.lease))
        except Exception as exc:  # its rows were not claimed, or their lease runs out
            self.log.debug("the claim ahead failed: %r", exc)
            return []

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
            # Its statements, the handlers' too, count toward txbox_worker_statements_total.
            driver(self._conn).cursor_factory = counting_cursor(self.counts)
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
        """Close the claim and processing connections; a batch claimed ahead is collected
        and given back first (its rows then need not wait out their lease)."""
        ahead = self._take_ahead()
        if ahead:
            try:
                self._batches.release(ahead)
            except Exception as exc:  # the lease runs out instead
                self.log.debug("could not release the batch claimed ahead: %r", exc)
        self._drop_processing_connection()
        self._claims.close()

    def _update_gauges(self, every: float = 5.0) -> None:
        now = time.monotonic()
        if now - self._last_gauges < every:
            return
        self._last_gauges = now
        conn = self._connection()
        self.counts.statements += 2  # BEGIN, COMMIT
        with conn.begin():
            cur = driver(conn).cursor()
            # A burst since the last ANALYZE makes the planner pick slow claim plans;
            # under steady load rows change fast, so not more than twice a minute.
            self._statistics.refresh(cur, now)
            cur.execute(inbox_sql.backlog(self.schema))
            row = cur.fetchone()
        if row is not None:
            metrics.WORKER_BACKLOG.labels(**self._labels).set(row[0])
            metrics.WORKER_OLDEST_DUE_AGE.labels(**self._labels).set(float(row[1]))
