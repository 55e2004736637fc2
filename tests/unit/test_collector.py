"""Turning a dead-lettered AMQP delivery into a dead-letter row (no broker needed)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pika

from framework import names
from framework.dead_letters.collector import letter_from_delivery
from framework.dead_letters.present import masked


def _death(count: int, queue: str = "order-service:inbox", reason: bytes = b"expired") -> dict[str, object]:
    return {
        "count": count,
        "reason": reason,
        "queue": queue,
        "exchange": "retry",
        "routing-keys": [b"order-service.order.place"],
        "time": datetime(2026, 1, 1, tzinfo=UTC),
    }


def test_x_death_and_our_headers_are_kept() -> None:
    mid = uuid.uuid4()
    props = pika.BasicProperties(
        message_id=str(mid),
        type="PlaceOrder",
        headers={
            "x-death": [_death(3, "delay:30s"), _death(1)],
            "x-first-death-queue": "order-service:inbox",
            "x-first-death-reason": "expired",
            names.HEADER_DEAD_REASON: b"retries_exhausted",
            names.HEADER_DEAD_ERROR: "database down for 4 minutes",
            names.HEADER_ATTEMPT: 9,
        },
    )
    letter, key = letter_from_delivery(props, b'{"message_id": "x"}', "order-service.dead_letter")
    assert (letter.source, letter.reason, letter.error) == (
        "broker",
        "retries_exhausted",
        "database down for 4 minutes",
    )
    assert letter.message_id == mid and letter.message_type == "PlaceOrder"
    assert letter.routing_key == "order-service.order.place"
    assert letter.attempts["deaths"] == 4 and letter.attempts["attempt"] == 9
    assert letter.attempts["first_death"] == {
        "queue": "order-service:inbox",
        "reason": "expired",
        "exchange": None,
        "time": "2026-01-01T00:00:00+00:00",
    }
    row = letter.row()  # JSON-serializable throughout
    assert '"x-death"' in row["headers"]
    _again, same_key = letter_from_delivery(props, b'{"message_id": "x"}', "order-service.dead_letter")
    assert same_key == key
    props.headers["x-death"][1]["count"] = 2  # type: ignore[index]
    assert letter_from_delivery(props, b'{"message_id": "x"}', "x")[1] != key


def test_without_our_headers_the_reason_comes_from_the_broker() -> None:
    letter, _ = letter_from_delivery(
        pika.BasicProperties(headers={"x-death": [_death(1, reason=b"rejected")]}), b"\x00\x01", "rk"
    )
    assert letter.reason == "broker_rejected" and "order-service:inbox" in letter.error
    assert letter.message is None and letter.raw_body == b"\x00\x01" and letter.message_id is None
    bare, _ = letter_from_delivery(pika.BasicProperties(), b"{}", "rk")
    assert bare.reason == "broker_unknown" and bare.routing_key == "rk"


def test_the_receivers_final_rejection_is_retries_exhausted() -> None:
    headers = {"x-death": [_death(1, reason=b"rejected")], names.HEADER_FINAL_ATTEMPT: True, names.HEADER_ATTEMPT: 10}
    letter, _ = letter_from_delivery(pika.BasicProperties(headers=headers), b"{}", "rk")
    assert letter.reason == "retries_exhausted" and "(attempt 10)" in letter.error and "rejected" in letter.error


def test_secrets_are_masked_at_any_depth() -> None:
    shown = masked({"message": {"auth_token": "eyJsecret", "payload": {"n": 1}}, "headers": [{"Authorization": "b"}]})
    assert shown == {
        "message": {"auth_token": "•••• (masked, 9 chars)", "payload": {"n": 1}},
        "headers": [{"Authorization": "•••• (masked, 1 chars)"}],
    }


class _Exploding(pika.BasicProperties):  # type: ignore[misc]
    """Properties whose every read fails: judging them cannot succeed."""

    def __getattribute__(self, name: str) -> object:
        if name in ("headers", "__class__"):
            return object.__getattribute__(self, name)
        raise RuntimeError(f"cannot read {name}")


def test_a_delivery_that_cannot_be_judged_is_an_internal_error_letter_with_its_body() -> None:
    props = _Exploding(headers={"x": b"\x00"})
    letter, key = letter_from_delivery(props, b"the body", "rk")
    assert letter.reason == "internal_error" and letter.raw_body == b"the body" and "cannot read" in letter.error
    assert letter.row()["reason"] == "internal_error"
    assert letter_from_delivery(props, b"the body", "rk")[1] == key  # a redelivery is recognised


def test_malformed_x_death_and_forged_reasons_are_judged_not_trusted() -> None:
    headers = {
        "x-death": [{"count": "3", "reason": b"rejected", "queue": 5, "routing-keys": "not a list"}, "junk"],
        names.HEADER_DEAD_REASON: "x" * 65,
    }
    letter, _ = letter_from_delivery(pika.BasicProperties(headers=headers, type=b"\xffT"), b"{}", "rk")
    assert letter.reason == "broker_rejected" and letter.attempts["deaths"] == 0
    assert letter.routing_key == "rk" and letter.message_type == "\ufffdT"
    assert letter.headers[names.HEADER_DEAD_REASON] == "x" * 65


def test_amqp_tables_and_arrays_nested_past_the_limit_decode_as_a_marker() -> None:
    import sys

    from framework import amqp, drivers

    drivers.tune_drivers()  # what every daemon does when it starts

    deep: dict[str, object] = {}
    inner = deep
    for i in range(5_000):
        inner["k"] = [{}] if i % 2 else {}
        inner = inner["k"][0] if i % 2 else inner["k"]  # type: ignore[index]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # pika encodes recursively: only the encoding needs it
    try:
        encoded = pika.BasicProperties(headers={"d": deep, "after": "kept"}).encode()
    finally:
        sys.setrecursionlimit(limit)
    decoded = pika.BasicProperties()
    decoded.decode(b"".join(encoded) if isinstance(encoded, list) else encoded)
    assert decoded.headers["after"] == "kept"
    assert amqp.TOO_DEEP_FIELD in repr(decoded.headers["d"])
