"""The receiver daemon: inbox queue → txbox.inbox, acked only after commit.

A guest of a loop it is given (docs/explanation/daemons.md, "One loop per process"): it
consumes on a ``SelectConnection`` on that loop (:class:`~framework.receiver.consumer.Consumer`),
writes each batch on its database connection with libpq's asynchronous calls, the
socket watched by the same loop (:mod:`framework.receiver.write`), and publishes its
retry and dead-letter copies on a confirm channel of their own there
(:mod:`framework.receiver.copies`). Deliveries gather while the previous batch is
written (for up to ``batch_wait`` after the first, up to ``batch_size``), and go as soon
as the database is free; once a batch's commit is done it is acked with one
``basic_ack(multiple=True)``, before the next batch is sent. Three paths leave the happy
one (:mod:`framework.receiver.store` writes them):

- bad input is REJECTED into txbox.dead_letters in the same transaction (never raised);
- a redelivered delivery (the previous holder died with it) is counted in
  txbox.redeliveries in its own committed transaction *before* it is touched, and
  handled alone, so one poisonous delivery cannot drag its batch mates to the limit;
- PostgreSQL unavailable: each delivery is republished to the ``delay`` exchange with
  its attempt number and acked only once the broker confirmed the copy; after
  the final attempt the copy goes, confirmed the same way, to ``<service>:dead_letter``.

Given a :class:`~framework.receiver.tenancy.Tenancy`, the receiver serves every tenant of
a registry: it reads the whole prefetch window, and each batch is the deliveries of one
tenant among them (the tenants taking turns), written to that tenant's database and
schema, and acked before the next is sent: with one ``basic_ack(multiple=True)`` when
it is a prefix of what is unacked, one by one when not. A delivery naming no
tenant of the registry is an ``unknown_tenant`` letter in the service's own database.

A session is one consuming connection: the topology declared (one blocking call, tried
again on a timer while RabbitMQ is down), the prefetch set, the turn awaited
(:mod:`framework.receiver.turns`), then consuming until the connection is lost, the
turn is lost (standing down), or a stop; the last two drain first (:meth:`Receiver._wind_down`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pika
from pika.adapters.select_connection import IOLoop
from prometheus_client import Counter

from framework import amqp, db, delivery_limit, metrics, names, topology
from framework import dead_letters as dl
from framework.backoff import reconnect_seconds
from framework.daemon import RABBITMQ, Daemon
from framework.errors import BrokerUnavailable
from framework.reasons import Reason
from framework.receiver.config import ReceiverConfig
from framework.receiver.consumer import Consumer
from framework.receiver.copies import Copies, Copy
from framework.receiver.handoff import Handoff
from framework.receiver.intake import Delivery, Intake
from framework.receiver.store import Prepared, Storing, end_spans
from framework.receiver.tenancy import Resolved, Store, Tenancy, store
from framework.receiver.turns import POLL_SECONDS, ConsumerTurn, Takeover, takeover_seconds
from framework.receiver.write import InboxWrite, Step
from framework.service import Service
from framework.signing import SigningConfig
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import inbox as inbox_sql
from framework.sql import redeliveries as redeliveries_sql
from framework.tenants.model import Registry as TenantRegistry

__all__ = ["InboxWrite", "Receiver"]

_IDLE_WAIT = 0.2  # seconds between a consuming receiver's looks at its turn, its copies and its progress
_DRAIN_SECONDS = 5.0  # at most this long, on the way out, for the write in flight, then for copies' confirms


@dataclass(eq=False)
class _Inflight:
    """A batch being written: sent without waiting (``write``), or written already with its outcome (``error``)."""

    batch: list[Delivery]
    prepared: Prepared
    store: Store  # where it is written
    write: InboxWrite | None = None
    error: Exception | None = None
    handed_at: float | None = None  # monotonic: the write claims its rows for the worker (Handoff)

    @property
    def done(self) -> bool:
        return self.write is None or self.write.done


class Receiver(Storing, Daemon):
    """``Receiver(service, config).run()`` until :meth:`stop` (or SIGTERM via the CLI), or
    started on a shared loop (:meth:`start_on`, `txbox run`).

    Every attribute is the loop thread's, but for what :class:`Daemon` shares, :meth:`stop`
    and what :meth:`waiting` and the gauges read (each replaced whole).
    """

    name = "receiver"

    def __init__(
        self,
        service: Service,
        config: ReceiverConfig | None = None,
        *,
        stop_event: threading.Event | None = None,
        tenancy: Tenancy | None = None,
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
        # The service's own database; with tenants, where deliveries naming none are lettered.
        self._home = store(None, self.settings.database_url, self.settings.schema, self.config.db_connect_timeout)
        self._at = self._home  # where the group being settled is written (Storing)
        #: Serving every tenant of a registry (framework/receiver/tenancy.py), or None.
        self.tenancy = tenancy
        self._resolved: dict[int, Resolved] = {}  # the buffer's deliveries' tenants, by delivery tag
        # The turn of each tenant's last batch (None: deliveries naming none), numbered by
        # _turns: who goes next (_one_tenant). Keys of the registry only (serve drops the others).
        self._served: dict[str | None, int] = {}
        self._turns = 0
        self._buffer: list[Delivery] = []
        self._first_at = 0.0  # monotonic: when the buffer's first delivery came
        self._inflight: _Inflight | None = None  # the batch being written
        # `txbox run`: what this receiver stores, it claims for the worker of its process.
        self.handoff: Handoff | None = None
        # The children counted per batch or delivery, looked up once.
        self._received = metrics.RECEIVER_RECEIVED.labels(**self.labels)
        self._peak_held = metrics.RECEIVER_PEAK_HELD.labels(**self.labels)
        self._user = amqp.username(self.settings.amqp_url)
        self._trusted = self.config.trusted(self._user)
        # Bytes of the bodies held unacked: collected (``_buffered``) and being written
        # (``_writing``). At ``max_unacked_bytes`` the receiver stops reading from the
        # socket (Consumer.pause), so RabbitMQ's sends back up into TCP instead of into our memory.
        self._buffered = 0
        self._writing = 0
        self.peak_held_bytes = 0
        # Deliveries still to take one at a time after a lost connection (see _consumer_open).
        self._careful = 0
        self._session_careful = False  # this session consumes with prefetch 1
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
        self._consumer: Consumer | None = None
        self._copies: Copies | None = None  # made on the loop (_begin)
        self._blocked_since: float | None = None  # publishing blocked by a broker alarm since (the loop writes it)
        metrics.RECEIVER_PUBLISHING_BLOCKED.labels(**self.labels).set_function(self._blocked_seconds)
        metrics.RECEIVER_COPIES_WAITING.labels(**self.labels).set_function(self._copies_waiting)
        self._standing_down = False  # another replica took the turn: stop consuming (_our_turn)
        self._broker_failures = 0
        self._soon = False  # a step is scheduled for the loop's next turn
        self._timers: dict[str, Any] = {}  # name → the pending timer of that name (_after)
        self._leaving: Callable[[], None] | None = None  # winding the session down; then this (_wind_down)
        self._leave_deadline = 0.0
        self._draining = False  # stopping: no new session

    # --- the loop: sessions ---------------------------------------------------------

    @property
    def _loop(self) -> IOLoop:
        loop = self.loop
        assert loop is not None, "the receiver runs only once started (start_on)"
        return loop

    def _after(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` in ``delay`` seconds, replacing the pending timer of that name;
        guarded, like every callback of the receiver's (:meth:`_guarded`)."""
        self._cancel(name)

        def due() -> None:
            self._timers.pop(name, None)
            self._guarded(callback)

        self._timers[name] = self._loop.call_later(max(0.0, delay), due)

    def _cancel(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            self._loop.remove_timeout(timer)

    def _guarded(self, callback: Callable[[], None]) -> None:
        """The last resort of the receiver's own timers: a bug ends the session, never the loop."""
        try:
            callback()
        except Exception as exc:
            self.log.exception("unexpected error in the receiver's loop: reconnecting")
            self._restart(exc)

    def _begin(self) -> None:
        self.state("starting", f"service {self.settings.service}, queue {self.queue}")
        self._copies = Copies(
            self.settings.amqp_url,
            self._loop,
            name=f"{self.settings.service} receiver copies",
            on_blocked=self._publishing_blocked,
            on_settled=self._copy_settled,
        )
        self._declare()

    def _declare(self) -> None:
        """Open the consuming connection; on its channel the topology is declared first
        (:meth:`_consumer_open`), without blocking the loop: a RabbitMQ node that takes a
        connection and never answers holds up this session only, not the other daemons of
        the loop (docs/explanation/daemons.md, "One loop per process"). While RabbitMQ is
        down, a new session follows after a backoff."""
        if self._draining:
            return
        self.progress()
        consumer = self._consumer = Consumer(
            self.settings.amqp_url,
            self._loop,
            name=f"{self.settings.service} receiver",
            on_open=self._consumer_open,
            on_gone=self._consumer_gone,
            on_delivery=self._on_delivery,
        )
        consumer.open()

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

    def _broker_failed(self, exc: BaseException) -> None:
        """RabbitMQ could not be reached or was lost: a new session after a backoff, in careful
        mode; a replica that still reaches the broker may consume meanwhile, so the turn goes."""
        self._careful = self.config.prefetch
        if self._turn is not None:
            # A turn taken again later waits for its consumer afresh.
            self._turn.release()
            self._takeover.reset()
        if self._draining:
            return
        self._broker_failures += 1
        delay = reconnect_seconds(self._broker_failures)
        self.state("RabbitMQ unavailable", f"{exc}; retrying in {delay:.1f}s")
        self._after("session", delay, self._declare)

    def _consumer_open(self, consumer: Consumer) -> None:
        if consumer is not self._consumer:
            return
        # Delay queues of a non-standard schedule, shaped exactly like topology's ones.
        extra = [topology.delay_queue(seconds) for seconds in self.config.extra_delays]
        consumer.declare(self.settings, self.service.registry, extra, then=lambda: self._declared(consumer))

    def _declared(self, consumer: Consumer) -> None:
        if consumer is not self._consumer:
            return
        # Once per process, after the first declaration: the broker's last net under this
        # receiver (framework.delivery_limit).
        self._ensure_delivery_limit()
        # Copies go on a connection of their own: a broker that blocks publishers (a memory
        # or disk alarm) keeps delivering to this one (docs/explanation/receive.md, "Publishing
        # blocked by the broker").
        assert self._copies is not None
        self._copies.begin(consumer)
        careful = self._careful > 0
        self._session_careful = careful
        consumer.qos(1 if careful else self.config.prefetch, then=self._qos_set)

    def _qos_set(self) -> None:
        self._broker_failures = 0
        self.set_ready(RABBITMQ, True)  # a standby is ready: standing by is its job
        self._await_turn()

    def _consumer_gone(self, consumer: Consumer, error: BaseException | None) -> None:
        """The consuming connection closed: asked to (the end of a wind-down), or lost."""
        if consumer is not self._consumer:
            return
        self._consumer = None
        self._close_session()
        refusal = topology.mismatch(self.settings, consumer.closed_by) if consumer.closed_by else None
        if refusal is not None:  # a misconfiguration: trying again would be refused again
            self.log.error("%s", refusal)
            self._leaving = None
            self._draining = True
            self._finish_stop(refusal)
            return
        then, self._leaving = self._leaving, None
        if then is not None:
            self._cancel("leave")
            then()
            return
        self._broker_failed(error or BrokerUnavailable("receiving: the connection closed"))
        if self._draining:
            self._finish_stop()

    def _close_session(self) -> None:
        """What a session held, let go: the broker requeues what is unacked when the channel goes."""
        self.consuming = False
        self._waiting = None  # not waiting for a turn: for the broker (readiness says so)
        self.set_ready(RABBITMQ, False)
        inflight, self._inflight = self._inflight, None
        if inflight is not None and inflight.write is not None and not inflight.write.done:
            # Left mid-write: its commit's outcome is unknown, so the connection goes; the
            # batch is redelivered, and deduped.
            inflight.write.unwatch()
            end_spans(inflight.prepared.spans)
            inflight.store.close()
        self._buffer = []  # unacked: the broker requeues them when the channel closes
        self._resolved.clear()
        self._buffered = self._writing = 0
        for name in ("tick", "turn", "batch wait"):
            self._cancel(name)
        if self._copies is not None:
            self._copies.close()

    def _restart(self, exc: BaseException) -> None:
        """A bug of ours outside a broker callback: end the session as if the connection were lost."""
        consumer = self._consumer
        if consumer is None:
            if not self._draining:
                self._broker_failed(exc)
            return
        self._leaving = None
        consumer.error = exc
        consumer.close()

    # --- waiting for the turn -----------------------------------------------------------

    def _await_turn(self) -> None:
        """Stand by until this replica holds the turn and may start (framework.receiver.turns),
        looking every POLL_SECONDS.

        Holding the turn, it waits while the broker counts another consumer, for at most
        the takeover bound: a holder whose session was lost while its consumer still held
        deliveries must have them requeued before anything later is stored, but the
        consumer of a node that died stays counted until that node returns, perhaps never
        (docs/explanation/operations.md, "A RabbitMQ cluster").
        """
        consumer = self._consumer
        if consumer is None or not consumer.is_open or self._draining or self._leaving is not None:
            return
        self.progress()
        if self._turn is None:
            consumer.consumers(self.queue, self._counted_without_turn)
            return
        try:
            held: bool | None = self._turn.check()
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                raise
            held = None  # unknown: the database cannot be reached
        if held is False:
            self._takeover.reset()
            self._wait_for("standby", f"another receiver consumes {self.queue}")
            self._after("turn", POLL_SECONDS, self._await_turn)
            return
        # Held, or the database cannot be reached: a replica that can take the turn must
        # still wait for our consumer to leave, and ours keeps the retry chain going until
        # it can check the turn (_our_turn).
        consumer.consumers(self.queue, lambda others: self._counted(held, others))

    def _counted_without_turn(self, others: int) -> None:
        if others:
            self.log.warning(
                "%d other consumer(s) on %s and TXBOX_RECEIVER_STANDBY=false: messages of one sequential "
                "segment may be stored, and handled, out of order",
                others,
                self.queue,
            )
        self._start_consuming()

    def _counted(self, held: bool | None, others: int) -> None:
        if self._draining or self._leaving is not None:
            return
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
            self._start_consuming()
            return
        state, detail = (
            ("taking over", f"{others} other consumer(s) on {self.queue}; waiting at most "
                            f"{self._takeover.bound:.0f}s for them to leave")
            if held
            else ("standby", f"{others} other consumer(s) on {self.queue}; the turn cannot be checked")
        )  # fmt: skip
        self._wait_for(state, detail)
        self._after("turn", POLL_SECONDS, self._await_turn)

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

    # --- consuming ----------------------------------------------------------------------

    def _start_consuming(self) -> None:
        consumer = self._consumer
        if consumer is None or not consumer.is_open:
            return
        consumer.consume(self.queue)
        self.consuming = True
        self.state("consuming", self.queue)
        self._after("tick", _IDLE_WAIT, self._tick)

    def _full_speed(self) -> None:
        """Consume again, with the full prefetch, unless the session is ending meanwhile."""
        consumer = self._consumer
        if consumer is not None and consumer.is_open and self._leaving is None and not self._draining:
            consumer.consume(self.queue)

    def _tick(self) -> None:
        """Every _IDLE_WAIT while consuming: progress, copies whose connection was lost, the turn."""
        if self._leaving is not None or self._consumer is None:
            return
        self.progress()
        assert self._copies is not None
        self._copies.flush()
        if not self._our_turn():
            self._wind_down(self._declare)  # a new session, standing by
            return
        self._after("tick", _IDLE_WAIT, self._tick)

    def _on_delivery(self, method: Any, props: Any, body: bytes) -> None:
        """On the loop, for each delivery pika read; the batch goes at the loop's next turn."""
        if not self._buffer:
            self._first_at = time.monotonic()
        self._buffer.append(Delivery.from_pika(method, props, body, self._trusted))
        self._buffered += len(body)
        held = self._buffered + self._writing
        if held > self.peak_held_bytes:
            self.peak_held_bytes = held
            self._peak_held.set(held)
        self._step_soon()

    def _full(self) -> bool:
        """Holding as many deliveries, or body bytes, as allowed unacked: read no more for now.
        With tenants, the whole prefetch window is read while a batch is written: a tenant's
        delivery behind another's burst is then seen, and written at its turn (_one_tenant)."""
        limit = self.config.prefetch if self.tenancy is not None else self.config.batch_size
        return len(self._buffer) >= limit or self._buffered + self._writing >= self.config.max_unacked_bytes

    def _step_soon(self) -> None:
        """Run a step at the loop's next turn, after what pika is delivering now (one per burst).
        A timer, not ``add_callback``, which writes to the loop's wake-up pipe each time."""
        if not self._soon:
            self._soon = True
            self._loop.call_later(0, self._step)

    def _step(self) -> None:
        self._soon = False
        self._guarded(self._advance)

    def _advance(self) -> None:
        """Group commit (docs/explanation/daemons.md, "The daemons and their threads"): while a batch is
        written, deliveries gather for the next one, for up to ``batch_wait`` after the
        first or until the batch is full, and then reading pauses until the write is over;
        once the database is free, what has arrived goes at once. Batch N is acked once its
        commit is done and before batch N+1 is sent, so acks follow commits in order. With
        tenants, reading goes on while a batch is written until the buffer holds the whole
        prefetch window (``batch_wait`` plays no part): the next batch is chosen from it.

        ``careful`` (prefetch 1), after a lost connection, until ``prefetch`` deliveries
        are settled: a delivery that kills the connection itself (one pika cannot even
        decode) then comes back alone, so RabbitMQ's delivery limit (docs/explanation/receive.md,
        "Receiver intake") counts it, not the innocent deliveries prefetched beside it.
        """
        consumer = self._consumer
        if consumer is None:
            return
        inflight = self._inflight
        if inflight is not None and not inflight.done:
            self._hold(consumer)
            return
        if inflight is not None:
            self._inflight = None
            self._finish(inflight)
        if self._leaving is not None:
            self._leave_step()
            return
        self._end_careful(consumer)
        if not self._buffer:
            consumer.resume()
            return
        self._take_buffer()
        if self._inflight is not None and not self._inflight.done and self._full():
            consumer.pause()
        else:
            consumer.resume()

    def _end_careful(self, consumer: Consumer) -> None:
        """A careful session (:meth:`_advance`) whose deliveries held when the connection was lost
        are settled, and whose turn holds: consume again with the full prefetch."""
        if self._session_careful and self._careful <= 0 and consumer.is_open and self._our_turn():
            self._session_careful = False
            consumer.cancel(lambda: consumer.qos(self.config.prefetch, then=self._full_speed))

    def _take_buffer(self) -> None:
        """The deliveries gathered, as the next batch: sent (:meth:`_send`, its write now the
        one in flight), or, if any was redelivered or admitting the batch failed, settled one
        by one at once."""
        self._cancel("batch wait")
        batch, self._buffer = self._buffer, []
        batch_bytes, self._buffered = self._buffered, 0
        forced: dict[int, dl.DeadLetter] = {}
        if self.tenancy is not None:
            batch, forced = self._one_tenant(batch)
            if self._buffer:  # the next tenant's, and what came after: the next batch
                self._first_at = time.monotonic()
                self._buffered = batch_bytes - sum(len(d.body) for d in batch)
                batch_bytes -= self._buffered
        self._received.inc(len(batch))
        self.progress()
        if any(d.redelivered for d in batch):
            # Someone died holding these: take them one by one so the one that kills us is
            # the only one whose counter climbs.
            self._writing = batch_bytes
            for delivery in batch:
                self._settle_group([delivery], forced)
            self._writing = 0
            self._next_tenant_soon()
            return
        try:
            prepared = self._admit(batch, forced)
        except Exception:  # last resort: a bug of ours; each delivery alone, in order
            self.log.exception("admitting a batch of %d failed: settling them one by one", len(batch))
            for delivery in batch:
                self._settle_group([delivery], forced)
            self._next_tenant_soon()
            return
        self._writing = batch_bytes
        self._inflight = self._send(batch, prepared)
        if self._inflight.done:
            self._step_soon()

    def _ack(self, group: list[Delivery]) -> None:
        """Ack ``group``, stored: with tenants a batch need not be a prefix of what arrived
        (:meth:`_one_tenant`), so the buffer's lowest tag bounds the ``multiple`` ack."""
        assert self._copies is not None
        below = min(d.delivery_tag for d in self._buffer) if self.tenancy is not None and self._buffer else None
        self._copies.ack(group, below)

    def _next_tenant_soon(self) -> None:
        """A batch settled at once, with no write in flight to step the loop: the next
        tenant's deliveries, left in the buffer, go at the loop's next turn."""
        if self._buffer:
            self._step_soon()

    def serve(self, registry: TenantRegistry) -> None:
        """On the loop: judge the deliveries read from now on by ``registry``; the connections
        of databases no tenant of it uses are closed (the one a write is on, once it is over)."""
        assert self.tenancy is not None, "a receiver serving tenants (tenancy=...)"
        self.tenancy.update(registry)
        self._resolved.clear()  # judged again, by ``registry``
        self._served = {k: turn for k, turn in self._served.items() if k is None or registry.get(k) is not None}
        self.tenancy.tidy(busy=self._inflight.store.link if self._inflight is not None else None)

    def _one_tenant(self, buffer: list[Delivery]) -> tuple[list[Delivery], dict[int, dl.DeadLetter]]:
        """The next tenant's deliveries, up to ``batch_size``, in the order they came (the
        others go back to the buffer, for the next batches), with the store they are written
        to made current, and the ``unknown_tenant`` letters of those naming no tenant (they
        go to the service's own database, together). Each delivery is resolved once.

        The tenants in the buffer take turns: the next is the one whose last batch is the
        oldest (never served: the one whose first delivery came first). A tenant's burst
        holds a delivery of another that has arrived for one batch, not for the whole
        burst (docs/how-to/tenants.md, "Fairness: what a burst costs the others")."""
        assert self.tenancy is not None
        resolved = [self._resolved.get(d.delivery_tag) or self._resolve(d) for d in buffer]
        first: dict[str | None, int] = {}
        for index, found in enumerate(resolved):
            first.setdefault(found.key, index)
        key = min(first, key=lambda k: (self._served.get(k, 0), first[k]))
        self._turns += 1
        self._served[key] = self._turns
        batch: list[Delivery] = []
        self._buffer = []
        for delivery, found in zip(buffer, resolved, strict=True):
            if found.key == key and len(batch) < self.config.batch_size:
                batch.append(delivery)
            else:
                self._buffer.append(delivery)
        self._at = self._home if key is None else self.tenancy.store(key)
        letters = {}
        for delivery in batch:
            found = self._resolved.pop(delivery.delivery_tag)
            if found.error is not None:
                letters[delivery.delivery_tag] = self._letter(delivery, Reason.UNKNOWN_TENANT, found.error)
        return batch, letters

    def _resolve(self, delivery: Delivery) -> Resolved:
        assert self.tenancy is not None
        found = self._resolved[delivery.delivery_tag] = self.tenancy.resolve(delivery)
        return found

    def _hold(self, consumer: Consumer) -> None:
        """A write is in flight: gather until the buffer is full, or, without tenants, its
        ``batch_wait`` is over, then stop reading until the write's end (its ``on_done``
        steps again). With tenants the whole window is read: the next batch is chosen among
        what has come (:meth:`_one_tenant`)."""
        if self._full():
            consumer.pause()
            return
        if not self._buffer or self.tenancy is not None:
            return
        remaining = self._first_at + float(self.config.batch_wait) - time.monotonic()
        if remaining <= 0:
            consumer.pause()
        elif "batch wait" not in self._timers:
            self._after("batch wait", remaining, self._step_soon)

    def _send(self, batch: list[Delivery], prepared: Prepared) -> _Inflight:
        """Start writing ``prepared``: sent without waiting when it is only rows (the usual
        batch), else written at once the ordinary way (dead letters, counters, a batch too large)."""
        rows = [row for _, row in prepared.pairs]
        inflight = _Inflight(batch, prepared, self._at)
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
            end_spans(prepared.spans, exc)
            inflight.error = exc
            return inflight
        # Prepared once per connection, in the first write's round trip; its end steps the
        # loop, so the batch's ack is never late.
        at = self._at
        held = at.link.prepared[1] if at.link.prepared[0] is conn else frozenset()
        insert = Step(at.insert_name, at.sql_insert, [text, str(len(rows)).encode()])
        # Not with tenants: the hand-off is to one worker, of one database.
        handoff = self.handoff if self.handoff is not None and self.handoff.wanted and self.tenancy is None else None
        steps = handoff.steps(insert, [row.id for row in rows]) if handoff else [insert]
        inflight.handed_at = time.monotonic() if handoff else None  # the lease runs from here
        write = InboxWrite(conn, steps, on_done=self._step_soon, prepared=held)
        at.link.prepared = (None, frozenset())  # known again once the write is over (_complete)
        inflight.write = write
        try:
            write.send()
            if not write.done:
                write.watch(self._loop)
        except Exception as exc:  # a bug of ours: the batch is rescued (_finish), the connection dropped
            write.unwatch()
            self._drop_db()
            end_spans(prepared.spans, exc)
            inflight.write, inflight.error = None, exc
        return inflight

    def _write_now(self, prepared: Prepared) -> Exception | None:
        """:meth:`_write` on this thread; its failure returned, for :meth:`_finish`."""
        try:
            self._write(prepared)
        except Exception as exc:
            return exc
        return None

    def _finish(self, inflight: _Inflight) -> None:
        batch = inflight.batch
        self._at = inflight.store
        if self.tenancy is not None:
            self.tenancy.tidy()  # retired while it was written (serve)
        try:
            if inflight.write is not None:
                self._complete(inflight.prepared, inflight.write, inflight.handed_at)
            elif inflight.error is not None:
                raise inflight.error
        except Exception as exc:
            self._writing = 0
            if not db.is_infrastructure_error(exc):
                self._rescue(batch, exc)
                return
            self._database_down(exc)
            self._retry_later(batch)
            return
        self._writing = 0
        self._careful -= len(batch)
        self.state("consuming", self.queue)
        assert self._copies is not None
        self._ack(batch)

    def _complete(self, prepared: Prepared, write: InboxWrite, handed_at: float | None = None) -> None:
        """Settle a write that is over: committed (the usual batch), or refused and written again
        the ordinary way (:meth:`_write`), which letters the conflicts of a duplicate id, or
        finds the rows PostgreSQL refuses."""
        write.unwatch()
        if write.error is None:
            self._at.link.prepared = (write.connection, write.prepared)
        if write.error is not None:
            self._drop_db()  # mid-protocol: the connection cannot be used again
            if db.is_infrastructure_error(write.error):
                end_spans(prepared.spans, write.error)
                raise write.error
            self._write(prepared)  # on a fresh connection
            return
        if write.refused is not None:
            self._write(prepared)
            return
        end_spans(prepared.spans)
        rows = [row for _, row in prepared.pairs]
        self._count(rows, {row.id for row in rows}, [])
        if handed_at is not None and self.handoff is not None:
            self.handoff.deliver(handed_at, write.results[-1], write.connection)

    def _database_down(self, exc: BaseException) -> None:
        self._drop_db()
        self.state("database unavailable", f"{exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__)

    def _settle_group(self, group: list[Delivery], letters: dict[int, dl.DeadLetter] | None = None) -> None:
        """Settle ``group`` in the ordinary, blocking way, with the letters already decided for
        deliveries of it (``letters`` by delivery tag: :meth:`_one_tenant`'s, which also made
        the group's store current); a redelivery past the limit is lettered as that."""
        try:
            forced = {**(letters or {}), **self._count_redeliveries(group)}
            self._store(group, forced)
        except Exception as exc:
            if not db.is_infrastructure_error(exc):
                self._rescue(group, exc)
                return
            self._database_down(exc)
            self._retry_later(group)
            return
        self._careful -= len(group)
        self.state("consuming", self.queue)
        assert self._copies is not None
        self._ack(group)

    # --- the way out: standing down, stopping -----------------------------------------

    def _wind_down(self, then: Callable[[], None]) -> None:
        """End the session: consume no more, let the write in flight end and the copies get
        their confirms (each bounded by _DRAIN_SECONDS: a stalled database or a blocked broker
        answers nothing), so their deliveries are acked rather than requeued; then close the
        connection and call ``then``."""
        consumer = self._consumer
        if consumer is None:
            then()
            return
        if self._leaving is not None:
            self._leaving = then
            return
        self._leaving = then
        self._cancel("turn")
        self._cancel("tick")
        if consumer.is_open and consumer.tag is not None:
            consumer.cancel()
        consumer.resume()
        self._leave_deadline = time.monotonic() + _DRAIN_SECONDS
        self._after("leave", _DRAIN_SECONDS, self._leave_timeout)
        self._step_soon()

    def _leave_timeout(self) -> None:
        self._leave_step(expired=True)

    def _leave_step(self, *, expired: bool = False) -> None:
        """One look at the wind-down: after the write's end, each copy's settling and the timeout."""
        consumer = self._consumer
        if self._leaving is None or consumer is None:
            return
        expired = expired or time.monotonic() >= self._leave_deadline
        inflight = self._inflight
        if inflight is not None:
            if not inflight.done and not expired:
                return  # its end steps again
            self._inflight = None
            if inflight.done:
                self._finish(inflight)
            else:
                self.log.warning("the batch write in flight did not end within %.0fs: leaving it", _DRAIN_SECONDS)
                if inflight.write is not None:
                    inflight.write.unwatch()
                end_spans(inflight.prepared.spans)
                inflight.store.close()
            # The copies' own time, from here.
            self._leave_deadline = time.monotonic() + _DRAIN_SECONDS
            self._after("leave", _DRAIN_SECONDS, self._leave_timeout)
            expired = False
        assert self._copies is not None
        if self._copies.waiting and not expired:
            self._copies.flush()
            return  # each settled copy, or the timeout, looks again
        self._cancel("leave")
        consumer.close()  # _consumer_gone calls ``then``

    def _copy_settled(self) -> None:
        if self._leaving is not None:
            self._leave_step()

    def _on_stop(self) -> None:
        self._draining = True
        self._cancel("session")
        self.state("draining")
        consumer = self._consumer
        if consumer is None:
            self._finish_stop()
        elif consumer.is_open:
            self._wind_down(self._finish_stop)
        else:
            self._leaving = self._finish_stop
            consumer.close()

    def _finish_stop(self, exc: BaseException | None = None) -> None:
        """The receiver's end (with ``exc``, what ended it): nothing is left open, no timer
        of its runs again."""
        for name in list(self._timers):
            self._cancel(name)
        if self._copies is not None:
            self._copies.close()
        self._home.close()
        if self.tenancy is not None:
            self.tenancy.close()
        if self._turn is not None:
            self._turn.release()
        self.state("stopped")
        self._end(exc)

    # --- last resort: the settling itself failed ----------------------------------------

    def _rescue(self, group: Sequence[Delivery], exc: BaseException) -> None:
        """A bug of ours failed a whole group: dead-letter each delivery as ``internal_error`` and go on.

        Each one in a transaction of its own, from the raw delivery alone; if even that
        fails, a copy goes to ``<service>:dead_letter`` (the collector stores it).
        """
        self.log.error(
            "settling %d deliveries failed (%r): dead-lettering them as %s", len(group), exc, Reason.INTERNAL_ERROR
        )
        schema = self._at.schema
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
            metrics.RECEIVER_REJECTED.labels(reason=Reason.INTERNAL_ERROR, **self._owner()).inc()
            if self._consumer is not None:
                self._consumer.ack(delivery.delivery_tag)

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
        assert self._copies is not None
        self._copies.send(Copy(delivery, exchange, key, props, on_confirmed=confirmed.labels(**self.labels).inc))

    def _publishing_blocked(self, reason: str | None) -> None:
        """RabbitMQ blocked (``reason``) or unblocked (None) our copies (on the loop)."""
        self._blocked_since = None if reason is None else time.monotonic()

    def _blocked_seconds(self) -> float:
        since = self._blocked_since
        return 0.0 if since is None else time.monotonic() - since

    def _copies_waiting(self) -> int:
        copies = self._copies
        return 0 if copies is None else len(copies.waiting)
