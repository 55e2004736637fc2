"""The receiver daemon: inbox queue → txbox.inbox, acked only after commit.

The loop collects deliveries for up to ``batch_size`` messages (waiting up to
``batch_wait`` for more only while the previous batch is still being written), parses
and validates them, stores them with one statement and its commit, sent without waiting
on the same thread (:mod:`framework.receiver.write`) while the next batch is being
collected and parsed, and, once that commit is done, acks the batch with one
``basic_ack(multiple=True)``. Three paths leave the happy one:

- bad input is REJECTED into txbox.dead_letters in the same transaction (never raised);
- a redelivered delivery (the previous holder died with it) is counted in
  txbox.redeliveries in its own committed transaction *before* it is touched, and
  handled alone, so one poisonous delivery cannot drag its batch mates to the limit;
- PostgreSQL unavailable: each delivery is republished to the ``delay`` exchange with
  its attempt number and acked only once the broker confirmed the copy; after
  the final attempt the copy goes, confirmed the same way, to ``<service>:dead_letter``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import psycopg
from opentelemetry import trace
from prometheus_client import Counter

from framework import amqp, db, delivery_limit, metrics, names, topology, tracing
from framework import dead_letters as dl
from framework.connections import ConnectionSlot
from framework.daemon import RABBITMQ, Daemon, Reconnect
from framework.envelope import decode_json
from framework.errors import BrokerUnavailable
from framework.reasons import Reason
from framework.receiver.config import ReceiverConfig
from framework.receiver.copies import Copies, Copy
from framework.receiver.intake import (
    Delivery,
    Filtered,
    Intake,
)
from framework.receiver.turns import POLL_SECONDS, ConsumerTurn, Takeover, takeover_seconds
from framework.receiver.write import InboxWrite, prepare
from framework.service import Service
from framework.signing import SigningConfig
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import inbox as inbox_sql
from framework.sql import redeliveries as redeliveries_sql
from framework.sql.inbox import InboxRow

_IDLE_WAIT = 0.2  # seconds of an empty wait before the loop looks at ``stopping`` again
_INSERT_NAME = b"txbox_receiver_insert"  # the batch INSERT, prepared once per connection (write.prepare)
_DRAIN_SECONDS = 5.0  # at most this long, on the way out, for copies still waiting for their confirm


def _nothing() -> None:
    pass


@dataclass
class _Prepared:
    pairs: list[tuple[Delivery, InboxRow]]
    letters: list[tuple[Delivery, dl.DeadLetter]]
    settled_keys: list[str]
    spans: list[trace.Span]  # the batch's store spans, linked to its deliveries' contexts; none if not recording


@dataclass(eq=False)
class _Inflight:
    """A batch being written: sent without waiting (``write``), or written already with its outcome (``error``)."""

    batch: list[Delivery]
    prepared: _Prepared
    write: InboxWrite | None = None
    error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.write is None or self.write.done


def _end(spans: Sequence[trace.Span], exc: BaseException | None = None) -> None:
    """End a batch's spans, marked failed by ``exc`` if given."""
    for span in spans:
        if exc is not None:
            tracing.failed(span, exc)
        span.end()


