"""Reading claimed inbox rows without letting one row stop the worker.

The claim commits in the same round trip that returns its rows, so a row the driver
cannot turn into Python values (JSON nested deeper than the parser's recursion limit,
a timestamp beyond Python's years 1-9999 stored by an older version) used to fail the
whole claim, crash the worker, and do the same after every restart. On the claim
connection the JSON and timestamp columns load leniently: a value that does not decode
becomes an :class:`Undecodable` holding its text, and that one row is dead-lettered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.abc import AdaptContext
from psycopg.adapt import Buffer, Loader
from psycopg.pq import Format

from framework import jsoncodec

TEXT_LIMIT = 100_000  # characters of an undecodable value kept for its dead letter


@dataclass(frozen=True)
class Undecodable:
    """A stored value the worker could not read, with why."""

    text: str
    error: str


def _undecodable(data: Buffer, exc: BaseException) -> Undecodable:
    text = bytes(data).decode("utf-8", "replace")
    return Undecodable(text[:TEXT_LIMIT], f"{type(exc).__name__}: {exc}"[:500])


class LenientJsonLoader(Loader):
    def load(self, data: Buffer) -> Any:
        try:
            return jsoncodec.loads(data)
        except (ValueError, RecursionError, MemoryError) as exc:
            return _undecodable(data, exc)


# The driver's own loader: psycopg's C one when its binary build is installed, ten times
# faster than the pure-Python class (which a subclass would get: C loaders cannot be
# subclassed), and two timestamps per claimed row made that a quarter of the worker's CPU.
_TIMESTAMPTZ = psycopg.adapters.get_loader(psycopg.adapters.types["timestamptz"].oid, Format.TEXT)


class LenientTimestamptzLoader(Loader):
    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        assert _TIMESTAMPTZ is not None
        self._strict = _TIMESTAMPTZ(oid, context).load

    def load(self, data: Buffer) -> Any:
        try:
            return self._strict(data)
        except (psycopg.DataError, ValueError, OverflowError) as exc:
            return _undecodable(data, exc)


def register(conn: psycopg.Connection[Any]) -> None:
    """Make ``conn`` (the claim connection) load JSON and timestamps leniently."""
    for name in ("json", "jsonb"):
        conn.adapters.register_loader(name, LenientJsonLoader)
    conn.adapters.register_loader("timestamptz", LenientTimestamptzLoader)
