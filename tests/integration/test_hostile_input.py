"""Hostile input against the real receiver: arbitrary bodies, headers and properties.

Whatever arrives on the inbox queue, the receiver must (1) keep running, (2) store only
messages that really are valid envelopes of a type the service accepts, with a payload
its schema allows, and (3) put everything else in the dead letters — each delivery ends
in exactly one of the two places, with its raw body kept byte for byte.

Each delivery carries a tag header of our own, so its outcome can be found whatever
hypothesis did to the rest of it.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from framework import names, topology
from framework.dead_letters import decode_body
from framework.envelope import parse_message
from framework.reasons import Reason
from framework.receiver import Receiver, ReceiverConfig
from framework.redaction import redact_bytes
from framework.service import Service
from tests import support
from tests.apps.helpers import place_order, publish, query, running, scalar

TAG = "x-hostile-case"
KNOWN_REASONS = {
    Reason.EMPTY_BODY,
    Reason.NOT_UTF8,
    Reason.NOT_JSON,
    Reason.TOO_DEEP,
    Reason.NOT_OBJECT,
    Reason.MISSING_FIELD,
    Reason.INVALID_FIELD,
    Reason.UNKNOWN_MESSAGE_TYPE,
    Reason.SCHEMA_INVALID,
    Reason.TOO_LARGE,
    Reason.WRONG_CONTENT_TYPE,
    Reason.NOT_ACCEPTED,
    Reason.UNSTORABLE,
    Reason.WRONG_ROUTE,  # a type sent on another type's routing key
}
ROUTING_KEYS = ("order-service.order.place", "inventory-service.stock.reserved", "inventory-service.stock.rejected")
EXCHANGE_OF = {ROUTING_KEYS[0]: "command", ROUTING_KEYS[1]: "event", ROUTING_KEYS[2]: "event"}

# --- strategies -------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and ±Infinity included: not JSON, jsonb refuses them
    | st.text(max_size=20)  # includes \x00, which jsonb refuses inside strings
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
header_values = st.recursive(
    st.text(max_size=20)
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.booleans()
    | st.none()
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = (
    "payload",
    "message_context",
    "message_id",
    "timestamp",
    "message_type",
    "aggregate_id",
    "aggregate_type",
    "message_version",
    "auth_token",
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """Raw junk, or a valid PlaceOrder (fresh id) bent in one or two places."""
    choice = draw(st.integers(0, 5))
    if choice == 0:
        return draw(st.binary(max_size=200))
    if choice == 1:
        return json.dumps(draw(json_like)).encode()
    data = place_order(aggregate_id=draw(st.text(min_size=1, max_size=10)))
    data["payload"] = {
        "customer": draw(st.text(min_size=1, max_size=30)),
        "sku": draw(st.from_regex(r"[A-Z0-9-]{1,10}", fullmatch=True)),
        "quantity": draw(st.integers(1, 1000)),
    }
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(FIELDS))
        action = draw(st.sampled_from(("drop", "replace", "payload-field")))
        if action == "drop":
            data.pop(name, None)
        elif action == "replace":
            data[name] = draw(json_like)
        elif isinstance(data.get("payload"), dict):
            data["payload"][draw(st.sampled_from(("customer", "sku", "quantity", "extra")))] = draw(json_like)
    if choice == 5:
        data["message_type"] = draw(st.sampled_from(("StockReserved", "StockRejected", "OrderPlaced", "RestockItem")))
    text = json.dumps(data, allow_nan=True)
    if choice == 4:  # truncated or with trailing junk
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=5))
    return text.encode("utf-8", errors="surrogatepass")


@st.composite
def properties(draw: st.DrawFn) -> pika.BasicProperties:
    headers = draw(st.dictionaries(st.text(min_size=1, max_size=12), header_values, max_size=4))
    return pika.BasicProperties(
        content_type=draw(
            st.none()
            | st.sampled_from(("application/json", "application/json; charset=utf-8", "APPLICATION/JSON"))
            | st.text(max_size=20)
        ),
        message_id=draw(st.none() | st.text(max_size=40) | st.uuids().map(str)),
        type=draw(st.none() | st.text(max_size=20)),
        priority=draw(st.none() | st.integers(0, 255)),
        timestamp=draw(st.none() | st.integers(0, 2**40)),
        delivery_mode=draw(st.sampled_from((1, 2))),
        correlation_id=draw(st.none() | st.text(max_size=20)),
        headers=headers,
    )


cases = st.lists(st.tuples(bodies(), properties(), st.sampled_from(ROUTING_KEYS)), min_size=1, max_size=12)


def _valid(**fields: Any) -> bytes:
    """A PlaceOrder envelope (payload fields or envelope fields overridden), as JSON bytes."""
    data = place_order()
    for name, value in fields.items():
        if name in data["payload"]:
            data["payload"][name] = value
        else:
            data[name] = value
    return json.dumps(data, allow_nan=True).encode()


def _json_props(headers: dict[str, Any] | None = None) -> pika.BasicProperties:
    return pika.BasicProperties(content_type="application/json", delivery_mode=2, headers=headers or {})


# --- the test -----------------------------------------------------------------------------


@pytest.fixture
def receiver(service: Service) -> Iterator[Receiver]:
    topology.declare(service.settings, service.registry)
    daemon = Receiver(service, ReceiverConfig(prefetch=100, batch_size=20))
    with running(daemon):
        yield daemon


def _publish(amqp_url: str, batch: list[tuple[str, bytes, pika.BasicProperties, str]]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for tag, body, props, key in batch:
            props.headers = {**(props.headers or {}), TAG: tag}
            channel.basic_publish(EXCHANGE_OF[key], key, body, props, mandatory=True)
    finally:
        connection.close()


def _outcomes(database_url: str, tags: list[str]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    stored: dict[str, list[Any]] = {}
    for tag, row_id, message_type, payload in query(
        database_url,
        "SELECT metadata->'properties'->'headers'->>%s, id, message_type, payload FROM txbox.inbox "
        "WHERE metadata->'properties'->'headers'->>%s = ANY(%s)",
        (TAG, TAG, tags),
    ):
        stored.setdefault(tag, []).append((row_id, message_type, payload))
    rejected: dict[str, list[Any]] = {}
    for tag, reason, raw, encoding, message_id in query(
        database_url,
        "SELECT headers->>%s, reason, raw_body, raw_encoding, message_id FROM txbox.dead_letters "
        "WHERE headers->>%s = ANY(%s)",
        (TAG, TAG, tags),
    ):
        rejected.setdefault(tag, []).append((reason, raw, encoding, message_id))
    return stored, rejected


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=cases)
@example(batch=[(_valid(customer="nul\x00inside"), _json_props(), ROUTING_KEYS[0])])
@example(batch=[(_valid(customer="lone \ud800 surrogate"), _json_props(), ROUTING_KEYS[0])])
@example(batch=[(_valid(message_context={"n": math.nan}), _json_props(), ROUTING_KEYS[0])])
@example(batch=[(_valid(), _json_props({"h\x00": "v\x00", "b": b"\xff\x00"}), ROUTING_KEYS[0])])
@example(batch=[(_valid(message_type="Bad\x00Type"), _json_props(), ROUTING_KEYS[0])])
def test_every_delivery_is_stored_valid_or_dead_lettered(
    batch: list[tuple[bytes, pika.BasicProperties, str]],
    receiver: Receiver,
    service: Service,
    database_url: str,
    amqp_url: str,
) -> None:
    tagged = [(uuid.uuid4().hex, body, props, key) for body, props, key in batch]
    _publish(amqp_url, tagged)
    tags = [t for t, *_ in tagged]

    def settled() -> bool:
        stored, rejected = _outcomes(database_url, tags)
        return all(t in stored or t in rejected for t in tags)

    support.wait_until(settled, 30, message="every hostile delivery stored or dead-lettered")
    stored, rejected = _outcomes(database_url, tags)
    accepted = {spec.message_type for spec in service.registry.accepted_types(service.name)}
    for tag, body, _props, _key in tagged:
        outcomes = len(stored.get(tag, [])) + len(rejected.get(tag, []))
        assert outcomes == 1, f"delivery {body[:80]!r} ended {outcomes} times (inbox {stored.get(tag)})"
        if tag in stored:
            # Stored as valid: it really is a valid envelope of an accepted type and schema.
            (row_id, message_type, payload) = stored[tag][0]
            message = parse_message(body)
            assert message.message_id == row_id
            assert message_type == message.message_type and message_type in accepted
            service.registry.get(message_type).validate(payload)
            assert payload == message.payload
            assert not _has_non_finite(payload)
        else:
            reason, raw, encoding, _ = rejected[tag][0]
            assert reason in KNOWN_REASONS, reason
            assert decode_body(raw, encoding) == redact_bytes(body), (
                "the dead letter must keep the raw body as received"
            )


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


# --- the nastiest cases, one by one, some of them redelivered ---------------------------------


def _nested(depth: int, leaf: str = "1") -> str:
    """JSON text nested ``depth`` objects deep (built as text: json.dumps would hit the recursion limit)."""
    return '{"a":' * depth + leaf + "}" * depth


def _with_json(field: str, text: str) -> bytes:
    """A valid PlaceOrder whose ``field`` (envelope or payload field) is the JSON ``text``."""
    data = place_order()
    if field in data["payload"]:
        data["payload"][field] = "HOLE"
    else:
        data[field] = "HOLE"
    return json.dumps(data).replace('"HOLE"', text).encode()


def _deep_table(depth: int) -> dict[str, Any]:
    table: dict[str, Any] = {"bottom": 1}
    for _ in range(depth):
        table = {"t": table}
    return table


NUL_PROPERTIES = {
    "type": "Place\x00Order",
    "correlation_id": "c\x00",
    "app_id": "\x00app",
    "reply_to": "r\x00",
    "content_encoding": "utf\x008",
    "cluster_id": "\x00",
}
WRONG_HEADERS = {
    "x-death": "not a list",
    "x-first-death-reason": 42,
    names.HEADER_ATTEMPT: "many",
    names.HEADER_FINAL_ATTEMPT: "yes",
    names.HEADER_SEGMENT: b"\xff\x00",
    names.HEADER_CONCURRENCY: {"parallel": True},
    names.HEADER_PRIORITY: 10**12,
    names.HEADER_DEAD_REASON: ["x"],
    "nul\x00key": "nul\x00value",
}

# (name, body, properties, redelivered, expected outcome: "stored" or a dead-letter reason)
NASTY: list[tuple[str, bytes, dict[str, Any], bool, str]] = [
    ("NUL message_id, redelivered", _valid(), {"message_id": "a\x00b"}, True, "stored"),
    ("overlong non-UUID message_id, redelivered", _valid(), {"message_id": "m" * 255}, True, "stored"),
    ("NUL in every property, redelivered", _valid(), {**NUL_PROPERTIES, "message_id": "\x00"}, True, "stored"),
    ("NUL in every property", _valid(), NUL_PROPERTIES, False, "stored"),
    ("wrong-typed headers, redelivered", _valid(), {"headers": WRONG_HEADERS}, True, "stored"),
    ("headers nested 300 deep", _valid(), {"headers": {"deep": _deep_table(300)}}, False, "stored"),
    ("context nested 990 deep", _with_json("message_context", _nested(990)), {}, False, Reason.TOO_DEEP),
    ("payload field nested 990 deep", _with_json("customer", _nested(990)), {}, False, Reason.TOO_DEEP),
    ("context nested 990 deep, redelivered", _with_json("message_context", _nested(990)), {}, True, "too_deep"),
    ("context nested 150 deep", _with_json("message_context", _nested(150)), {}, False, "stored"),
    ("auth_token nested 500 deep", _with_json("auth_token", _nested(500)), {}, False, Reason.TOO_DEEP),
    ("arrays 5000 deep", b"[" * 5000 + b"]" * 5000, {}, True, Reason.TOO_DEEP),
    ("NUL in a payload string", _valid(customer="nul\x00"), {}, False, Reason.UNSTORABLE),
]


def _publish_nasty(amqp_url: str, cases: list[tuple[str, bytes, dict[str, Any], bool, str]]) -> list[str]:
    tags = []
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for _name, body, props, _redelivered, _expected in cases:
            tag = uuid.uuid4().hex
            tags.append(tag)
            extra = {k: v for k, v in props.items() if k != "headers"}
            properties = pika.BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                headers={**props.get("headers", {}), TAG: tag},
                **extra,
            )
            channel.basic_publish("command", ROUTING_KEYS[0], body, properties, mandatory=True)
    finally:
        connection.close()
    return tags


def _take_without_ack(amqp_url: str, queue: str, count: int) -> None:
    """Hold ``count`` deliveries, then drop the connection: RabbitMQ redelivers them flagged redelivered."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    for _ in range(count):
        method, _props, _body = channel.basic_get(queue, auto_ack=False)
        assert method is not None
    connection.close()


