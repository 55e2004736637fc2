"""What a dead letter may be replayed as: the route this service's own contracts give it.

A letter holds what a sender wrote (or a stranger who published to the ``dead_letter``
exchange, or a row someone inserted), and a replay acts under this service's database and
broker users. So nothing of the letter is taken on trust (docs/explanation/dead-letters.md, "Dead
letters"): its message type is looked up in the contracts, which give the kind, exchange
and routing key, and every claim the letter makes about them — the ``message_type`` and
``routing_key`` columns, the envelope's fields, the stored AMQP ``type`` and
``message_id`` properties, the ``exchange`` header, the ``x-death`` and ``CC`` routes —
must agree with that. Then the source decides:

* **inbox**: a message this service received: its type must be one it receives. It runs
  here again; nothing is sent.
* **broker**: a delivery to this service's queue that never reached its inbox: its type
  must be one this service receives. Its own commands and events are sent again through
  its outbox; an event of another producer is never published under this service's
  broker user (every subscriber would take it for this service's): it goes straight
  into this service's inbox instead.
* **outbox**: a message this service wrote: a command (sent to the service whose contract
  declares it) or an event this service publishes; another service's event is refused.

Keys of our own retry chain (``delay.*``, ``<service>.dead_letter``,
``<service>:inbox.<key>``) and its exchanges (``delay``, ``retry``, ``dead_letter``) say
nothing about the original route: the first two are ignored, the third is read as
``<key>``. Every loop here runs over at most :data:`MAX_CLAIMS` items of the letter.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from framework import names
from framework.contracts import MessageSpec, Registry
from framework.errors import ReplayRefused, TxboxError

MAX_CLAIMS = 64  # x-death entries, routing keys of one entry, CC keys: more is refused, not read
_SHOWN = 120  # characters of a claimed value quoted in a refusal
_OURS = (names.DELAY_EXCHANGE, names.RETRY_EXCHANGE, names.DEAD_LETTER_EXCHANGE)


@dataclass(frozen=True)
class Route:
    """Where a replay puts the letter's message: ``send`` through the outbox to ``exchange``
    with ``routing_key``, or (not ``send``) into this service's inbox."""

    spec: MessageSpec
    exchange: str
    routing_key: str
    send: bool


def route(letter: dict[str, Any], registry: Registry, service: str) -> Route:
    """The route of ``letter`` (a ``txbox.dead_letters`` row) by this service's contracts.

    Raises :class:`ReplayRefused` naming the claim that disagrees, or the rule a message of
    that type and source breaks; reads at most :data:`MAX_CLAIMS` items of each list.
    """
    envelope = letter["message"] if isinstance(letter["message"], dict) else {}
    headers = letter["headers"] if isinstance(letter["headers"], dict) else {}
    attempts = letter["attempts"] if isinstance(letter["attempts"], dict) else {}
    broker = letter["source"] == "broker"
    # Who wrote which part: the collector the AMQP properties and the broker the x-death
    # facts of a broker letter, the relay the exchange of an outbox one; elsewhere a header
    # of that name is the sender's and is not read.
    props = headers.get("amqp_properties") if broker else None
    props = props if isinstance(props, dict) else {}
    if not broker:
        attempts = {}
    if letter["source"] != "outbox":
        headers = {k: v for k, v in headers.items() if k == "CC"} if broker else {}
    spec = _spec(
        registry,
        [
            ("the letter's message_type", letter["message_type"]),
            ("the envelope's message_type", envelope.get("message_type")),
            ("the AMQP type property", props.get("type")),
        ],
    )
    _same_id(
        letter["message_id"],
        [
            ("the envelope's message_id", envelope.get("message_id")),
            ("the AMQP message_id property", props.get("message_id")),
        ],
    )
    exchange = names.exchange_for(spec.kind)
    # A multi-tenant message's key names its tenant: every key the letter holds must be that
    # one key (docs/explanation/receive.md, "Multi-tenant routing keys").
    agreed: str | None = None
    for where, key in _keys(letter, headers, attempts, service):
        if not spec.routes(key) or (agreed is not None and key != agreed):
            raise ReplayRefused(
                f"{where} {_show(key)} is not the key this service's contracts give {spec.message_type} "
                f"({(agreed or spec.routing_key)!r}){_whose(registry, key)}: the letter's parts disagree, "
                "so it is not replayed"
            )
        agreed = key
    if spec.tenant_scoped and agreed is None:
        raise ReplayRefused(
            f"{spec.message_type} is a multi-tenant message and the letter holds no routing key naming its "
            "tenant and environment: not replayed"
        )
    for where, claimed in _exchanges(headers, attempts):
        if claimed != exchange:
            raise ReplayRefused(
                f"{where} {_show(claimed)} is not the exchange of {spec.message_type} ({exchange!r}, a {spec.kind}): "
                "the letter's parts disagree, so it is not replayed"
            )
    return _by_source(letter["source"], registry, service, spec, exchange, agreed or spec.routing_key)


