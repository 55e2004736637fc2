"""The worker daemon: runs handlers exactly once per inbox row.

The worker is a guest of the loop it is given (docs/explanation/daemons.md, "One loop per
process"): the socket of its LISTEN session is a handler of that loop, the poll interval,
the holds and the reconnect backoff are timers of it, and each cycle is one callback of
it. Its state and its connections (claim, processing, and LISTEN, which the workers of
one database on the loop share: framework/worker/wake.py) are the loop thread's; besides
it only the timeout watchdog (framework/worker/timeout.py, which must interrupt a handler
from outside) and the pruner (framework/retention.py, its own connection) run. One cycle:

1. **Claim** (own committed transaction, on the claim connection,
   framework/worker/claims.py): due rows at the head of their sequential segment,
   ``started_attempts + 1`` and the lease. A crash from here on is visible as
   ``started > finished``. Under a backlog the next claim is sent before this batch runs
   and collected after it (PostgreSQL claims while Python handles), without a thread.
   Rows another daemon of the process claimed for this worker (:meth:`Worker.take`) run
   before the next claim, and take its place.
2. **Decode** (framework/worker/decode.py): each row a :class:`Claimed`, pure.
3. **Process** (one transaction per batch): :class:`framework.worker.batch.BatchRunner`
   runs the handlers, inline in the cycle's callback (they are blocking code, on the loop
   thread); framework/worker/settle.py settles every row (docs/explanation/handle.md, "Worker
   batches").
4. **Wait**: for a NOTIFY on the LISTEN socket, the poll interval or a stop, the
   window or hold after a NOTIFY as :class:`framework.wakeup.Pace` says (a timer). One
   replica of the service, the holder of an advisory lock on its LISTEN session, listens
   on the inbox's inserts and NOTIFYs the others (on a help channel) when its claim
   comes back full; the others claim at their poll interval too, and take the lock when
   its holder's session ends (docs/explanation/operations.md, "Replicas of every daemon").

Poison: a row whose earlier run never finished (the process died) is claimed *alone*,
with nothing claimed ahead beside it, so a batch mate of the killer is never blamed for
its crashes; the batch runner abandons it once the threshold is reached.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from pika.adapters.select_connection import IOLoop
from sqlalchemy import Connection

from framework import db, metrics, names
from framework.backoff import reconnect_seconds
from framework.daemon import POSTGRESQL, Daemon
from framework.outcomes import WorkerOutcome
from framework.retention import inbox_pruner
from framework.service import Service
from framework.settings import RetentionSettings
from framework.sql import inbox as inbox_sql
from framework.sql import rendered
from framework.wakeup import HOLD_MAX, Pace
from framework.worker import decode
from framework.worker.batch import BatchRunner, Claimed, driver
from framework.worker.claims import Claims, Statement, statement
from framework.worker.config import WorkerConfig
from framework.worker.counts import Counts, counting_cursor
from framework.worker.timeout import Watchdog
from framework.worker.wake import Listeners, Notifications

SUSPECT_CHECK_INTERVAL = 1.0  # seconds between looks for rows a dead worker left behind
ANALYZE_INTERVAL = 30.0  # seconds at least between two ANALYZEs of the inbox by one worker
# Rows claimed for the worker by another daemon (Worker.take) with less than this share of
# their lease left when their turn comes are given back and claimed the ordinary way.
HANDED_LEASE_LEFT = 0.5


def _claim_order(row: Sequence[Any]) -> tuple[Any, Any]:
    return -row[-2], row[-1]  # priority, created_at (the last two of CLAIM_COLUMNS)


class Worker(Daemon):
    """``Worker(service, config).run()`` until :meth:`stop` (or SIGTERM via the CLI); or
    ``start_on(loop, finished)`` beside other daemons of the process.

    Every attribute is the loop thread's, but for what :class:`Daemon` shares.
    """

    name = "worker"
    needs = (POSTGRESQL,)  # the worker never talks to RabbitMQ

    def __init__(
        self,
        service: Service,
        config: WorkerConfig | None = None,
        *,
        stop_event: threading.Event | None = None,
        retention: RetentionSettings | None = None,
        tenant: str | None = None,
        listeners: Listeners | None = None,
    ) -> None:
        """``listeners``: the LISTEN sessions this worker shares with the others of its loop
        (one per database: the tenants of one database listen on one connection); by
        default a session of its own."""
        super().__init__(service, stop_event=stop_event, tenant=tenant)
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
        # One replica of the service LISTENs on the inserts; the others on the help channel
        # (docs/explanation/daemons.md, "Wake-ups" and "Replicas of every daemon").
        self._listen = Notifications(
            self.settings.database_url,
            names.notify_channel(self.schema, names.INBOX),
            help_channel=names.inbox_help_channel(self.schema),
            lock_key=names.worker_listener_lock_key(self.schema),
            counts=self.counts,
            listeners=listeners,
            on_notify=self._heard,
        )
        # A worker whose claim after a NOTIFY found nothing (another replica took the rows)
        # holds the next ones back, never longer than the poll interval (docs/explanation/daemons.md, "Wake-ups").
        self._pace = Pace(hold_max=min(HOLD_MAX, float(self.config.poll_interval)))
        self._watchdog: Watchdog | None = None
        self._last_gauges = 0.0
        self._last_suspect_check = 0.0
        self._more = False  # claim again at once, not at the next NOTIFY (see run_once)
        self._polled = False  # the last wait ran out its poll interval (no NOTIFY, no stop)
        # Rows claimed for this worker by another daemon of its loop (take), run before the next claim.
        self._handed: deque[Claimed] = deque()
        # The wait between cycles (see _wait): a cycle is due at the loop's next turn, or a
        # wait is on, begun with nothing on the socket (slept) and maybe woken by a NOTIFY.
        self._soon = False
        self._waiting = False
        self._slept = False
        self._woken = False
        self._notified = False  # the next claim answers a NOTIFY that woke the worker from sleep
        self._wait_deadline = 0.0  # monotonic: the end of the poll interval of this wait
        self._timer: Any = None  # the wait's timer (poll interval, window or hold), or the reconnect backoff's
        self._failures = 0  # database failures in a row (the backoff)
        self._batches = BatchRunner(
            service,
            self.config,
            connection=self._connection,
            drop_connection=self._drop_processing_connection,
            give_back=self._release_quietly,
            log=self.log,
            tenant=tenant,
            counts=self.counts,
        )

    @property
    def listening(self) -> bool:
        """The LISTEN is in place (a NOTIFY now wakes the worker)."""
        return self._listen.listening

    @property
    def leading(self) -> bool:
        """This replica is its service's listener: it LISTENs on the inbox's inserts
        (docs/explanation/daemons.md, "Wake-ups" and "Replicas of every daemon")."""
        return self._listen.leading

    @property
    def idle(self) -> bool:
        """Started and waiting for work: no cycle due, no claim in flight, nothing handed
        (read from another thread, a test's, it is a moment's view)."""
        return self._waiting and not self._woken and not self._handed and not self.ended

    # --- the loop -----------------------------------------------------------------

    @property
    def _loop(self) -> IOLoop:
        loop = self.loop
        assert loop is not None, "the worker runs only once started (start_on)"
        return loop

    def _begin(self) -> None:
        try:
            self.service.middleware  # noqa: B018 -- builds the permission guard: bad TXBOX_JWT_* stops the worker now
        except Exception as exc:
            self._end(exc)
            return
        self._watchdog = Watchdog(self.log)
        self.pruner.start()
        self._step_soon()

    def _on_stop(self) -> None:
        """The running batch (if any) has finished: what the worker holds goes back, then it ends."""
        self._shut()
        self._end()

    def _step_soon(self) -> None:
        """A cycle at the loop's next turn (one, however often asked). A timer, not
        ``add_callback``, which writes to the loop's wake-up pipe each time."""
        if not self._soon:
            self._soon = True
            self._loop.call_later(0, self._step)

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            self._loop.remove_timeout(timer)

    def _step(self) -> None:
        """One cycle: listen (again), claim (or take what was handed), process, then wait
        or go on. Its last resort: a failure that is not the database's ends the worker,
        never the loop the other daemons run on."""
        self._soon = False
        self._cancel_timer()
        self._waiting = self._woken = False
        if self.ended:
            return
        if self.stopping:
            self._stop_requested()
            return
        notified, self._notified = self._notified, False
        self.progress()
        try:
            # (Re)connected before the claim, which finds what came while nobody listened.
            if not self._listen.open(self._loop):
                self._take_turn()
            handled = self.run_once()
            self.counts.publish(self.labels)
            self._pace.found(handled, notified=notified)
            self._failures = 0
            self.state("processing")
            # The gauges use a connection too: losing it there is the same outage, not a crash.
            self._update_gauges()
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                self._fail(exc)
                return
            self._lost_db(exc)
            return
        except BaseException as exc:  # the loop's other daemons go on; run() raises it
            self._fail(exc)
            return
        if self.stop_event.is_set():  # asked during the batch (a signal handler only sets the event)
            self._stop_requested()
        elif self._handed or (handled and self._more):
            self._step_soon()
        else:
            self._wait()

    def _fail(self, exc: BaseException) -> None:
        """The worker cannot go on (a bug, not an outage): it ends, with ``exc`` (which
        :meth:`run` raises, and ``txbox run`` reports)."""
        self._shut()
        self._end(exc)

    def _lost_db(self, exc: BaseException) -> None:
        """Drop the connections (a batch claimed ahead is given back first) and cycle again
        after a backoff, the loop going on meanwhile."""
        self._drop_connections()
        self._failures += 1
        delay = reconnect_seconds(self._failures)
        self.state("PostgreSQL unavailable", f"{exc}; retrying in {delay:.1f}s")
        self._timer = self._loop.call_later(delay, self._retry)

    def _retry(self) -> None:
        self._timer = None
        self._step_soon()

    # --- the wait -----------------------------------------------------------------

    def _wait(self) -> None:
        """Wait for work: a NOTIFY (at once, or after the window or hold), the poll
        interval, a row handed over, or a stop. NOTIFYs that came during the cycle make it
        no sleep: the claim that answers them follows at once, or at the end of a hold.
        One claim answers every NOTIFY since the last one (docs/explanation/daemons.md, "Wake-ups")."""
        self._polled = False
        self._waiting = True
        self._woken = False
        self._wait_deadline = time.monotonic() + float(self.config.poll_interval)
        count = self._drain_listen()  # what came during the cycle
        if count < 0:  # the LISTEN connection broke: look now, and listen again first
            self._kick()
            return
        self._slept = count == 0
        if count:
            self._woken_by_notify()
            return
        self._timer = self._loop.call_later(float(self.config.poll_interval), self._poll_ran_out)

    def _poll_ran_out(self) -> None:
        self._timer = None
        self._polled = True
        self._step_soon()

    def _woken_by_notify(self) -> None:
        """A NOTIFY during the wait: claim now, or after the rest of a hold or the window
        of a worker woken from sleep, within the poll interval (Pace)."""
        self._woken = True
        self._notified = self._slept  # an empty claim after it says another replica took the rows
        now = time.monotonic()
        delay = min(self._pace.delay(now, from_sleep=self._slept), max(0.0, self._wait_deadline - now))
        self._cancel_timer()
        if delay > 0:
            self._timer = self._loop.call_later(delay, self._delay_over)
        else:
            self._step_soon()

    def _delay_over(self) -> None:
        self._timer = None
        self._step_soon()

    def _kick(self) -> None:
        """Cycle at the next turn: the wait, if any, ends (no window, no hold)."""
        if self._waiting:
            self._cancel_timer()
            self._waiting = False
        self._step_soon()

    def _heard(self, count: int) -> None:
        """The LISTEN session read ``count`` NOTIFYs for this worker while it was not
        reading (-1: the connection broke, and is listened on again at the next cycle)."""
        if count < 0:
            self._kick()
            return
        self._told_pace(count)
        if self._waiting and not self._woken:
            self._woken_by_notify()

    def _drain_listen(self) -> int:
        """The NOTIFYs on the LISTEN socket now, each told to the pace (the gaps' running
        mean); -1 if the connection broke (it is closed)."""
        count = self._listen.drain()
        self._told_pace(count)
        return count

    def _told_pace(self, count: int) -> None:
        now = time.monotonic()
        for _ in range(count):
            self._pace.notify(now)

    def _shut(self) -> None:
        """The worker's end: claims it holds and has not run go back, nothing is left open,
        no timer or handler of its is on the loop."""
        self._waiting = False
        try:
            if self.loop is not None:
                self._cancel_timer()
            if self._watchdog is not None:
                self._watchdog.close()
            self.pruner.close()
            self._give_back_handed()
            self._drop_connections()
        except Exception as exc:  # the last resort: the worker ends all the same, the loop goes on
            self.log.warning("the worker's end did not go cleanly: %r", exc)
        finally:
            self._listen.close()
        self.state("stopped")

    # --- one cycle ----------------------------------------------------------------

    def run_once(self) -> int:
        """One batch: claimed now (suspects first), ahead during the previous one, or handed
        over (:meth:`take`); processed."""
        if self._watchdog is None:  # called without run() (tests, embedding): timeouts still hold
            self._watchdog = Watchdog(self.log)
        # The NOTIFYs on the socket now are for rows this claim's snapshot sees: they must
        # not wake the worker again after it (docs/explanation/daemons.md, "Wake-ups").
        self._drain_listen()  # a broken connection is closed: the next cycle listens again
        if self._claims.in_flight:
            batch = self._collect_ahead()
        elif self._handed:
            return self._run_handed()
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
        if (
            full
            and not self._handed
            and time.monotonic() - self._last_suspect_check < SUSPECT_CHECK_INTERVAL
            and not self.stopping
        ):
            # A backlog: send the next claim now and collect it after this batch, so
            # PostgreSQL claims while Python handles.
            self._claims.send(self._claim_batch, self.config.batch_size)
        if full:
            # Work for more than one replica: the listener wakes the others, once per full
            # claim (docs/explanation/operations.md, "Replicas of every daemon"). A NOTIFY read
            # during this statement waits for the next drain, before the next claim or wait.
            self._listen.call_for_help()
        handled = self._process(batch)
        self._more = self._made_more(batch)
        return handled

    def _made_more(self, batch: Sequence[Claimed]) -> bool:
        """Claim again at once? A short batch took every due row nobody else holds, and a
        row committed since comes with a NOTIFY. So only for a full batch or for rows that
        this batch made due and no NOTIFY announces: the next row of a segment, the lane
        of an abandoned or given-back row. At a trickle this saves the empty claim after
        every batch."""
        return (
            len(batch) >= self.config.batch_size
            or self._batches.freed
            or any(c.outcome not in (WorkerOutcome.PROCESSED, WorkerOutcome.FAILED) for c in batch)
        )

    # --- rows handed over -----------------------------------------------------------

    @property
    def wants_handoff(self) -> bool:
        """On the loop thread: the worker would take rows claimed for it now (:meth:`take`).

        Started and neither stopping nor backing off, with no backlog of its own (no claim
        in flight, its last batch not followed by a claim at once) and less than a batch
        handed to it waiting: at moderate load. Under a backlog, rows are better left to
        the ordinary claims, which take them in priority and arrival order.
        """
        return (
            self.loop is not None
            and not self.ended
            and not self.stopping
            and self._failures == 0
            and not self._claims.in_flight
            and not self._more
            and len(self._handed) < self.config.batch_size
        )

    def take(self, claimed_at: float, rows: Sequence[tuple[Any, ...]], *, statements: int = 0) -> None:
        """On the loop thread: ``rows`` (tuples of :data:`framework.sql.inbox.CLAIM_COLUMNS`)
        were claimed for this worker by someone else (:func:`framework.sql.inbox.claim_ids`
        with this worker's lease), their lease begun at ``claimed_at`` (``time.monotonic()``
        before the claim was sent). They are decoded now and run like a claimed batch, in
        chunks of ``batch_size``, from the loop's next turn on and before the next claim; a
        chunk's rows with less than :data:`HANDED_LEASE_LEFT` of their lease left by then
        are given back instead, and claimed the ordinary way. A worker that has ended gives
        them back at once. The claim counts as one of the worker's
        (``txbox_worker_claims_total``, ``txbox_worker_statements_total``), and so do
        ``statements`` more sent with it on the worker's behalf."""
        self.counts.claim(len(rows), self.labels)
        self.counts.statements += statements
        self.counts.publish(self.labels)
        if not rows:
            return
        handed = self._decoded(claimed_at, sorted(rows, key=_claim_order))
        self.counts.handed += len(handed)
        if self.ended or self.loop is None:
            self._give_back(handed)
            return
        self._handed.extend(handed)
        if self._waiting:
            self._kick()

    def _run_handed(self) -> int:
        """The next chunk of the rows handed over: the stale ones given back, the rest processed."""
        now = time.monotonic()
        lease = float(self.config.lease)
        chunk = [self._handed.popleft() for _ in range(min(len(self._handed), self.config.batch_size))]
        batch = [c for c in chunk if c.claimed_at + lease - now >= lease * HANDED_LEASE_LEFT]
        stale = [c for c in chunk if c.claimed_at + lease - now < lease * HANDED_LEASE_LEFT]
        if stale:
            self._batches.release(stale)  # raises when the database is gone: then their lease runs out
        handled = self._process(batch) if batch else 0
        # Rows given back are due again, and no NOTIFY announces them: claim at once.
        self._more = bool(stale) or (bool(batch) and self._made_more(batch))
        return handled + len(stale)  # the rows this cycle found (Pace.found), settled or given back

    def _give_back_handed(self) -> None:
        handed = list(self._handed)
        self._handed.clear()
        self._give_back(handed)

    def _give_back(self, batch: Sequence[Claimed]) -> None:
        """Release claims never run, quietly: if the database is gone their lease runs out instead."""
        if not batch:
            return
        try:
            self._batches.release(batch)
        except Exception as exc:
            self.log.debug("could not give back the rows handed over: %r", exc)
            self._drop_processing_connection()

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
        self.counts.claim(len(rows), self.labels)
        self._statistics.after_claim(self._claims.connection(), time.monotonic() - claimed_at, len(rows), self.log)
        return self._decoded(claimed_at, rows)

    def _decoded(self, claimed_at: float, rows: Sequence[tuple[object, ...]]) -> list[Claimed]:
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
            metrics.WORKER_BACKLOG.labels(**self.labels).set(row[0])
            metrics.WORKER_OLDEST_DUE_AGE.labels(**self.labels).set(float(row[1]))
