"""Claimed inbox rows as the worker's :class:`Claimed`: pure translation, no I/O
(docs/explanation/handle.md, "Worker batches").

:func:`claimed` turns one row of a claim into a :class:`Claimed` (its :class:`Message`,
fencing token and lease start), or marks it ``undecodable`` when it cannot: it never
raises, so one bad row never fails the claim or the batch.

The claim commits in the same round trip that returns its rows, so a row the driver
cannot turn into Python values (JSON nested deeper than the parser's recursion limit,
a timestamp beyond Python's years 1-9999 stored by an older version) used to fail the
whole claim, crash the worker, and do the same after every restart. On the claim
connection the JSON and timestamp columns load leniently: a value that does not decode
becomes an :class:`Undecodable` holding its text, and that one row is dead-lettered.
"""

from __future__ import annotations

import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq
from psycopg.abc import AdaptContext
from psycopg.adapt import AdaptersMap, Buffer, Loader, Transformer
from psycopg.pq import Format

from framework import jsoncodec
from framework.envelope import Message
from framework.outcomes import WorkerOutcome
from framework.redaction import clip
from framework.sql import inbox as inbox_sql

TEXT_LIMIT = 100_000  # characters of an undecodable value kept for its dead letter


@dataclass(frozen=True)
class Undecodable:
    """A stored value the worker could not read, with why."""

    text: str
    error: str


def _undecodable(data: Buffer, exc: BaseException) -> Undecodable:
    text = bytes(data).decode("utf-8", "replace")
    # Cut with redaction.clip, not a slice: a cut through a URL's user info would leave its
    # password where the masking of the letter's text no longer sees one.
    return Undecodable(clip(text, TEXT_LIMIT) or "", clip(f"{type(exc).__name__}: {exc}", 500) or "")


class LenientJsonLoader(Loader):
    def load(self, data: Buffer) -> Any:
        try:
            return jsoncodec.loads(data)
        except (ValueError, RecursionError, MemoryError) as exc:
            return _undecodable(data, exc)


# The driver's own loader: psycopg's C one when its binary build is installed, much cheaper
# than the pure-Python class (which a subclass would get: C loaders cannot be subclassed),
# and the worker reads two timestamps per claimed row (benchmarks/code-choices.md,
# "Claimed timestamps: psycopg's C loader").
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


def register(adapters: AdaptersMap) -> None:
    """Make ``adapters`` (the claim connection's) load JSON and timestamps leniently."""
    for name in ("json", "jsonb"):
        adapters.register_loader(name, LenientJsonLoader)
    adapters.register_loader("timestamptz", LenientTimestamptzLoader)


def claim_rows(result: pq.abc.PGresult, context: AdaptContext) -> list[tuple[Any, ...]]:
    """The rows of a claim's ``result`` received on a connection whose loaders are not
    lenient (``context``'s: a daemon that claims for the worker on a connection of its
    own), loaded as the claim connection loads them (:func:`register`)."""
    adapters = AdaptersMap(context.adapters)
    register(adapters)
    transformer = Transformer(adapters)
    transformer.set_pgresult(result)
    rows: list[tuple[Any, ...]] = transformer.load_rows(0, result.ntuples, tuple)
    return rows


@dataclass
class Claimed:
    """A claimed inbox row and what became of it."""

    id: uuid.UUID
    message_type: str
    routing_key: str
    started: int  # started_attempts after our claim: the fencing token
    finished: int
    metadata: dict[str, Any]
    message: Message
    claimed_at: float  # time.monotonic() before the claim: the lease runs from here
    outcome: WorkerOutcome = WorkerOutcome.PENDING
    reason: str = ""
    error: str = ""
    error_type: str = ""
    delay: float = 0.0
    finished_delta: int = 1
    crashed: bool = False  # its handler was running when the batch broke off: never released
    undecodable: str = ""  # why the stored row could not be read; it is dead-lettered unrun
    raw: dict[str, str] | None = None  # the stored columns as text, for the dead letter of such a row

    @property
    def unfinished_before(self) -> int:
        """Runs before this claim that never finished: the process died inside them."""
        return self.started - 1 - self.finished


