"""The dead-letter reason codes are stored and read outside txbox: their spelling is pinned."""

from __future__ import annotations

import json

import orjson
import pika.spec

from framework import reasons
from framework.reasons import Reason

STORED = {
    "empty_body",
    "not_utf8",
    "not_json",
    "too_deep",
    "not_object",
    "missing_field",
    "invalid_field",
    "unknown_message_type",
    "schema_invalid",
    "too_large",
    "wrong_content_type",
    "not_accepted",
    "wrong_route",
    "id_conflict",
    "unstorable",
    "redelivery_limit",
    "retries_exhausted",
    "unknown_tenant",
    "max_attempts",
    "permanent_error",
    "poison",
    "no_handler",
    "unauthorized",
    "signature_missing",
    "signature_invalid",
    "signing_key_unknown",
    "unroutable",
    "nacked",
    "expired",
    "internal_error",
}


def test_every_reason_keeps_its_stored_spelling() -> None:
    assert {r.value for r in Reason} == STORED
    assert all(r.name.lower() == r.value for r in Reason)


def test_a_reason_is_its_string_wherever_it_goes() -> None:
    assert json.dumps(Reason.POISON) == orjson.dumps(Reason.POISON).decode() == '"poison"'
    assert f"{Reason.POISON}" == str(Reason.POISON) == "poison"
    frame = pika.spec.BasicProperties(headers={"x-txbox-reason": Reason.NACKED}).encode()
    decoded = pika.spec.BasicProperties()
    decoded.decode(b"".join(frame))
    assert decoded.headers == {"x-txbox-reason": "nacked"}


def test_broker_reasons_are_prefixed() -> None:
    assert reasons.broker("expired") == "broker_expired"
    assert reasons.broker(None) == "broker_unknown"
