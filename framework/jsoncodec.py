"""Every conversion of values to JSON, in one place.

- :func:`loads` / :func:`dumps`: JSON on the hot paths, orjson's speed with the standard
  library's results (below);
- :func:`to_storable`, :func:`clean_text`, :func:`clean_string`, :func:`storable_text`, :func:`clip_depth`:
  hostile values made into what PostgreSQL stores (docs/explanation/dead-letters.md, "Dead letters");
- :func:`amqp_json`: what an AMQP delivery carries (bytes, datetimes, decimals) as JSON text;
- :func:`plain` / :func:`pretty`: any value for a JSON response or a person to read
  (what JSON has no type for becomes its ``str()``).

On the hot paths:

Every received body and every claimed inbox row (payload, context, metadata) is parsed
once, and the inbox and outbox JSON written once per message. orjson does both at a
fraction of the standard library's CPU (benchmarks/code-choices.md, "JSON on the hot
paths"), but differs from
:mod:`json` on a few inputs, so it only gets the input when it returns exactly what
:func:`json.loads` would:

- integers beyond 64 bits come back as floats from orjson (precision silently lost):
  text with a run of 19 or more digits goes to :func:`json.loads`, which keeps them exact;
- what orjson refuses but :mod:`json` accepts (``NaN``, ``Infinity``, overflowing
  floats, lone UTF-16 surrogates, nesting deeper than 1024) is parsed again by
  :func:`json.loads`, which accepts it or raises the error callers already handle.

:func:`dumps` likewise writes the JSON value :func:`json.dumps` writes (a float may be
spelled differently, ``0.00001`` for ``1e-05``: the same number, and jsonb stores
numbers, not their spelling). orjson writes NaN and ±Infinity as ``null`` and refuses
integers beyond 64 bits, non-string keys and deep nesting, so any output holding
``null`` and any refusal is written again by :mod:`json` (compact, UTF-8 as is).

Neither is total: :func:`dumps` raises ``RecursionError`` on nesting near Python's
recursion limit (orjson refuses more than 1024 levels, :mod:`json` recurses), and
writes what ``jsonb`` refuses (``\\u0000``, lone surrogates) as given. Writers of
hostile input (dead letters) pass it through :func:`to_storable` first, which is total.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from collections.abc import Callable
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import orjson

# Digits → "0", so a run of 19 digits is one substring search at C speed, where a regex
# scan costs more than orjson's whole parse (benchmarks/code-choices.md, "JSON on the
# hot paths").
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON text exactly as :func:`json.loads` does (same values, same errors), faster."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if _NINETEEN_DIGITS not in raw.translate(_DIGITS_TO_ZERO):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data if isinstance(data, str) else raw)


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    """``json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=default)``, faster:
    the same JSON value (``default`` must render datetimes with ``isoformat()``, as orjson does)."""
    try:
        out = orjson.dumps(value, default=default)
    except TypeError:
        return _encoder(default)(value)
    if b"null" in out:
        return _encoder(default)(value)  # maybe a NaN or an infinity that orjson turned into null
    return out.decode()


@functools.cache
def _encoder(default: Callable[[Any], Any] | None) -> Callable[[Any], str]:
    # One encoder per ``default``: json.dumps with options builds a new one per call,
    # which costs as much as encoding a small value.
    return json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=default).encode


JSON_DEPTH_LIMIT = 64
"""Nesting :func:`to_storable` keeps; deeper parts become :data:`TOO_DEEP`."""
TOO_DEEP = f"<nested deeper than {JSON_DEPTH_LIMIT} levels, not kept>"
_BIG_INT_BITS = 10_000  # ~3,000 digits: str() refuses more than 4,300 and jsonb numerics are bounded


def to_storable(value: Any) -> Any:
    """``value`` as JSON PostgreSQL stores in ``jsonb``; total: never raises, always storable.

    - NUL (``jsonb`` and ``text`` refuse it) becomes U+FFFD, lone surrogates (not UTF-8)
      become U+FFFD, in keys and strings;
    - containers nested deeper than :data:`JSON_DEPTH_LIMIT` become the string
      :data:`TOO_DEEP` (PostgreSQL's stack and Python's recursion have limits);
    - NaN and ±Infinity become their names, integers beyond ~3,000 digits a short
      description, bytes text (UTF-8, invalid bytes replaced), dates ISO 8601, decimals
      numbers, and anything else its ``str()``.

    A dead letter is the last resort for hostile input: if its row could not be stored
    its writer would fail on the same input again and again. The raw body keeps the
    bytes, so nothing is lost by cleaning the parsed copies.
    """
    return _storable(value, 0)


def _storable(value: Any, depth: int = 0) -> Any:
    if isinstance(value, dict | list | tuple):
        return _storable_container(value, depth)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return clean_string(value)
    if isinstance(value, int):
        return value if value.bit_length() <= _BIG_INT_BITS else f"<integer of {value.bit_length()} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return _storable_other(value)


def _storable_container(value: dict[Any, Any] | list[Any] | tuple[Any, ...], depth: int) -> Any:
    if depth >= JSON_DEPTH_LIMIT:
        return TOO_DEEP
    if isinstance(value, dict):
        return {_key(k): _storable(v, depth + 1) for k, v in value.items()}
    return [_storable(v, depth + 1) for v in value]


def _storable_other(value: Any) -> Any:
    """What JSON has no type for: bytes as text, dates in ISO 8601, decimals, else ``str()``."""
    if isinstance(value, bytes | bytearray | memoryview):
        return clean_string(bytes(value).decode("utf-8", "replace"))
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return _decimal(value)
    return clean_string(safe_str(value))


def _key(key: Any) -> str:
    if isinstance(key, bytes | bytearray):
        return clean_string(bytes(key).decode("utf-8", "replace"))
    return clean_string(key if isinstance(key, str) else safe_str(key))


def _decimal(value: Decimal) -> Any:
    if value.is_finite():
        as_float = float(value)
        if math.isfinite(as_float):
            return as_float
    return str(value)


def safe_str(value: Any) -> str:
    """``str(value)``, or a name of its type when its ``__str__`` fails."""
    try:
        return str(value)
    except Exception:  # a foreign object whose __str__ fails still names its type
        return f"<unprintable {type(value).__name__}>"


def clean_string(text: str) -> str:
    """``text`` as a ``text`` column stores it: NUL and lone surrogates become U+FFFD."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def clean_text(value: Any, limit: int) -> str | None:
    """``value`` for a ``text`` column: str, no NUL, valid UTF-8, at most ``limit`` characters (+ a note)."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        text = bytes(value).decode("utf-8", "replace")
    else:
        text = value if isinstance(value, str) else safe_str(value)
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text)} characters)"
    return clean_string(text)


def storable_text(text: str) -> bool:
    """Text PostgreSQL stores as is: no NUL, no lone surrogate."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_CONTAINERS = (dict, list, tuple)


