"""Property tests of the envelope parser: any input either parses to a valid Message or
raises EnvelopeError with a known reason — never another exception, never a half-valid message.

The receiver dead-letters whatever raises here, so an exception of another type would
crash it (or, caught broadly, hide the reason), and a message accepted with a bad field
would be stored as valid.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from framework.envelope import Message, format_timestamp, parse_message
from framework.errors import EnvelopeError
from framework.reasons import Reason

REASONS = {
    Reason.EMPTY_BODY,
    Reason.NOT_UTF8,
    Reason.NOT_JSON,
    Reason.TOO_DEEP,
    Reason.NOT_OBJECT,
    Reason.MISSING_FIELD,
    Reason.INVALID_FIELD,
}
REQUIRED = ("payload", "message_id", "timestamp", "message_type", "aggregate_id", "aggregate_type", "message_version")
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SAMPLE: dict[str, Any] = {
    "payload": {"sku": "A-1", "quantity": 3},
    "message_id": "3eb8257f-1341-49fb-bf77-027549cd4761",
    "timestamp": "2024-03-02T08:56:22.555Z",
    "message_type": "PlaceOrder",
    "aggregate_id": "3",
    "aggregate_type": "order",
    "message_version": "1.0",
}

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=15,
)
json_objects = st.dictionaries(st.text(max_size=12), json_values, max_size=5)
timestamps = st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)).map(
    lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000)
)


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    """A valid envelope as a JSON-ready dict (what a well-behaved producer sends)."""
    out: dict[str, Any] = {
        "payload": draw(json_objects),
        "message_context": draw(st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=3)),
        "message_id": str(draw(st.uuids())),
        "timestamp": format_timestamp(draw(timestamps)),
        "message_type": draw(st.text(min_size=1, max_size=40)),
        "aggregate_id": draw(st.text(min_size=1, max_size=40)),
        "aggregate_type": draw(st.text(min_size=1, max_size=40)),
        "message_version": draw(st.text(max_size=8)),
    }
    if draw(st.booleans()):
        out["auth_token"] = draw(st.text(max_size=60))
    return out


def check_outcome(body: bytes | str) -> Message | None:
    """Parse; the outcome must be a valid Message or an EnvelopeError with a known reason."""
    try:
        message = parse_message(body)
    except EnvelopeError as exc:
        assert exc.reason in REASONS, exc.reason
        assert str(exc)
        return None
    assert isinstance(message.message_id, uuid.UUID)
    for name in ("message_type", "aggregate_id", "aggregate_type"):
        value = getattr(message, name)
        assert isinstance(value, str) and value != "", name
    assert isinstance(message.message_version, str)
    assert isinstance(message.payload, dict)
    assert isinstance(message.message_context, dict)
    assert message.timestamp.tzinfo is not None
    assert message.auth_token is None or isinstance(message.auth_token, str)
    # What we accepted we can send on unchanged: a parsed message round-trips.
    assert parse_message(message.to_json()) == message
    return message


@FAST
@given(st.binary(max_size=300))
@example(b"")
@example(b"\xff\xfe")
@example(b"[" * 100_000)
@example(b'{"a":' * 50_000)
def test_arbitrary_bytes_never_crash_the_parser(body: bytes) -> None:
    check_outcome(body)


@FAST
@given(json_values)
def test_arbitrary_json_never_crashes_the_parser(value: Any) -> None:
    message = check_outcome(json.dumps(value))
    if not isinstance(value, dict):
        assert message is None


@FAST
@given(envelopes())
def test_valid_envelopes_parse_and_round_trip(data: dict[str, Any]) -> None:
    message = parse_message(json.dumps(data).encode())
    assert message.message_id == uuid.UUID(data["message_id"])
    assert message.payload == data["payload"]
    assert json.loads(message.to_json()) == {k: v for k, v in data.items() if k != "message_context"} | {
        "message_context": data["message_context"]
    }


@FAST
@given(envelopes(), st.sampled_from(REQUIRED))
def test_a_missing_required_field_is_named(data: dict[str, Any], name: str) -> None:
    del data[name]
    try:
        parse_message(json.dumps(data))
    except EnvelopeError as exc:
        assert (exc.reason, exc.field) == (Reason.MISSING_FIELD, name)
    else:
        raise AssertionError(f"accepted an envelope without {name}")


@FAST
@given(envelopes(), st.sampled_from((*REQUIRED, "message_context", "auth_token")), json_values)
def test_a_field_of_the_wrong_shape_is_rejected_or_valid(data: dict[str, Any], name: str, value: Any) -> None:
    """Replace one field by any JSON value: rejected naming that field, or still a valid message."""
    data[name] = value
    try:
        message = parse_message(json.dumps(data))
    except EnvelopeError as exc:
        assert exc.reason == Reason.INVALID_FIELD, exc
        assert exc.field == name
        return
    check_outcome(json.dumps(data))
    if name == "message_id":
        assert message.message_id == uuid.UUID(value)


@FAST
@given(
    envelopes(),
    st.sampled_from(("timestamp", "message_id")),
    st.text(max_size=40)
    | st.sampled_from(
        ["0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00", "2024-03-02T08:56:22", "2024-13-01T00:00:00Z"]
    ),
)
@example(data=None, name="timestamp", text="0001-01-01T00:00:00+05:00")  # OverflowError once
@example(data=None, name="timestamp", text="9999-12-31T23:59:59-05:00")
def test_malformed_ids_and_times_are_invalid_fields(data: dict[str, Any] | None, name: str, text: str) -> None:
    data = dict(data or SAMPLE)
    data[name] = text
    check_outcome(json.dumps(data))


@FAST
@given(envelopes(), st.integers(min_value=0, max_value=400))
def test_truncated_envelopes_are_rejected_cleanly(data: dict[str, Any], cut: int) -> None:
    body = json.dumps(data).encode()
    if cut < len(body):
        assert check_outcome(body[:cut]) is None


any_text = st.text(alphabet=st.characters(categories=["Cs", "Cc", "L", "N", "So"]), max_size=12)


@FAST
@given(
    envelopes(), st.sampled_from(("message_type", "aggregate_id", "auth_token", "payload", "message_context")), any_text
)
@example(data=SAMPLE, name="payload", text="\ud800")
@example(data=SAMPLE, name="message_type", text="a\udfffb")
def test_lone_surrogates_are_rejected_not_accepted(data: dict[str, Any], name: str, text: str) -> None:
    """JSON can escape half a UTF-16 pair (`\\ud800`); no UTF-8 encoder takes the result.

    Accepting it would crash whoever stores or re-sends the message (PostgreSQL, psycopg,
    ``to_json``), so it must be rejected here with a reason.
    """
    data = dict(data)
    data[name] = {"k": text} if name in ("payload", "message_context") else text
    body = json.dumps(data).encode()  # ensure_ascii: lone surrogates become \\udxxx escapes
    message = check_outcome(body)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert message is None
