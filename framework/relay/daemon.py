"""The outbox relay: claim due outbox rows, publish them with streamed confirms, record outcomes.

One loop (the caller's thread) talks to PostgreSQL; the :class:`Publisher` I/O thread
talks to RabbitMQ; a listener thread turns ``NOTIFY`` into a wake-up. The loop keeps up
to ``max_in_flight`` messages unconfirmed and claims the next batch while earlier ones
wait for their confirms, so neither the database nor the broker round trip is paid per
message. A row is marked ``processed_at`` only after its confirm; everything between
claim and record is covered by the lease, so a publisher that dies (even ``kill -9``)
leaves rows that another publisher takes over when the lease runs out.

Outcomes of one publish:

- confirmed → published;
- returned unroutable: a command is a failure (nobody accepts it: likely a missing
  binding), an event is published (nobody subscribed);
- nacked / unroutable command / confirm timeout → ``finished_attempts + 1``, backoff via
  ``locked_until``; after ``max_attempts`` abandoned with a dead letter, in one transaction;
- connection lost / publisher closed → the lease is released at once (no attempt is
  counted: it was not the message's fault; the broker may have it, the inbox dedups);
- not published at all: a claimed row whose time to live has run out is abandoned at once
  with a dead letter ``expired`` (docs/architecture.md, "Expiry and filters"); a claimed
  row whose message cannot be built (say, metadata written around the outbox API) is
  abandoned at once with a dead letter ``internal_error`` (docs/architecture.md, "Dead
  letters"), and the rest of its batch goes on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter as Tally
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pika
import psycopg
from opentelemetry import trace

from framework import amqp, db, expiry, metrics, names, topology, tracing
from framework import retention as retention_
from framework.backoff import backoff_seconds
from framework.connections import ConnectionSlot, Listener
from framework.daemon import RABBITMQ, Daemon, Reconnect
from framework.dead_letters import DeadLetter
from framework.envelope import CONTENT_TYPE
from framework.errors import BrokerUnavailable, DatabaseUnavailable, PublishError
from framework.outbox import default_segment
from framework.outcomes import RelayOutcome
from framework.publisher import confirms
from framework.publisher.confirms import Outgoing, Publisher
from framework.reasons import Reason
from framework.relay.config import RelayConfig
from framework.service import Service
from framework.settings import RetentionSettings
from framework.signing import Signer, SigningConfig
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import outbox as named
from framework.sql import rendered
from framework.sql.outbox import Claimed
from framework.wakeup import Wakeup

log = logging.getLogger("txbox.publisher")

# Marks wait for the next claim to carry them (docs/architecture.md, "Wake-ups"): at most
# this many rows, and while rows wait so, the loop looks again after at most MARK_DELAY.
FOLD_AT_MOST = named.HAS_NEXT_AT_MOST
MARK_DELAY = 0.05  # seconds


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def envelope_body(row: Claimed) -> bytes:
    """The envelope, assembled from the row's JSON text without parsing it again.

    Payload and context come out of PostgreSQL as JSON text already; splicing them saves
    a parse and a dump per message on the hot path. Field order is the envelope's
    (docs/architecture.md, "The envelope").
    """
    parts = [
        '{"payload":',
        row.payload_json,
        ',"message_context":',
        row.context_json,
        ',"message_id":"',
        row.id,
        '","timestamp":"',
        row.stamp,
        '","message_type":',
        _dumps(row.message_type),
        ',"aggregate_id":',
        _dumps(row.aggregate_id),
        ',"aggregate_type":',
        _dumps(row.aggregate_type),
        ',"message_version":',
        _dumps(row.message_version),
    ]
    if row.auth_token is not None:
        parts += [',"auth_token":', _dumps(row.auth_token)]
    parts.append("}")
    return "".join(parts).encode()


_SHORT_BYTES = 255  # an AMQP short string (the ``type`` property, a routing key)
_SHORT_CHARS = _SHORT_BYTES // 4


def _short_strings(row: Claimed) -> None:
    """Raise if a value sent as an AMQP short string is longer than one holds."""
    for name, value in (("message_type", row.message_type), ("routing_key", row.routing_key)):
        if len(value.encode()) > _SHORT_BYTES:
            raise ValueError(f"{name} of {len(value.encode())} bytes: AMQP allows {_SHORT_BYTES}")


def unbuildable(row: Claimed, exc: Exception) -> tuple[Outgoing, PublishError]:
    """The outcome of a row whose message could not be built: a failure the writer abandons
    at once as ``internal_error`` (docs/architecture.md, "Dead letters")."""
    item = Outgoing("", "", b"", pika.BasicProperties(message_id=row.id), True, row)
    error = f"the relay could not build its message: {type(exc).__name__}: {exc}"
    return item, PublishError(error[:2000], Reason.INTERNAL_ERROR)


def lane_headers(row: Claimed) -> dict[str, Any]:
    """The ordering lane the sender chose, for the receiving service's inbox row.

    Only what differs from the receiver's defaults is sent (the usual message, one lane
    per aggregate at priority 0, carries none of it). The priority travels as a header
    because the row's is a smallint and the AMQP property holds 0-255 only; receivers
    honour these headers from trusted broker users only (the ``user_id`` property).
    """
    headers: dict[str, Any] = {}
    if row.segment and row.segment != default_segment(row.aggregate_type, row.aggregate_id):
        headers[names.HEADER_SEGMENT] = row.segment
    if row.concurrency == "parallel":
        headers[names.HEADER_CONCURRENCY] = row.concurrency
    if row.priority:
        headers[names.HEADER_PRIORITY] = row.priority
    return headers


def outgoing(row: Claimed, user_id: str = "", signer: Signer | None = None) -> Outgoing:
    """The AMQP message of a row: persistent, mandatory, properties mirroring the envelope.

    ``user_id`` (the relay's broker user) lets RabbitMQ vouch for the lane headers. The
    AMQP ``priority`` mirrors the row's where it fits 0-255 (classic priority queues
    and other consumers read it; quorum queues ignore it). With a ``signer``, an event
    carries the signature of its body, as Mosaic's do (docs/architecture.md, "Event
    signing"); commands are not signed.
    """
    body = envelope_body(row)
    headers = lane_headers(row)
    if signer is not None and row.kind == "event":
        headers.update(signer.headers(body))
    if row.correlation_id:
        headers[names.HEADER_CORRELATION_ID] = row.correlation_id
    if row.expires_at is not None:
        expires_at = expiry.from_metadata(row.expires_at)
        if expires_at is not None:
            headers[names.HEADER_EXPIRES_AT] = expiry.header_value(expires_at)
    # The writer's context goes out as it was stored: the publish is a batch span linked
    # to it, not a hop of the trace (docs/architecture.md, "Tracing").
    if row.trace is not None:
        headers.update(tracing.carrier_from(row.trace))
    # AMQP short strings hold 255 bytes: pika would refuse them only when publishing, on
    # the I/O thread, as a lost connection, and the row would be released and claimed
    # again forever. Text is at most 4 bytes a character: most values skip the encoding.
    if len(row.message_type) > _SHORT_CHARS or len(row.routing_key) > _SHORT_CHARS:
        _short_strings(row)
    props = pika.BasicProperties(
        content_type=CONTENT_TYPE,
        delivery_mode=2,
        message_id=row.id,
        type=row.message_type,
        timestamp=row.epoch,
        headers=headers or None,
        priority=row.priority if 0 < row.priority <= 255 else None,
        user_id=user_id or None,
    )
    return Outgoing(names.exchange_for(row.kind), row.routing_key, body, props, True, row)


class PublishSpans:
    """The PRODUCER spans of one claimed batch, linked to the contexts its rows were written
    in (docs/architecture.md, "Tracing"). They end with the batch's last confirm, marked
    failed if any publish of it failed; confirms arrive on the publisher's I/O thread."""

    def __init__(self, spans: list[trace.Span], count: int) -> None:
        self._spans = spans
        self._left = count
        self._failures = 0
        self._error = ""
        self._lock = threading.Lock()

    def done(self, error: str | None) -> None:
        """One publish of the batch is settled; ``error`` if it failed."""
        with self._lock:
            self._left -= 1
            if error is not None:
                self._failures += 1
                self._error = self._error or error
            if self._left:
                return
        for span in self._spans:
            if self._failures:
                span.set_attribute("txbox.failed", self._failures)
                span.set_status(trace.StatusCode.ERROR, f"{self._failures} failed, first: {self._error}"[:1000])
            span.end()


