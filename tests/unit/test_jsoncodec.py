"""framework.jsoncodec.loads returns what json.loads returns, value for value and error for error."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from framework import jsoncodec

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@given(json_values)
def test_same_value_as_json_for_any_json_text(value: object) -> None:
    text = json.dumps(value, ensure_ascii=False)
    assert jsoncodec.loads(text) == json.loads(text)
    assert jsoncodec.loads(text.encode()) == json.loads(text)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats() | st.text(),
        lambda inner: (
            st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=5)
        ),
        max_leaves=30,
    )
)
def test_dumps_writes_the_same_json_as_json(value: object) -> None:
    """NaN, infinities, huge integers and integer keys included: the same JSON value (a float's
    spelling may differ: 0.00001 for 1e-05, which jsonb stores as the same number)."""
    theirs = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    ours = jsoncodec.dumps(value)
    assert json.dumps(json.loads(ours)) == json.dumps(json.loads(theirs))


@pytest.mark.parametrize(
    "text",
    [
        "123456789012345678901234567890",  # beyond 64 bits: orjson would return a float
        '{"id": -9223372036854775809}',
        '{"n": 18446744073709551616}',
    ],
)
def test_big_integers_stay_exact(text: str) -> None:
    value = jsoncodec.loads(text)
    assert value == json.loads(text)
    assert type(next(iter(value.values())) if isinstance(value, dict) else value) is int


def test_what_only_json_accepts_is_still_accepted() -> None:
    assert math.isnan(jsoncodec.loads("NaN"))
    assert jsoncodec.loads('{"a": 1.5e400}') == {"a": math.inf}
    assert jsoncodec.loads('["\\ud800"]') == ["\ud800"]  # lone surrogate: the envelope rejects it later


@pytest.mark.parametrize("text", ["", "{", "[1,]", "{'a': 1}", "nul"])
def test_errors_are_jsons_errors(text: str) -> None:
    with pytest.raises(json.JSONDecodeError) as ours:
        jsoncodec.loads(text)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(text)
    assert str(ours.value) == str(theirs.value)


def test_too_deep_raises_recursion_error_like_json() -> None:
    with pytest.raises(RecursionError):
        jsoncodec.loads("[" * 100_000 + "]" * 100_000)


def test_memoryview_input_as_psycopg_passes_it() -> None:
    assert jsoncodec.loads(memoryview(b'{"n": 12345678901234567890123}')) == {"n": 12345678901234567890123}
    assert jsoncodec.loads(memoryview(b'{"n": 1}')) == {"n": 1}
