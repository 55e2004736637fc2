"""The worker's batch: run the handlers of claimed inbox rows in one transaction, and settle them.

:class:`BatchRunner` processes the rows the daemon claimed (framework/worker/daemon.py
keeps the loop, the claims and the connections; docs/architecture.md, "Worker batches").

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
repeat on restart (docs/architecture.md, "Worker: handlers that misbehave").

Timeout: handlers run in the worker's thread (they need its transaction); a watchdog
interrupts an overdue one (statement cancel + an exception raised in the thread) and
ends the process if it still runs at the end of its lease (framework/worker/timeout.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from opentelemetry import context as otel_context
from opentelemetry import trace
from sqlalchemy import Connection

from framework import db, expiry, jsoncodec, logs, metrics, names, outbox_commit, redaction, tracing
from framework import dead_letters as dl
from framework.backoff import backoff_seconds
from framework.envelope import Message
from framework.errors import HandlerMisuse, HandlerTimeout, PermanentError
from framework.middleware import Middleware
from framework.outbox import Outbox
from framework.outcomes import WorkerOutcome
from framework.reasons import Reason
from framework.service import Service
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import inbox as q
from framework.sql import outbox as outbox_sql
from framework.sql import rendered
from framework.sql.outbox import OutboxRow
from framework.worker import guard
from framework.worker.config import GRACE, LEASE_MARGIN, MIN_RUN, WorkerConfig
from framework.worker.decode import Undecodable
from framework.worker.timeout import Watchdog


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
class Claimed:
    """A claimed inbox row and what became of it."""

    id: uuid.UUID
    message_type: str
    routing_key: str
    started: int  # started_attempts after our claim: the fencing token
    finished: int
    metadata: dict[str, Any]
    message: Message
    claimed_at: float  # time.monotonic() before the claim: the lease runs from here
    outcome: WorkerOutcome = WorkerOutcome.PENDING
    reason: str = ""
    error: str = ""
    error_type: str = ""
    delay: float = 0.0
    finished_delta: int = 1
    crashed: bool = False  # its handler was running when the batch broke off: never released
    undecodable: str = ""  # why the stored row could not be read; it is dead-lettered unrun
    raw: dict[str, str] | None = None  # the stored columns as text, for the dead letter of such a row

    @property
    def unfinished_before(self) -> int:
        """Runs before this claim that never finished: the process died inside them."""
        return self.started - 1 - self.finished


class BatchRunner:
    """Processes the claimed batches of one worker, on the connection the daemon keeps.

    ``connection`` opens (or returns) the processing connection, ``drop_connection``
    throws it away, and ``give_back`` releases claims when processing stops hard (the
    daemon adds the batch it claimed ahead).
    """

    def __init__(
        self,
        service: Service,
        config: WorkerConfig,
        *,
        connection: Callable[[], Connection],
        drop_connection: Callable[[], None],
        give_back: Callable[[Sequence[Claimed]], None],
        log: logging.Logger,
    ) -> None:
        self.service = service
        self.config = config
        self.schema = service.settings.schema
        self.log = log
        self._connection = connection
        self._drop_processing_connection = drop_connection
        self._release_quietly = give_back
        # Rendered once: run per batch (framework/sql/__init__.py, ``rendered``).
        presume = q.presume_processed(self.schema)
        self._presume = rendered(presume)
        self._presume_armed = rendered(guard.armed(presume))  # the commit guard and batch mark (guard.py)
        self._insert_outbox = rendered(outbox_sql.insert(self.schema))
        self._create_guard, self._truncate_guard = rendered(guard.create_guard()), rendered(guard.truncate())
        self._disarm = rendered(guard.disarm())
        self._disarm_text = self._disarm.decode()
        self._pipeline = service.settings.outbox_commit_pipeline  # off behind poolers that refuse pipelines
        self._labels = {"service": service.settings.service}
        self._durations: dict[str, Any] = {}
        self._processed_counters: dict[str, Any] = {}
        self._watchdog: Watchdog | None = None
        self._guarded: Connection | None = None  # the connection known to have the commit guard's table
        self._guard_batches = 0  # batches armed on it since the table was created or truncated
        self._middleware: Sequence[Middleware] = ()
        self._tracer: trace.Tracer | None = None  # the provider's tracer when spans record
        self.freed = False  # the last run made rows due that no NOTIFY will announce

    def run(self, batch: list[Claimed], watchdog: Watchdog) -> int:
        """Process ``batch``: how many of its rows were settled (0: given back)."""
        self._watchdog = watchdog
        self.freed = False
        return self._process(batch)

    def claimed(self, row: Sequence[Any], claimed_at: float) -> Claimed:
        """A claimed row (a tuple of framework.sql.inbox.CLAIM_COLUMNS); one that cannot be read is marked so."""
        try:
            return self._decode(row, claimed_at)
        except Exception as exc:  # last resort: this row is dead-lettered, the batch goes on
            return self._unreadable(row, claimed_at, _describe(exc))

    def _decode(self, row: Sequence[Any], claimed_at: float) -> Claimed:
        # By position, in the order of CLAIM_COLUMNS (this runs for every message).
        (
            message_id,
            message_type,
            aggregate_type,
            aggregate_id,
            message_version,
            routing_key,
            payload,
            context,
            metadata,
            timestamp,
            started,
            finished,
            _priority,
            _created_at,
        ) = row
        # One test for the usual row; the reasons only for a bad one.
        if (
            isinstance(payload, Undecodable)
            or isinstance(timestamp, Undecodable)
            or not isinstance(context, dict | None)
            or not isinstance(metadata, dict | None)
        ):
            return self._unreadable(row, claimed_at, _undecodable_reasons(payload, context, metadata, timestamp))
        handler = self.service.handler_for(message_type)
        max_attempts = (handler.max_attempts if handler else None) or self.config.max_attempts
        metadata = metadata or {}
        message = Message(
            message_id=message_id,
            message_type=message_type,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            payload=payload,
            message_context=context or {},
            timestamp=timestamp if isinstance(timestamp, datetime) else datetime.fromisoformat(str(timestamp)),
            message_version=message_version,
            auth_token=metadata.get("auth_token"),
            attempt=finished + 1,
            max_attempts=max_attempts,
            routing_key=routing_key,
        )
        return Claimed(
            id=message_id,
            message_type=message_type,
            routing_key=routing_key,
            started=started,
            finished=finished,
            metadata=metadata,
            message=message,
            claimed_at=claimed_at,
        )

    def _unreadable(self, claim: Sequence[Any], claimed_at: float, why: str) -> Claimed:
        """A claimed row the worker cannot turn into a Message: abandoned unrun, its columns kept as text."""
        row = dict(zip(q.CLAIM_COLUMNS, claim, strict=False))
        finished = row["finished_attempts"]
        message = Message(
            message_id=row["id"],
            message_type=str(row["message_type"]),
            aggregate_type=str(row["aggregate_type"]),
            aggregate_id=str(row["aggregate_id"]),
            payload={},
            message_version=str(row["message_version"]),
            attempt=finished + 1,
            max_attempts=self.config.max_attempts,
            routing_key=row["routing_key"],
        )
        raw = {name: _as_text(row[name]) for name in q.STORED_COLUMNS}
        return Claimed(
            id=row["id"],
            message_type=str(row["message_type"]),
            routing_key=str(row["routing_key"]),
            started=row["started_attempts"],
            finished=finished,
            metadata={},
            message=message,
            claimed_at=claimed_at,
            undecodable=why,
            raw=raw,
        )

    # --- process ------------------------------------------------------------------

    def _process(self, batch: list[Claimed], known: dict[uuid.UUID, BaseException] | None = None) -> int:
        if not batch:
            return 0
        for attempt in range(self.config.conflict_retries + 1):
            for claimed in batch:
                claimed.outcome = WorkerOutcome.PENDING
            try:
                with logs.bind(batch_size=len(batch)):
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
        self._count(batch)
        return len(batch)

    def _last_resort(self, batch: list[Claimed], exc: Exception) -> int:
        """The worker failed on the batch for a reason no handler outcome explains (a bug, a
        value it cannot store): each message alone, and one that fails so alone is
        dead-lettered as ``internal_error``. Never a crash, which would repeat on restart."""
        self.log.error("the worker failed on a batch of %d: %s", len(batch), _describe(exc))
        self._drop_processing_connection()  # its state is unknown
        if len(batch) > 1:
            return sum(self._process([claimed]) for claimed in batch)
        [claimed] = batch
        error = f"the worker failed on this message ({type(exc).__name__}): {_describe(exc)}"
        self._abandon(claimed, Reason.INTERNAL_ERROR, error, error_type=type(exc).__name__)
        try:
            self._settle_alone(claimed, bare=False)
        except Exception as again:
            if db.is_infrastructure_error(again):
                raise
            # Even its dead letter cannot be stored as it is: one with the id and the error only.
            self._drop_processing_connection()
            self._settle_alone(claimed, bare=True)
        self._count(batch)
        return 1

    def _settle_alone(self, claimed: Claimed, *, bare: bool) -> None:
        conn = self._connection()
        with conn.begin():
            cur = driver(conn).cursor()
            cur.execute(self._presume, {"ids": [claimed.id], "started": [claimed.started]})
            if not cur.fetchall():
                claimed.outcome = WorkerOutcome.LOST  # claimed again by another worker after our lease
                return
            self._settle(cur, [claimed], bare=bare)

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
            session = guard.HandlerSession(bind=conn, join_transaction_mode="rollback_only", autoflush=True)
            # Once per pass, not per message: the hooks, and the tracer if spans record.
            self._middleware, self._tracer = self.service.middleware, tracing.recording_tracer()
            # Optimistic pass: handlers' outbox rows are inserted together at the end
            # (one pipelined round trip); careful pass: at once, inside each savepoint.
            outbox_rows: list[OutboxRow] | None = None if careful else []
            try:
                for claimed in batch:
                    claimed.outcome = WorkerOutcome.PENDING
                    if claimed.id not in ours:
                        claimed.outcome = WorkerOutcome.LOST  # claimed again by another worker after our lease
                    elif claimed.undecodable:
                        self._abandon(
                            claimed, Reason.INTERNAL_ERROR, f"the stored row cannot be read: {claimed.undecodable}"
                        )
                    elif claimed.id in known:
                        self._classify(claimed, known[claimed.id])
                    else:
                        # The handler's own log lines too; the id formatted only if a line is written.
                        with logs.bind(message_id=claimed.id):
                            self._run_one(claimed, conn, raw, session, transaction, outbox_rows)
                if outbox_rows is not None:
                    try:
                        if outbox_rows:
                            cur.executemany(self._insert_outbox, [r.params() for r in outbox_rows])
                        session.flush()
                    except Exception as exc:
                        self._reraise_infrastructure(exc)
                        raise _Rerun(None, exc) from exc
            finally:
                session.close()
            self._settle(cur, batch)
            self._commit(conn, cur, transaction)
        except BaseException:
            self._abort(conn, transaction)
            raise
        self._guarded = conn

    def _commit(self, conn: Connection, cur: psycopg.Cursor[Any], transaction: Any) -> None:
        """Delete the commit guard's keys, then COMMIT: in one round trip where the COMMIT
        pipeline may be used (framework/outbox_commit.py; no savepoint can start between
        the two). A failed DELETE aborts the pipeline, so that COMMIT never runs."""
        if not (self._pipeline and outbox_commit.hold(conn, self._disarm_text, {})):
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

    def _run_one(
        self,
        claimed: Claimed,
        conn: Connection,
        raw: psycopg.Connection[Any],
        session: guard.HandlerSession,
        transaction: Any,
        outbox_rows: list[OutboxRow] | None,
    ) -> None:
        """Run one handler; ``outbox_rows`` collects its outbox rows (optimistic pass), or,
        when None, it runs carefully: in a savepoint, its rows written at once."""
        careful = outbox_rows is None
        message = claimed.message
        if claimed.unfinished_before >= self.config.poison_threshold:
            self._abandon(
                claimed,
                Reason.POISON,
                f"{claimed.unfinished_before} runs never finished (the process died in the handler): "
                f"abandoned without running (threshold {self.config.poison_threshold})",
                finished_delta=claimed.unfinished_before + 1,
            )
            return
        expires_at = claimed.metadata.get(names.METADATA_EXPIRES_AT)
        if expires_at is not None and _expired(expires_at):
            self._abandon(claimed, Reason.EXPIRED, expiry.describe(expires_at, "before a worker ran its handler"))
            return
        handler = self.service.handler_for(claimed.message_type)
        if handler is None:
            self._abandon(claimed, Reason.NO_HANDLER, f"no handler registered for {claimed.message_type}")
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
        savepoint = conn.begin_nested() if careful else None
        started = time.perf_counter()
        assert self._watchdog is not None
        try:
            span = handler_span(claimed, tracer=self._tracer)
            with self._watchdog.guard(timeout, hard, raw.cancel_safe), span:
                outbox = Outbox(
                    session,
                    self.service.registry,
                    schema=self.schema,
                    incoming=message,
                    defer_to=outbox_rows,
                    sent_by=(self.service.name, handler.name),
                )
                guard.run_handler(
                    handler, message, session, outbox, conn, raw, transaction, savepoint, self._middleware
                )
                if careful:
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
            self._classify(claimed, exc)
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

    def _classify(self, claimed: Claimed, exc: BaseException) -> None:
        # A handler's error text is logged and stored (last_error, the dead letter): never
        # with the message's auth_token in it (docs/architecture.md, "Secrets").
        token = claimed.message.auth_token
        text = redaction.scrub_values(redaction.redact_text(_describe(exc)), [token] if token else [])
        if isinstance(exc, PermanentError):
            self._abandon(claimed, exc.dead_letter_reason, text, error_type=type(exc).__name__)
            return
        if claimed.message.is_final_attempt:
            self._abandon(
                claimed,
                Reason.MAX_ATTEMPTS,
                f"failed {claimed.message.attempt} of {claimed.message.max_attempts} attempts; last: {text}",
                error_type=type(exc).__name__,
            )
            return
        claimed.outcome = WorkerOutcome.FAILED
        claimed.error = text
        claimed.error_type = type(exc).__name__
        claimed.delay = backoff_seconds(
            claimed.message.attempt,
            base=float(self.config.backoff_base),
            cap=float(self.config.backoff_cap),
            jitter=self.config.backoff_jitter,
        )

    def _abandon(
        self, claimed: Claimed, reason: str, error: str, *, error_type: str = "", finished_delta: int = 1
    ) -> None:
        claimed.outcome = WorkerOutcome.ABANDONED
        claimed.reason = reason
        claimed.error = error
        claimed.error_type = error_type or reason
        claimed.finished_delta = finished_delta

    def _settle(self, cur: psycopg.Cursor[Any], batch: Sequence[Claimed], *, bare: bool = False) -> None:
        """Write every outcome of the batch in the processing transaction."""
        # Processed rows are already marked (presume_processed); correct the others.
        failed = [c for c in batch if c.outcome is WorkerOutcome.FAILED]
        if failed:
            cur.executemany(
                q.mark_failed(self.schema),
                [
                    {
                        "id": c.id,
                        "delay": c.delay,
                        "error": _clip(f"{c.error_type}: {c.error}"),
                        "auth_token": c.metadata.get("auth_token"),
                    }
                    for c in failed
                ],
            )
        abandoned = [c for c in batch if c.outcome is WorkerOutcome.ABANDONED]
        released = [c for c in batch if c.outcome is WorkerOutcome.RELEASED]
        if released:
            cur.execute(
                q.unclaim(self.schema), ([c.id for c in released], [c.metadata.get("auth_token") for c in released])
            )
        if abandoned:
            cur.executemany(
                q.mark_abandoned(self.schema),
                [
                    {"id": c.id, "finished": c.finished_delta, "error": _clip(f"{c.reason}: {c.error}")}
                    for c in abandoned
                ],
            )
            dead_letters_sql.insert_letters(cur, self.schema, [self._dead_letter(c, bare=bare) for c in abandoned])

    def _dead_letter(self, claimed: Claimed, *, bare: bool = False) -> dl.DeadLetter:
        """The dead letter of an abandoned claim; ``bare``: only what cannot fail to store."""
        if bare:
            return dl.DeadLetter(
                source="inbox",
                reason=claimed.reason,
                error=claimed.error,
                error_type=claimed.error_type,
                message_id=claimed.id,
            )
        properties = claimed.metadata.get("properties")
        headers = properties.get("headers") if isinstance(properties, dict) else None
        return dl.DeadLetter(
            source="inbox",
            reason=claimed.reason,
            error=claimed.error,
            error_type=claimed.error_type,
            message_id=claimed.id,
            message_type=claimed.message_type,
            routing_key=claimed.routing_key,
            message=claimed.message.to_dict() if claimed.raw is None else None,
            raw_body=jsoncodec.dumps(claimed.raw).encode() if claimed.raw is not None else None,
            headers=headers if isinstance(headers, dict) else {},
            attempts={
                "started": claimed.started,
                "finished": claimed.finished + claimed.finished_delta,
                "max_attempts": claimed.message.max_attempts,
            },
        )

    def _count(self, batch: Sequence[Claimed]) -> None:
        for c in batch:
            if c.outcome is WorkerOutcome.PROCESSED:
                self._processed(c.message_type).inc()
                continue
            labels = {"message_type": c.message_type, **self._labels}
            if c.outcome is WorkerOutcome.FAILED:
                metrics.WORKER_FAILED.labels(**labels).inc()
                self.log.warning("%s %s failed (attempt %d): %s", c.message_type, c.id, c.message.attempt, c.error)
            elif c.outcome is WorkerOutcome.ABANDONED:
                metrics.WORKER_ABANDONED.labels(reason=c.reason, **labels).inc()
                self.log.error("%s %s abandoned (%s): %s", c.message_type, c.id, c.reason, c.error)

    def release(self, batch: Sequence[Claimed]) -> None:
        """Give back claims that were never run: not an attempt, not poison."""
        conn = self._connection()
        with conn.begin():
            driver(conn).cursor().execute(
                q.release(self.schema), {"ids": [c.id for c in batch], "started": [c.started for c in batch]}
            )


def driver(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under a SQLAlchemy one."""
    raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    return raw


