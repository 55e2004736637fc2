"""The receiver daemon: inbox queue → txbox.inbox, acked only after commit (DESIGN §6).

The loop collects deliveries for up to ``batch_size`` messages (waiting up to
``batch_wait`` for more only while the previous batch is still being written), parses
and validates them, stores them with one statement and one commit on a database thread
— while the next batch is being collected and parsed — and, once that commit is done,
acks the batch with one ``basic_ack(multiple=True)``. Three paths leave the happy one:

- bad input is REJECTED into txbox.dead_letters in the same transaction (never raised);
- a redelivered delivery (the previous holder died with it) is counted in
  txbox.redeliveries in its own committed transaction *before* it is touched, and
  handled alone, so one poisonous delivery cannot drag its batch mates to the limit;
- PostgreSQL unavailable: each delivery is republished to the ``delay`` exchange with
  its attempt number and acked only once the broker confirmed the copy (DESIGN §5); after
  the final attempt the copy goes, confirmed the same way, to ``<service>:dead_letter``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import psycopg

from framework import amqp, db, names, topology
from framework import dead_letters as dl
from framework.daemon import Daemon, Reconnect
from framework.envelope import decode_json
from framework.errors import BrokerUnavailable
from framework.receiver import metrics, store
from framework.receiver.config import ReceiverConfig
from framework.receiver.intake import UNSTORABLE, Delivery, InboxRow, Intake
from framework.service import Service

_REPUBLISHED_PROPERTIES = (
    "content_type",
    "content_encoding",
    "priority",
    "correlation_id",
    "reply_to",
    "message_id",
    "timestamp",
    "type",
    "app_id",
)


_IDLE_WAIT = 0.2  # seconds of an empty wait before the loop looks at ``stopping`` again


def _wake(connection: pika.BlockingConnection, _write: Future[None]) -> None:
    """Done callback of a write, on the database thread: ends the consuming thread's wait."""
    with contextlib.suppress(pika.exceptions.ConnectionWrongStateError):  # closed meanwhile
        connection.add_callback_threadsafe(_nothing)


def _nothing() -> None:
    pass


@dataclass
class _Prepared:
    pairs: list[tuple[Delivery, InboxRow]]
    letters: list[dl.DeadLetter]
    settled_keys: list[str]


