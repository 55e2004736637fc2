"""Intake and configuration of the receiver, without services."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from framework import jsoncodec, names
from framework.contracts import load_registry
from framework.dead_letters import DeadLetter
from framework.errors import ConfigurationError
from framework.receiver import Delivery, Intake, ReceiverConfig
from framework.receiver.config import parse_schedule
from framework.receiver.intake import InboxRow
from tests.apps.helpers import place_order

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"


@pytest.fixture(scope="module")
def intake() -> Intake:
    return Intake(load_registry(CONTRACTS), "order-service", max_body_bytes=1024 * 1024)


def delivery(body: bytes, **kwargs: Any) -> Delivery:
    kwargs.setdefault("properties", {"content_type": "application/json"})
    kwargs.setdefault("exchange", "command")
    kwargs.setdefault("wire", True)
    kwargs.setdefault("routing_key", "order-service.order.place")
    return Delivery(delivery_tag=1, body=body, **kwargs)


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


def test_sender_chosen_lane_counts_from_a_trusted_sender_only(intake: Intake) -> None:
    headers = {names.HEADER_SEGMENT: "lane-1", names.HEADER_CONCURRENCY: "parallel", names.HEADER_PRIORITY: -7}
    row = intake.admit(delivery(with_(), headers=headers, trusted=True))
    assert isinstance(row, InboxRow) and (row.segment, row.concurrency, row.priority) == ("lane-1", "parallel", -7)
    stranger = intake.admit(delivery(with_(), headers=headers, properties={"priority": 9}))
    assert isinstance(stranger, InboxRow)
    assert (stranger.segment, stranger.concurrency, stranger.priority) == ("order:42", "sequential", 9)


@pytest.mark.parametrize(
    "headers",
    [
        {names.HEADER_SEGMENT: "nul\x00lane", names.HEADER_CONCURRENCY: b"parallel", names.HEADER_PRIORITY: 2**40},
        {names.HEADER_SEGMENT: "x" * 5000, names.HEADER_CONCURRENCY: ["parallel"], names.HEADER_PRIORITY: True},
        {names.HEADER_SEGMENT: 7, names.HEADER_CONCURRENCY: None, names.HEADER_PRIORITY: "3"},
        {names.HEADER_SEGMENT: "lone \ud800", names.HEADER_ATTEMPT: "2", names.HEADER_FINAL_ATTEMPT: "false"},
    ],
)
def test_malformed_control_headers_fall_back_to_the_defaults(intake: Intake, headers: dict[str, Any]) -> None:
    row = intake.admit(delivery(with_(), headers=headers, trusted=True, exchange="retry"))
    assert isinstance(row, DeadLetter) and row.reason == "wrong_route"  # retry needs the inbox.<key> form
    d = delivery(with_(), headers=headers, trusted=True)
    row = intake.admit(d)
    assert isinstance(row, InboxRow)
    assert (row.segment, row.concurrency, row.priority) == ("order:42", "sequential", 0)
    assert d.attempt == 1 and not d.final_attempt


def test_attempt_headers_count_only_on_our_retry_path() -> None:
    headers = {names.HEADER_ATTEMPT: 3, names.HEADER_FINAL_ATTEMPT: True}
    key = "order-service:inbox.order-service.order.place"
    ours = Delivery(delivery_tag=1, body=b"", exchange="retry", routing_key=key, headers=headers, trusted=True)
    assert ours.attempt == 3 and ours.final_attempt
    stranger = Delivery(delivery_tag=1, body=b"", exchange="retry", routing_key=key, headers=headers)
    assert stranger.attempt == 1 and not stranger.final_attempt
    direct = Delivery(delivery_tag=1, body=b"", exchange="command", headers=headers, trusted=True)
    assert direct.attempt == 1 and not direct.final_attempt


@pytest.mark.parametrize(
    ("exchange", "routing_key", "message_type"),
    [
        ("event", "order-service.order.place", "PlaceOrder"),  # a command through the event exchange
        ("command", "order-service.order.cancel", "PlaceOrder"),  # another type's key
        ("", "order-service:inbox", "PlaceOrder"),  # straight into the queue
        ("retry", "order-service:inbox.inventory-service.stock.reserved", "PlaceOrder"),
    ],
)
def test_a_message_off_its_contract_route_is_wrong_route(
    intake: Intake, exchange: str, routing_key: str, message_type: str
) -> None:
    d = Delivery(
        delivery_tag=1,
        body=with_(message_type=message_type),
        exchange=exchange,
        routing_key=routing_key,
        properties={"content_type": "application/json"},
        wire=True,
    )
    outcome = intake.admit(d)
    assert isinstance(outcome, DeadLetter) and outcome.reason == "wrong_route", outcome


def test_our_retry_path_keeps_the_original_route(intake: Intake) -> None:
    key = "order-service:inbox.order-service.order.place"
    row = intake.admit(delivery(with_(), exchange="retry", routing_key=key))
    assert isinstance(row, InboxRow)


@pytest.mark.parametrize("message_id", [None, "", "a\x00b", "x" * 10_000, "not-a-uuid", 42, b"\xff", "lone \ud800"])
def test_the_redelivery_counter_key_is_always_storable_and_stable(message_id: Any) -> None:
    props = {} if message_id is None else {"message_id": message_id}
    key = Delivery(delivery_tag=1, body=b"body", properties=props).counter_key
    assert key.startswith("sha1:") and len(key) == 45 and key.isascii()
    assert Delivery(delivery_tag=9, body=b"body", properties=dict(props)).counter_key == key
    assert Delivery(delivery_tag=1, body=b"other", properties=dict(props)).counter_key != key


def test_the_redelivery_counter_key_of_a_uuid_is_its_canonical_form() -> None:
    mid = "3EB8257F-1341-49FB-BF77-027549CD4761"
    assert Delivery(delivery_tag=1, body=b"x", properties={"message_id": mid}).counter_key == mid.lower()


@pytest.mark.parametrize("field", ["payload", "message_context"])
def test_json_nested_past_the_limit_is_too_deep_in_any_field(intake: Intake, field: str) -> None:
    # 990 levels parse (Python's limit is ~1000), but serializing them again would not.
    text = json.dumps(place_order(**{field: {"k": "HOLE"}})).replace('"HOLE"', '{"a":' * 990 + "1" + "}" * 990)
    outcome = intake.admit(delivery(text.encode()))
    assert isinstance(outcome, DeadLetter) and outcome.reason == "too_deep", outcome


def test_json_at_the_limit_is_accepted(intake: Intake) -> None:
    from framework.envelope import MAX_JSON_DEPTH

    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH - 3):  # envelope, payload, and the field hold it
        deep = [deep]
    data = place_order()
    data["message_context"] = {"k": deep}
    row = intake.admit(delivery(json.dumps(data).encode()))
    assert isinstance(row, InboxRow), row


def test_header_tables_nested_deep_are_clipped_not_fatal(intake: Intake) -> None:
    deep: Any = "bottom"
    for _ in range(400):
        deep = {"h": deep}
    row = intake.admit(delivery(with_(), headers={"deep": deep, "x-death": "not a list"}))
    assert isinstance(row, InboxRow)
    assert "<nested too deep>" in row.metadata and len(row.metadata) < 1000
    letter = intake.admit(delivery(b"junk", headers={"deep": deep}))
    assert isinstance(letter, DeadLetter) and "<nested too deep>" in json.dumps(letter.headers)


def test_a_bug_in_the_intake_ends_as_internal_error_not_a_crash(intake: Intake, monkeypatch: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(intake, "wrong_route", broken)
    body = with_()
    outcome = intake.admit(delivery(body))
    assert isinstance(outcome, DeadLetter) and outcome.reason == "internal_error" and "boom" in outcome.error
    assert outcome.raw_body == body


def test_retry_routing_key_is_unwrapped() -> None:
    d = Delivery(
        delivery_tag=1, body=b"", exchange="retry", routing_key="order-service:inbox.order-service.order.place"
    )
    assert d.original_routing_key("order-service") == "order-service.order.place"
    assert d.attempt == 1 and not d.final_attempt
    d.headers = {names.HEADER_ATTEMPT: 3, names.HEADER_FINAL_ATTEMPT: True}
    d.trusted = True
    assert d.attempt == 3 and d.final_attempt


def test_counter_key_does_not_need_the_body_to_parse() -> None:
    mid = str(uuid.uuid4())
    assert Delivery(delivery_tag=1, body=b"x", properties={"message_id": mid}).counter_key == mid
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
    expected = json.dumps(values, separators=(",", ":"), ensure_ascii=False, default=jsoncodec.amqp_value)
    assert json.dumps(json.loads(jsoncodec.amqp_json(values))) == json.dumps(json.loads(expected))  # NaN != NaN


def test_trusted_users_always_include_the_receivers_own() -> None:
    assert ReceiverConfig().trusted("guest") == {"guest"}
    assert ReceiverConfig(trusted_users=" relay , other,").trusted("guest") == {"relay", "other", "guest"}
    assert ReceiverConfig().trusted("") == frozenset()
