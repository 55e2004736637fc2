"""What the fuzz suite publishes: generated deliveries, each with the outcome the spec demands.

A :class:`Case` is one delivery (route, raw body, AMQP properties) plus its expectation:

- ``valid``: a well-formed envelope of an accepted type: stored in the inbox once;
- ``dup_same``: the same message again (same id, same content): a quiet duplicate;
- ``dup_conflict``: the same message id with other content: dead-lettered as ``id_conflict``;
- ``hostile``: anything else sent to the inbox queue: dead-lettered, nothing stored;
- ``either``: valid by the contract but past a limit the spec leaves open (nesting depth):
  stored once or dead-lettered, but exactly one of the two;
- ``collected``: published to the ``dead_letter`` exchange: one dead letter, whatever it holds.

Bodies, headers and properties are built with plain ``json``/strings and sent with plain
pika, never through txbox's own encoder. Large and deep values are built from drawn
sizes, not drawn byte by byte, so hypothesis stays fast.
"""

from __future__ import annotations

import datetime as dt
import json
import reprlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

SERVICE = "order-service"
TAG = "x-fuzz-case"  # header naming the case; kept by both daemons in the dead letter / inbox metadata
MAX_BODY_BYTES = 65_536  # the receiver under test runs with this limit (TXBOX_RECEIVER_MAX_BODY_BYTES)

COMMAND_KEY = "order-service.order.place"
ROUTES: dict[str, tuple[str, str]] = {  # route → (exchange, routing key)
    "command": ("command", COMMAND_KEY),
    "inbox": ("", f"{SERVICE}:inbox"),  # straight to the queue through the default exchange
    "retry": ("retry", f"{SERVICE}:inbox.{COMMAND_KEY}"),  # as a delayed retry comes back
    "dead_letter": ("dead_letter", f"{SERVICE}.dead_letter"),
}
# Routes a valid message may take. Straight into the queue is no contract's route: the
# receiver dead-letters what comes that way as wrong_route (hostile cases use it).
INBOX_ROUTES = ("command", "retry")
HOSTILE_ROUTES = ("command", "inbox", "retry")
EXPECTATIONS = ("valid", "dup_same", "dup_conflict", "hostile", "either", "collected")


@dataclass(repr=False)
class Case:
    expect: str
    route: str
    body: bytes
    properties: dict[str, Any]  # keyword arguments of pika.BasicProperties (headers without the tag)
    what: str  # a few words saying what was generated, for the report
    message_id: uuid.UUID | None = None  # valid/duplicate cases
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __repr__(self) -> str:  # short: bodies and header tables may be nested thousands deep
        return describe(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints an example
        printer.text(describe(self))


# --- envelopes ------------------------------------------------------------------------------


def envelope(message_id: uuid.UUID, **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "payload": {"customer": "ada", "sku": "SKU-1", "quantity": 1},
        "message_context": {"example_correlation_id": str(uuid.uuid4())},
        "message_id": str(message_id),
        "timestamp": "2026-11-24T10:00:00.000Z",
        "message_type": "PlaceOrder",
        "aggregate_id": "42",
        "aggregate_type": "order",
        "message_version": "1.0",
        "auth_token": "secret-token",
    }
    data.update(overrides)
    return data


def dumps(data: Any) -> bytes:
    return json.dumps(data, allow_nan=True).encode("utf-8", "surrogatepass")


def with_raw(data: dict[str, Any], field_name: str, raw_json: str) -> bytes:
    """``data`` as JSON with ``field_name`` spliced in as the raw text ``raw_json`` (deep values, bad JSON)."""
    marker = f"@@{uuid.uuid4().hex}@@"
    text = json.dumps({**data, field_name: marker})
    return text.replace(json.dumps(marker), raw_json, 1).encode("utf-8", "surrogatepass")


def deep_json(depth: int, kind: str) -> str:
    """Nesting of ``depth`` levels without recursion: objects, arrays or a mix."""
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    if kind == "array":
        return "[" * depth + "1" + "]" * depth
    opening = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    closing = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return opening + "1" + closing


# --- strategies: text, JSON and header values ---------------------------------------------------

# Control characters, NUL, RTL marks, non-BMP: the characters that break storage and logs.
nasty_text = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",))
    | st.sampled_from(["\x00", "\x01", "\x1b", "\x7f", "\u2028", "\u202e", "\ufeff", "\U0001f4a9", "\\", '"']),
    max_size=24,
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and ±Infinity: not JSON, yet Python's json writes them
    | nasty_text
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(nasty_text, inner, max_size=3), max_leaves=10
)
header_keys = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=16
) | st.sampled_from(
    ["x-death", "x-txbox-attempt", "x-txbox-final-attempt", "x-txbox-segment", "x-txbox-concurrency", "x-txbox-reason"]
)
header_scalars = (
    nasty_text
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.booleans()
    | st.none()
    | st.binary(max_size=16)
    | st.decimals(places=2, min_value=-(10**6), max_value=10**6, allow_nan=False)
    | st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(2100, 1, 1)).map(
        lambda d: d.replace(microsecond=0)
    )
)
header_values = st.recursive(
    header_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(header_keys, inner, max_size=3),
    max_leaves=8,
)