def _by_source(source: str, registry: Registry, service: str, spec: MessageSpec, exchange: str, key: str) -> Route:
    received = spec.message_type in {s.message_type for s in registry.accepted_types(service)}
    own = spec.service == service
    if source in ("inbox", "broker") and not received:
        raise ReplayRefused(
            f"{service} does not receive {spec.message_type} (a {spec.kind} of {spec.service}; check its "
            "contract's x-subscribes): a letter of its queue cannot hold it"
        )
    if source == "inbox":
        return Route(spec, exchange, key, send=False)
    if source == "broker":
        return Route(spec, exchange, key, send=spec.kind == "command" or own)
    if spec.kind == "event" and not own:
        raise ReplayRefused(
            f"{service} does not publish {spec.message_type}: it is an event of {spec.service}, "
            "so an outbox letter of this service cannot hold it"
        )
    return Route(spec, exchange, key, send=True)


def _spec(registry: Registry, claims: list[tuple[str, Any]]) -> MessageSpec:
    """The one spec every given type claim names (aliases of one type agree)."""
    found: list[tuple[str, str, MessageSpec]] = []
    for where, value in claims:
        if value is None:
            continue
        if not isinstance(value, str):
            raise ReplayRefused(f"{where} is not text ({type(value).__name__}): the letter names no message type")
        try:
            found.append((where, value, registry.get(value)))
        except TxboxError:
            raise ReplayRefused(
                f"{where} {_show(value)} is a type no contract of this service's declares: nothing to replay"
            ) from None
    if not found:
        raise ReplayRefused("the letter names no message type: nothing to replay (discard it)")
    first_where, first_value, spec = found[0]
    for where, value, other in found[1:]:
        if other.message_type != spec.message_type:
            raise ReplayRefused(
                f"{first_where} says {_show(first_value)} but {where} says {_show(value)}: "
                "the letter's parts disagree, so it is not replayed"
            )
    return spec


def _same_id(message_id: Any, claims: list[tuple[str, Any]]) -> None:
    for where, value in claims:
        if value is None:
            continue
        try:
            same = isinstance(value, str) and len(value) <= 100 and uuid.UUID(value) == message_id
        except ValueError:
            same = False
        if not same:
            raise ReplayRefused(
                f"{where} {_show(value)} differs from the letter's message_id {message_id}: "
                "the letter's parts disagree, so it is not replayed"
            )


def _keys(
    letter: dict[str, Any], headers: dict[str, Any], attempts: dict[str, Any], service: str
) -> Iterator[tuple[str, str]]:
    """Every original routing key the letter claims, our retry chain's forms undone."""
    raw: list[tuple[str, Any]] = [("the letter's routing key", letter["routing_key"])]
    raw += [("a CC header key", k) for k in _bounded(headers.get("CC"), "CC header")]
    for death in _bounded(attempts.get("x_death"), "x-death list"):
        if isinstance(death, dict):
            raw += [("an x-death routing key", k) for k in _bounded(death.get("routing-keys"), "x-death routing-keys")]
    retry_prefix = names.retry_routing_key(service, "")
    for where, key in raw:
        if key is None:
            continue
        if not isinstance(key, str):
            raise ReplayRefused(f"{where} is not text ({type(key).__name__}): the letter's route is unreadable")
        if key.startswith(retry_prefix):
            yield where, key[len(retry_prefix) :]
        elif not (key.startswith("delay.") or key == names.dead_letter_routing_key(service)):
            yield where, key


def _exchanges(headers: dict[str, Any], attempts: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every exchange the letter claims the message was sent to, our retry chain's left out."""
    first = attempts.get("first_death")
    raw: list[tuple[str, Any]] = [
        ("the exchange header", headers.get("exchange")),
        ("the first death's exchange", first.get("exchange") if isinstance(first, dict) else None),
    ]
    for death in _bounded(attempts.get("x_death"), "x-death list"):
        if isinstance(death, dict):
            raw.append(("an x-death exchange", death.get("exchange")))
    for where, value in raw:
        if value is not None and value not in _OURS:
            yield where, value


def _bounded(value: Any, what: str) -> list[Any]:
    """``value`` as a list of at most :data:`MAX_CLAIMS` items (a lone value: a list of one)."""
    items: list[Any] = [] if value is None else value if isinstance(value, list) else [value]
    if len(items) > MAX_CLAIMS:
        raise ReplayRefused(
            f"the letter's {what} has {len(items)} entries (more than {MAX_CLAIMS}): not judged, not replayed"
        )
    return items


def _whose(registry: Registry, key: str) -> str:
    """`` — the key of X (a command of S)`` when another message type has that key."""
    for spec in registry.messages.values():
        if spec.routing_key == key:
            return f" — it is the key of {spec.message_type} (a {spec.kind} of {spec.service})"
    return ""


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:_SHOWN] + ("…" if len(text) > _SHOWN else ""))