class Receiver(Daemon):
    """``Receiver(service, config).run()`` until :meth:`stop` (or SIGTERM via the CLI)."""

    name = "receiver"

    def __init__(self, service: Service, config: ReceiverConfig | None = None) -> None:
        super().__init__()
        self.service = service
        self.settings = service.settings
        self.config = config or ReceiverConfig.from_env()
        self.queue = names.inbox_queue(self.settings.service)
        self.intake = Intake(service.registry, self.settings.service, max_body_bytes=self.config.max_body_bytes)
        self._schedule = self.config.schedule
        self._db: psycopg.Connection[Any] | None = None
        self._buffer: list[Delivery] = []
        self._labels = {"service": self.settings.service}

    # --- the loop -----------------------------------------------------------------

    def run(self) -> None:
        reconnect = Reconnect(self)
        try:
            while not self.stopping:
                try:
                    self._consume(reconnect)
                except BrokerUnavailable as exc:
                    if reconnect.failed("RabbitMQ", exc):
                        break
        finally:
            self._drop_db()
            self.state("stopped")

    def _consume(self, reconnect: Reconnect) -> None:
        connection = amqp.connect(self.settings.amqp_url, name=f"{self.settings.service} receiver")
        try:
            with amqp.broker_errors("receiving"):
                channel = connection.channel()
                topology.declare(self.settings, self.service.registry, channel)
                self._declare_extra_delays(channel)
                publish_channel = connection.channel()
                publish_channel.confirm_delivery()
                channel.basic_qos(prefetch_count=self.config.prefetch)
                self._warn_if_not_alone(channel)
                tag = channel.basic_consume(self.queue, self._on_delivery)
                reconnect.succeeded()
                self.state("consuming", self.queue)
                self._loop(connection, channel, publish_channel)
                # Undispatched deliveries are nacked (requeued) by pika on cancel.
                channel.basic_cancel(tag)
        finally:
            self._buffer = []  # unacked: the broker requeues them when the channel closes
            if connection.is_open:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    connection.close()

    def _warn_if_not_alone(self, channel: Any) -> None:
        """Two receivers on one queue may store a segment's messages out of order (README "Scaling")."""
        others = channel.queue_declare(self.queue, passive=True).method.consumer_count
        if others:
            self.log.warning(
                "%d other consumer(s) on %s: messages of one sequential segment may be stored, and handled, "
                "out of order; run one receiver per inbox queue unless the service's messages are parallel",
                others,
                self.queue,
            )

    def _loop(self, connection: pika.BlockingConnection, channel: Any, publish_channel: Any) -> None:
        """Consume and settle until stopped; batch N is written while batch N+1 is collected.

        The write runs on one database thread; everything pika does (acks, the delay
        chain) stays on this thread, which waits for batch N's commit before acking it and
        before handing over batch N+1, so acks still follow commits in order.
        """
        pool = ThreadPoolExecutor(1, thread_name_prefix="txbox-receiver-db")
        inflight: tuple[list[Delivery], Future[None]] | None = None
        try:
            while not self.stopping:
                self._fill(connection, busy=inflight[1] if inflight is not None else None)
                if not self._buffer:
                    if inflight is not None:
                        self._finish(inflight, channel, publish_channel)
                        inflight = None
                    continue
                batch, self._buffer = self._buffer, []
                metrics.RECEIVED.labels(**self._labels).inc(len(batch))
                if any(d.redelivered for d in batch):
                    if inflight is not None:
                        self._finish(inflight, channel, publish_channel)
                        inflight = None
                    # Someone died holding these: take them one by one so the one that
                    # kills us is the only one whose counter climbs.
                    for delivery in batch:
                        self._settle_group([delivery], channel, publish_channel)
                    continue
                prepared = self._admit(batch, {})
                if inflight is not None:
                    self._finish(inflight, channel, publish_channel)
                inflight = (batch, pool.submit(self._write, prepared))
                inflight[1].add_done_callback(functools.partial(_wake, connection))
            if inflight is not None:
                self._finish(inflight, channel, publish_channel)
        finally:
            pool.shutdown(wait=True)  # a write in flight completes; its batch is redelivered, deduped

    def _finish(self, inflight: tuple[list[Delivery], Future[None]], channel: Any, publish_channel: Any) -> None:
        batch, future = inflight
        try:
            future.result()
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                raise
            self._database_down(exc)
            self._retry_later(batch, channel, publish_channel)
            return
        self.state("consuming", self.queue)
        channel.basic_ack(batch[-1].delivery_tag, multiple=True)

    def _database_down(self, exc: BaseException) -> None:
        self._drop_db()
        self.state("database unavailable", f"{exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__)

    def _on_delivery(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        self._buffer.append(Delivery.from_pika(method, props, body))

    def _fill(self, connection: pika.BlockingConnection, busy: Future[None] | None) -> None:
        """Collect deliveries until a full batch, a free database, ``batch_wait`` after the first, or a stop.

        Group commit: while the previous batch is being written (``busy``), deliveries
        gather for the next one; once the database is free, what has arrived goes at
        once. A quiet receiver adds no batching delay to a message's latency, a busy one
        gets batches as large as a write takes. Every wait returns early on a delivery or
        on the end of the write (:func:`_wake`), so the write's ack is never late.
        """
        deadline: float | None = None
        while len(self._buffer) < self.config.batch_size and not self.stopping:
            if deadline is None:
                connection.process_data_events(time_limit=_IDLE_WAIT)
                if not self._buffer:
                    return
                deadline = time.monotonic() + self.config.batch_wait
                continue
            if busy is None or busy.done():
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

    def _settle_group(self, group: list[Delivery], channel: Any, publish_channel: Any) -> None:
        try:
            forced = self._count_redeliveries(group)
            self._store(group, forced)
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                raise
            self._database_down(exc)
            self._retry_later(group, channel, publish_channel)
            return
        self.state("consuming", self.queue)
        channel.basic_ack(group[-1].delivery_tag, multiple=True)

    def _count_redeliveries(self, group: Sequence[Delivery]) -> dict[int, dl.DeadLetter]:
        """Count redeliveries in their own committed transaction; dead letters for those past the limit."""
        forced: dict[int, dl.DeadLetter] = {}
        redelivered = [d for d in group if d.redelivered]
        if not redelivered:
            return forced
        metrics.REDELIVERED.labels(**self._labels).inc(len(redelivered))
        conn = self._connection()
        with conn.cursor() as cur:
            counts = {
                d.delivery_tag: store.count_redelivery(cur, self.settings.schema, self.queue, d.counter_key)
                for d in redelivered
            }
        conn.commit()
        for delivery in redelivered:
            count = counts[delivery.delivery_tag]
            if count > self.config.redelivery_limit:
                data: Any = None
                try:
                    data = decode_json(delivery.body)
                except Exception:  # whatever it is, it is dead: keep the raw body only
                    data = None
                forced[delivery.delivery_tag] = self.intake.reject(
                    delivery,
                    dl.REDELIVERY_LIMIT,
                    f"redelivered {count} times (limit {self.config.redelivery_limit}): "
                    "the receiver died holding it each time",
                    data=data,
                )
        return forced

    def _store(self, group: Sequence[Delivery], forced: dict[int, dl.DeadLetter]) -> None:
        self._write(self._admit(group, forced))

    def _admit(self, group: Sequence[Delivery], forced: dict[int, dl.DeadLetter]) -> _Prepared:
        """Parse and validate (CPU only, no database): rows to store and dead letters."""
        pairs: list[tuple[Delivery, InboxRow]] = []
        letters: list[dl.DeadLetter] = []
        for delivery in group:
            outcome = forced.get(delivery.delivery_tag) or self.intake.admit(delivery)
            if isinstance(outcome, InboxRow):
                pairs.append((delivery, outcome))
            else:
                letters.append(outcome)
        return _Prepared(pairs, letters, [d.counter_key for d in group if d.redelivered])

    def _write(self, prepared: _Prepared) -> None:
        """One statement for the rows, the dead letters, the counters; one commit."""
        pairs, letters, settled_keys = prepared.pairs, prepared.letters, prepared.settled_keys
        rows = [row for _, row in pairs]
        schema = self.settings.schema
        conn = self._connection()
        try:
            with conn.cursor() as cur:
                new = store.insert_rows(cur, schema, rows)
                store.insert_dead_letters(cur, schema, letters)
                store.forget_redeliveries(cur, schema, self.queue, settled_keys)
            conn.commit()
        except psycopg.Error as exc:
            conn.rollback()
            if db.is_infrastructure_error(exc):
                raise
            # Something in the data (e.g. \u0000 inside a JSON string, which jsonb
            # refuses): find the culprits one savepoint at a time.
            new, letters = self._store_carefully(conn, pairs, letters, settled_keys)
        self._count(rows, new, letters)

    def _store_carefully(
        self,
        conn: psycopg.Connection[Any],
        pairs: Sequence[tuple[Delivery, InboxRow]],
        letters: list[dl.DeadLetter],
        settled_keys: Sequence[str],
    ) -> tuple[set[Any], list[dl.DeadLetter]]:
        schema = self.settings.schema
        new: set[Any] = set()
        letters = list(letters)
        with conn.cursor() as cur:
            for delivery, row in pairs:
                try:
                    with conn.transaction():
                        new |= store.insert_rows(cur, schema, [row])
                except psycopg.Error as exc:
                    if db.is_infrastructure_error(exc):
                        raise
                    letter = self.intake.reject(
                        delivery,
                        UNSTORABLE,
                        f"PostgreSQL refused the row: {exc}".strip(),
                        error_type=type(exc).__name__,
                    )
                    letter.message_id, letter.message_type = row.id, row.message_type
                    letters.append(letter)
            store.insert_dead_letters(cur, schema, letters)
            store.forget_redeliveries(cur, schema, self.queue, settled_keys)
        conn.commit()
        return new, letters

    def _count(self, rows: Sequence[InboxRow], new: set[Any], letters: Sequence[dl.DeadLetter]) -> None:
        metrics.STORED.labels(**self._labels).inc(len(new))
        if len(rows) > len(new):
            metrics.DUPLICATES.labels(**self._labels).inc(len(rows) - len(new))
        for letter in letters:
            metrics.REJECTED.labels(reason=letter.reason, **self._labels).inc()
            if letter.reason != UNSTORABLE:
                self.log.warning("rejected a delivery (%s): %s", letter.reason, letter.error[:300])

    # --- PostgreSQL down: the delay/retry chain of DESIGN §5 ---------------------------

    def _retry_later(self, group: Sequence[Delivery], channel: Any, publish_channel: Any) -> None:
        """Park each delivery in a delay queue, or give it up to ``<service>:dead_letter``.

        Either way a copy is published with a confirm and only then is the delivery
        acked. The last step used to be ``basic_reject`` into the inbox queue's
        dead-letter exchange, but broker dead-lettering is at most once: a letter whose
        target queue had no leader at that instant (say, just after a broker restart)
        was dropped.
        """
        service = self.settings.service
        for delivery in group:
            headers = dict(delivery.headers)
            if delivery.final_attempt:
                headers[names.HEADER_DEAD_REASON] = dl.RETRIES_EXHAUSTED
                headers[names.HEADER_DEAD_ERROR] = (
                    f"the receiver could not store it through the whole delay/retry chain "
                    f"(attempt {delivery.attempt}): the database stayed unavailable"
                )
                exchange, key, done = (
                    names.DEAD_LETTER_EXCHANGE,
                    names.dead_letter_routing_key(service),
                    metrics.GAVE_UP,
                )
            else:
                retries_done = delivery.attempt - 1
                final = retries_done >= len(self._schedule)
                delay = self._schedule[min(retries_done, len(self._schedule) - 1)]
                headers[names.HEADER_ATTEMPT] = delivery.attempt + 1
                if final:
                    headers[names.HEADER_FINAL_ATTEMPT] = True
                headers["CC"] = [names.retry_routing_key(service, delivery.original_routing_key(service))]
                exchange, key, done = names.DELAY_EXCHANGE, names.delay_routing_key(delay), metrics.DELAYED
            props = pika.BasicProperties(
                delivery_mode=2,
                headers=headers,
                **{k: delivery.properties[k] for k in _REPUBLISHED_PROPERTIES if k in delivery.properties},
            )
            try:
                publish_channel.basic_publish(exchange, key, delivery.body, props, mandatory=True)
            except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
                # No queue took the copy: keep the delivery in the inbox queue rather than lose it.
                self.log.error("%s refused a copy (%r): requeueing the delivery", exchange, exc)
                channel.basic_nack(delivery.delivery_tag, requeue=True)
                continue
            channel.basic_ack(delivery.delivery_tag)
            done.labels(**self._labels).inc()

    # --- PostgreSQL connection ----------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._db is None or self._db.closed:
            self._db = db.connect(
                self.settings.database_url,
                connect_timeout=self.config.db_connect_timeout,
                application_name="txbox-receiver",
            )
        return self._db

    def _drop_db(self) -> None:
        if self._db is not None:
            with contextlib.suppress(psycopg.Error):
                self._db.close()
            self._db = None