def deep_table(depth: int, kind: str) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = {"d": value} if kind == "object" else [value]
    return value


@st.composite
def header_tables(draw: st.DrawFn) -> dict[str, Any]:
    """Random tables, sometimes deep, wide or large, sometimes with wrong-typed txbox headers."""
    headers: dict[str, Any] = draw(st.dictionaries(header_keys, header_values, max_size=5))
    shape = draw(st.sampled_from(("plain", "plain", "deep", "wide", "large", "txbox")))
    if shape == "deep":
        headers["deep"] = deep_table(
            draw(st.sampled_from((20, 100, 480, 520, 1500))), draw(st.sampled_from(("object", "list")))
        )
    elif shape == "wide":
        headers.update({f"k{i}": i for i in range(draw(st.sampled_from((200, 1000))))})
    elif shape == "large":
        headers["large"] = "x" * draw(st.sampled_from((10_000, 60_000)))
    elif shape == "txbox":
        wrong = st.sampled_from(["3", -1, 0, 2**62, b"\x00", {"n": 1}, [1, 2], "yes", "", "\x00", Decimal("1.5"), None])
        for name in ("x-txbox-attempt", "x-txbox-final-attempt", "x-txbox-segment", "x-txbox-concurrency"):
            if draw(st.booleans()):
                headers[name] = draw(wrong)
    return headers


def _segment_is_storable(headers: dict[str, Any]) -> bool:
    """A string segment header becomes a text column; PostgreSQL text holds no NUL."""
    segment = headers.get("x-txbox-segment")
    return not (isinstance(segment, str) and "\x00" in segment)


@st.composite
def plain_properties(draw: st.DrawFn, *, hostile: bool) -> dict[str, Any]:
    """Properties a sender may set. Hostile ones add content types, expirations and odd ids."""
    props: dict[str, Any] = {
        "delivery_mode": draw(st.sampled_from((1, 2))),
        "priority": draw(st.none() | st.integers(0, 255)),
        "timestamp": draw(st.none() | st.integers(0, 2**63 - 1)),
        "correlation_id": draw(st.none() | st.text(max_size=40)),
        "app_id": draw(st.none() | st.text(max_size=20)),
        "headers": draw(header_tables()),
    }
    if hostile:
        props["content_type"] = draw(
            st.none()
            | st.sampled_from(("application/json", "text/plain", "application/octet-stream", ""))
            | st.text(max_size=30)
        )
        props["content_encoding"] = draw(st.none() | st.sampled_from(("gzip", "utf-16", "")))
        props["message_id"] = draw(st.none() | st.text(max_size=60) | st.uuids().map(str))
        props["type"] = draw(st.none() | st.text(max_size=30))
        props["expiration"] = draw(st.none() | st.sampled_from(("0", "1", "60000")))
        if "expiration" in props:
            # RabbitMQ 3.10 itself loses a message with a malformed x-death that expires in the
            # inbox queue (its dead-lettering crashes the queue's leader), before any txbox
            # daemon sees it (docs/explanation/receive.md, "Receiver intake"): not a case to judge.
            props["headers"].pop("x-death", None)
        props["user_id"] = None  # the broker refuses a user_id other than the connection's
    else:
        props["content_type"] = draw(
            st.none() | st.sampled_from(("application/json", "application/json; charset=utf-8", "Application/JSON"))
        )
    return {k: v for k, v in props.items() if v is not None}