def handler_span(claimed: Claimed, *, tracer: trace.Tracer | None) -> contextlib.AbstractContextManager[object]:
    """The CONSUMER span of one handler run, current while it runs: child of the context the
    inbox row keeps (the span that wrote the message), so what the handler sends continues
    the message's trace (docs/architecture.md, "Tracing").

    When nothing records (``tracer`` None: :func:`framework.tracing.recording_tracer`) no span is
    built: the API's no-op span would only carry the stored context, so that context is
    made current instead, and a message without one costs nothing (the no-op span cost
    a third of a small handler's run).
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
    no attribute the span's name already says (the SDK checks each one on every span,
    about a microsecond each): the handler is the one of the message type in the name,
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
    """An inbox row's stored expiry has passed (docs/architecture.md, "Expiry and filters")."""
    expires_at = expiry.from_metadata(value)
    return expires_at is not None and expiry.passed(expires_at)


def _as_text(value: Any) -> str:
    """A claimed column as text for a dead letter, whatever it holds."""
    if isinstance(value, Undecodable):
        return value.text
    if isinstance(value, str):
        return value
    try:
        return jsoncodec.dumps(value, default=str)
    except Exception:  # nested past the encoder's limit, or worse: its type at least
        return f"<{type(value).__name__} that cannot be written as JSON>"


