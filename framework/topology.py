"""Declare the RabbitMQ topology from the contracts, idempotently.

Exchanges ``command``/``event``/``delay``/``retry``/``dead_letter`` (topic, durable); the
service's inbox queue with its dead-letter arguments and bindings; its dead-letter
queue; Mosaic's shared ``delay:<n>s`` queues, declared with exactly the arguments
Mosaic's libraries give them (:func:`mosaic_delay_queue`), and txbox's own
``delay:<n>s:at-least-once`` queues that its delayed retries wait in (:func:`delay_queue`).
Every declaration matches what a Mosaic service declares for the same name, so a txbox
service and a Mosaic service start on one vhost in either order (docs/explanation/receive.md,
"Mosaic compatibility").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.channel
import pika.exceptions

from framework import amqp, names
from framework.contracts import Registry
from framework.errors import TopologyMismatch
from framework.settings import Settings

log = logging.getLogger("txbox.topology")


@dataclass(frozen=True)
class QueueSpec:
    name: str
    arguments: dict[str, Any]
    bindings: list[tuple[str, str]] = field(default_factory=list)  # (exchange, routing key)


@dataclass(frozen=True)
class Topology:
    exchanges: tuple[str, ...]
    queues: list[QueueSpec]


def plan(settings: Settings, registry: Registry) -> Topology:
    """What the service needs on the broker (pure: a test compares the broker against it)."""
    service = settings.service
    # No x-delivery-limit: Mosaic declares the inbox queues with exactly these arguments and
    # RabbitMQ refuses (406) a second declaration with others; the limit is a policy
    # (framework.delivery_limit).
    inbox_arguments: dict[str, Any] = {
        "x-queue-type": settings.queue_type,
        "x-dead-letter-exchange": names.DEAD_LETTER_EXCHANGE,
        "x-dead-letter-routing-key": names.dead_letter_routing_key(service),
    }
    inbox = QueueSpec(
        names.inbox_queue(service),
        inbox_arguments,
        [*registry.binding_keys(service), (names.RETRY_EXCHANGE, names.retry_binding(service))],
    )
    dead = QueueSpec(
        names.dead_letter_queue(service),
        {"x-queue-type": settings.queue_type},
        [(names.DEAD_LETTER_EXCHANGE, names.dead_letter_routing_key(service))],
    )
    shared = [mosaic_delay_queue(s) for s in names.DELAY_SECONDS]
    delays = [delay_queue(s) for s in names.DELAY_SECONDS]
    return Topology(names.EXCHANGES, [inbox, dead, *shared, *delays])


def mosaic_delay_queue(seconds: int) -> QueueSpec:
    """Mosaic's shared ``delay:<n>s``, with exactly the arguments Mosaic's message bus gives it.

    RabbitMQ refuses a second declaration with other arguments (406 inequivalent arg), so
    any argument added here would stop either the Mosaic service or txbox from starting,
    whichever comes second. txbox does not park its own retries here: this queue
    dead-letters at most once (see :func:`delay_queue`).
    """
    return QueueSpec(
        names.mosaic_delay_queue(seconds),
        {
            "x-message-ttl": seconds * 1000,
            "x-dead-letter-exchange": names.RETRY_EXCHANGE,
            "x-queue-type": "quorum",
        },
        [(names.DELAY_EXCHANGE, names.mosaic_delay_routing_key(seconds))],
    )


def delay_queue(seconds: int) -> QueueSpec:
    """A queue holding retries for ``seconds`` before they expire into ``retry``.

    Quorum with at-least-once dead-lettering, whatever the inbox queue type: the copy a
    receiver parks here (the database was down) is the only one left once the original
    delivery is acked. A classic queue dead-letters at most once; the chaos run lost
    deliveries that way when RabbitMQ restarted while they waited (on restart, expired
    messages went to an inbox queue whose leader was not elected yet, and were dropped).
    At-least-once dead-lettering keeps each message until the target queue confirmed it,
    and needs ``reject-publish`` overflow. Mosaic's ``delay:<n>s`` cannot carry those
    arguments (Mosaic declares it without them), hence a queue of txbox's own beside it,
    shared by every txbox service on the vhost and declared alike by all of them.
    """
    return QueueSpec(
        names.delay_queue(seconds),
        {
            "x-queue-type": "quorum",
            "x-message-ttl": seconds * 1000,
            "x-dead-letter-exchange": names.RETRY_EXCHANGE,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        },
        [(names.DELAY_EXCHANGE, names.delay_routing_key(seconds))],
    )


def declare_queue(channel: Any, queue: QueueSpec, settings: Settings) -> None:
    """Declare ``queue`` and its bindings; a queue with other arguments raises TopologyMismatch."""
    _guard(lambda: channel.queue_declare(queue.name, durable=True, arguments=queue.arguments), settings)
    for exchange, key in queue.bindings:
        channel.queue_bind(queue.name, exchange, routing_key=key)


def declare(settings: Settings, registry: Registry, channel: Any | None = None) -> Topology:
    """Declare everything; a second run changes nothing. Returns what was declared."""
    topology = plan(settings, registry)
    connection = None
    if channel is None:
        connection = amqp.connect(settings.amqp_url, name=f"{settings.service} topology")
        channel = connection.channel()
    try:
        with amqp.broker_errors("declaring the topology"):
            for exchange in topology.exchanges:
                _guard(lambda e=exchange: channel.exchange_declare(e, exchange_type="topic", durable=True), settings)
            for queue in topology.queues:
                declare_queue(channel, queue, settings)
    finally:
        if connection is not None and connection.is_open:
            connection.close()
    return topology


def declare_on(
    settings: Settings,
    registry: Registry,
    channel: pika.channel.Channel,
    done: Callable[[], None],
    *,
    extra: Sequence[QueueSpec] = (),
) -> None:
    """Declare everything, and the ``extra`` queues after it, on an open channel of a
    connection on a loop, without waiting.

    The declarations go out in :func:`declare`'s order (pika sends each once RabbitMQ has
    answered the one before); ``done`` runs on the loop once the last was answered. A
    declaration RabbitMQ refuses closes the channel instead: its close callback gets the
    reason, which :func:`mismatch` explains.
    """
    topology = plan(settings, registry)
    calls: list[Callable[..., None]] = [
        functools.partial(channel.exchange_declare, e, exchange_type="topic", durable=True) for e in topology.exchanges
    ]
    for queue in [*topology.queues, *extra]:
        calls.append(functools.partial(channel.queue_declare, queue.name, durable=True, arguments=queue.arguments))
        calls += [functools.partial(channel.queue_bind, queue.name, e, routing_key=k) for e, k in queue.bindings]
    for call in calls[:-1]:
        call()
    calls[-1](callback=lambda _frame: done())  # a channel answers in order: this one comes last


def mismatch(settings: Settings, exc: BaseException) -> TopologyMismatch | None:
    """What a channel closed by RabbitMQ's 406 (PRECONDITION_FAILED) to a declaration means;
    None for any other reason."""
    if not isinstance(exc, pika.exceptions.ChannelClosedByBroker) or exc.reply_code != 406:
        return None
    found = amqp.explain_precondition(exc.reply_text)
    if found is None:
        return TopologyMismatch(f"RabbitMQ refused a declaration: {exc.reply_text}")
    what, name, arg, wanted, current = found
    hint = ""
    if arg == "x-queue-type" and name in (
        names.inbox_queue(settings.service),
        names.dead_letter_queue(settings.service),
    ):
        hint = f", or set TXBOX_QUEUE_TYPE={current.strip(chr(39))} to keep the existing queue"
    if name in {names.mosaic_delay_queue(s) for s in names.DELAY_SECONDS}:
        hint = (
            ". It is shared with Mosaic services, which declare it with only x-message-ttl, "
            "x-dead-letter-exchange=retry and x-queue-type=quorum (a txbox release before Mosaic "
            "compatibility declared more); txbox's own retries wait in "
            f"{names.delay_queue(int(name.removeprefix('delay:').removesuffix('s')))!r}"
        )
    return TopologyMismatch(
        f"{what} {name!r} already exists with {arg}={current}, txbox needs {arg}={wanted}. "
        f"Fix: drain and delete it (rabbitmqctl delete_queue {name!r}) so txbox can declare it{hint}."
        if what == "queue"
        else f"exchange {name!r} already exists with {arg}={current}, txbox needs {wanted}. "
        f"Fix: delete the exchange (rabbitmqctl delete_exchange {name!r}) and run `txbox topology` again."
    )


def _guard(declare_call: Any, settings: Settings) -> None:
    try:
        declare_call()
    except pika.exceptions.ChannelClosedByBroker as exc:
        found = mismatch(settings, exc)
        if found is None:
            raise
        raise found from None