class Receiver(Daemon):
    """``Receiver(service, config).run()`` until :meth:`stop` (or SIGTERM via the CLI)."""

    name = "receiver"

    def __init__(
        self, service: Service, config: ReceiverConfig | None = None, *, stop_event: threading.Event | None = None
    ) -> None:
        super().__init__(service, stop_event=stop_event)
        self.config = config or ReceiverConfig.from_env()
        self.queue = names.inbox_queue(self.settings.service)
        self.intake = Intake(
            service.registry,
            self.settings.service,
            max_body_bytes=self.config.max_body_bytes,
            selectors=service.selectors,
            # A bad key or policy fails here, at start; fetched keys are fetched once here.
            verifier=SigningConfig.from_env().verifier(
                {s.service for s in service.registry.accepted_types(self.settings.service) if s.kind == "event"}
            ),
        )
        self._schedule = self.config.schedule
        self._db = ConnectionSlot(
            self.settings.database_url,
            connect_timeout=self.config.db_connect_timeout,
            application_name="txbox-receiver",
        )
        self._buffer: list[Delivery] = []
        self._insert_prepared_on: psycopg.Connection[Any] | None = None  # the connection it was prepared on
        self._labels = {"service": self.settings.service}
        # The children counted per batch or delivery, looked up once.
        self._received = metrics.RECEIVER_RECEIVED.labels(**self._labels)
        self._stored = metrics.RECEIVER_STORED.labels(**self._labels)
        self._peak_held = metrics.RECEIVER_PEAK_HELD.labels(**self._labels)
        self._user = amqp.username(self.settings.amqp_url)
        self._trusted = self.config.trusted(self._user)
        # Bytes of the bodies held unacked: collected (``_buffered``) and being written
        # (``_writing``). Past ``max_unacked_bytes`` the loop stops reading from the
        # socket, so RabbitMQ's sends back up into TCP instead of into our memory.
        self._buffered = 0
        self._writing = 0
        self.peak_held_bytes = 0
        # Deliveries still to take one at a time after a lost connection (see _consume).
        self._careful = 0
        self._limit_checked = False
        # The one consuming replica per inbox queue (docs/explanation/operations.md, "Replicas of every daemon").
        self._turn = (
            ConsumerTurn(
                self.settings.database_url, self.settings.service, connect_timeout=self.config.db_connect_timeout
            )
            if self.config.standby
            else None
        )
        self._takeover = Takeover(
            takeover_seconds(
                connect_timeout=self.config.db_connect_timeout,
                drain_seconds=_DRAIN_SECONDS,
                heartbeat_seconds=amqp.HEARTBEAT_SECONDS,
            )
        )
        # What the receiver waits for instead of consuming, and since when (monotonic): /readyz.
        self._waiting: tuple[str, str, float] | None = None
        self.consuming = False  # between basic_consume and leaving it: for tests and logs
        self._copies = Copies(
            self.settings.amqp_url,
            name=f"{self.settings.service} receiver copies",
            max_unconfirmed=self.config.prefetch,
            on_blocked=self._publishing_blocked,
        )
        self._blocked_since: float | None = None  # publishing blocked by a broker alarm since
        metrics.RECEIVER_PUBLISHING_BLOCKED.labels(**self._labels).set_function(self._blocked_seconds)
        metrics.RECEIVER_COPIES_WAITING.labels(**self._labels).set_function(lambda: len(self._copies.waiting))
        self._standing_down = False  # another replica took the turn: stop consuming (_our_turn)

    # --- the loop -----------------------------------------------------------------

    def run(self) -> None:
        reconnect = Reconnect(self)
        try:
            while not self.stopping:
                self.progress()
                try:
                    self._consume(reconnect)
                except BrokerUnavailable as exc:
                    self._careful = self.config.prefetch
                    if self._turn is not None:
                        # A replica that still reaches the broker may consume meanwhile;
                        # a turn taken again later waits for its consumer afresh.
                        self._turn.release()
                        self._takeover.reset()
                    if reconnect.failed("RabbitMQ", exc):
                        break
        finally:
            self._drop_db()
            if self._turn is not None:
                self._turn.release()
            self.state("stopped")

    def _consume(self, reconnect: Reconnect) -> None:
        connection = amqp.connect(self.settings.amqp_url, name=f"{self.settings.service} receiver")
        try:
            with amqp.broker_errors("receiving"):
                channel = connection.channel()
                topology.declare(self.settings, self.service.registry, channel)
                self._declare_extra_delays(channel)
                self._ensure_delivery_limit()
                # Copies go on a connection of their own: a broker that blocks publishers
                # (a memory or disk alarm) keeps delivering to this one (docs/explanation/receive.md,
                # "Publishing blocked by the broker").
                self._copies.begin(connection, channel)
                careful = self._careful > 0
                channel.basic_qos(prefetch_count=1 if careful else self.config.prefetch)
                reconnect.succeeded()
                self.set_ready(RABBITMQ, True)  # a standby is ready: standing by is its job
                if not self._await_turn(connection, channel):
                    return
                tag = channel.basic_consume(self.queue, self._on_delivery)
                self.consuming = True
                self.state("consuming", self.queue)
                self._loop(connection, channel, careful=careful)
                if careful and not self.stopping and self._our_turn():
                    # The deliveries held when the connection was lost are settled: full speed.
                    channel.basic_cancel(tag)
                    channel.basic_qos(prefetch_count=self.config.prefetch)
                    tag = channel.basic_consume(self.queue, self._on_delivery)
                    self._loop(connection, channel, careful=False)
                self._copies.drain(_DRAIN_SECONDS)
                # Undispatched deliveries are nacked (requeued) by pika on cancel.
                channel.basic_cancel(tag)
        finally:
            self.consuming = False
            self._waiting = None  # not waiting for a turn: for the broker (readiness says so)
            self.set_ready(RABBITMQ, False)
            self._buffer = []  # unacked: the broker requeues them when the channel closes
            self._buffered = self._writing = 0
            self._copies.close()
            amqp.close_quietly(connection)

    def _ensure_delivery_limit(self) -> None:
        """Once per process: the broker's last net under this receiver (framework.delivery_limit)."""
        if self._limit_checked:
            return
        self._limit_checked = True
        outcome = delivery_limit.ensure(self.settings)
        if outcome.held:
            self.log.info("%s", outcome.message)
        else:
            self.log.warning("%s", outcome.message)

    def _await_turn(self, connection: pika.BlockingConnection, channel: Any) -> bool:
        """Stand by until this replica holds the turn and may start (framework.receiver.turns).

        Holding the turn, it waits while the broker counts another consumer, for at most
        the takeover bound: a holder whose session was lost while its consumer still held
        deliveries must have them requeued before anything later is stored, but the
        consumer of a node that died stays counted until that node returns, perhaps never
        (docs/explanation/operations.md, "A RabbitMQ cluster"). Returns False when stopped meanwhile.
        """
        if self._turn is None:
            others = channel.queue_declare(self.queue, passive=True).method.consumer_count
            if others:
                self.log.warning(
                    "%d other consumer(s) on %s and TXBOX_RECEIVER_STANDBY=false: messages of one sequential "
                    "segment may be stored, and handled, out of order",
                    others,
                    self.queue,
                )
            return True
        while not self.stopping:
            self.progress()
            try:
                held: bool | None = self._turn.check()
            except Exception as exc:
                if not db.is_infrastructure_error(exc):
                    raise
                held = None  # unknown: the database cannot be reached
            if held is not False:
                # Held, or the database cannot be reached: a replica that can take the
                # turn must still wait for our consumer to leave, and ours keeps the retry
                # chain going until it can check the turn (_our_turn).
                others = channel.queue_declare(self.queue, passive=True).method.consumer_count
                if held:
                    start = self._takeover.ready(others)
                else:
                    self._takeover.reset()  # the broker's count is the only guard: no bound
                    start = not others
                if start:
                    if others:
                        self.log.warning(
                            "taking over %s after %.0fs although RabbitMQ still counts %d other consumer(s): a "
                            "receiver that lost its turn stops within that time, so they are consumers of a lost "
                            "node (their deliveries were requeued when it went) or not txbox receivers",
                            self.queue,
                            self._takeover.waited(),
                            others,
                        )
                    self._takeover.reset()
                    self._standing_down = False
                    self._waiting = None
                    return True
                state, detail = (
                    ("taking over", f"{others} other consumer(s) on {self.queue}; waiting at most "
                                    f"{self._takeover.bound:.0f}s for them to leave")
                    if held
                    else ("standby", f"{others} other consumer(s) on {self.queue}; the turn cannot be checked")
                )  # fmt: skip
            else:
                self._takeover.reset()
                state, detail = "standby", f"another receiver consumes {self.queue}"
            self._wait_for(state, detail)
            connection.process_data_events(time_limit=POLL_SECONDS)  # keeps the broker connection alive
        return False

    def _wait_for(self, state: str, detail: str) -> None:
        """Log the state once; keep when this wait began for :meth:`waiting`."""
        self.state(state, detail)
        if self._waiting is None or self._waiting[0] != state:
            self._waiting = (state, detail, time.monotonic())
        else:
            self._waiting = (state, detail, self._waiting[2])

    def waiting(self) -> dict[str, Any] | None:
        """What the receiver waits for instead of consuming (its turn on ``queue``), and for how
        long; None while consuming. Any thread may call it: it reads one snapshot."""
        waiting = self._waiting
        if waiting is None:
            return None
        state, detail, since = waiting
        return {"state": state, "detail": detail, "queue": self.queue, "seconds": round(time.monotonic() - since, 3)}

    def _our_turn(self) -> bool:
        """While consuming: False once another replica took the turn (checked every POLL_SECONDS),
        and from then on until :meth:`_await_turn` gets it back."""
        if self._turn is not None and not self._standing_down and self._turn.due() and not self._turn.still_held():
            self._standing_down = True
            self.state("standing down", f"another receiver took over {self.queue}")
        return not self._standing_down

    def _loop(self, connection: pika.BlockingConnection, channel: Any, *, careful: bool) -> None:
        """Consume and settle until stopped; batch N is written while batch N+1 is collected.

        ``careful`` (prefetch 1), after a lost connection, until ``prefetch`` deliveries
        are settled: a delivery that kills the connection itself (one pika cannot even
        decode) then comes back alone, so RabbitMQ's delivery limit (docs/explanation/receive.md,
        "Receiver intake") counts it, not the innocent deliveries prefetched beside it.

        One thread does it all (docs/explanation/daemons.md, "The daemons and their threads"): a
        batch's INSERT, its commit included, is sent without waiting (:class:`InboxWrite`) and the
        database socket is watched on the broker connection's own I/O loop, so the wait
        for more deliveries ends as soon as the commit is in. Batch N is acked once its
        commit is done and before batch N+1 is sent, so acks still follow commits in order.
        """
        inflight: _Inflight | None = None
        try:
            while not self.stopping and not (careful and self._careful <= 0) and self._our_turn():
                self.progress()  # _fill returns at least every _IDLE_WAIT
                self._copies.flush()  # copies whose publishing connection was lost go again
                self._fill(connection, busy=inflight)
                if not self._buffer:
                    if inflight is not None:
                        self._finish(inflight, channel)
                        inflight = None
                    continue
                batch, self._buffer = self._buffer, []
                batch_bytes, self._buffered = self._buffered, 0
                self._received.inc(len(batch))
                if any(d.redelivered for d in batch):
                    if inflight is not None:
                        self._finish(inflight, channel)
                        inflight = None
                    # Someone died holding these: take them one by one so the one that
                    # kills us is the only one whose counter climbs.
                    self._writing = batch_bytes
                    for delivery in batch:
                        self._settle_group([delivery], channel)
                    self._writing = 0
                    continue
                try:
                    prepared = self._admit(batch, {})
                except Exception:  # last resort: a bug of ours; each delivery alone, in order
                    self.log.exception("admitting a batch of %d failed: settling them one by one", len(batch))
                    if inflight is not None:
                        self._finish(inflight, channel)
                        inflight = None
                    for delivery in batch:
                        self._settle_group([delivery], channel)
                    continue
                if inflight is not None:
                    self._finish(inflight, channel)
                self._writing = batch_bytes
                inflight = self._send(connection, batch, prepared)
            if inflight is not None:
                self._finish(inflight, channel)
                inflight = None
        finally:
            if inflight is not None and inflight.write is not None and not inflight.write.done:
                # Left mid-write (the broker connection failed): its commit's outcome is
                # unknown, so the connection goes; the batch is redelivered, and deduped.
                inflight.write.unwatch()
                _end(inflight.prepared.spans)
                self._drop_db()

    def _send(self, connection: pika.BlockingConnection, batch: list[Delivery], prepared: _Prepared) -> _Inflight:
        """Start writing ``prepared``: sent without waiting when it is only rows (the usual
        batch), else written at once the ordinary way (dead letters, counters, a batch too large)."""
        rows = [row for _, row in prepared.pairs]
        inflight = _Inflight(batch, prepared)
        if not rows or prepared.letters or prepared.settled_keys:
            inflight.error = self._write_now(prepared)
            return inflight
        try:
            text = inbox_sql.batch_json(rows).encode()
        except Exception:  # a string no UTF-8 encoder takes: the careful way finds it
            inflight.error = self._write_now(prepared)
            return inflight
        if len(text) > inbox_sql.MAX_BATCH_CHARS:
            inflight.error = self._write_now(prepared)
            return inflight
        try:
            conn = self._connection()
        except Exception as exc:
            _end(prepared.spans, exc)
            inflight.error = exc
            return inflight
        try:
            if self._insert_prepared_on is not conn:
                prepare(conn, _INSERT_NAME, inbox_sql.insert_all_new_sql(self.settings.schema))
                self._insert_prepared_on = conn
        except Exception as exc:
            self._drop_db()
            _end(prepared.spans, exc)
            inflight.error = exc
            return inflight
        # Its end wakes the loop's wait on the broker connection (a timer due at once
        # ends process_data_events), so the batch's ack is never late.
        write = InboxWrite(
            conn,
            _INSERT_NAME,
            [text, str(len(rows)).encode()],
            on_done=functools.partial(connection.call_later, 0, _nothing),
        )
        inflight.write = write
        try:
            write.send()
            if not write.done:
                write.watch(amqp.ioloop(connection))
        except Exception as exc:  # a bug of ours: the batch is rescued (_finish), the connection dropped
            write.unwatch()
            self._drop_db()
            _end(prepared.spans, exc)
            inflight.write, inflight.error = None, exc
        return inflight

    def _write_now(self, prepared: _Prepared) -> Exception | None:
        """:meth:`_write` on this thread; its failure returned, for :meth:`_finish`."""
        try:
            self._write(prepared)
        except Exception as exc:
            return exc
        return None

    def _finish(self, inflight: _Inflight, channel: Any) -> None:
        batch = inflight.batch
        try:
            if inflight.write is not None:
                self._complete(inflight.prepared, inflight.write)
            elif inflight.error is not None:
                raise inflight.error
        except Exception as exc:
            self._writing = 0
            if not db.is_infrastructure_error(exc):
                self._rescue(batch, exc, channel)
                return
            self._database_down(exc)
            self._retry_later(batch)
            return
        self._writing = 0
        self._careful -= len(batch)
        self.state("consuming", self.queue)
        self._copies.ack(batch)

    def _complete(self, prepared: _Prepared, write: InboxWrite) -> None:
        """Wait for the write if it is not over yet, then settle it: committed (the usual
        batch), or refused and written again the ordinary way (:meth:`_write`), which
        letters the conflicts of a duplicate id, or finds the rows PostgreSQL refuses."""
        write.wait()
        write.unwatch()
        if write.error is not None:
            self._drop_db()  # mid-protocol: the connection cannot be used again
            if db.is_infrastructure_error(write.error):
                _end(prepared.spans, write.error)
                raise write.error
            self._write(prepared)  # on a fresh connection
            return
        if write.refused is not None:
            self._write(prepared)
            return
        _end(prepared.spans)
        rows = [row for _, row in prepared.pairs]
        self._count(rows, {row.id for row in rows}, [])

    def _database_down(self, exc: BaseException) -> None:
        self._drop_db()
        self.state("database unavailable", f"{exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__)

    def _on_delivery(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        self._buffer.append(Delivery.from_pika(method, props, body, self._trusted))
        self._buffered += len(body)
        held = self._buffered + self._writing
        if held > self.peak_held_bytes:
            self.peak_held_bytes = held
            self._peak_held.set(held)

    def _full(self) -> bool:
        """Holding as many deliveries, or body bytes, as allowed unacked: read no more for now."""
        return (
            len(self._buffer) >= self.config.batch_size
            or self._buffered + self._writing >= self.config.max_unacked_bytes
        )

    def _fill(self, connection: pika.BlockingConnection, busy: _Inflight | None) -> None:
        """Collect deliveries until a full batch, a free database, ``batch_wait`` after the first, or a stop.

        Group commit: while the previous batch is being written (``busy``), deliveries
        gather for the next one; once the database is free, what has arrived goes at
        once. A quiet receiver adds no batching delay to a message's latency, a busy one
        gets batches as large as a write takes. Every wait returns early on a delivery or
        on the end of the write (:meth:`_send`), so the write's ack is never late.
        """
        deadline: float | None = None
        while not self._full() and not self.stopping:
            if deadline is None:
                connection.process_data_events(time_limit=_IDLE_WAIT)
                if not self._buffer:
                    return
                deadline = time.monotonic() + self.config.batch_wait
                continue
            if busy is None or busy.done:
                connection.process_data_events(time_limit=0)  # what has arrived meanwhile
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            connection.process_data_events(time_limit=remaining)

    def _declare_extra_delays(self, channel: Any) -> None:
        """Delay queues of a non-standard schedule, shaped exactly like topology's ones."""
        for seconds in self.config.extra_delays:
            topology.declare_queue(channel, topology.delay_queue(seconds), self.settings)

    # --- settling a batch -----------------------------------------------------------

    def _settle_group(self, group: list[Delivery], channel: Any) -> None:
        try:
            forced = self._count_redeliveries(group)
            self._store(group, forced)
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                self._rescue(group, exc, channel)
                return
            self._database_down(exc)
            self._retry_later(group)
            return
        self._careful -= len(group)
        self.state("consuming", self.queue)
        self._copies.ack(group)

    def _count_redeliveries(self, group: Sequence[Delivery]) -> dict[int, dl.DeadLetter]:
        """Count redeliveries in their own committed transaction; dead letters for those past the limit."""
        forced: dict[int, dl.DeadLetter] = {}
        redelivered = [d for d in group if d.redelivered]
        if not redelivered:
            return forced
        metrics.RECEIVER_REDELIVERED.labels(**self._labels).inc(len(redelivered))
        conn = self._connection()
        with conn.cursor() as cur:
            counts = {
                d.delivery_tag: redeliveries_sql.count(cur, self.settings.schema, self.queue, d.counter_key)
                for d in redelivered
            }
        conn.commit()
        for delivery in redelivered:
            count = counts[delivery.delivery_tag]
            if count > self.config.redelivery_limit:
                forced[delivery.delivery_tag] = self._redelivery_letter(delivery, count)
        return forced

    def _redelivery_letter(self, delivery: Delivery, count: int) -> dl.DeadLetter:
        error = (
            f"redelivered {count} times (limit {self.config.redelivery_limit}): the receiver died holding it each time"
        )
        try:
            data: Any = decode_json(delivery.body)
        except Exception:  # whatever it is, it is dead: keep the raw body only
            data = None
        try:
            return self.intake.reject(delivery, Reason.REDELIVERY_LIMIT, error, data=data)
        except Exception:
            letter = self.intake.last_resort(delivery, error)
            letter.reason = letter.error_type = Reason.REDELIVERY_LIMIT
            return letter

    def _store(self, group: Sequence[Delivery], forced: dict[int, dl.DeadLetter]) -> None:
        self._write(self._admit(group, forced))

    def _admit(self, group: Sequence[Delivery], forced: dict[int, dl.DeadLetter]) -> _Prepared:
        """Parse and validate (CPU only, no database): rows to store and dead letters."""
        pairs: list[tuple[Delivery, InboxRow]] = []
        letters: list[tuple[Delivery, dl.DeadLetter]] = []
        for delivery in group:
            # The sender's context, bounded, is what the handler continues (the worker
            # parses it) and what the store spans link (docs/explanation/operations.md, "Tracing").
            delivery.trace = tracing.carrier_from(delivery.headers) or None
        spans = self._store_spans(group)
        try:
            for delivery in group:
                outcome = forced.get(delivery.delivery_tag) or self.intake.admit(delivery)
                if isinstance(outcome, InboxRow):
                    pairs.append((delivery, outcome))
                elif isinstance(outcome, Filtered):
                    # Not for this service: acked with its batch, never stored (docs/explanation/receive.md,
                    # "Expiry and filters").
                    metrics.RECEIVER_FILTERED.labels(message_type=outcome.message_type, **self._labels).inc()
                else:
                    letters.append((delivery, outcome))
        except BaseException as exc:
            _end(spans, exc)
            raise
        if letters:
            for span in spans:
                span.set_attribute("txbox.rejected", len(letters))
        return _Prepared(pairs, letters, [d.counter_key for d in group if d.redelivered], spans)

    def _store_spans(self, group: Sequence[Delivery]) -> list[trace.Span]:
        """The CONSUMER spans of one batch (parsing and its one write), linked to the context
        of every delivery, ours or a foreign publisher's (docs/explanation/operations.md, "Tracing")."""
        return tracing.batch_spans(
            f"store {self.queue}",
            trace.SpanKind.CONSUMER,
            {
                "messaging.system": tracing.MESSAGING_SYSTEM,
                "messaging.operation.type": "receive",
                "messaging.destination.name": self.queue,
                "messaging.batch.message_count": len(group),
            },
            (delivery.trace for delivery in group),
        )

    def _write(self, prepared: _Prepared) -> None:
        """One statement for the rows, one for the dead letters, one for the counters; one commit.

        A message id that was already stored is compared with what is stored only then
        (one more statement, for those ids alone): a true duplicate is quiet, a different
        message under that id is an ``id_conflict`` letter.
        """
        if not prepared.spans:
            self._write_batch(prepared)
            return
        try:
            with trace.use_span(prepared.spans[0], record_exception=False, set_status_on_exception=False):
                self._write_batch(prepared)
        except BaseException as exc:
            _end(prepared.spans, exc)
            raise
        _end(prepared.spans)

    def _write_batch(self, prepared: _Prepared) -> None:
        pairs, settled_keys = prepared.pairs, prepared.settled_keys
        rows = [row for _, row in pairs]
        schema = self.settings.schema
        conn = self._connection()
        try:
            with conn.cursor() as cur:
                new = inbox_sql.insert_rows(cur, schema, rows)
                letters = prepared.letters + self._conflicts(cur, pairs, new)
                dead_letters_sql.insert_letters(cur, schema, [letter for _, letter in letters])
                redeliveries_sql.forget(cur, schema, self.queue, settled_keys)
            conn.commit()
        except Exception as exc:  # psycopg's, or a dead letter that cannot be built
            conn.rollback()
            if db.is_infrastructure_error(exc):
                raise
            # Something in the data (e.g. \u0000 inside a JSON string, which jsonb
            # refuses): find the culprits one savepoint at a time.
            new, letters = self._store_carefully(conn, prepared)
        self._count(rows, new, [letter for _, letter in letters])

    def _conflicts(
        self, cur: psycopg.Cursor[Any], pairs: Sequence[tuple[Delivery, InboxRow]], new: set[Any]
    ) -> list[tuple[Delivery, dl.DeadLetter]]:
        """``id_conflict`` letters for the rows whose id the inbox holds with other content."""
        rows = [row for _, row in pairs]
        letters = []
        for index, stored in inbox_sql.conflicting(cur, self.settings.schema, rows, new):
            delivery, row = pairs[index]
            try:
                data: Any = decode_json(delivery.body)
            except Exception:
                data = None
            letter = self.intake.reject(
                delivery,
                Reason.ID_CONFLICT,
                f"message id {row.id} is already in the inbox with other content ({stored}): "
                "a different message reusing an id is not a duplicate",
                data=data,
            )
            letter.message_id, letter.message_type = row.id, row.message_type
            letters.append((delivery, letter))
        return letters

    def _store_carefully(
        self, conn: psycopg.Connection[Any], prepared: _Prepared
    ) -> tuple[set[Any], list[tuple[Delivery, dl.DeadLetter]]]:
        """Each row, then each dead letter, in a savepoint of its own: one bad item cannot fail the rest."""
        schema = self.settings.schema
        new: set[Any] = set()
        letters = list(prepared.letters)
        kept: list[tuple[Delivery, InboxRow]] = []
        with conn.cursor() as cur:
            for delivery, row in prepared.pairs:
                try:
                    with conn.transaction():
                        new |= inbox_sql.insert_rows(cur, schema, [row])
                    kept.append((delivery, row))
                except Exception as exc:
                    if db.is_infrastructure_error(exc):
                        raise
                    letter = self.intake.reject(
                        delivery,
                        Reason.UNSTORABLE,
                        f"PostgreSQL refused the row: {exc}".strip(),
                        error_type=type(exc).__name__,
                    )
                    letter.message_id, letter.message_type = row.id, row.message_type
                    letters.append((delivery, letter))
            letters += self._conflicts(cur, kept, new)
            letters = [(delivery, self._insert_letter(conn, cur, delivery, letter)) for delivery, letter in letters]
            redeliveries_sql.forget(cur, schema, self.queue, prepared.settled_keys)
        conn.commit()
        return new, letters

    def _insert_letter(
        self, conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any], delivery: Delivery, letter: dl.DeadLetter
    ) -> dl.DeadLetter:
        """Store ``letter``; if it cannot be, an ``internal_error`` letter of the raw delivery instead."""
        try:
            with conn.transaction():
                dead_letters_sql.insert_letters(cur, self.settings.schema, [letter])
            return letter
        except Exception as exc:
            if db.is_infrastructure_error(exc):
                raise
            fallback = self.intake.last_resort(delivery, f"the {letter.reason} dead letter could not be stored: {exc}")
            with conn.transaction():
                dead_letters_sql.insert_letters(cur, self.settings.schema, [fallback])
            return fallback

    def _count(self, rows: Sequence[InboxRow], new: set[Any], letters: Sequence[dl.DeadLetter]) -> None:
        self._stored.inc(len(new))
        conflicts = sum(1 for letter in letters if letter.reason == Reason.ID_CONFLICT)
        if len(rows) > len(new) + conflicts:
            metrics.RECEIVER_DUPLICATES.labels(**self._labels).inc(len(rows) - len(new) - conflicts)
        if conflicts:
            metrics.RECEIVER_ID_CONFLICTS.labels(**self._labels).inc(conflicts)
        for letter in letters:
            metrics.RECEIVER_REJECTED.labels(reason=letter.reason, **self._labels).inc()
            if letter.reason != Reason.UNSTORABLE:
                self.log.warning("rejected a delivery (%s): %s", letter.reason, letter.error[:300])

    # --- last resort: the settling itself failed ----------------------------------------

    def _rescue(self, group: Sequence[Delivery], exc: BaseException, channel: Any) -> None:
        """A bug of ours failed a whole group: dead-letter each delivery as ``internal_error`` and go on.

        Each one in a transaction of its own, from the raw delivery alone; if even that
        fails, a copy goes to ``<service>:dead_letter`` (the collector stores it).
        """
        self.log.error(
            "settling %d deliveries failed (%r): dead-lettering them as %s", len(group), exc, Reason.INTERNAL_ERROR
        )
        schema = self.settings.schema
        for index, delivery in enumerate(group):
            letter = self.intake.last_resort(delivery, exc)
            try:
                conn = self._connection()
                conn.rollback()
                with conn.cursor() as cur:
                    dead_letters_sql.insert_letters(cur, schema, [letter])
                    if delivery.redelivered:
                        redeliveries_sql.forget(cur, schema, self.queue, [delivery.counter_key])
                conn.commit()
            except Exception as failure:
                if db.is_infrastructure_error(failure):
                    # The database went away: the rest wait in the delay chain, untried.
                    self._database_down(failure)
                    self._retry_later(group[index:])
                    return
                else:
                    self._drop_db()
                    self._give_up(delivery, Reason.INTERNAL_ERROR, letter.error)
                continue
            metrics.RECEIVER_REJECTED.labels(reason=Reason.INTERNAL_ERROR, **self._labels).inc()
            channel.basic_ack(delivery.delivery_tag)

    # --- PostgreSQL down: the delay/retry chain ---------------------------

    def _retry_later(self, group: Sequence[Delivery]) -> None:
        """Park each delivery in a delay queue, or give it up to ``<service>:dead_letter``.

        Either way a copy is published with a confirm and only then is the delivery
        acked. The last step used to be ``basic_reject`` into the inbox queue's
        dead-letter exchange, but broker dead-lettering is at most once: a letter whose
        target queue had no leader at that instant (say, just after a broker restart)
        was dropped.
        """
        service = self.settings.service
        for delivery in group:
            if delivery.final_attempt:
                self._give_up(
                    delivery,
                    Reason.RETRIES_EXHAUSTED,
                    f"the receiver could not store it through the whole delay/retry chain "
                    f"(attempt {delivery.attempt}): the database stayed unavailable",
                )
                continue
            headers = self._copied_headers(delivery)
            retries_done = delivery.attempt - 1
            final = retries_done >= len(self._schedule)
            delay = self._schedule[min(retries_done, len(self._schedule) - 1)]
            headers[names.HEADER_ATTEMPT] = delivery.attempt + 1
            if final:
                headers[names.HEADER_FINAL_ATTEMPT] = True
            headers["CC"] = [names.retry_routing_key(service, delivery.original_routing_key(service))]
            self._publish_copy(
                delivery, names.DELAY_EXCHANGE, names.delay_routing_key(delay), headers, metrics.RECEIVER_DELAYED
            )

    def _give_up(self, delivery: Delivery, reason: str, error: str) -> None:
        """A confirmed copy to ``<service>:dead_letter`` with our reason headers, then the ack."""
        headers = self._copied_headers(delivery)
        headers[names.HEADER_DEAD_REASON] = reason
        headers[names.HEADER_DEAD_ERROR] = error
        key = names.dead_letter_routing_key(self.settings.service)
        self._publish_copy(delivery, names.DEAD_LETTER_EXCHANGE, key, headers, metrics.RECEIVER_GAVE_UP)

    def _copied_headers(self, delivery: Delivery) -> dict[str, Any]:
        """Headers of a copy we publish: our ``user_id`` vouches for it, so a stranger's control headers go.

        So do a stranger's death headers: the broker dead-letters our copy (the delay
        queue's TTL) and RabbitMQ 3.10 chokes on malformed ones, which stops every
        at-least-once queue of the node from dead-lettering. Those of our own chain are
        the broker's.
        """
        headers = amqp.encodable_headers(delivery.headers)
        if not delivery.trusted:
            for name in (*names.CONTROL_HEADERS, *names.BROKER_DEATH_HEADERS):
                headers.pop(name, None)
        return headers

    def _publish_copy(
        self, delivery: Delivery, exchange: str, key: str, headers: dict[str, Any], confirmed: Counter
    ) -> None:
        """Publish a copy on the publishing connection; the delivery is acked once the broker
        confirmed the copy (``confirmed`` counts it then), requeued if no queue takes it."""
        props = pika.BasicProperties(
            delivery_mode=2,
            headers=headers,
            user_id=self._user,
            **{k: delivery.properties[k] for k in names.REPUBLISHED_PROPERTIES if k in delivery.properties},
        )
        self._copies.send(Copy(delivery, exchange, key, props, on_confirmed=confirmed.labels(**self._labels).inc))

    def _publishing_blocked(self, reason: str | None) -> None:
        """On the publisher's I/O thread: RabbitMQ blocked (``reason``) or unblocked (None) our copies."""
        self._blocked_since = None if reason is None else time.monotonic()

    def _blocked_seconds(self) -> float:
        since = self._blocked_since
        return 0.0 if since is None else time.monotonic() - since

    # --- PostgreSQL connection ----------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        return self._db.get()

    def _drop_db(self) -> None:
        self._db.close()