def _undecodable_reasons(payload: Any, context: Any, metadata: Any, timestamp: Any) -> str:
    """Why a claimed row's values cannot make a Message."""
    bad = [
        f"{name}: {value.error}"
        for name, value in (
            ("payload", payload),
            ("message_context", context),
            ("metadata", metadata),
            ("message_timestamp", timestamp),
        )
        if isinstance(value, Undecodable)
    ]
    bad += [
        f"{name} is a JSON {type(value).__name__}, not an object"
        for name, value in (("message_context", context), ("metadata", metadata))
        if value is not None and not isinstance(value, dict)
    ]
    return "; ".join(bad)


def _only(known: dict[uuid.UUID, BaseException], claimed: Claimed) -> dict[uuid.UUID, BaseException] | None:
    return {claimed.id: known[claimed.id]} if claimed.id in known else None


def _aborted(raw: psycopg.Connection[Any]) -> bool:
    """The transaction is aborted: a statement failed, maybe an earlier handler's flushed row."""
    return not raw.closed and raw.info.transaction_status == psycopg.pq.TransactionStatus.INERROR


def _is_database_error(exc: BaseException) -> bool:
    return isinstance(exc, sa.exc.DBAPIError | psycopg.Error)


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc).strip() or type(exc).__name__
    except Exception:  # a handler's exception whose __str__ fails is still its message's failure
        text = type(exc).__name__
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return text + where


def _clip(text: str, limit: int = 2000) -> str:
    """Error text for ``last_error``: bounded, and without what a text column refuses."""
    text = jsoncodec.clean_string(text)
    return text if len(text) <= limit else text[:limit] + "…"