def claimed(
    row: Sequence[Any], claimed_at: float, max_attempts: Callable[[str], int | None], default_attempts: int
) -> Claimed:
    """A claimed row (a tuple of framework.sql.inbox.CLAIM_COLUMNS) as a :class:`Claimed`; one
    that cannot be read is marked so (``undecodable``), never raised. Pure: no I/O.

    ``max_attempts(message_type)`` is the handler's own limit (None: ``default_attempts``).
    """
    try:
        return _decode(row, claimed_at, max_attempts, default_attempts)
    except Exception as exc:  # last resort: this row is dead-lettered, the batch goes on
        return unreadable(row, claimed_at, describe(exc), default_attempts)


def _decode(
    row: Sequence[Any], claimed_at: float, max_attempts: Callable[[str], int | None], default_attempts: int
) -> Claimed:
    # By position, in the order of CLAIM_COLUMNS (this runs for every message).
    (
        message_id,
        message_type,
        aggregate_type,
        aggregate_id,
        message_version,
        routing_key,
        payload,
        context,
        metadata,
        timestamp,
        started,
        finished,
        _priority,
        _created_at,
    ) = row
    # One test for the usual row; the reasons only for a bad one.
    if (
        isinstance(payload, Undecodable)
        or isinstance(timestamp, Undecodable)
        or not isinstance(context, dict | None)
        or not isinstance(metadata, dict | None)
    ):
        return unreadable(row, claimed_at, undecodable_reasons(payload, context, metadata, timestamp), default_attempts)
    metadata = metadata or {}
    message = Message(
        message_id=message_id,
        message_type=message_type,
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        payload=payload,
        message_context=context or {},
        timestamp=timestamp if isinstance(timestamp, datetime) else datetime.fromisoformat(str(timestamp)),
        message_version=message_version,
        auth_token=metadata.get("auth_token"),
        attempt=finished + 1,
        max_attempts=max_attempts(message_type) or default_attempts,
        routing_key=routing_key,
    )
    return Claimed(
        id=message_id,
        message_type=message_type,
        routing_key=routing_key,
        started=started,
        finished=finished,
        metadata=metadata,
        message=message,
        claimed_at=claimed_at,
    )


def unreadable(claim: Sequence[Any], claimed_at: float, why: str, max_attempts: int) -> Claimed:
    """A claimed row the worker cannot turn into a Message: abandoned unrun, its columns kept as text."""
    row = dict(zip(inbox_sql.CLAIM_COLUMNS, claim, strict=False))
    finished = row["finished_attempts"]
    message = Message(
        message_id=row["id"],
        message_type=str(row["message_type"]),
        aggregate_type=str(row["aggregate_type"]),
        aggregate_id=str(row["aggregate_id"]),
        payload={},
        message_version=str(row["message_version"]),
        attempt=finished + 1,
        max_attempts=max_attempts,
        routing_key=row["routing_key"],
    )
    raw = {name: as_text(row[name]) for name in inbox_sql.STORED_COLUMNS}
    return Claimed(
        id=row["id"],
        message_type=str(row["message_type"]),
        routing_key=str(row["routing_key"]),
        started=row["started_attempts"],
        finished=finished,
        metadata={},
        message=message,
        claimed_at=claimed_at,
        undecodable=why,
        raw=raw,
    )


def as_text(value: Any) -> str:
    """A claimed column as text for a dead letter, whatever it holds."""
    if isinstance(value, Undecodable):
        return value.text
    if isinstance(value, str):
        return value
    try:
        return jsoncodec.dumps(value, default=str)
    except Exception:  # nested past the encoder's limit, or worse: its type at least
        return f"<{type(value).__name__} that cannot be written as JSON>"


def undecodable_reasons(payload: Any, context: Any, metadata: Any, timestamp: Any) -> str:
    """Why a claimed row's values cannot make a Message."""
    bad = [
        f"{name}: {value.error}"
        for name, value in (
            ("payload", payload),
            ("message_context", context),
            ("metadata", metadata),
            ("message_timestamp", timestamp),
        )
        if isinstance(value, Undecodable)
    ]
    bad += [
        f"{name} is a JSON {type(value).__name__}, not an object"
        for name, value in (("message_context", context), ("metadata", metadata))
        if value is not None and not isinstance(value, dict)
    ]
    return "; ".join(bad)


def describe(exc: BaseException) -> str:
    """An exception as one line of text, with where it was raised; never fails."""
    try:
        text = str(exc).strip() or type(exc).__name__
    except Exception:  # a handler's exception whose __str__ fails is still its message's failure
        text = type(exc).__name__
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return text + where
