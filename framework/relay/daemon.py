"""The outbox relay: claim due outbox rows, publish them with streamed confirms, record outcomes.

The relay is a guest of the loop it is given (docs/explanation/daemons.md, "One loop per
process"), whose one thread owns it: the loop waits on the database socket (``NOTIFY``)
and the broker's (confirms, returns) at once, with timers for the poll fallback, marks
that wait and reconnects. One database
connection claims, records and listens; one :class:`ConfirmChannel` publishes. The loop
keeps up to ``max_in_flight`` messages unconfirmed and claims the next batch while
earlier ones wait for their confirms. A row is marked ``processed_at`` only after its
confirm, and the mark rides the next claim (one statement a cycle; framework/sql/outbox.py)
or, with failures, their transaction; everything between claim and record is covered
by the lease, so a publisher that dies (even ``kill -9``) leaves rows that another
publisher takes over when the lease runs out.

What each outcome means for its row is settlement's (framework/relay/settle.py); how a
row becomes a message is translation's (framework/relay/messages.py). A claimed row whose
time to live has run out is abandoned at once with a dead letter ``expired``
(docs/explanation/receive.md, "Expiry and filters"); one whose message cannot be built is
abandoned at once as ``internal_error`` (docs/explanation/dead-letters.md, "Dead letters"), and the
rest of its batch goes on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika.channel
import psycopg
from pika.adapters.select_connection import IOLoop
from psycopg import sql

from framework import amqp, db, expiry, metrics, names, topology
from framework import retention as retention_
from framework.backoff import reconnect_seconds
from framework.confirms.channel import ConfirmChannel, Outgoing
from framework.connections import ConnectionSlot
from framework.daemon import RABBITMQ, Daemon
from framework.errors import DatabaseUnavailable, PublishError
from framework.outcomes import RelayOutcome
from framework.reasons import Reason
from framework.relay import claims
from framework.relay.claims import Claims
from framework.relay.config import RelayConfig
from framework.relay.messages import outgoing, unbuildable
from framework.relay.settle import Settlement, Written, relay_outcome
from framework.relay.spans import PublishSpans, publish_spans
from framework.service import Service
from framework.settings import RetentionSettings
from framework.signing import SigningConfig
from framework.sql import outbox as outbox_sql
from framework.sql import rendered
from framework.sql.outbox import Claimed
from framework.wakeup import Pace

# Marks wait for the next claim to carry them (docs/explanation/daemons.md, "Wake-ups"): at most
# this many rows (more are marked by a statement of their own just before the claim: the
# claim's successor probe grows with them), and for at most MARK_DELAY.
FOLD_AT_MOST = outbox_sql.HAS_NEXT_AT_MOST
MARK_DELAY = 0.05  # seconds
CLAIM_TIMEOUT = 30.0  # seconds a claim may go unanswered before its connection is given up
CONNECTION_NAME = "txbox-publisher"  # its one connection's application_name (pg_stat_activity)


_CLAIM = "txbox_relay_claim"
_CLAIM_WINDOW = "txbox_relay_claim_window"


@dataclass
class Cycle:
    """What one claim carries and finds: the marks it folds in, the room it asks for, and
    what woke it (so a NOTIFY or confirm that came during it keeps the hint)."""

    room: int
    marks: list[tuple[Outgoing, float]]
    notified: int
    due: int
    sent_at: float = 0.0  # monotonic
    rows: list[Claimed] = field(default_factory=list)


class Relay(Daemon):
    """The relay daemon (`txbox publisher`); ``Relay(service, config).run()`` until ``stop_event``.

    ``txbox run`` embeds it by passing a shared ``stop_event``. The relay declares the
    topology on its first channel before it publishes; ``declare_topology=False`` when the
    caller declared it already. A declaration RabbitMQ refuses ends the relay with the
    :class:`framework.errors.TopologyMismatch` that explains it. Every attribute is the loop thread's,
    but for what :class:`Daemon` shares and :meth:`stop`, which only wakes the loop.
    """

    name = "publisher"  # as its command names it: logs, threads and metrics say "publisher"

    def __init__(
        self,
        service: Service,
        config: RelayConfig | None = None,
        *,
        stop_event: threading.Event | None = None,
        declare_topology: bool = True,
        retention: RetentionSettings | None = None,
        tenant: str | None = None,
    ) -> None:
        # The tenant whose outbox this relay publishes is put on every message.
        super().__init__(service, stop_event=stop_event, tenant=tenant)
        self.config = config or RelayConfig.from_env()
        # Published rows older than TXBOX_OUTBOX_RETENTION go, in a thread of their own with
        # a connection of its own (docs/explanation/operations.md, "Retention").
        self.pruner = retention_.outbox_pruner(self, retention)
        self._undeclared = declare_topology  # the topology is still to declare, on the next channel
        self.schema = self.settings.schema
        self._user = amqp.username(self.settings.amqp_url)  # our messages' user_id (lane headers)
        self._signer = SigningConfig.from_env().signer()  # a bad key fails here, at start
        self._settle = Settlement(self.schema, self.config, self.log)
        # Rendered once: run per claim (framework/sql/__init__.py, ``rendered``).
        self._sql_claim = rendered(outbox_sql.claim(self.schema))  # also the fallback, run at once (_claimed)
        self._claims = Claims({_CLAIM: self._sql_claim, _CLAIM_WINDOW: rendered(outbox_sql.claim_window(self.schema))})
        self._cycle: Cycle | None = None  # the claim in flight
        self._step_after_claim = False  # a step came while a claim was in flight
        self._sql_backlog = rendered(outbox_sql.backlog(self.schema))
        self._sql_listen = sql.SQL("LISTEN {}").format(sql.Identifier(names.notify_channel(self.schema, names.OUTBOX)))
        self._statistics = db.Statistics(self.schema, names.OUTBOX, min_interval=float(self.config.metrics_interval))
        # A claim lost to a database crash only loses a lease: the row is claimed (and
        # maybe published) again, which at-least-once delivery allows. Losing the last
        # marks only means those rows are published again (the inbox dedups). So the
        # connection does not wait for fsync. Generic plans: left to choose, PostgreSQL
        # planned every claim again (docs/explanation/daemons.md, "Generic plans").
        self._db = ConnectionSlot(
            self.settings.database_url,
            autocommit=True,
            synchronous_commit=False,
            generic_plans=True,
            application_name=CONNECTION_NAME,
        )
        self._fd: int | None = None  # the database socket while the loop watches it
        self._channel: ConfirmChannel | None = None
        self._pace = Pace()
        # Published rows whose mark waits for the next claim, each with its confirm's
        # monotonic time (the claim back-dates the mark to it).
        self._confirmed: list[tuple[Outgoing, float]] = []
        self._others: list[tuple[Outgoing, PublishError]] = []  # failures and releases to write
        self._spans: dict[str, PublishSpans] = {}  # a batch's publish spans until its confirms (by message id)
        self._hint = True  # False while a claim would find nothing new (see _claimed)
        self._notified = 0  # NOTIFYs seen (a claim compares it)
        self._due = 0  # confirms that may have made rows due (compared like _notified)
        self._room_bound = False  # in-flight room bounds the claims: every confirm wakes the loop
        self._wide = True  # last claims found as many heads as asked for (see _claimed)
        self._next_full_claim = 0.0
        self._next_gauges = 0.0
        self._soon = False  # a step is scheduled for the loop's next turn
        self._stepping = False  # a step runs (a NOTIFY read now did not wake the loop from sleep)
        self._later: tuple[float, Any] | None = None  # (monotonic deadline, timer) of a step to come
        self._db_failures = 0
        self._broker_failures = 0
        self._broker_after = 0.0  # monotonic: no new channel before this (backoff)
        self._draining = False
        self._closing = False  # the drain asked the channel to close
        self._finished_drain = False  # the drain recorded what was left and the relay ended
        self._ended_by: BaseException | None = None  # what ends the relay when its drain is done
        self._drain_check = False  # a look at the drain is scheduled (_done)
        self._drain_deadline = 0.0
        self._drain_timer: Any = None  # the drain's timeout, until the relay ended
        self._in_flight = metrics.PUBLISHER_IN_FLIGHT.labels(**self.labels)
        # What the loop ran, by kind (claim, mark, write: a transaction of failures), for
        # the tests and the bench: a cycle is one claim (docs/explanation/daemons.md, "Wake-ups").
        self.statements: Tally[str] = Tally()
        self.published = 0  # totals of this relay, for tests and `txbox run`'s summary
        self.failed = 0
        self.abandoned = 0

    @property
    def idle(self) -> bool:
        """Connected and listening, with nothing to claim until a NOTIFY, a confirm or the
        poll (read from another thread, a test's, it is a moment's view)."""
        return (
            self._fd is not None and self._cycle is None and not self._hint and not self._soon and not self._confirmed
        )

    # ---- lifecycle ---------------------------------------------------------------

    @property
    def _loop(self) -> IOLoop:
        loop = self.loop
        assert loop is not None, "the relay runs only once started (start_on)"
        return loop

    def _begin(self) -> None:
        """Declare the topology (again after a backoff while RabbitMQ is down), then relay;
        a stop request drains (:meth:`_begin_drain`)."""
        self.state("starting", f"service {self.settings.service}, schema {self.schema}")
        self.pruner.start()
        self._relay()

    def _declare_on(self, channel: pika.channel.Channel, done: Callable[[], None]) -> None:
        """The topology, declared on the relay's first channel before it publishes, without
        blocking the loop: a RabbitMQ node that takes the connection and never answers holds
        up the relay's channel only (docs/explanation/daemons.md, "One loop per process")."""
        topology.declare_on(self.settings, self.service.registry, channel, done)

    def _relay(self) -> None:
        if self._draining:
            return
        self._loop.call_later(0, self._tick)
        self._step_soon()

    def _on_stop(self) -> None:
        self._begin_drain()

    def _tick(self) -> None:
        """The poll fallback, at least every poll interval: look again; give up a claim that
        has not answered within CLAIM_TIMEOUT (a database gone silent, not closed)."""
        if self._finished_drain:
            return
        self.progress()
        cycle = self._cycle
        if cycle is not None and time.monotonic() - cycle.sent_at > CLAIM_TIMEOUT:
            self._lost_db(DatabaseUnavailable(f"a claim had no answer within {CLAIM_TIMEOUT:g}s"))
        if not self._draining:
            self._hint = True
            self._step_soon()
        self._loop.call_later(min(float(self.config.poll_interval), CLAIM_TIMEOUT), self._tick)

    # ---- scheduling ----------------------------------------------------------------

    def _step_soon(self) -> None:
        """Run a step at the loop's next turn, after what it is reading now (one per burst).
        A timer, not ``add_callback``, which writes to the loop's wake-up pipe each time."""
        if not self._soon:
            self._soon = True
            self._loop.call_later(0, self._step)

    def _step_in(self, delay: float) -> None:
        """Run a step ``delay`` seconds from now, unless a timed one comes sooner (a step at the
        next turn does not count: what it finds may need this one, say after a backoff)."""
        delay = max(0.0, delay)
        at = time.monotonic() + delay
        if self._later is not None and self._later[0] <= at:
            return
        if self._later is not None:
            self._loop.remove_timeout(self._later[1])
        self._later = (at, self._loop.call_later(delay, self._step_due))

    def _step_due(self) -> None:
        self._later = None
        self._step_soon()

    # ---- the step ------------------------------------------------------------------

    def _step(self) -> None:
        """One round: record failures, claim (carrying the marks) and publish."""
        self._soon = False
        if self._draining:
            return
        self.progress()
        self._stepping = True
        try:
            conn = self._conn()
            if conn is None:
                return
            if self._cycle is not None:
                self._step_after_claim = True  # its rows step again (_claimed)
                return
            if self._others:
                self._write_all(conn)
            channel = self._broker()
            if channel is None:
                if self._marks_overdue():
                    self._write_marks(conn)
                if self._broker_after > time.monotonic():
                    self._step_in(self._broker_after - time.monotonic())
                return
            self._gauges(conn, channel)
            self._claim(conn, channel, channel.in_flight)
            self._db_failures = 0
            if self._cycle is None and self._confirmed:
                self._step_in(self._confirmed[0][1] + MARK_DELAY - time.monotonic())
        except Exception as exc:  # the last resort: the loop goes on with a new connection
            self._failed(exc)
        finally:
            self._stepping = False

    def _marks_overdue(self) -> bool:
        """A mark has waited MARK_DELAY for a claim to carry it, or too many wait."""
        confirmed = self._confirmed
        return bool(confirmed) and (len(confirmed) > FOLD_AT_MOST or time.monotonic() >= confirmed[0][1] + MARK_DELAY)

    def _claim(self, conn: psycopg.Connection[Any], channel: ConfirmChannel, in_flight: int) -> None:
        """Send the claim there is room for beside ``in_flight`` unconfirmed messages, carrying
        the marks that wait; its rows come to :meth:`_claimed`."""
        room = min(self.config.batch_size, self.config.max_in_flight - in_flight)
        self._room_bound = room < self.config.batch_size
        if len(self._confirmed) > FOLD_AT_MOST or ((room <= 0 or not self._hint) and self._marks_overdue()):
            # Too many for the claim's probe, or no claim to carry them: a claim that
            # would find nothing costs more than the mark alone (which says whether it
            # freed a successor: then the claim runs after all).
            self._write_marks(conn)
        if room <= 0 or not self._hint:
            return
        cycle = Cycle(room, self._confirmed, self._notified, self._due, time.monotonic())
        params = claims.parameters(
            room,
            float(self.config.lease),
            [item.token.id for item, _ in cycle.marks],
            [cycle.sent_at - at for _, at in cycle.marks],  # the marks say when the confirms came
        )
        # Many lanes: the plain claim streams down outbox_due_idx and stops at the limit.
        # Few, deep lanes: the plain claim would probe every waiting row (sql.claim_window).
        self._claims.send(conn, _CLAIM if self._wide else _CLAIM_WINDOW, params)
        self._confirmed = []
        self._cycle = cycle

    def _claimed(self, conn: psycopg.Connection[Any], rows: list[Claimed]) -> None:
        """The claim in flight came back with ``rows`` (committed, with its marks): claim the
        next batch if this one was full and there is room, then publish these."""
        cycle, self._cycle = self._cycle, None
        assert cycle is not None
        cycle.rows = rows
        self._counted_claim(rows)
        self._counted(Written(published=Tally(item.token.message_type for item, _ in cycle.marks)))
        if not self._wide and not rows and time.monotonic() >= self._next_full_claim:
            # The window may be all rows waiting behind blocked heads (say, a long
            # backoff): look at the whole table now and then so no lane starves.
            self._next_full_claim = time.monotonic() + float(self.config.poll_interval)
            params = {"limit": cycle.room, "lease": float(self.config.lease), "marked": [], "ages": []}
            rows = cycle.rows = outbox_sql.fetch_claimed(conn, self._sql_claim, params)
            self._counted_claim(rows)
        self._wide = len(rows) >= cycle.room
        # A slow claim may run ANALYZE (framework/db.py, Statistics): before the claim ahead,
        # which must be alone on the connection; and should it fail, the rows in hand
        # still go out before the connection is given up.
        trouble: Exception | None = None
        try:
            self._statistics.after_claim(conn, time.monotonic() - cycle.sent_at, len(rows), self.log)
        except Exception as exc:
            trouble = exc
        # A short claim took every due head there is: claiming again is pointless until
        # something changes (a write frees the next heads, NOTIFY, a confirm whose mark
        # may free one, the poll timer). A NOTIFY or such a confirm that came during the
        # claim may be for a row its snapshot missed.
        full = len(rows) >= cycle.room
        self._hint = full or self._notified != cycle.notified or self._due != cycle.due
        channel = self._channel
        if self._draining or channel is None or not channel.is_open:
            if rows:  # not to be sent now: give the leases back at once
                self._settle.release(conn, [row.id for row in rows])
                self._sent("write")
            if self._draining:
                self._drained()
            else:
                self._step_soon()
            return
        if full and trouble is None:
            # The next batch while this one is published: PostgreSQL claims while Python sends.
            self._claim(conn, channel, channel.in_flight + len(rows))
        if rows:
            self._publish(conn, channel, rows)
        self._in_flight.set(channel.in_flight)
        if trouble is not None:
            self._failed(trouble)
            return
        if self._claims.in_flight:  # the claim ahead
            return
        # A step now only if one was asked for meanwhile (a NOTIFY, a confirm that frees a
        # successor, a failure) or more is ready: a NOTIFY under load waits out its window
        # (_notice) and its claim takes the rows that came in it.
        if full or self._others or self._step_after_claim:
            self._step_after_claim = False
            self._step_soon()
        elif self._confirmed:
            self._step_in(self._confirmed[0][1] + MARK_DELAY - time.monotonic())

    def _publish(self, conn: psycopg.Connection[Any], channel: ConfirmChannel, rows: list[Claimed]) -> None:
        items = self._outgoing(rows)  # in claim order: priority, then creation
        if any(r.expires_at is not None for r in rows):
            items = self._expire(items)
        if not items:
            return
        spans = publish_spans(self.settings.service, items)
        for item in items:
            item.on_done = self._done
            if spans is not None:
                self._spans[item.message_id] = spans
        channel.publish(items)  # a closed channel completes them at once as connection_lost

    def _outgoing(self, rows: list[Claimed]) -> list[Outgoing]:
        """The messages of ``rows``; one that cannot be built is a failure abandoned at once,
        and the others go on (docs/explanation/dead-letters.md, "Dead letters")."""
        items: list[Outgoing] = []
        for row in rows:
            try:
                items.append(outgoing(row, self._user, self._signer, self.tenant))
            except Exception as exc:  # the last resort: one row must not stop the relay
                self.log.exception("outbox row %s: its message could not be built; dead-lettering it", row.id)
                self._others.append(unbuildable(row, exc))
                self._step_soon()
        return items

    def _expire(self, items: list[Outgoing]) -> list[Outgoing]:
        """The items still to publish; expired ones are failures abandoned at once
        (docs/explanation/receive.md, "Expiry and filters")."""
        keep: list[Outgoing] = []
        now = time.time()
        for item in items:
            row: Claimed = item.token
            expires_at = expiry.from_metadata(row.expires_at)
            if expires_at is not None and expiry.passed(expires_at, now):
                error = PublishError(expiry.describe(expires_at, "before the relay published it"), Reason.EXPIRED)
                self._others.append((item, error))
            else:
                keep.append(item)
        if len(keep) < len(items):
            self._step_soon()
        return keep

    def _done(self, item: Outgoing, error: PublishError | None) -> None:
        """A publish completed (the channel calls this on the loop): keep its outcome, and
        step now only if that must be acted on now.

        A confirmed row's mark waits for the next claim (docs/explanation/daemons.md, "Wake-ups"),
        unless a row waits behind it in its lane (``has_next`` True, asked at its claim)
        or may (None: a large claim's rows are not asked): then the loop claims now, and
        the claim marks it and takes the successor. A row written behind it after its
        claim comes with a NOTIFY, whose claim carries the mark; if not, the next claim
        does (MARK_DELAY at the latest). Failures, and confirms while in-flight room
        bounds the claims, step now too.
        """
        spans = self._spans.pop(item.message_id, None)
        published = relay_outcome(item.token, error) is RelayOutcome.PUBLISHED
        if spans is not None:
            spans.done(None if published else str(error))
        if error is None:
            self._confirmed.append((item, time.monotonic()))
            if item.token.has_next is not False:
                self._due += 1
                self._hint = True
                self._step_soon()
            elif self._room_bound:
                self._step_soon()
            else:
                self._step_in(MARK_DELAY)
        else:
            self._others.append((item, error))
            self._step_soon()
        if self._draining and not self._drain_check:
            self._drain_check = True  # one look per loop turn, however many confirms came
            self._loop.call_later(0, self._drained)

    # ---- recording -------------------------------------------------------------------

    def _write_marks(self, conn: psycopg.Connection[Any]) -> None:
        """The waiting marks in a statement of their own (no claim will carry them soon)."""
        confirmed, self._confirmed = self._confirmed, []
        try:
            written = self._settle.marks(conn, [item for item, _ in confirmed])
            self._sent("mark")
        except BaseException:
            self._confirmed[:0] = confirmed
            raise
        self._counted(written)

    def _write_all(self, conn: psycopg.Connection[Any]) -> None:
        """Failures and releases, with the waiting marks, in one transaction."""
        confirmed, others = self._confirmed, self._others
        self._confirmed, self._others = [], []
        try:
            written = self._settle.write(conn, [item for item, _ in confirmed], others)
            self._sent("write")
        except BaseException:
            self._confirmed[:0] = confirmed
            self._others[:0] = others
            raise
        self._counted(written)

    def _sent(self, kind: str, n: int = 1) -> None:
        """Count what the loop sent to PostgreSQL (``Relay.statements`` and the metric)."""
        self.statements[kind] += n
        metrics.PUBLISHER_STATEMENTS.labels(kind=kind, **self.labels).inc(n)

    def _counted_claim(self, rows: list[Claimed]) -> None:
        self._sent("claim")
        metrics.PUBLISHER_CLAIMS.labels(found="rows" if rows else "nothing", **self.labels).inc()

    def _counted(self, written: Written) -> None:
        owner = self.labels
        for message_type, n in written.published.items():
            metrics.PUBLISHER_PUBLISHED.labels(message_type=message_type, **owner).inc(n)
        for (message_type, reason), n in written.failed.items():
            metrics.PUBLISHER_FAILED.labels(message_type=message_type, reason=reason, **owner).inc(n)
        for message_type, n in written.abandoned.items():
            metrics.PUBLISHER_ABANDONED.labels(message_type=message_type, **owner).inc(n)
        self.published += sum(written.published.values())
        self.failed += sum(written.failed.values())
        self.abandoned += sum(written.abandoned.values())
        if written.unblocked:
            self._hint = True

    def _gauges(self, conn: psycopg.Connection[Any], channel: ConfirmChannel) -> None:
        self._in_flight.set(channel.in_flight)
        now = time.monotonic()
        if now < self._next_gauges:
            return
        self._next_gauges = now + self.config.metrics_interval
        # A burst since the last ANALYZE makes the planner pick a slow claim plan (framework/sql/outbox.py).
        if self._statistics.refresh(conn.cursor(), now):
            self._sent("gauge")
        count, age = conn.execute(self._sql_backlog).fetchone() or (0, 0)
        self._sent("gauge")
        metrics.PUBLISHER_BACKLOG.labels(**self.labels).set(count)
        metrics.PUBLISHER_OLDEST_DUE_AGE.labels(**self.labels).set(float(age))

    # ---- database ------------------------------------------------------------------

    def _conn(self) -> psycopg.Connection[Any] | None:
        """The open connection, listening, its socket watched by the loop; None while it is
        down (a step is scheduled for the next try)."""
        if self._db.is_open and self._fd is not None:
            return self._db.get()
        self._db.close()
        conn = self._db.get()  # raises DatabaseUnavailable: _step backs off
        conn.add_notify_handler(lambda _: self._notice())  # NOTIFYs read while a statement ran
        conn.execute(self._sql_listen)
        self._claims.prepare(conn)
        self._fd = conn.fileno()
        self._loop.add_handler(self._fd, self._readable, IOLoop.READ)
        self.state("running")
        self._hint = True  # NOTIFYs may have come while it was down
        return conn

    def _readable(self, _fd: int, _events: int) -> None:
        """The database socket has data while no statement runs: NOTIFYs, or the end."""
        conn = self._db.get() if self._db.is_open else None
        # A statement that another thread runs on the connection (a test's look at it)
        # reads its own result: leave the socket to it.
        if conn is None or not conn.lock.acquire(blocking=False):
            return
        pgconn = conn.pgconn
        rows = None
        try:
            if self._cycle is not None:
                rows = self._claims.collect(conn)
            else:
                pgconn.consume_input()
            notified = False
            while pgconn.notifies() is not None:
                notified = True
        except (psycopg.Error, DatabaseUnavailable) as exc:
            self._lost_db(exc)
            return
        finally:
            conn.lock.release()
        if notified:
            self._notice()
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            self._lost_db(DatabaseUnavailable("the database connection closed"))
        elif rows is not None:
            try:
                self._claimed(conn, rows)
            except Exception as exc:  # the last resort, as in _step
                self._failed(exc)

    def _notice(self) -> None:
        """Rows may have arrived: claim at once, or after the hold or window (Pace)."""
        self._notified += 1
        self._hint = True
        now = time.monotonic()
        self._pace.notify(now)
        if self._soon:
            return
        # The window under load, for a NOTIFY that woke the loop from sleep (Pace). The relay
        # keeps no hold: publisher replicas racing for a NOTIFY cost one claim each, and a
        # hold after each lost race made every next row wait for it (benchmarks/one-thread.md).
        delay = self._pace.delay(now, from_sleep=not self._stepping)
        if delay > 0:
            self._step_in(delay)
        else:
            self._step_soon()

    def _failed(self, exc: Exception) -> None:
        """A step or a claim's rows failed: log what is not the database's usual trouble, then
        start again on a new connection (marks wait for the next claim; rows in hand that
        were not published wait for their lease)."""
        if not isinstance(exc, DatabaseUnavailable) and not (
            isinstance(exc, psycopg.Error) and db.is_infrastructure_error(exc)
        ):
            self.log.exception("unexpected error in the relay's loop")
        self._lost_db(exc)

    def _unwatch(self) -> None:
        """Stop watching the database socket. psycopg closes it itself on a fatal error,
        before the loop can let go of it: then the poller has nothing left to remove."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError, KeyError):
                self._loop.remove_handler(fd)

    def _lost_db(self, exc: BaseException) -> None:
        """Drop the connection and try again after a backoff, the loop going on meanwhile.
        A claim in flight is lost with it: its marks wait for the next claim (marking is
        idempotent), its rows, if it committed, for their lease."""
        if self._cycle is not None:
            self._confirmed[:0] = self._cycle.marks
            self._cycle = None
        self._unwatch()
        self._db.close()
        self._db_failures += 1
        delay = reconnect_seconds(self._db_failures)
        self.state("PostgreSQL unavailable", f"{exc}; retrying in {delay:.1f}s")
        if not self._draining:
            self._step_in(delay)

    # ---- broker ----------------------------------------------------------------------

    def _broker(self) -> ConfirmChannel | None:
        """The open channel; else None, opening a new one once the backoff allows."""
        channel = self._channel
        if channel is not None and channel.is_open:
            return channel
        if channel is not None and channel.state in ("new", "opening"):
            return None
        if time.monotonic() < self._broker_after:
            return None
        self._channel = ConfirmChannel(
            self.settings.amqp_url,
            self._loop,
            name=f"{self.settings.service} publisher" + (f" of tenant {self.tenant}" if self.tenant else ""),
            confirm_timeout=float(self.config.confirm_timeout),
            on_change=self._channel_changed,
            prepare=self._declare_on if self._undeclared else None,
        )
        self._channel.open()
        return None

    def _channel_changed(self, channel: ConfirmChannel) -> None:
        if channel is not self._channel:
            return
        if channel.is_open:
            self._broker_failures = 0
            self._undeclared = False  # declared (durable): the next channels need not
            self.set_ready(RABBITMQ, True)
            self.state("running")
            self._hint = True
            self._step_soon()
            return
        self.set_ready(RABBITMQ, False)
        refusal = topology.mismatch(self.settings, channel.error) if channel.error is not None else None
        if refusal is not None and not self._draining:  # a misconfiguration: a retry is refused again
            self.log.error("%s", refusal)
            self._ended_by = refusal
            self._begin_drain()
            return
        if self._draining:
            self._drained()
            return
        # Its incomplete sends have failed as connection_lost (their releases are written
        # at the next step); a new channel after a backoff.
        self._broker_failures += 1
        delay = reconnect_seconds(self._broker_failures)
        self._broker_after = time.monotonic() + delay
        self.state("RabbitMQ unavailable", f"{channel.error}; retrying in {delay:.1f}s")
        self._step_in(delay)

    # ---- shutdown --------------------------------------------------------------------

    def _begin_drain(self) -> None:
        """Stop claiming; wait (bounded) for outstanding confirms, then close and record."""
        if self._draining:
            return
        self._draining = True
        channel = self._channel
        outstanding = channel.in_flight if channel is not None else 0
        self.state("draining", f"{outstanding} confirm(s) outstanding")
        self._drain_deadline = time.monotonic() + float(self.config.drain_timeout)
        self._drain_timer = self._loop.call_later(float(self.config.drain_timeout), self._drained)
        self._drained()

    def _drained(self) -> None:
        """Called at the drain's start, after each confirm while draining and at its timeout:
        once nothing is outstanding (or the time is up), close the channel."""
        self._drain_check = False
        if self._cycle is not None:
            if time.monotonic() < self._drain_deadline:
                return  # its rows are given back when they come (_claimed), which calls again
            self._lost_db(DatabaseUnavailable("the claim in flight had no answer by the end of the drain"))
        channel = self._channel
        if channel is None or channel.state not in ("opening", "open"):
            self._finish_drain()
            return
        if channel.in_flight and time.monotonic() < self._drain_deadline:
            return  # the next confirm, or the timeout, calls again
        if channel.in_flight:
            self.log.warning("drain timeout: %d confirm(s) still outstanding, releasing them", channel.in_flight)
        if not self._closing:
            self._closing = True
            channel.close()  # what is still incomplete fails as 'closed' → released; _channel_changed finishes

    def _finish_drain(self) -> None:
        """Record what is left (three tries), then end the loop; once."""
        if self._finished_drain:
            return
        self._finished_drain = True
        for _ in range(3):
            try:
                conn = self._db.get()
                if self._others or self._confirmed:
                    self._write_all(conn)
                break
            except (psycopg.Error, DatabaseUnavailable) as exc:
                self._db.close()
                self.log.warning("could not record outcomes on shutdown (%s); leases will expire instead", exc)
                time.sleep(0.2)
        self._shut()
        self._end(self._ended_by)

    def _shut(self) -> None:
        """The relay's end: nothing is left open, no timer of its runs again."""
        channel = self._channel
        if channel is not None and channel.state in ("opening", "open"):
            channel.close()
        self._unwatch()
        self._db.close()
        for timer in (self._later[1] if self._later else None, self._drain_timer):
            if timer is not None:
                self._loop.remove_timeout(timer)
        self._later = self._drain_timer = None
        self.pruner.close()
        self._in_flight.set(0)
        self.state("stopped", f"published {self.published}, failed {self.failed}, abandoned {self.abandoned}")