def clip_depth(value: Any, limit: int) -> Any:
    """``value`` with containers nested deeper than ``limit`` replaced by a marker string.

    AMQP header tables can nest as deep as a frame allows; every later step (JSON text,
    jsonb, the dead letter) would have to recurse that deep. The recursion here stops
    at ``limit``. Shallow values (the usual headers) come back as they are.
    """
    if limit <= 0:
        return "<nested too deep>" if isinstance(value, _CONTAINERS) else value
    if isinstance(value, dict):
        # Every delivery's headers pass here: most are empty or flat, and come back as they are.
        if not value or not any(isinstance(v, _CONTAINERS) for v in value.values()):
            return value
        return {k: clip_depth(v, limit - 1) for k, v in value.items()}
    if isinstance(value, _CONTAINERS):
        return [clip_depth(v, limit - 1) for v in value]
    return value


def amqp_value(value: Any) -> Any:
    """``default`` of :func:`dumps` for AMQP values: bytes as UTF-8 text (else base64),
    datetimes ISO 8601, anything else (decimals) its ``str()``."""
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def amqp_json(value: Any) -> str:
    """Compact JSON of what a delivery carries (AMQP values: bytes, datetimes, decimals too)."""
    return dumps(value, amqp_value)


def plain(value: Any) -> Any:
    """``value`` as plain JSON types (for a JSON response): what JSON has no type for is its ``str()``."""
    return json.loads(json.dumps(value, default=str))


def pretty(value: Any, *, ensure_ascii: bool = False) -> str:
    """``value`` indented for a person to read; what JSON has no type for is its ``str()``."""
    return json.dumps(value, indent=2, ensure_ascii=ensure_ascii, default=str)
