import dataclasses
import json
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from framework.envelope import Message, message_from_dict, parse_message, peek_top_level
from framework.errors import EnvelopeError

# The sample envelope of Mosaic's guide (docs/explanation/relay.md, "The envelope"), verbatim.
SEED_ENVELOPE = """{
"payload":{"title": "Example Title 1", "count": 3},
"message_context":{"example_correlation_id": "9b9824d7-5af1-45c2-9f5d-32423f0d6d39"},
"message_id":"3eb8257f-1341-49fb-bf77-027549cd4761",
"timestamp":"2024-03-02T08:56:22.555Z",
"message_type":"ExampleCreateCommand",
"aggregate_id": "3",
"aggregate_type": "example",
"message_version":"1.1",
"auth_token":"eyJhbGcixxx.eyJ0ZW5hbnRJZCxxx.VYqnlcLWxxx"
}"""


def valid() -> dict[str, Any]:
    return json.loads(SEED_ENVELOPE)


def test_parses_the_seed_example() -> None:
    m = parse_message(SEED_ENVELOPE.encode())
    assert m.message_id == uuid.UUID("3eb8257f-1341-49fb-bf77-027549cd4761")
    assert m.timestamp == datetime(2024, 3, 2, 8, 56, 22, 555000, tzinfo=UTC)
    assert (m.message_type, m.aggregate_id, m.aggregate_type, m.message_version) == (
        "ExampleCreateCommand",
        "3",
        "example",
        "1.1",
    )
    assert m.payload == {"title": "Example Title 1", "count": 3}
    assert m.correlation_id == "9b9824d7-5af1-45c2-9f5d-32423f0d6d39"
    assert m.auth_token == "eyJhbGcixxx.eyJ0ZW5hbnRJZCxxx.VYqnlcLWxxx"


def test_round_trips() -> None:
    m = parse_message(SEED_ENVELOPE.encode())
    assert json.loads(m.to_json()) == valid()
    assert parse_message(m.to_json()) == m


def test_round_trips_without_optional_fields() -> None:
    m = Message(message_id=uuid.uuid4(), message_type="T", aggregate_type="a", aggregate_id="1", payload={"x": [1]})
    again = parse_message(m.to_json())
    assert again.message_id == m.message_id and again.payload == m.payload and again.auth_token is None
    assert "auth_token" not in json.loads(m.to_json())


def test_auth_token_never_in_repr_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    m = parse_message(SEED_ENVELOPE.encode())
    assert "eyJhbGci" not in repr(m) and "eyJhbGci" not in str(m)
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("handling %s", m)
    assert "eyJhbGci" not in caplog.text


@pytest.mark.parametrize(
    ("body", "reason", "field"),
    [
        (b"", "empty_body", None),
        (b"   ", "empty_body", None),
        (b"\xff\xfe\x00", "not_utf8", None),
        (b"{not json", "not_json", None),
        (b"[1, 2]", "not_object", None),
        (b'"text"', "not_object", None),
        (b"[" * 10000 + b"]" * 10000, "too_deep", None),
    ],
)
def test_malformed_bodies(body: bytes, reason: str, field: str | None) -> None:
    with pytest.raises(EnvelopeError) as err:
        parse_message(body)
    assert err.value.reason == reason and err.value.field == field


@pytest.mark.parametrize(
    "field", ["payload", "message_id", "timestamp", "message_type", "aggregate_id", "aggregate_type", "message_version"]
)
def test_missing_field_is_named(field: str) -> None:
    data = valid()
    del data[field]
    with pytest.raises(EnvelopeError) as err:
        parse_message(json.dumps(data))
    assert (err.value.reason, err.value.field) == ("missing_field", field)
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("message_id", "not-a-uuid"),
        ("message_id", 42),
        ("timestamp", "yesterday"),
        ("timestamp", "2024-03-02T08:56:22"),  # no zone
        ("timestamp", 1709369782),
        ("payload", [1, 2]),
        ("payload", "text"),
        ("message_type", 7),
        ("message_type", ""),
        ("aggregate_id", 3),
        ("aggregate_type", None),
        ("message_version", 1.1),
        ("message_context", "ctx"),
        ("auth_token", {"a": 1}),
    ],
)
def test_wrong_type_or_value_is_named(field: str, value: object) -> None:
    data = valid()
    data[field] = value
    with pytest.raises(EnvelopeError) as err:
        parse_message(json.dumps(data))
    assert (err.value.reason, err.value.field) == ("invalid_field", field)


def test_optional_fields_may_be_absent_or_null() -> None:
    data = valid()
    del data["auth_token"]
    data["message_context"] = None
    m = parse_message(json.dumps(data))
    assert m.auth_token is None and m.message_context == {}


def test_final_attempt() -> None:
    m = parse_message(SEED_ENVELOPE.encode())
    assert not m.is_final_attempt
    assert not m.with_delivery(attempt=2, max_attempts=3).is_final_attempt
    assert m.with_delivery(attempt=3, max_attempts=3).is_final_attempt


def test_a_parsed_envelope_is_a_whole_message() -> None:
    """message_from_dict builds the Message without its __init__: every field must be there."""
    original = Message(
        message_id=uuid.uuid4(),
        message_type="PlaceOrder",
        aggregate_type="order",
        aggregate_id="1",
        payload={"sku": "A"},
        message_context={"c": 1},
    )
    parsed = message_from_dict(json.loads(original.to_json()))
    assert set(vars(parsed)) == {f.name for f in dataclasses.fields(Message)}
    assert parsed == dataclasses.replace(original, timestamp=parsed.timestamp)
    assert (parsed.attempt, parsed.max_attempts, parsed.routing_key, parsed.auth_token) == (1, None, None, None)


def test_peek_top_level_reads_one_top_level_string_and_skips_nested_values() -> None:
    deep = b'{"a":' * 10_000 + b'"message_id"' + b"}" * 10_000
    assert peek_top_level(b'{"payload":' + deep + b', "message_id": "m"}', "message_id") == "m"
    assert peek_top_level(b'{"x": ["\\"}]", {"message_id": "inner"}], "message\\u005fid": "m"}', "message_id") == "m"
    assert peek_top_level(b'{"message_id": "a", "message_id": "b"}', "message_id") == "b"  # as json.loads
    for body in (b"", b"[]", b'"message_id"', b'{"message_id": 7}', b'{"message_id": "\xff"}', b'{"a": tru'):
        assert peek_top_level(body, "message_id") is None, body
    # Cut off by the window: what follows is not read.
    assert peek_top_level(b'{"a": "' + b"x" * 100 + b'", "message_id": "m"}', "message_id", limit=50) is None
    assert peek_top_level(b'{"a": [' + b"[" * 100_000, "message_id") is None