# --- strategies: cases -------------------------------------------------------------------------

SAFE_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from(["\x01", "\x1b", "\u202e"]),
    min_size=1,
    max_size=40,
)


@st.composite
def valid_cases(draw: st.DrawFn) -> Case:
    """A valid PlaceOrder (context may be odd but storable), over any inbox route, any headers."""
    message_id = uuid.uuid4()
    payload = {
        "customer": draw(SAFE_TEXT.filter(lambda s: len(s) <= 200)),
        "sku": draw(st.from_regex(r"[A-Z0-9-]{1,40}", fullmatch=True)),
        "quantity": draw(st.integers(1, 1000)),
    }
    context = draw(st.dictionaries(SAFE_TEXT, SAFE_TEXT | st.integers(-(2**53), 2**53) | st.booleans(), max_size=4))
    data = envelope(message_id, payload=payload, message_context=context, aggregate_id=draw(SAFE_TEXT))
    if draw(st.booleans()):
        data.pop("auth_token")
    if draw(st.booleans()):
        data.pop("message_context")
    props = draw(plain_properties(hostile=False))
    if draw(st.booleans()):
        props["message_id"] = str(message_id)
    expect = "valid" if _segment_is_storable(props["headers"]) else "either"
    shape = draw(st.sampled_from(("plain", "plain", "near_limit")))
    if shape == "near_limit":  # sizes around the receiver's body limit: stored up to it, rejected past it
        size = MAX_BODY_BYTES + draw(st.integers(-3, 3))
        data["message_context"] = {"pad": ""}
        pad = size - len(dumps(data))
        data["message_context"]["pad"] = "p" * max(pad, 0)
        body = dumps(data)
        if len(body) > MAX_BODY_BYTES:
            expect = "hostile"
        return Case(expect, draw(st.sampled_from(INBOX_ROUTES)), body, props, f"valid, {len(body)} bytes", message_id)
    return Case(expect, draw(st.sampled_from(INBOX_ROUTES)), dumps(data), props, "valid", message_id)


def duplicate(original: Case, *, conflicting: bool, route: str) -> Case:
    """The same message again: byte for byte, or with the same id and other content."""
    props = dict(original.properties)  # never mutated: publishing builds its own copy
    if not conflicting:
        return Case("dup_same", route, original.body, props, "same id, same content", original.message_id)
    data = json.loads(original.body)
    data["payload"]["quantity"] = data["payload"]["quantity"] % 1000 + 1
    data["aggregate_id"] = data["aggregate_id"] + "-other"
    return Case("dup_conflict", route, dumps(data), props, "same id, other content", original.message_id)


FIELDS = ("payload", "message_context", "message_id", "timestamp", "message_type", "aggregate_id",
          "aggregate_type", "message_version", "auth_token")  # fmt: skip


Hostile = tuple[bytes, str, str]


@st.composite
def hostile_bodies(draw: st.DrawFn) -> Hostile:
    """(body, what, expectation) of a body the receiver must dead-letter (or, for depth, may store)."""
    kind = draw(st.sampled_from(HOSTILE_KINDS))
    data = envelope(uuid.uuid4())
    return _HOSTILE[kind](draw, data)