def publish_spans(service: str, items: list[Outgoing]) -> PublishSpans | None:
    """The publish spans of a batch, or None when nothing records (no work per message then)."""
    spans = tracing.batch_spans(
        f"publish {service}",
        trace.SpanKind.PRODUCER,
        {
            "messaging.system": tracing.MESSAGING_SYSTEM,
            "messaging.operation.type": "publish",
            "messaging.batch.message_count": len(items),
        },
        # The outgoing headers hold the row's carrier, bounded (``outgoing``); a row whose
        # message could not be built has none, and its stored carrier is bounded here.
        (item.properties.headers or tracing.carrier_from(item.token.trace) for item in items),
    )
    return PublishSpans(spans, len(items)) if spans else None


def relay_outcome(row: Claimed, error: PublishError | None) -> RelayOutcome:
    """What one publish's result means for its row (the list at the top of this module)."""
    if error is None or (error.reason == Reason.UNROUTABLE and row.kind == "event"):
        return RelayOutcome.PUBLISHED  # an event nobody subscribed to is fine
    if error.reason in (Reason.NACKED, Reason.UNROUTABLE, confirms.TIMEOUT, Reason.EXPIRED, Reason.INTERNAL_ERROR):
        return RelayOutcome.FAILED
    return RelayOutcome.RELEASED  # connection lost / publisher closed: not the message's fault


