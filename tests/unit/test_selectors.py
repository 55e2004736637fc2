"""Selectors (framework/selectors.py) and expiry (framework/expiry.py) without servers: the
language, its errors with positions, bounded work on hostile values, and where both meet
the receiver's intake, the service and the outbox."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from framework import CommandHandler, expiry, names
from framework.cli import main as txbox
from framework.contracts import load_registry
from framework.dead_letters import DeadLetter
from framework.errors import SelectorError
from framework.outbox import Outbox
from framework.receiver import Delivery, Intake
from framework.receiver.intake import Filtered
from framework.selectors import Fields, parse
from framework.service import Service
from framework.sql.inbox import InboxRow
from tests.apps.helpers import place_order

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"

ENVELOPE = {
    "message_type": "PlaceOrder",
    "aggregate_id": "42",
    "message_version": "1.0",
    "payload": {"customer": "ada", "quantity": 3, "address": {"country": "DE"}, "vip": True, "note": None},
    "message_context": {"tenant": "acme"},
}
HEADERS = {"x-tenant": "acme", "x-count": 5, "x-ratio": Decimal("0.5"), "nested": {"level": "one"}}


def matches(text: str, envelope: dict[str, Any] | None = None, headers: dict[str, Any] | None = None) -> bool:
    fields = Fields(ENVELOPE if envelope is None else envelope, HEADERS if headers is None else headers, "svc.a.b")
    return parse(text).matches(fields)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("message_type = 'PlaceOrder'", True),
        ("headers['x-tenant'] = 'acme' AND payload.quantity >= 3", True),
        ("headers['x-tenant'] IN ('globex', 'acme')", True),
        ("headers['x-tenant'] NOT IN ('globex', 'acme')", False),
        ("headers['x-count'] > 4.5 and headers['x-count'] <> 6", True),
        ("headers['x-ratio'] = 0.5", True),
        ("payload.address.country = 'DE' OR payload.quantity = 0", True),
        ("payload.vip = TRUE AND NOT payload.vip = false", True),
        ("message_context.tenant = 'acme'", True),
        ("headers.nested.level = 'one'", True),
        ("routing_key = 'svc.a.b'", True),
        ("EXISTS headers['x-tenant'] AND NOT EXISTS headers.absent", True),
        ("EXISTS payload.note", False),  # null is not there
        ("(aggregate_id = '41' OR aggregate_id = '42') AND message_version = '1.0'", True),
        ("it's = 1".replace("it's", "payload.customer"), False),
        ("payload.customer = 'it''s'", False),
        # Three-valued: a missing field or another type is unknown, and NOT unknown stays unknown.
        ("headers.absent = 'x'", False),
        ("NOT headers.absent = 'x'", False),
        ("NOT headers['x-count'] = '5'", False),  # a number is not text
        ("headers['x-count'] IN ('5')", False),
        ("payload.vip IN (1)", False),  # TRUE is not 1
        ("headers.absent = 'x' OR payload.quantity = 3", True),
        ("NOT (headers.absent = 'x' AND payload.quantity = 4)", True),  # unknown AND false is false
    ],
)
def test_the_language(text: str, expected: bool) -> None:
    assert matches(text) is expected


@pytest.mark.parametrize(
    ("text", "position", "expected"),
    [
        ("message_type = ", 16, "a literal"),
        ("tenant = 'a'", 1, "a field"),
        ("(message_type = 'a'", 20, "')'"),
        ("message_type = 'a' payload.x = 1", 20, "AND, OR or the end"),
        ("headers.a NOT = 1", 15, "IN after NOT"),
        ("headers.a IN 'x'", 14, "'(' after IN"),
        ("headers.a ~ 'x'", 11, "unexpected character"),
        ("headers[x] = 1", 9, "a quoted name"),
        ("headers = 'x'", 1, "needs a name"),
        ("message_type.x = 'a'", 1, "has no fields inside"),
        ("payload.vip < TRUE", 0, "compare with = and <> only"),
        ("", 1, "a field"),
    ],
)
def test_a_malformed_selector_says_where_and_what_it_expected(text: str, position: int, expected: str) -> None:
    with pytest.raises(SelectorError) as caught:
        parse(text)
    assert expected in str(caught.value)
    if position:
        assert f"position {position}" in str(caught.value)


def test_nesting_and_length_are_bounded_at_parse_time() -> None:
    with pytest.raises(SelectorError, match="levels of parentheses"):
        parse("(" * 40 + "payload.a = 1" + ")" * 40)
    with pytest.raises(SelectorError, match="levels of parentheses"):
        parse("NOT " * 40 + "payload.a = 1")
    with pytest.raises(SelectorError, match="at most 4096 characters"):
        parse("payload.a IN (" + ", ".join(["1"] * 2000) + ")")


class CountingTable(dict[str, Any]):
    """A header table that counts how often it is looked into."""

    reads = 0

    def get(self, key: str, default: Any = None) -> Any:
        CountingTable.reads += 1
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        CountingTable.reads += 1
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("a selector never walks a table")


def test_hostile_values_cost_one_lookup_per_name_of_the_path() -> None:
    deep: Any = "acme"
    for _ in range(100_000):  # far deeper than any recursion would survive
        deep = CountingTable({"a": deep})
    CountingTable.reads = 0
    selector = parse("headers.a.a.a = 'acme' OR headers.a.a.a.a.b = 'acme'")  # a table; a missing name
    assert selector.matches(Fields(ENVELOPE, deep, "")) is False
    assert CountingTable.reads == 3 + 5
    huge = "acme" * 2_000_000
    CountingTable.reads = 0
    table = CountingTable({"x-tenant": huge, "n": Decimal("NaN"), "s": Decimal("sNaN")})
    assert not parse("headers['x-tenant'] = 'acme' OR headers['x-tenant'] IN ('a', 'b')").matches(
        Fields(ENVELOPE, table, "")
    )
    # A NaN from a header is unknown, neither an error nor a match.
    assert not parse("headers.n = 1 OR headers.n IN (1) OR headers.s > 1 OR headers.s IN (1)").matches(
        Fields(ENVELOPE, table, "")
    )
    assert CountingTable.reads == 6


def _service() -> Service:
    return Service(name="order-service", contracts_dir=CONTRACTS, database_url="postgresql://h/d", amqp_url="amqp://h")


class Selective(CommandHandler):
    message_type = "PlaceOrder"
    selector = "headers['x-tenant'] = 'acme'"


def test_a_handler_selector_is_parsed_when_registered_and_a_bad_one_stops_the_start() -> None:
    service = _service()
    service.register(Selective())
    assert list(service.selectors) == ["PlaceOrder"]

    class Broken(Selective):
        selector = "headers['x-tenant'] = acme"

    with pytest.raises(SelectorError) as caught:
        _service().register(Broken())
    assert "Broken.selector" in str(caught.value) and "position 23" in str(caught.value)


def _delivery(data: dict[str, Any], headers: dict[str, Any]) -> Delivery:
    return Delivery(
        delivery_tag=1, body=json.dumps(data).encode(), properties={"content_type": "application/json"}, headers=headers
    )


def test_the_intake_filters_then_expires_then_stores() -> None:
    registry = load_registry(CONTRACTS)
    intake = Intake(
        registry, "order-service", max_body_bytes=1 << 20, selectors={"PlaceOrder": parse(Selective.selector or "")}
    )
    past = expiry.header_value(time.time() - 1)
    future = time.time() + 600
    acme = {"x-tenant": "acme"}
    assert intake.admit(_delivery(place_order(), {"x-tenant": "globex"})) == Filtered("PlaceOrder")
    assert intake.admit(_delivery(place_order(), {"x-tenant": "globex", names.HEADER_EXPIRES_AT: past})) == Filtered(
        "PlaceOrder"
    )
    letter = intake.admit(_delivery(place_order(), {**acme, names.HEADER_EXPIRES_AT: past}))
    assert isinstance(letter, DeadLetter) and letter.reason == "expired" and letter.source == "broker"
    row = intake.admit(_delivery(place_order(), {**acme, names.HEADER_EXPIRES_AT: expiry.header_value(future)}))
    assert isinstance(row, InboxRow)
    assert json.loads(row.metadata)[names.METADATA_EXPIRES_AT] == pytest.approx(future, abs=0.002)


@pytest.mark.parametrize(
    "value",
    [None, 17, b"2020-01-01T00:00:00Z", "", "yesterday", "2020-01-01T00:00:00", "2020-01-01T00:00:00Z" + " " * 40],
)
def test_a_header_that_is_no_time_gives_no_expiry(value: Any) -> None:
    assert expiry.from_header(value) is None


def test_header_round_trip_and_offsets() -> None:
    assert expiry.from_header("2030-05-06T07:08:09.123Z") == pytest.approx(
        datetime(2030, 5, 6, 7, 8, 9, 123000, tzinfo=UTC).timestamp()
    )
    assert expiry.from_header("2030-05-06T09:08:09.123+02:00") == expiry.from_header("2030-05-06T07:08:09.123Z")
    assert expiry.header_value(expiry.from_header("2030-05-06T07:08:09.123Z") or 0) == "2030-05-06T07:08:09.123Z"


def test_an_expiry_outside_what_a_datetime_shows_is_written_clamped_never_raises() -> None:
    # Year 1 with a positive offset is year 0 in UTC; nothing may raise while a dead
    # letter's text is written for it (it would turn an `expired` into `internal_error`).
    ancient = expiry.from_header("0001-01-01T00:00:00+01:00")
    assert ancient is not None and expiry.passed(ancient)
    assert expiry.describe(ancient, "at the receiver").startswith("expired at ")  # clamped to 2 January of year 1
    assert expiry.header_value(1e15).startswith("9999-12-31")
    with pytest.raises(ValueError, match="after the year 9999"):
        expiry.deadline(timedelta(days=3_000_000))


def test_the_outbox_stores_an_absolute_expiry_and_refuses_a_ttl_that_cannot_be() -> None:
    registry = load_registry(CONTRACTS)
    outbox = Outbox(None, registry)  # type: ignore[arg-type]
    spec = registry.get("PlaceOrder")
    payload = {"customer": "ada", "sku": "SKU-1", "quantity": 1}
    before = time.time()
    row = outbox.build(spec, aggregate_id="1", payload=payload, ttl=timedelta(minutes=5))
    assert before + 299.999 <= row.metadata[names.METADATA_EXPIRES_AT] <= time.time() + 300.001
    assert names.METADATA_EXPIRES_AT not in outbox.build(spec, aggregate_id="1", payload=payload).metadata
    for bad in (0, -1, float("nan"), float("inf"), timedelta(0)):
        with pytest.raises(ValueError, match="ttl must be"):
            outbox.build(spec, aggregate_id="1", payload=payload, ttl=bad)
    later = datetime.now(UTC) + timedelta(hours=1)
    with pytest.raises(ValueError, match="never be sent"):
        outbox.build(spec, aggregate_id="1", payload=payload, ttl=60, not_before=later)


def test_the_receiver_command_refuses_an_app_with_a_bad_selector_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "txbox_selector_app.py").write_text(
        "from framework import CommandHandler, Service\n"
        f"service = Service(name='order-service', database_url='postgresql://h/d', amqp_url='amqp://h',"
        f" contracts_dir={str(CONTRACTS)!r})\n"
        "class Orders(CommandHandler):\n"
        "    message_type = 'PlaceOrder'\n"
        "    selector = \"payload.quantity > 0 AND (headers['x-tenant'] = 'acme'\"\n"
        "service.register(Orders())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert txbox(["receiver", "--app", "txbox_selector_app:service"]) == 2
    err = capsys.readouterr().err
    assert "Orders.selector" in err and "expected ')' at position 55" in err and "Traceback" not in err