def _random_bytes(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    return draw(st.binary(max_size=200)), "random bytes", "hostile"


def _encoding(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    """The right envelope in another encoding, or behind a byte order mark."""
    text = json.dumps(data, ensure_ascii=False)
    codec = draw(st.sampled_from(("utf-16", "utf-32", "utf-8-sig")))
    return text.encode(codec), f"envelope in {codec}", "hostile"


def _empty(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    return draw(st.sampled_from((b"", b" ", b"\n\t"))), "empty body", "hostile"


def _not_an_object(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    return dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))), "JSON, not an object", "hostile"


def _wrong_type(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    name = draw(st.sampled_from(FIELDS))
    bad = draw(json_values.filter(lambda v: not isinstance(v, str) or name in ("payload", "message_context")))
    if name in ("payload", "message_context") and isinstance(bad, dict):
        bad = [bad]
    if name == "auth_token" and bad is None:
        bad = 0
    data[name] = bad
    return dumps(data), f"{name} of a wrong type", "hostile"


def _missing(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    name = draw(st.sampled_from([f for f in FIELDS if f not in ("message_context", "auth_token")]))
    data.pop(name)
    return dumps(data), f"{name} missing", "hostile"


def _nul(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    where = draw(st.sampled_from(("customer", "context", "aggregate_id", "message_type")))
    text = "a\x00b"
    if where == "customer":
        data["payload"]["customer"] = text
    elif where == "context":
        data["message_context"] = {"k\x00": text}
    else:
        data[where] = text
    return dumps(data), f"NUL in {where}", "hostile"


def _deep(name: str) -> Callable[[st.DrawFn, dict[str, Any]], Hostile]:
    """A ``payload`` or ``message_context`` nested deep."""

    def deep(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
        depth = draw(st.sampled_from((50, 200, 500, 900, 1000, 1100, 3000, 20_000)))
        shape = draw(st.sampled_from(("object", "array", "mixed")))
        if name == "payload":  # the schema allows no extra field: deep payload is schema-invalid
            raw = '{"customer":"ada","sku":"S","quantity":1,"extra":' + deep_json(depth, shape) + "}"
            expect = "hostile"
        else:
            raw = '{"deep":' + deep_json(depth, shape) + "}"
            expect = "either"  # a valid context: stored, or rejected as too deep; never lost or doubled
        return with_raw(data, name, raw), f"{name} nested {depth} deep ({shape})", expect

    return deep


def _deep_body(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    depth = draw(st.sampled_from((1000, 5000, 100_000)))
    return (
        deep_json(depth, draw(st.sampled_from(("object", "array", "mixed")))).encode(),
        f"body nested {depth}",
        "hostile",
    )


def _oversized(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    size = draw(st.sampled_from((MAX_BODY_BYTES + 1, 2 * MAX_BODY_BYTES, 600_000)))
    data["message_context"] = {"pad": "o" * size}
    return dumps(data), f"{size}+ bytes", "hostile"


def _truncated(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    text = dumps(data)
    return text[: draw(st.integers(1, len(text) - 1))], "truncated envelope", "hostile"


def _surrogate(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    data["payload"]["customer"] = "lone \ud800"
    return dumps(data), "lone surrogate escape", "hostile"


def _nan(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    data["message_context"] = {"n": draw(st.sampled_from((float("nan"), float("inf"), float("-inf"))))}
    return dumps(data), "NaN/Infinity in the context", "hostile"


def _unknown_type(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    data["message_type"] = draw(st.sampled_from(("RestockItem", "PlaceOrder\x00", "placeorder")))
    return dumps(data), "unknown message type", "hostile"


def _not_accepted(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    data["message_type"] = "OrderPlaced"
    return dumps(data), "a type the service does not accept", "hostile"


def _bad_schema(draw: st.DrawFn, data: dict[str, Any]) -> Hostile:
    data["payload"] = draw(
        st.sampled_from(
            ({}, {"customer": "", "sku": "x", "quantity": 0}, {"customer": "a", "sku": "S", "quantity": 10**30})
        )
    )
    return dumps(data), "payload against the schema", "hostile"


# In the order the draw picks them from (a seed's examples depend on it).
_HOSTILE: dict[str, Callable[[st.DrawFn, dict[str, Any]], Hostile]] = {
    "bytes": _random_bytes,
    "json": _not_an_object,
    "wrong_type": _wrong_type,
    "missing": _missing,
    "nul": _nul,
    "deep_payload": _deep("payload"),
    "deep_context": _deep("message_context"),
    "deep_body": _deep_body,
    "oversized": _oversized,
    "truncated": _truncated,
    "surrogate": _surrogate,
    "nan": _nan,
    "unknown_type": _unknown_type,
    "not_accepted": _not_accepted,
    "bad_schema": _bad_schema,
    "empty": _empty,
    "encoding": _encoding,
}
HOSTILE_KINDS = tuple(_HOSTILE)


@st.composite
def hostile_cases(draw: st.DrawFn) -> Case:
    body, what, expect = draw(hostile_bodies())
    props = draw(plain_properties(hostile=True))
    return Case(expect, draw(st.sampled_from(HOSTILE_ROUTES)), body, props, what)


def _x_death() -> st.SearchStrategy[Any]:
    entry = st.fixed_dictionaries(
        {},
        optional={
            "count": st.integers(-(2**63), 2**63 - 1)
            | nasty_text
            | st.none()
            | st.decimals(places=1, allow_nan=False, min_value=-9, max_value=9),
            "queue": nasty_text | st.integers() | st.binary(max_size=8),
            "reason": st.sampled_from(("rejected", "expired", "maxlen", "delivery_limit")) | nasty_text | st.integers(),
            "exchange": nasty_text,
            "time": st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(2100, 1, 1)) | nasty_text,
            "routing-keys": st.lists(nasty_text, max_size=3) | nasty_text | st.integers() | st.just([]),
        },
    )
    return st.lists(entry | header_scalars, max_size=3) | header_scalars | entry


@st.composite
def collected_cases(draw: st.DrawFn) -> Case:
    """Anything published to the dead_letter exchange: valid or junk bodies, malformed x-death."""
    if draw(st.booleans()):
        body, what, _ = draw(hostile_bodies())
    else:
        body, what = dumps(envelope(uuid.uuid4())), "valid envelope"
    props = draw(plain_properties(hostile=True))
    props.pop("expiration", None)  # an expired dead letter would just be dropped by the broker
    headers = props["headers"]
    if draw(st.booleans()):
        headers["x-death"] = draw(_x_death())
        what += ", malformed x-death"
    for name in ("x-first-death-queue", "x-first-death-reason", "x-txbox-reason", "x-txbox-error", "x-txbox-attempt"):
        if draw(st.integers(0, 3)) == 0:
            headers[name] = draw(header_values)
    return Case("collected", "dead_letter", body, props, what)


@st.composite
def batches(draw: st.DrawFn, max_size: int) -> list[Case]:
    """Valid and hostile deliveries interleaved, with duplicates of some valid ones later in the batch."""
    cases: list[Case] = []
    for _ in range(draw(st.integers(1, max_size))):
        pick = draw(st.sampled_from(("valid", "valid", "hostile", "hostile", "collected", "duplicate")))
        # A conflicting copy grows a little: keep it clear of the body limit.
        originals = [c for c in cases if c.expect == "valid" and len(c.body) < MAX_BODY_BYTES - 100]
        if pick == "duplicate" and originals:
            original = draw(st.sampled_from(originals))
            cases.append(
                duplicate(original, conflicting=draw(st.booleans()), route=draw(st.sampled_from(INBOX_ROUTES)))
            )
        elif pick == "collected":
            cases.append(draw(collected_cases()))
        elif pick == "hostile":
            cases.append(draw(hostile_cases()))
        else:
            cases.append(draw(valid_cases()))
    return cases


def describe(case: Case) -> str:
    headers = case.properties.get("headers") or {}
    props = {k: v for k, v in case.properties.items() if k != "headers"}
    return (
        f"{case.expect} via {case.route}: {case.what}; body {len(case.body)} bytes {case.body[:80]!r}; "
        f"properties {_clip(props)}; headers {_clip(headers)}"
    )


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxdict, _SHORT.maxlist = 4, 60, 60, 6, 4


def _clip(value: Any) -> str:
    """A short repr, also of tables nested a thousand deep (plain repr would recurse)."""
    return _SHORT.repr(value)


def landmarks() -> list[list[Case]]:
    """One delivery of each hostile class a past run found, each in a batch of its own, run first.

    Generated batches find these too, given enough examples; listing them keeps the
    bounded run of `make test` sure to meet each one, and a batch of its own keeps one
    class from hiding the next behind a crash.
    """
    json_props: dict[str, Any] = {"content_type": "application/json", "delivery_mode": 2, "headers": {}}

    def props(**headers: Any) -> dict[str, Any]:
        return {**json_props, "headers": headers}

    first, second = uuid.uuid4(), uuid.uuid4()
    big = dumps(envelope(uuid.uuid4(), message_context={"pad": "o" * 70_000}))
    deep_context = with_raw(envelope(uuid.uuid4()), "message_context", '{"deep":' + deep_json(3000, "mixed") + "}")
    deep_payload = with_raw(envelope(uuid.uuid4()), "payload", '{"extra":' + deep_json(500, "object") + "}")
    deep_960 = with_raw(envelope(uuid.uuid4()), "message_context", '{"deep":' + deep_json(960, "object") + "}")
    third = uuid.uuid4()
    original = Case("valid", "command", dumps(envelope(first)), props(), "valid", first)
    return [[original, duplicate(original, conflicting=False, route="command"),
             duplicate(original, conflicting=True, route="retry")]] + [[case] for case in [
        Case("hostile", "command", dumps(envelope(uuid.uuid4()))[:-5], props(), "truncated envelope"),
        Case("hostile", "inbox", b"\xff\xfe\x00junk", props(), "random bytes"),
        Case("hostile", "command", deep_json(100_000, "array").encode(), props(), "body nested 100000"),
        Case("hostile", "retry", big, props(), "70000+ bytes"),
        Case("either", "command", deep_context, props(), "message_context nested 3000 deep (mixed)"),
        Case("hostile", "command", deep_payload, props(), "payload nested 500 deep (object)"),
        Case("either", "command", deep_960, props(), "message_context nested 960 deep (object)"),
        Case("valid", "command", dumps(envelope(third)), props(b=b"\x00"), "valid, a bytes header holding NUL", third),
        Case("hostile", "inbox", dumps(envelope(uuid.uuid4())), props(), "valid envelope, straight into the queue"),
        Case("valid", "command", dumps(envelope(second)), props(deep=deep_table(1500, "object")),
             "valid, header table nested 1500 deep", second),
        Case("collected", "dead_letter", b"not json", props(**{"x-death": "not a list"}), "x-death a string"),
        Case("collected", "dead_letter", b"not json", props(**{"x-death": [1, "two"]}), "x-death entries not tables"),
        Case("collected", "dead_letter", b"not json", props(**{"x-death": [{"count": "many", "queue": "q"}]}),
             "x-death count not a number"),
        Case("collected", "dead_letter", dumps(envelope(uuid.uuid4(), message_type="Place\x00Order")), props(),
             "NUL in an envelope's message_type"),
        Case("collected", "dead_letter", deep_payload, props(), "payload nested 500 deep (object)"),
        Case("collected", "dead_letter", b"not json", props(deep=deep_table(1500, "list")),
             "header table nested 1500 deep"),
    ]]  # fmt: skip