class Relay(Daemon):
    """The relay daemon (`txbox publisher`); ``Relay(service, config).run()`` until ``stop_event``.

    ``txbox run`` embeds it by passing a shared ``stop_event``; ``declare_topology=False``
    when the caller declared the topology already.
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
    ) -> None:
        super().__init__(service, stop_event=stop_event)
        self.config = config or RelayConfig.from_env()
        # Published rows older than TXBOX_OUTBOX_RETENTION go, in a thread of their own
        # (docs/architecture.md, "Retention").
        self.pruner = retention_.outbox_pruner(self, retention)
        self.declare_topology = declare_topology
        self.schema = self.settings.schema
        self._user = amqp.username(self.settings.amqp_url)  # our messages' user_id (lane headers: lane_headers)
        self._signer = SigningConfig.from_env().signer()  # a bad key fails here, at start
        # Rendered once: run per claim or batch (framework/sql/__init__.py, ``rendered``).
        self._sql_claim_window = rendered(named.claim_window(self.schema))
        self._sql_claim = rendered(named.claim(self.schema))
        self._sql_mark = rendered(named.mark_published(self.schema))
        self._sql_retry = rendered(named.retry_later(self.schema))
        self._sql_abandon = rendered(named.abandon(self.schema))
        self._sql_release = rendered(named.release(self.schema))
        self._sql_backlog = rendered(named.backlog(self.schema))
        self._sql_dead = rendered(dead_letters_sql.insert_sql(self.schema))
        self._statistics = db.Statistics(self.schema, names.OUTBOX, min_interval=float(self.config.metrics_interval))
        # NOTIFY (with a window under load), confirms, finished writes, stop
        # (docs/architecture.md, "Wake-ups").
        self._wake = Wakeup(self.stop_event)
        # Outcomes handed to the loop, each with the monotonic time it was known.
        self._results: deque[tuple[Outgoing, PublishError | None, float]] = deque()
        self._unrecorded: list[tuple[Outgoing, PublishError | None]] = []
        # Published rows whose mark waits for the next claim, which carries it (see _gather).
        # Each with its confirm's monotonic time: the claim back-dates the mark to it.
        self._deferred: list[tuple[Outgoing, float]] = []
        self._confirm_wakes = True  # in-flight room bounds the claims: every confirm wakes the loop
        # Marks ride claims only under load (Wakeup.under_load: NOTIFYs under 5 ms apart): there a
        # claim is frequent and already waits; at a trickle marking in the claim made each
        # claim, and so each message, later by about a mark's time (see _gather).
        self._fold = False
        self._due = 0  # confirms that may have made rows due (compared like _notified)
        self._spans: dict[str, PublishSpans] = {}  # a batch's publish spans until its confirms (by message id)
        # A claim lost to a database crash only loses a lease: the row is claimed (and
        # maybe published) again, which at-least-once delivery allows. Losing the last
        # marks only means those rows are published again (the inbox dedups). So neither
        # connection waits for fsync.
        url = self.settings.database_url
        # Generic plans: left to choose, PostgreSQL planned every claim again (docs/architecture.md,
        # "Generic plans").
        self._claim_db = ConnectionSlot(url, autocommit=True, synchronous_commit=False, generic_plans=True)
        self._write_db = ConnectionSlot(url, autocommit=True, synchronous_commit=False, generic_plans=True)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="publisher write")
        self._writing: tuple[list[tuple[Outgoing, PublishError | None]], Future[Any], int] | None = None
        self._notified = 0  # NOTIFYs seen by the listener: a write compares it (see _collect_writes)
        self._publisher: Publisher | None = None
        self._db_retry = Reconnect(self)
        self._broker_retry = Reconnect(self)
        self._next_gauges = 0.0
        self._claim_hint = True  # False while a claim would find nothing new (see _claim_and_publish)
        self._next_full_claim = 0.0
        self._wide = True  # last claims found as many heads as asked for (see _claim_and_publish)
        self._in_flight = metrics.PUBLISHER_IN_FLIGHT.labels(self.settings.service)
        self.published = 0  # totals of this relay, for tests and `txbox run`'s summary
        self.failed = 0
        self.abandoned = 0

    # ---- lifecycle ---------------------------------------------------------------

    def stop(self) -> None:
        super().stop()
        self._wake.set()

    def run(self) -> None:
        """Relay until stopped, then drain (bounded) and return."""
        self.state("starting", f"service {self.settings.service}, schema {self.schema}")
        if self.declare_topology and not self._declare():
            return
        listener = Listener(self, names.notify_channel(self.schema, names.OUTBOX), self._notice).start()
        self.pruner.start()
        try:
            while not self.stopping:
                self.progress()
                self._wake.clear()
                if not self._step() and not self._wake.wait(self._wait_timeout()):
                    self._claim_hint = True  # the poll fallback (or marks waiting): look again
            self._drain()
        finally:
            self._wake.set()
            if self._publisher is not None:
                self._publisher.close(timeout=0)
            self._writer.shutdown(wait=True)
            self._close_db()
            listener.close()
            self.pruner.close()
            self._in_flight.set(0)
            self.state("stopped", f"published {self.published}, failed {self.failed}, abandoned {self.abandoned}")

    def _wait_timeout(self) -> float:
        """The poll interval; MARK_DELAY while outcomes wait to be recorded or confirms may
        come without waking the loop (see :meth:`_done`)."""
        poll = float(self.config.poll_interval)
        publisher = self._publisher
        in_flight = publisher is not None and publisher.in_flight
        # Outcomes for the writer wait while a write runs; its end wakes the loop (_written),
        # and this bounds the wait should they have been gathered as it looked.
        if self._deferred:
            # From the oldest waiting confirm, not from this wake-up: wake-ups that bring
            # no claim must not keep putting its mark off (see _marks_overdue).
            return max(0.0, min(poll, self._deferred[0][1] + MARK_DELAY - time.monotonic()))
        if self._unrecorded or (self._fold and (self._results or in_flight)):
            return min(poll, MARK_DELAY)
        return poll

    def _marks_overdue(self) -> bool:
        """A mark has waited MARK_DELAY for a claim to carry it: claim now, hint or not."""
        return bool(self._deferred) and time.monotonic() >= self._deferred[0][1] + MARK_DELAY

    def _declare(self) -> bool:
        while not self.stopping:
            self.progress()
            try:
                topology.declare(self.settings, self.service.registry)
                self._broker_retry.succeeded()
                return True
            except BrokerUnavailable as exc:
                if self._broker_retry.failed("RabbitMQ", exc):
                    return False
        return False

    def _step(self) -> bool:
        """One round: record outcomes, claim and publish; True when more work is ready now.

        The marks of a few confirmed rows ride the claim (docs/architecture.md,
        "Wake-ups"). Other outcomes, and the marks of large batches at full load, are
        written on a second connection by a writer thread while this one claims, so the
        two biggest statements of the relay (mark and claim) overlap instead of adding up.
        """
        try:
            self._collect_writes(block=False)
            conn = self._db()
            self._gather()
            publisher = self._broker()
            if publisher is None or self.stopping:
                self._undefer()
            self._start_write()
            if publisher is None:
                return False
            self._gauges(conn, publisher)
            claimed = self._claim_and_publish(conn, publisher)
            self._in_flight.set(publisher.in_flight)
            self._db_retry.succeeded()
            return claimed >= self.config.batch_size and publisher.in_flight < self.config.max_in_flight
        except (psycopg.Error, DatabaseUnavailable) as exc:
            if not isinstance(exc, DatabaseUnavailable) and not db.is_infrastructure_error(exc):
                log.exception("unexpected database error")
            self._close_db()
            self._db_retry.failed("PostgreSQL", exc)
            return False

    # ---- database ------------------------------------------------------------------

    def _db(self) -> psycopg.Connection[Any]:
        fresh = not self._claim_db.is_open
        conn = self._claim_db.get()
        if fresh:
            self.state("running")
        return conn

    def _close_db(self) -> None:
        self._claim_db.close()
        self._write_db.close()

    def _claim_and_publish(self, conn: psycopg.Connection[Any], publisher: Publisher) -> int:
        room = min(self.config.batch_size, self.config.max_in_flight - publisher.in_flight)
        if room <= 0:
            self._undefer()  # no claim to carry the marks: the writer writes them
            self._start_write()
            return 0
        if not self._claim_hint and not self._marks_overdue():
            return 0
        # Confirms wake the loop when in-flight rows bound the claims (room is short).
        self._confirm_wakes = room < self.config.batch_size
        self._fold = self._wake.under_load()
        # What came since the step gathered rides this claim too: a confirm whose row has a
        # successor and that came before this line is carried; one after it changes
        # ``_due`` and keeps the claim hint below.
        notified, due = self._notified, self._due
        self._gather()
        marked = self._deferred
        now = time.monotonic()
        params = {
            "limit": room,
            "lease": float(self.config.lease),
            "window": room * 4,
            "marked": [item.token.id for item, _ in marked],
            "ages": [now - at for _, at in marked],  # the marks say when the confirms came
        }
        started = time.monotonic()
        if self._wide:
            # Many lanes: the plain claim streams down outbox_due_idx and stops at the limit.
            rows = named.fetch_claimed(conn, self._sql_claim, params)
            self._marked(marked)
            self._wide = len(rows) >= room
        else:
            # Few, deep lanes: the plain claim would probe every waiting row (sql.claim_window).
            rows = named.fetch_claimed(conn, self._sql_claim_window, params)
            self._marked(marked)
            now = time.monotonic()
            if not rows and now >= self._next_full_claim:
                # The window may be all rows waiting behind blocked heads (say, a long
                # backoff): look at the whole table now and then so no lane starves.
                self._next_full_claim = now + float(self.config.poll_interval)
                rows = named.fetch_claimed(conn, self._sql_claim, {**params, "marked": [], "ages": []})
            self._wide = len(rows) >= room
        self._statistics.after_claim(conn, time.monotonic() - started, len(rows), log)
        # A short claim took every due head there is: claiming again is pointless until
        # something changes (a write frees the next heads, NOTIFY, a confirm whose mark
        # may free one, the poll timer). A NOTIFY or such a confirm that came during the
        # claim may be for a row its snapshot missed.
        self._claim_hint = len(rows) >= room or self._notified != notified or self._due != due
        if not rows:
            return 0
        items = self._outgoing(rows)  # in claim order: priority, then creation
        if any(r.expires_at is not None for r in rows):
            items = self._expire(items)
            if not items:
                return len(rows)
        spans = publish_spans(self.settings.service, items)
        for item in items:
            item.on_done = self._done
            if spans is not None:
                self._spans[item.message_id] = spans
        try:
            publisher.submit(items)
        except PublishError as exc:
            for item in items:
                self._end_span(item, exc)
            conn.execute(self._sql_release, {"ids": [r.id for r in rows]})
            return 0
        return len(items)

    def _outgoing(self, rows: list[Claimed]) -> list[Outgoing]:
        """The messages of ``rows``; one that cannot be built goes to the writer as a failure
        it abandons at once, and the others go on (docs/architecture.md, "Dead letters")."""
        items: list[Outgoing] = []
        for row in rows:
            try:
                items.append(outgoing(row, self._user, self._signer))
            except Exception as exc:  # the last resort: one row must not stop the relay
                log.exception("outbox row %s: its message could not be built; dead-lettering it", row.id)
                self._results.append((*unbuildable(row, exc), 0.0))
                self._wake.set()
        return items

    def _expire(self, items: list[Outgoing]) -> list[Outgoing]:
        """The items still to publish; expired ones go to the writer as failures it abandons at once
        (docs/architecture.md, "Expiry and filters")."""
        keep: list[Outgoing] = []
        now = time.time()
        for item in items:
            row: Claimed = item.token
            expires_at = expiry.from_metadata(row.expires_at)
            if expires_at is not None and expiry.passed(expires_at, now):
                error = PublishError(expiry.describe(expires_at, "before the relay published it"), Reason.EXPIRED)
                self._results.append((item, error, 0.0))
            else:
                keep.append(item)
        if len(keep) < len(items):
            self._wake.set()
        return keep

    def _done(self, item: Outgoing, error: PublishError | None) -> None:
        """Completion callback on the publisher's I/O thread: hand over; wake the loop if it
        must act now.

        A confirmed row's mark waits for the next claim (docs/architecture.md, "Wake-ups"),
        unless a row waits behind it in its lane (``has_next`` True, asked at its claim):
        then the loop claims now, and the claim marks it and takes the successor. A row
        written behind it after its claim comes with a NOTIFY, whose claim carries the
        mark if the confirm came first; if not, the next claim takes it (the next NOTIFY,
        or MARK_DELAY at the latest). A row of a large claim (``has_next`` None: not
        asked) goes to the writer as before (see _gather); failures, confirms while
        in-flight room bounds the claims, and every confirm at a trickle (no window, so
        no folding: the writer marks, as before) wake the loop too.
        """
        self._end_span(item, error)
        self._results.append((item, error, time.monotonic()))
        has_next = item.token.has_next
        if error is None and has_next and self._fold:
            self._due += 1
            self._claim_hint = True
            self._wake.set()
        elif error is not None or has_next is None or self._confirm_wakes or not self._fold:
            self._wake.set()

    def _end_span(self, item: Outgoing, error: PublishError | None) -> None:
        spans = self._spans.pop(item.message_id, None)
        if spans is not None:
            failed = relay_outcome(item.token, error) is not RelayOutcome.PUBLISHED
            spans.done(str(error) if failed else None)

    def _gather(self) -> None:
        """Take the outcomes handed over so far: under load, published rows of small claims
        wait for the next claim to mark them (at most FOLD_AT_MOST: more go to the writer,
        as do failures, releases, the rows of large claims, whose successors the writer's
        mark reports, and every mark at a trickle)."""
        fold = self._fold
        while self._results:
            item, error, at = self._results.popleft()
            if fold and error is None and item.token.has_next is not None:
                self._deferred.append((item, at))
            else:
                self._unrecorded.append((item, error))
        if len(self._deferred) > FOLD_AT_MOST:
            self._undefer()

    def _undefer(self) -> None:
        """The marks that wait for a claim go to the writer instead."""
        self._unrecorded[:0] = [(item, None) for item, _ in self._deferred]
        self._deferred = []

    def _marked(self, marked: list[tuple[Outgoing, float]]) -> None:
        """The claim that carried the marks of ``marked`` committed: count them."""
        if not marked:
            return
        self._deferred = []
        published: Tally[str] = Tally(item.token.message_type for item, _ in marked)
        for message_type, n in published.items():
            metrics.PUBLISHER_PUBLISHED.labels(self.settings.service, message_type).inc(n)
        self.published += len(marked)

    def _start_write(self) -> None:
        """Hand the outcomes gathered so far to the writer thread (one batch at a time)."""
        if self._writing is not None or not self._unrecorded:
            return
        batch, self._unrecorded = self._unrecorded, []
        conn = self._write_db.get()
        notified = self._notified
        future = self._writer.submit(self._write, conn, batch)
        future.add_done_callback(lambda done: self._written(done, notified))
        self._writing = (batch, future, notified)

    def _written(self, future: Future[Any], notified: int) -> None:
        """Writer thread, a write done: wake the loop only if it has something to do now: the
        write failed or may have made rows due (see :meth:`_collect_writes`), or outcomes
        wait for the next write. Else the next confirm, NOTIFY or poll collects it: at a
        trickle that saves a wake-up of the loop per message."""
        if (
            future.exception() is not None
            or self._results
            or self._unrecorded
            or self._notified != notified
            or future.result()[3]
            or self.stopping
        ):
            self._wake.set()

    def _collect_writes(self, *, block: bool) -> None:
        """Account a finished write; a failed one goes back to the queue for the next try."""
        if self._writing is None:
            return
        batch, future, notified = self._writing
        if not block and not future.done():
            return
        self._writing = None
        try:
            published, failed, abandoned, unblocked = future.result()
        except BaseException:
            self._unrecorded[:0] = batch
            raise
        for message_type, n in published.items():
            metrics.PUBLISHER_PUBLISHED.labels(self.settings.service, message_type).inc(n)
        for (message_type, reason), n in failed.items():
            metrics.PUBLISHER_FAILED.labels(self.settings.service, message_type, reason).inc(n)
        for message_type, n in abandoned.items():
            metrics.PUBLISHER_ABANDONED.labels(self.settings.service, message_type).inc(n)
        # Claim again only if the write made a row due: a successor of a marked row, a
        # released or abandoned row's lane. A row committed after the mark's snapshot
        # escaped its successor probe, but its NOTIFY came after the write started: a
        # claim that the NOTIFY triggered meanwhile may have found it still blocked.
        if unblocked or self._notified != notified:
            self._claim_hint = True
        self.published += sum(published.values())
        self.failed += sum(failed.values())
        self.abandoned += sum(abandoned.values())

    def _record_now(self) -> None:
        """Write every outcome gathered so far and wait for it (shutdown)."""
        self._collect_writes(block=True)
        while self._results:
            item, error, _ = self._results.popleft()
            self._unrecorded.append((item, error))
        self._undefer()
        self._start_write()
        self._collect_writes(block=True)

    def _write(
        self, conn: psycopg.Connection[Any], batch: list[tuple[Outgoing, PublishError | None]]
    ) -> tuple[Tally[str], Tally[tuple[str, str]], Tally[str], bool]:
        """Writer thread: all outcomes of ``batch`` in one transaction; True at the end when
        that may have made rows due (see :func:`framework.sql.outbox.mark_published`)."""
        published: list[str] = []
        published_types: Tally[str] = Tally()
        failures: list[tuple[Claimed, PublishError]] = []
        released: list[str] = []
        for item, error in batch:
            row: Claimed = item.token
            outcome = relay_outcome(row, error)
            if outcome is RelayOutcome.PUBLISHED:
                published.append(row.id)
                published_types[row.message_type] += 1
            elif outcome is RelayOutcome.FAILED:
                assert error is not None
                failures.append((row, error))
            else:
                released.append(row.id)
        failed: Tally[tuple[str, str]] = Tally()
        abandoned: Tally[str] = Tally()
        unblocked = bool(released or failures)
        if not released and not failures:
            # Only marks, the usual write: one statement, so in autocommit it commits in
            # the round trip that runs it, without a BEGIN and a COMMIT of its own.
            with conn.cursor() as cur:
                return published_types, failed, abandoned, self._mark(cur, published)
        with conn.transaction(), conn.cursor() as cur:
            if published:
                unblocked = self._mark(cur, published) or unblocked
            if released:
                cur.execute(self._sql_release, {"ids": released})
            for row, error in failures:
                failed[(row.message_type, error.reason)] += 1
                if self._fail(cur, row, error):
                    abandoned[row.message_type] += 1
        if failures:
            log.warning("%d publish(es) failed, e.g. %s: %s", len(failures), failures[0][0].id, failures[0][1])
        return published_types, failed, abandoned, unblocked

    def _mark(self, cur: psycopg.Cursor[Any], published: list[str]) -> bool:
        """Mark ``published``; True when that may have made rows due (see
        :func:`framework.sql.outbox.mark_published`)."""
        if not published:
            return False
        probe = len(published) <= named.PROBE_AT_MOST
        cur.execute(self._sql_mark, {"ids": published, "probe": probe})
        return not probe or bool((cur.fetchone() or (False,))[0])

    def _fail(self, cur: psycopg.Cursor[Any], row: Claimed, error: PublishError) -> bool:
        """Count a failed attempt; abandon with a dead letter at ``max_attempts``. True if abandoned."""
        attempt = row.finished_attempts + 1
        text = str(error)
        if error.reason in (Reason.EXPIRED, Reason.INTERNAL_ERROR):  # no attempt would fare better
            return self._abandon(cur, row, error.reason, text, attempt)
        if attempt < self.config.max_attempts:
            delay = backoff_seconds(attempt, base=self.config.retry_base, cap=self.config.retry_cap, jitter=0.5)
            cur.execute(self._sql_retry, {"id": row.id, "delay": delay, "error": text})
            return False
        reason = error.reason if error.reason in (Reason.NACKED, Reason.UNROUTABLE) else Reason.MAX_ATTEMPTS
        return self._abandon(cur, row, reason, f"gave up after {attempt} attempts: {text}", attempt)

    def _abandon(self, cur: psycopg.Cursor[Any], row: Claimed, reason: str, text: str, attempt: int) -> bool:
        """Give the row up with its dead letter. True if abandoned (False: finished elsewhere meanwhile)."""
        cur.execute(self._sql_abandon, {"id": row.id, "error": text})
        if cur.rowcount == 0:
            return False  # finished elsewhere meanwhile
        try:
            message: dict[str, Any] | None = json.loads(envelope_body(row))
        except Exception:  # the row's own columns stay in the outbox: the letter does without
            message = None
        letter = DeadLetter(
            source="outbox",
            reason=reason,
            error=text,
            error_type="PublishError",
            message_id=uuid.UUID(row.id),
            message_type=row.message_type,
            routing_key=row.routing_key,
            message=message,
            headers={"exchange": names.exchange_for(row.kind)},
            attempts={"started": row.started_attempts, "finished": attempt, "max_attempts": self.config.max_attempts},
        )
        cur.execute(self._sql_dead, letter.row())
        return True

    def _gauges(self, conn: psycopg.Connection[Any], publisher: Publisher | None) -> None:
        self._in_flight.set(publisher.in_flight if publisher is not None else 0)
        now = time.monotonic()
        if now < self._next_gauges:
            return
        self._next_gauges = now + self.config.metrics_interval
        # A burst since the last ANALYZE makes the planner pick a slow claim plan (framework/sql/outbox.py).
        self._statistics.refresh(conn.cursor(), now)
        count, age = conn.execute(self._sql_backlog).fetchone() or (0, 0)
        metrics.PUBLISHER_BACKLOG.labels(self.settings.service).set(count)
        metrics.PUBLISHER_OLDEST_DUE_AGE.labels(self.settings.service).set(float(age))

    # ---- broker ----------------------------------------------------------------------

    def _broker(self) -> Publisher | None:
        """The open publisher, reconnecting (with capped backoff) after a lost connection."""
        if self._publisher is not None and self._publisher.is_open:
            return self._publisher
        if self._publisher is not None:
            # Its incomplete sends have failed as connection_lost: record their releases first.
            self._publisher.close(timeout=0)
            self._publisher = None
            self.set_ready(RABBITMQ, False)
            return None
        try:
            self._publisher = Publisher(
                self.settings.amqp_url,
                name=f"{self.settings.service} publisher",
                confirm_timeout=float(self.config.confirm_timeout),
            ).start()
            self._broker_retry.succeeded()
            self.set_ready(RABBITMQ, True)  # the topology was declared before the first connect (run)
            self.state("running")
            return self._publisher
        except BrokerUnavailable as exc:
            self._broker_retry.failed("RabbitMQ", exc)
            return None

    # ---- wake-up ---------------------------------------------------------------------

    def _notice(self) -> None:
        """Rows may have arrived: claim at the next step (listener thread)."""
        self._notified += 1
        self._claim_hint = True
        self._wake.notify()

    # ---- shutdown --------------------------------------------------------------------

    def _drain(self) -> None:
        """Stop claiming; wait (bounded) for outstanding confirms; record; release the rest."""
        publisher = self._publisher
        if publisher is not None:
            outstanding = publisher.in_flight
            self.state("draining", f"{outstanding} confirm(s) outstanding")
            if not publisher.flush(self.config.drain_timeout):
                log.warning("drain timeout: %d confirm(s) still outstanding, releasing them", publisher.in_flight)
            publisher.close(timeout=0)  # what is still incomplete fails as 'closed' → released
            self._publisher = None
        for _ in range(3):
            try:
                self._record_now()
                return
            except (psycopg.Error, DatabaseUnavailable) as exc:
                self._close_db()
                log.warning("could not record outcomes on shutdown (%s); leases will expire instead", exc)
                time.sleep(0.2)
