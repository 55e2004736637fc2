"""Intake and configuration of the receiver, without services."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from framework import names
from framework.contracts import load_registry
from framework.dead_letters import DeadLetter
from framework.errors import ConfigurationError
from framework.receiver import Delivery, Intake, ReceiverConfig
from framework.receiver.config import parse_schedule
from framework.receiver.intake import InboxRow, _json_default, json_text
from tests.apps.helpers import place_order

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"


@pytest.fixture(scope="module")
def intake() -> Intake:
    return Intake(load_registry(CONTRACTS), "order-service", max_body_bytes=1024 * 1024)


def delivery(body: bytes, **kwargs: Any) -> Delivery:
    kwargs.setdefault("properties", {"content_type": "application/json"})
    return Delivery(delivery_tag=1, body=body, routing_key="order-service.order.place", **kwargs)


def without(field: str) -> bytes:
    data = place_order()
    del data[field]
    return json.dumps(data).encode()


def with_(**fields: Any) -> bytes:
    return json.dumps(place_order(**fields)).encode()


CASES = {
    "empty body": (b"", "empty_body"),
    "not utf-8": (b"\xff\xfe", "not_utf8"),
    "not json": (b"{nope", "not_json"),
    "json array": (b"[]", "not_object"),
    "missing message_id": (without("message_id"), "missing_field"),
    "non-uuid message_id": (with_(message_id="abc"), "invalid_field"),
    "missing message_type": (without("message_type"), "missing_field"),
    "unknown message type": (with_(message_type="Nope"), "unknown_message_type"),
    "known but not for this service": (with_(message_type="RestockItem"), "not_accepted"),
    "schema-invalid payload": (with_(payload={"customer": "a"}), "schema_invalid"),
    "over the size limit": (b"{" + b" " * (1024 * 1024) + b"}", "too_large"),
    "10,000 levels of nesting": (b"[" * 10_000 + b"]" * 10_000, "too_deep"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_becomes_a_dead_letter_with_its_reason_and_raw_body(intake: Intake, case: str) -> None:
    body, reason = CASES[case]
    outcome = intake.admit(delivery(body))
    assert isinstance(outcome, DeadLetter)
    assert (outcome.source, outcome.reason) == ("broker", reason)
    assert outcome.raw_body == body


def test_wrong_content_type_is_rejected_but_parameters_are_fine(intake: Intake) -> None:
    bad = intake.admit(delivery(with_(), properties={"content_type": "text/plain"}))
    assert isinstance(bad, DeadLetter) and bad.reason == "wrong_content_type"
    good = intake.admit(delivery(with_(), properties={"content_type": "application/json; charset=utf-8"}))
    assert isinstance(good, InboxRow)


def test_a_valid_delivery_becomes_a_row_with_registry_facts(intake: Intake) -> None:
    data = place_order(aggregate_id="9")
    row = intake.admit(delivery(json.dumps(data).encode(), redelivered=True, headers={"h": b"\xff"}))
    assert isinstance(row, InboxRow)
    assert row.id == uuid.UUID(data["message_id"])
    assert (row.kind, row.routing_key, row.segment, row.concurrency) == (
        "command",
        "order-service.order.place",
        "order:9",
        "sequential",
    )
    assert row.redelivered and row.queue == "order-service:inbox"
    assert json.loads(row.metadata)["auth_token"] == "secret-token"


def test_sender_chosen_segment_and_concurrency(intake: Intake) -> None:
    headers = {names.HEADER_SEGMENT: "lane-1", names.HEADER_CONCURRENCY: "parallel"}
    row = intake.admit(delivery(with_(), headers=headers))
    assert isinstance(row, InboxRow) and (row.segment, row.concurrency) == ("lane-1", "parallel")


def test_retry_routing_key_is_unwrapped() -> None:
    d = Delivery(delivery_tag=1, body=b"", routing_key="order-service:inbox.order-service.order.place")
    assert d.original_routing_key("order-service") == "order-service.order.place"
    assert d.attempt == 1 and not d.final_attempt
    d.headers = {names.HEADER_ATTEMPT: 3, names.HEADER_FINAL_ATTEMPT: True}
    assert d.attempt == 3 and d.final_attempt


def test_counter_key_does_not_need_the_body_to_parse() -> None:
    assert Delivery(delivery_tag=1, body=b"x", properties={"message_id": "m-1"}).counter_key == "m-1"
    assert Delivery(delivery_tag=1, body=b"x").counter_key.startswith("sha1:")


def test_default_schedule_is_design_section_5() -> None:
    config = ReceiverConfig()
    assert config.schedule == (10, 10, 10, 10, 30, 30, 30, 30)
    assert config.extra_delays == ()
    assert config.redelivery_limit == 5 and config.max_body_bytes == 1024 * 1024


def test_short_schedules_need_their_own_delay_queues() -> None:
    assert parse_schedule("1s*2, 2s") == (1, 1, 2)
    assert ReceiverConfig(retry_schedule="1s*2,10s").extra_delays == (1,)


@pytest.mark.parametrize("bad", ["", "0s", "1.5s", "10s*x", "soon"])
def test_a_bad_schedule_fails_at_start_naming_the_variable(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="TXBOX_RECEIVER_RETRY_SCHEDULE"):
        ReceiverConfig(retry_schedule=bad)


def test_a_batch_larger_than_the_prefetch_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="TXBOX_RECEIVER_BATCH_SIZE"):
        ReceiverConfig(prefetch=10, batch_size=20)


def test_headers_jsonb_cannot_store_are_cleaned_not_fatal(intake: Intake) -> None:
    row = intake.admit(delivery(with_(), headers={"nul": "a\x00b", "nan": float("nan"), "ok": 1}))
    assert isinstance(row, InboxRow)
    headers = json.loads(row.metadata)["properties"]["headers"]
    assert "\x00" not in headers["nul"] and headers["nan"] == "nan" and headers["ok"] == 1


def test_json_text_of_amqp_values_is_what_the_json_module_writes() -> None:
    """orjson renders datetimes itself and the rest through the same default as json."""
    values = {
        "when": datetime(2026, 11, 23, 15, 0, 0, 123456, tzinfo=UTC),
        "naive": datetime(2026, 1, 2, 3, 4, 5),
        "zoned": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
        "bytes": b"\x00\xff raw",
        "text bytes": b"hello",
        "amount": Decimal("12.50"),
        "nested": [{"n": 2**70, "f": float("nan")}, None, True, 1.5],
    }
    expected = json.dumps(values, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    assert json.dumps(json.loads(json_text(values))) == json.dumps(json.loads(expected))  # NaN != NaN
