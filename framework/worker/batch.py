"""The worker's batch: run the handlers of claimed inbox rows in one transaction, and settle them.

:class:`BatchRunner` processes the rows the daemon claimed (framework/worker/daemon.py
keeps the loop, the claims and the connections; docs/explanation/handle.md, "Worker batches").

**Process** (one transaction per batch, on a SQLAlchemy connection): the first
statement presumes every claim processed and locks it (``presume_processed``: fence and
success mark in one pass); handlers run with a ``Session`` joined to the transaction;
the statements that settle the rest (failed, abandoned, dead letters) follow; one
commit. A handler's writes and its row's ``processed_at`` commit together or not at all.

Handlers first run *optimistically* — no savepoints, their ORM writes flushed together at
the end of the batch — because a SAVEPOINT and a RELEASE per message cost two round trips
each, more than the handler's own work. When a handler raises, the transaction is rolled
back and the batch runs again without running that message (its outcome is known); from
the second failure on, or when the final flush fails, the batch runs *carefully* with one
SAVEPOINT per message.

Outcomes: return → processed; ``PermanentError`` → abandoned at once; anything else
(``RetryableError``, other exceptions, the timeout) → ``locked_until = now + backoff``,
abandoned after ``max_attempts``; a serialization failure or deadlock → the whole batch
runs again (not the handler's fault, not counted). Every abandon writes its dead letter
in the same transaction.

Poison: a row whose earlier run never finished (the process died) is claimed *alone*
(the daemon sees to that), and once ``started - finished`` reached the threshold before
this claim it is abandoned without running.

Handlers that commit, roll back, close or break the batch transaction fail their own
message and never the batch mates' work: a session that refuses those calls, a commit
guard PostgreSQL enforces, and a batch mark the driver tracks for free tell the worker
(framework/worker/guard.py). A release after a crash leaves out the claim whose handler
was running, so it counts toward poison. Rows the worker cannot decode, and batches it
fails on itself, end as dead letters (``internal_error``), never as a crash that would
repeat on restart (docs/explanation/handle.md, "Worker: handlers that misbehave").

Timeout: handlers run in the worker's thread (they need its transaction); a watchdog
interrupts an overdue one (statement cancel + an exception raised in the thread) and
ends the process if it still runs at the end of its lease (framework/worker/timeout.py).

What a row's outcome means and the statements that record it are
framework/worker/settle.py's; turning a claimed row into a :class:`Claimed`,
framework/worker/decode.py's. One pass over a batch is one :class:`Pass`: its
transaction, session and whether it runs carefully, handed to each handler run.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa
from opentelemetry import context as otel_context
from opentelemetry import trace
from sqlalchemy import Connection, NestedTransaction, Transaction

from framework import db, expiry, logs, metrics, names, outbox_commit, tracing
from framework.backoff import backoff_seconds
from framework.errors import HandlerMisuse, HandlerTimeout
from framework.middleware import Middleware
from framework.outbox import Outbox
from framework.outcomes import WorkerOutcome
from framework.reasons import Reason
from framework.service import Service
from framework.sql import inbox as inbox_sql
from framework.sql import outbox as outbox_sql
from framework.sql import rendered
from framework.sql.outbox import OutboxRow
from framework.worker import guard
from framework.worker.config import GRACE, LEASE_MARGIN, MIN_RUN, WorkerConfig
from framework.worker.counts import Counts
from framework.worker.decode import Claimed, describe
from framework.worker.settle import Settlement, abandon, driver
from framework.worker.timeout import Watchdog

__all__ = ["BatchRunner", "Claimed", "Pass", "driver", "handler_span", "run_deadlines"]


class _Conflict(Exception):
    """A serialization failure or deadlock: run the batch again."""


class _Split(Exception):
    """The commit refused the batch for a reason no single handler raised, or a handler
    ended the transaction of a careful pass: run each alone."""

    def __init__(self, known: dict[uuid.UUID, BaseException] | None = None) -> None:
        super().__init__()
        self.known = known or {}


class _Rerun(Exception):
    """A handler failed (or the final flush did) in an optimistic pass: roll back, run again."""

    def __init__(self, claimed: Claimed | None, exc: BaseException, *, gone: bool = False) -> None:
        super().__init__(type(exc).__name__)  # not str(exc): a handler's exception may fail to print
        self.claimed = claimed
        self.exc = exc
        self.gone = gone  # the handler ended the transaction: a careful pass cannot contain it


@dataclass
class Pass:
    """One pass over a batch, in one transaction: what every handler run of it shares.

    ``careful``: each handler in a savepoint of its own, its outbox rows written at once;
    otherwise (optimistic) no savepoints, and the handlers' outbox rows wait in
    ``outbox_rows`` to be inserted together at the end of the pass.
    """

    conn: Connection
    raw: psycopg.Connection[Any]
    cur: psycopg.Cursor[Any]
    transaction: Transaction
    session: guard.HandlerSession
    careful: bool
    middleware: Sequence[Middleware] = ()
    tracer: trace.Tracer | None = None  # the provider's tracer when spans record
    outbox_rows: list[OutboxRow] = field(default_factory=list)

    @property
    def defer_to(self) -> list[OutboxRow] | None:
        """Where a handler's outbox rows go: this pass's list, or None (written at once)."""
        return None if self.careful else self.outbox_rows


class BatchRunner:
    """Processes the claimed batches of one worker, on the connection the daemon keeps.

    ``connection`` opens (or returns) the processing connection, ``drop_connection``
    throws it away, and ``give_back`` releases claims when processing stops hard (the
    daemon adds the batch it claimed ahead). ``counts`` gets the transactions' BEGIN and
    COMMIT (the statements go through the connection's counting cursor).
    """

    def __init__(
        self,
        service: Service,
        config: WorkerConfig,
        *,
        connection: Callable[[], Connection],
        drop_connection: Callable[[], None],
        give_back: Callable[[Sequence[Claimed]], None],
        log: logs.Log,
        tenant: str | None = None,
        counts: Counts | None = None,
    ) -> None:
        self.service = service
        self.config = config
        self.schema = service.settings.schema
        self.log = log
        self.counts = counts or Counts()
        self._connection = connection
        self._drop_processing_connection = drop_connection
        self._release_quietly = give_back
        self._labels = metrics.labels(service.settings.service, tenant)
        # The tenant, on every line logged while a batch runs: the handlers' own too.
        self._bound: dict[str, str] = {logs.TENANT: tenant} if tenant else {}
        self.settlement = Settlement(self.schema, config, self._labels, log)
        # Rendered once: run per batch (framework/sql/__init__.py, ``rendered``).
        presume = inbox_sql.presume_processed(self.schema)
        self._presume = rendered(presume)
        self._presume_armed = rendered(guard.armed(presume))  # the commit guard and batch mark (guard.py)
        self._insert_outbox = rendered(outbox_sql.insert(self.schema))
        self._create_guard, self._truncate_guard = rendered(guard.create_guard()), rendered(guard.truncate())
        self._disarm = rendered(guard.disarm())
        self._disarm_text = self._disarm.decode()
        self._pipeline = service.settings.outbox_commit_pipeline  # off behind poolers that refuse pipelines
        self._durations: dict[str, Any] = {}
        self._processed_counters: dict[str, Any] = {}
        self._watchdog: Watchdog | None = None
        self._guarded: Connection | None = None  # the connection known to have the commit guard's table
        self._guard_batches = 0  # batches armed on it since the table was created or truncated
        self.freed = False  # the last run made rows due that no NOTIFY will announce

    def run(self, batch: list[Claimed], watchdog: Watchdog) -> int:
        """Process ``batch``: how many of its rows were settled (0: given back)."""
        self._watchdog = watchdog
        self.freed = False
        return self._process(batch)

    # --- process ------------------------------------------------------------------

    def _process(self, batch: list[Claimed], known: dict[uuid.UUID, BaseException] | None = None) -> int:
        if not batch:
            return 0
        for attempt in range(self.config.conflict_retries + 1):
            for claimed in batch:
                claimed.outcome = WorkerOutcome.PENDING
            try:
                with logs.bind(batch_size=len(batch), **self._bound):
                    self._run_batch(batch, dict(known or {}))
                break
            except _Split as split:
                return sum(self._process([c], _only(split.known, c)) for c in batch)
            except Exception as exc:
                if not (isinstance(exc, _Conflict) or db.is_transient_conflict(exc)):
                    if db.is_infrastructure_error(exc):
                        self._release_quietly(batch)
                        raise
                    return self._last_resort(batch, exc)
                metrics.WORKER_CONFLICTS.labels(**self._labels).inc()
                if attempt == self.config.conflict_retries:
                    self.release(batch)
                    return 0
                time.sleep(backoff_seconds(attempt + 1, base=0.01, cap=0.5))
            except BaseException:
                # Stopping hard: give the claims back if we can, so they neither wait
                # out the lease nor look like poison.
                self._release_quietly(batch)
                raise
        self.settlement.count(batch, self._processed)
        return len(batch)

    def _last_resort(self, batch: list[Claimed], exc: Exception) -> int:
        """The worker failed on the batch for a reason no handler outcome explains (a bug, a
        value it cannot store): each message alone, and one that fails so alone is
        dead-lettered as ``internal_error``. Never a crash, which would repeat on restart."""
        self.log.error("the worker failed on a batch of %d: %s", len(batch), describe(exc))
        self._drop_processing_connection()  # its state is unknown
        if len(batch) > 1:
            return sum(self._process([claimed]) for claimed in batch)
        [claimed] = batch
        error = f"the worker failed on this message ({type(exc).__name__}): {describe(exc)}"
        abandon(claimed, Reason.INTERNAL_ERROR, error, error_type=type(exc).__name__)
        try:
            self._settle_alone(claimed, bare=False)
        except Exception as again:
            if db.is_infrastructure_error(again):
                raise
            # Even its dead letter cannot be stored as it is: one with the id and the error only.
            self._drop_processing_connection()
            self._settle_alone(claimed, bare=True)
        self.settlement.count(batch, self._processed)
        return 1

    def _settle_alone(self, claimed: Claimed, *, bare: bool) -> None:
        conn = self._connection()
        self.counts.statements += 2  # BEGIN, COMMIT
        with conn.begin():
            cur = driver(conn).cursor()
            cur.execute(self._presume, {"ids": [claimed.id], "started": [claimed.started]})
            if not cur.fetchall():
                claimed.outcome = WorkerOutcome.LOST  # claimed again by another worker after our lease
                return
            self.settlement.write(cur, [claimed], bare=bare)

    def _run_batch(self, batch: list[Claimed], known: dict[uuid.UUID, BaseException]) -> None:
        """Run the batch in one transaction: optimistically first, carefully on trouble.

        Optimistic: no savepoints, and ORM writes of all handlers go out in one flush at
        the end (SQLAlchemy batches them) — a few round trips per *batch*. When a handler
        raises, the transaction is rolled back and the batch runs again without it (its
        outcome is already known, so it does not run twice); from the third failure on,
        or when the final flush fails and nobody can say whose row broke it, the batch
        runs carefully: a SAVEPOINT per message. A handler that ends the transaction of
        a careful pass (nothing contains that) sends every message to a transaction of
        its own. Either way nothing a handler wrote survives unless its row is marked
        processed in the same commit. So one claim runs a healthy handler at most five
        times: three optimistic passes, one careful, one alone.
        """
        careful = False
        while True:
            try:
                self._pass(batch, known, careful)
                return
            except _Rerun as rerun:
                if rerun.claimed is not None:
                    known[rerun.claimed.id] = rerun.exc
                if rerun.gone and careful and len(batch) > 1:
                    raise _Split(known) from rerun.exc
                careful = careful or rerun.claimed is None or len(known) > 2
            except Exception as exc:
                if not _is_database_error(exc) or db.is_infrastructure_error(exc) or db.is_transient_conflict(exc):
                    raise
                # The commit itself refused the batch (say, a deferred constraint): whose
                # row broke it cannot be told, so each message gets a transaction of its
                # own, and alone, the refusal is its message's failure.
                if len(batch) > 1:
                    raise _Split(known) from exc
                if batch[0].id in known:
                    raise  # even settling it without running fails: not the message's doing
                known[batch[0].id] = exc

    def _pass(self, batch: list[Claimed], known: dict[uuid.UUID, BaseException], careful: bool) -> None:
        conn = self._connection()
        raw = driver(conn)
        transaction = conn.begin()
        self.counts.statements += 2  # psycopg's BEGIN, and the COMMIT or ROLLBACK
        try:
            cur = raw.cursor()
            # A new connection may lack the commit guard's table; after a failed pass (which
            # also rolled back any TRUNCATE in it) its dead keys are emptied too, so that
            # failures coming more often than TRUNCATE_EVERY batches cannot keep them growing.
            if self._guarded is not conn:
                cur.execute(self._create_guard)
            if self._guarded is not conn or self._guard_batches >= guard.TRUNCATE_EVERY:
                cur.execute(self._truncate_guard)
                self._guard_batches = 0
            self._guard_batches += 1
            # The presumption armed: the commit guard and the batch mark ride its round trip.
            cur.execute(self._presume_armed, {"ids": [c.id for c in batch], "started": [c.started for c in batch]})
            presumed = cur.fetchall()  # (id, frees)
            ours = {row[0] for row in presumed}
            self.freed = self.freed or any(row[1] for row in presumed)
            # Once per pass, not per message: the hooks, and the tracer if spans record.
            run = Pass(
                conn=conn,
                raw=raw,
                cur=cur,
                transaction=transaction,
                session=guard.HandlerSession(bind=conn, join_transaction_mode="rollback_only", autoflush=True),
                careful=careful,
                middleware=self.service.middleware,
                tracer=tracing.recording_tracer(),
            )
            try:
                for claimed in batch:
                    claimed.outcome = WorkerOutcome.PENDING
                    if claimed.id not in ours:
                        claimed.outcome = WorkerOutcome.LOST  # claimed again by another worker after our lease
                    elif claimed.undecodable:
                        abandon(claimed, Reason.INTERNAL_ERROR, f"the stored row cannot be read: {claimed.undecodable}")
                    elif claimed.id in known:
                        self.settlement.classify(claimed, known[claimed.id])
                    else:
                        # The handler's own log lines too; the id formatted only if a line is written.
                        with logs.bind(message_id=claimed.id):
                            self._run_one(claimed, run)
                if not careful:
                    self._flush(run)
            finally:
                run.session.close()
            self.settlement.write(cur, batch)
            self._commit(conn, cur, transaction)
        except BaseException:
            self._abort(conn, transaction)
            raise
        self._guarded = conn

    def _flush(self, run: Pass) -> None:
        """End of an optimistic pass: the handlers' outbox rows in one pipelined round trip, their ORM writes."""
        try:
            if run.outbox_rows:
                run.cur.executemany(self._insert_outbox, [r.params() for r in run.outbox_rows])
            run.session.flush()
        except Exception as exc:
            self._reraise_infrastructure(exc)
            raise _Rerun(None, exc) from exc

    def _commit(self, conn: Connection, cur: psycopg.Cursor[Any], transaction: Any) -> None:
        """Delete the commit guard's keys, then COMMIT: in one round trip where the COMMIT
        pipeline may be used (framework/outbox_commit.py; no savepoint can start between
        the two). A failed DELETE aborts the pipeline, so that COMMIT never runs."""
        if self._pipeline and outbox_commit.hold(conn, self._disarm_text, {}):
            self.counts.statements += 1  # sent with the COMMIT, not through a cursor
        else:
            cur.execute(self._disarm)
        transaction.commit()

    def _abort(self, conn: Connection, transaction: Any) -> None:
        """Roll a failed pass back; drop the connection if a handler left it unusable or
        inside a transaction of its own (which the next batch must not inherit)."""
        self._guarded = None  # the pass that created it may be the one rolled back
        try:
            current = None if conn.closed else conn.get_transaction()
            if current is not None and current is transaction:
                current.rollback()  # also clears a transaction whose commit failed
            if conn.closed or driver(conn).info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                self._drop_processing_connection()
        except Exception as exc:
            self.log.debug("rolling back a failed pass failed: %r", exc)
            self._drop_processing_connection()

    def _run_one(self, claimed: Claimed, run: Pass) -> None:
        """Run one handler in ``run``: optimistically (its outbox rows kept for the end of
        the pass), or carefully (in a savepoint, its rows written at once)."""
        message = claimed.message
        if claimed.unfinished_before >= self.config.poison_threshold:
            abandon(
                claimed,
                Reason.POISON,
                f"{claimed.unfinished_before} runs never finished (the process died in the handler): "
                f"abandoned without running (threshold {self.config.poison_threshold})",
                finished_delta=claimed.unfinished_before + 1,
            )
            return
        expires_at = claimed.metadata.get(names.METADATA_EXPIRES_AT)
        if expires_at is not None and _expired(expires_at):
            abandon(claimed, Reason.EXPIRED, expiry.describe(expires_at, "before a worker ran its handler"))
            return
        handler = self.service.handler_for(claimed.message_type)
        if handler is None:
            abandon(claimed, Reason.NO_HANDLER, f"no handler registered for {claimed.message_type}")
            return
        deadlines = run_deadlines(
            claimed.claimed_at,
            time.monotonic(),
            float(self.config.lease),
            float(handler.timeout or self.config.timeout),
        )
        if deadlines is None:
            claimed.outcome = WorkerOutcome.RELEASED  # too little lease left to start it: someone runs it later
            return
        timeout, hard = deadlines
        conn, raw, session, transaction = run.conn, run.raw, run.session, run.transaction
        savepoint: NestedTransaction | None = conn.begin_nested() if run.careful else None
        started = time.perf_counter()
        assert self._watchdog is not None
        try:
            span = handler_span(claimed, tracer=run.tracer)
            with self._watchdog.guard(timeout, hard, raw.cancel_safe), span:
                outbox = Outbox(
                    session,
                    self.service.registry,
                    schema=self.schema,
                    incoming=message,
                    defer_to=run.defer_to,
                    sent_by=(self.service.name, handler.name),
                )
                guard.run_handler(handler, message, session, outbox, conn, raw, transaction, savepoint, run.middleware)
                if run.careful:
                    session.commit()  # rollback_only mode: flushes, leaves the savepoint to us
            if savepoint is not None:
                savepoint.commit()
            claimed.outcome = WorkerOutcome.PROCESSED
        except BaseException as exc:
            if self._watchdog.fired or isinstance(exc, HandlerTimeout):
                exc = HandlerTimeout(f"{handler.name} ran longer than its timeout of {timeout:g}s")
            found = guard.misuse(session, conn, raw, transaction, savepoint)
            # SQLAlchemy itself rolls the transaction back when an autoflush fails, which
            # in an optimistic pass may be an earlier handler's row: not this one's doing.
            blamed = savepoint is not None or not _is_database_error(exc) or guard.refused_commit(exc)
            if found is not None and found[1] and blamed:
                # The transaction is gone (committed nothing: the guard refuses a COMMIT):
                # this message failed, and the batch must run again without it.
                raise _Rerun(claimed, HandlerMisuse(found[0]), gone=True) from exc
            # Releasing the batch must not undo this run's claim: if it brought the process
            # or its connection down, the next claim has to count it toward poison.
            claimed.crashed = not isinstance(exc, Exception) or db.is_infrastructure_error(exc)
            self._reraise_infrastructure(exc)
            if savepoint is None:
                # Optimistic pass: roll back and run again without it — unless it is a
                # database error, which may be an earlier handler's row (flushed by this
                # one's query) or a transaction an earlier handler left aborted: then the
                # whole batch runs carefully, so nobody is blamed for another's error.
                # (A timeout aborts the transaction itself, by cancelling the statement.)
                blame = isinstance(exc, HandlerTimeout) or not (_is_database_error(exc) or _aborted(raw))
                raise _Rerun(claimed if blame else None, exc) from exc
            session.rollback()  # rolls back the joined savepoint
            if savepoint.is_active:
                savepoint.rollback()
            self.settlement.classify(claimed, exc)
        finally:
            self._watchdog.disarm()
            self._duration(claimed.message_type).observe(time.perf_counter() - started)

    def _duration(self, message_type: str) -> Any:
        return self._by_type(self._durations, metrics.WORKER_HANDLER_DURATION, message_type)

    def _processed(self, message_type: str) -> Any:
        return self._by_type(self._processed_counters, metrics.WORKER_PROCESSED, message_type)

    def _by_type(self, children: dict[str, Any], metric: Any, message_type: str) -> Any:
        """``metric``'s series for ``message_type``, looked up once (this runs per message)."""
        child = children.get(message_type)
        if child is None:
            child = children[message_type] = metric.labels(message_type=message_type, **self._labels)
        return child

    @staticmethod
    def _reraise_infrastructure(exc: BaseException) -> None:
        """Not the message's fault: conflicts re-run the batch, the rest end the pass."""
        if isinstance(exc, HandlerTimeout):
            return
        if db.is_transient_conflict(exc):
            raise _Conflict() from exc
        if db.is_infrastructure_error(exc) or not isinstance(exc, Exception):
            raise exc

    def release(self, batch: Sequence[Claimed]) -> None:
        """Give back claims that were never run: not an attempt, not poison."""
        self.counts.statements += 2  # BEGIN, COMMIT
        self.settlement.release(self._connection(), batch)


def handler_span(claimed: Claimed, *, tracer: trace.Tracer | None) -> contextlib.AbstractContextManager[object]:
    """The CONSUMER span of one handler run, current while it runs: child of the context the
    inbox row keeps (the span that wrote the message), so what the handler sends continues
    the message's trace (docs/explanation/operations.md, "Tracing").

    When nothing records (``tracer`` None: :func:`framework.tracing.recording_tracer`) no span is
    built: the API's no-op span would only carry the stored context, so that context is
    made current instead, and a message without one costs nothing (the no-op span cost
    a noticeable share of a small handler's run).
    """
    if tracer is None:
        carrier = claimed.metadata.get(names.METADATA_TRACE)
        context = tracing.extract(carrier) if carrier else None
        return _current(context) if context else contextlib.nullcontext()
    return _recorded_span(tracer, claimed)


@contextlib.contextmanager
def _current(context: otel_context.Context) -> Iterator[None]:
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def _recorded_span(tracer: trace.Tracer, claimed: Claimed) -> tracing.CurrentSpan:
    """The recording span of :func:`handler_span`, current while it runs and marked failed
    by an exception out of the handler (:class:`framework.tracing.CurrentSpan`).

    Once per message, so kept lean: started and made current by hand rather than through
    ``start_as_current_span`` (the same calls without its layers of context managers), and
    no attribute the span's name already says (the SDK checks each one on every span):
    the handler is the one of the message type in the name,
    the service is the resource's; ``txbox.attempt`` only on a retry."""
    attributes: dict[str, Any] = {
        "messaging.system": tracing.MESSAGING_SYSTEM,
        "messaging.operation.type": "process",
        "messaging.message.id": str(claimed.id),
    }
    if claimed.message.attempt > 1:
        attributes["txbox.attempt"] = claimed.message.attempt
    span = tracer.start_span(
        f"handle {claimed.message_type}",
        context=tracing.extract(claimed.metadata.get(names.METADATA_TRACE)),
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )
    return tracing.CurrentSpan(span)


def run_deadlines(claimed_at: float, now: float, lease: float, timeout: float) -> tuple[float, float] | None:
    """(timeout, hard stop) in seconds from ``now`` for one handler run; None: do not start it.

    The run must end before the lease does: the timeout cancels its statement and
    interrupts it, and the watchdog ends the process at the hard stop, ``LEASE_MARGIN``
    before the lease's end, if the handler ignores that. Between the two there is always
    ``GRACE``: the batch mates before it may have used most of the lease, and a timeout
    equal to the hard stop would end the process a watchdog tick after the cancel,
    before a handler waiting on a lock could even see its statement cancelled
    (measured: two inventory workers contending for stock rows exited four times in a
    fault-free chaos run).
    """
    hard = claimed_at + lease - LEASE_MARGIN - now
    if hard < GRACE + MIN_RUN:
        return None
    return min(timeout, hard - GRACE), hard


def _expired(value: Any) -> bool:
    """An inbox row's stored expiry has passed (docs/explanation/receive.md, "Expiry and filters")."""
    expires_at = expiry.from_metadata(value)
    return expires_at is not None and expiry.passed(expires_at)


def _only(known: dict[uuid.UUID, BaseException], claimed: Claimed) -> dict[uuid.UUID, BaseException] | None:
    return {claimed.id: known[claimed.id]} if claimed.id in known else None


def _aborted(raw: psycopg.Connection[Any]) -> bool:
    """The transaction is aborted: a statement failed, maybe an earlier handler's flushed row."""
    return not raw.closed and raw.info.transaction_status == psycopg.pq.TransactionStatus.INERROR


def _is_database_error(exc: BaseException) -> bool:
    return isinstance(exc, sa.exc.DBAPIError | psycopg.Error)
