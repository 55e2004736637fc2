"""JSON on the hot paths: orjson's speed with the standard library's results.

Every received body and every claimed inbox row (payload, context, metadata) is parsed
once, and the inbox and outbox JSON written once per message. orjson does both 3-5x
faster (the receiver spends 8 % less CPU per message with it), but differs from
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
hostile input (dead letters) pass it through :func:`framework.dead_letters.to_storable`
first, which is total.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import orjson

# Digits → "0", so a run of 19 digits is one substring search (C speed; a regex scan
# cost twice as much as orjson's whole parse).
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
