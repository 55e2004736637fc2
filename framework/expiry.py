"""A message's time to live: the absolute expiry it carries, and the one test of it.

A sender gives ``ttl`` (``outbox.send_command(..., ttl=...)``, ``publish_event``, a direct
``Publisher.publish``); the message then carries the time it expires, computed once on
the sender's clock, and every daemon that holds it compares that time with its own
clock before passing it on: the relay before publishing, the receiver before storing,
the worker before running the handler. An expired message is dead-lettered as
``expired`` (docs/explanation/receive.md, "Expiry and filters").
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from framework.envelope import format_timestamp

# Longest header value read as an expiry: an ISO 8601 time with an offset and microseconds
# fits; anything longer is not one, and is not parsed.
_MAX_HEADER_CHARS = 40

# The range a datetime can show: an expiry outside it is clamped when written as text (a
# dead letter's error, a header), never allowed to raise there.
_EARLIEST = datetime(1, 1, 2, tzinfo=UTC).timestamp()
_LATEST = datetime(9999, 12, 31, tzinfo=UTC).timestamp()


def deadline(ttl: timedelta | float, now: float | None = None) -> float:
    """The expiry (seconds since the epoch) of a message sent now with ``ttl``."""
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"ttl must be a positive number of seconds or timedelta, not {ttl!r}")
    expires_at = round((time.time() if now is None else now) + seconds, 3)
    if expires_at >= _LATEST:
        raise ValueError(
            f"ttl {ttl!r} would expire after the year 9999: leave the ttl out for a message that does not expire"
        )
    return expires_at


def header_value(expires_at: float) -> str:
    """The ``x-txbox-expires-at`` header: ISO 8601, UTC, milliseconds, ``Z`` (as the envelope's timestamp)."""
    return format_timestamp(datetime.fromtimestamp(min(max(expires_at, _EARLIEST), _LATEST), UTC))


def from_header(value: Any) -> float | None:
    """The expiry a delivery's header gives, or None when absent or not a time.

    A malformed value is ignored rather than rejected: the header is an addition to the
    envelope, and a message is not refused for what a peer adds to it.
    """
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_HEADER_CHARS:
        return None
    try:
        parsed = datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return round(parsed.timestamp(), 3)


def from_metadata(value: Any) -> float | None:
    """The expiry stored in a row's ``metadata`` (a number), or None."""
    if type(value) is float or type(value) is int:
        return float(value)
    return None


def passed(expires_at: float, now: float | None = None) -> bool:
    """True once ``expires_at`` is reached on this host's clock."""
    return expires_at <= (time.time() if now is None else now)


def describe(expires_at: float, where: str) -> str:
    """The dead letter's error text."""
    return f"expired at {header_value(expires_at)} {where}"
