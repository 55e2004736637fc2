"""Building a dead-letter row never raises, and what it returns is storable JSON and text."""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from framework import dead_letters as dl
from framework import names
from framework.dead_letters import BODY_LIMIT, MAX_ACCEPTED_BODY, MESSAGE_LIMIT, DeadLetter
from framework.jsoncodec import JSON_DEPTH_LIMIT, TOO_DEEP, to_storable
from framework.reasons import Reason


def _deep(depth: int) -> list[Any]:
    outer: list[Any] = []
    inner = outer
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no")


def _assert_storable(text: str) -> None:
    assert "\\u0000" not in text and "\x00" not in text
    text.encode("utf-8")  # no lone surrogates
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON jsonb takes"))


def test_what_jsonb_refuses_is_replaced() -> None:
    value = {
        "nul\x00key": "nul\x00value",
        "surrogate": "\ud800x",
        "nan": math.nan,
        "inf": -math.inf,
        "big": 10**5000,
        "bytes": b"\x00\xff",
        "when": datetime(2026, 1, 1, tzinfo=UTC),
        "decimal": Decimal("1.5"),
        "huge decimal": Decimal("1e400"),
        "odd": _Unprintable(),
        b"\xffkey": (1, 2),
        7: None,
    }
    out = to_storable(value)
    text = dl.jsoncodec.dumps(out)
    _assert_storable(text)
    assert out["nul\ufffdkey"] == "nul\ufffdvalue" and out["nan"] == "nan" and out["decimal"] == 1.5
    assert out["big"].startswith("<integer of") and out["huge decimal"] == "1E+400"
    assert out["odd"] == "<unprintable _Unprintable>" and out["7"] is None and out["\ufffdkey"] == [1, 2]


def test_deep_nesting_is_cut_at_the_limit() -> None:
    out = to_storable({"d": _deep(100_000)})
    text = dl.jsoncodec.dumps(out)
    assert TOO_DEEP in text and text.count("[") == JSON_DEPTH_LIMIT - 1


@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text() | st.binary(),
        lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
        max_leaves=30,
    )
)
def test_to_storable_is_total(value: Any) -> None:
    _assert_storable(dl.jsoncodec.dumps(to_storable(value)))


def test_an_oversized_body_keeps_a_prefix_with_length_and_hash() -> None:
    body = "ü".encode() * BODY_LIMIT  # two bytes a character: the cut must not split one
    row = DeadLetter(source="broker", reason="too_large", error="e", raw_body=body).row()
    assert row["raw_encoding"] == "utf-8" and body.startswith(row["raw_body"].encode())
    assert len(row["raw_body"].encode()) == BODY_LIMIT
    facts = json.loads(row["headers"])[names.BODY_FACTS]
    assert facts == {
        "length": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "stored": BODY_LIMIT,
        "truncated": True,
    }


def test_a_message_up_to_the_largest_accepted_body_is_stored_whole() -> None:
    """Replayable: a letter keeps every envelope a receiver may accept whole, not a raw prefix."""
    message = {"payload": {"blob": "ü" * (MAX_ACCEPTED_BODY // 2)}}  # two bytes a character
    row = DeadLetter(source="inbox", reason="max_attempts", error="e", message=message).row()
    assert row["raw_body"] is None and json.loads(row["message"]) == message


def test_an_oversized_message_is_not_stored_whole() -> None:
    """The worker's abandon has no raw body: the envelope's JSON is what gets a prefix."""
    message = {"payload": {"blob": "x" * MESSAGE_LIMIT}}
    row = DeadLetter(source="inbox", reason="max_attempts", error="e", message=message).row()
    assert row["message"] is None and len(row["raw_body"]) == BODY_LIMIT
    assert json.loads(row["headers"])[names.BODY_FACTS]["length"] == len(json.dumps(message, separators=(",", ":")))


def test_a_senders_body_facts_header_does_not_pass_for_ours() -> None:
    row = DeadLetter(source="broker", reason="r", error="e", raw_body=b"x", headers={names.BODY_FACTS: "forged"}).row()
    headers = json.loads(row["headers"])
    assert headers[names.BODY_FACTS]["length"] == 1 and headers[f"{names.BODY_FACTS} (sender)"] == "forged"


def test_text_columns_are_clean_and_bounded() -> None:
    row = DeadLetter(
        source="broker",
        reason="r\x00",
        error="\ud800" + "e" * 100_000,
        message_type=b"\xff\x00T",  # type: ignore[arg-type]
        routing_key=_Unprintable(),  # type: ignore[arg-type]
        message_id="not a uuid",  # type: ignore[arg-type]
    ).row()
    assert row["reason"] == "r\ufffd" and row["message_id"] is None
    assert len(row["error"]) < dl.ERROR_LIMIT + 100 and row["error"].endswith("(100001 characters)")
    assert "\x00" not in row["message_type"] and row["routing_key"] == "<unprintable _Unprintable>"


def test_a_row_that_cannot_be_built_is_an_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(value: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(dl, "to_storable", broken)
    mid = uuid.uuid4()
    row = DeadLetter(source="broker", reason="poison", error="boom\x00", message_id=mid, raw_body=b"abc").row()
    assert row["reason"] == Reason.INTERNAL_ERROR and row["message_id"] == mid
    assert "poison" in row["error"] and "RecursionError" in row["error"] and "\x00" not in row["error"]
    assert json.loads(row["headers"])[names.BODY_FACTS]["sha256"] == hashlib.sha256(b"abc").hexdigest()


def test_internal_error_letter_keeps_the_body() -> None:
    letter = dl.internal_error_letter(source="broker", error="bug", raw_body=b"\x00raw", headers={"h": 1})
    row = letter.row()
    assert row["reason"] == Reason.INTERNAL_ERROR and dl.decode_body(row["raw_body"], row["raw_encoding"]) == b"\x00raw"