def test_the_nastiest_deliveries_end_in_a_defined_outcome_and_the_receiver_goes_on(
    service: Service, database_url: str, amqp_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    queue = names.inbox_queue(service.name)
    redelivered = [case for case in NASTY if case[3]]
    first = [case for case in NASTY if not case[3]]
    tags = _publish_nasty(amqp_url, redelivered)
    _take_without_ack(amqp_url, queue, len(redelivered))
    tags += _publish_nasty(amqp_url, first)
    cases = redelivered + first
    with running(Receiver(service, ReceiverConfig(prefetch=100, batch_size=20))):
        support.wait_until(
            lambda: all(t in s or t in r for s, r in [_outcomes(database_url, tags)] for t in tags),
            30,
            message="every nasty delivery stored or dead-lettered",
        )
        # The receiver is still alive and well: a plain message behind them is stored.
        tail = place_order()
        publish(amqp_url, [json.dumps(tail).encode()])
        support.wait_until(
            lambda: scalar(database_url, "SELECT count(*) FROM txbox.inbox WHERE id = %s", (tail["message_id"],)),
            30,
            message="the message behind them to be stored",
        )
    stored, rejected = _outcomes(database_url, tags)
    for tag, (name, body, _props, _redelivered, expected) in zip(tags, cases, strict=True):
        outcomes = stored.get(tag, []) + rejected.get(tag, [])
        assert len(outcomes) == 1, f"{name}: ended {len(outcomes)} times"
        if expected == "stored":
            assert tag in stored, f"{name}: dead-lettered as {rejected.get(tag)}"
        else:
            assert tag in rejected, f"{name}: stored"
            reason, raw, encoding, _ = rejected[tag][0]
            assert reason == expected, f"{name}: {reason}"
            assert decode_body(raw, encoding) == redact_bytes(body)  # as received, but for secrets
    assert scalar(database_url, "SELECT count(*) FROM txbox.redeliveries") == 0, "settled counters are dropped"
    segments = {
        r[0]
        for r in query(
            database_url,
            "SELECT segment FROM txbox.inbox WHERE metadata->'properties'->'headers'->>%s = ANY(%s)",
            (TAG, tags),
        )
    }
    assert segments == {"order:42"}, "untrusted or malformed lane headers are ignored"
