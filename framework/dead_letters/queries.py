"""What `txbox dlq` and the dashboard ask for: a connection to read with, the overview card
and the timeline's buckets.

The statements are in framework/sql/: the dead letters' reads and the filters of a list
(``Filters``) in ``dead_letters.py``, the
inbox's and outbox's numbers and the timeline's counts in ``messages.py``, the report
tables in ``reports.py`` (docs/explanation/daemons.md, "Tables and their SQL").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row
from sqlalchemy.engine import Engine

from framework import names
from framework.db import database_errors
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import messages as messages_sql

SOURCES = ("broker", "inbox", "outbox")


@contextmanager
def connection(engine: Engine) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A pooled raw psycopg connection in autocommit mode with dict rows."""
    with database_errors("cannot reach the service's database"):
        raw = engine.raw_connection()
    conn: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
    try:
        # Reads need no transaction; writers (replay, discard) open their own.
        conn.autocommit = True
        conn.row_factory = dict_row
        yield conn
    finally:
        if not conn.closed:
            conn.row_factory = tuple_row
            conn.autocommit = False
        raw.close()  # back to the pool


def parse_when(text: str) -> datetime:
    """`2h` (that long ago) or an ISO 8601 time (UTC when it has no zone); ValueError else."""
    from framework.settings import parse_duration

    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
    except ValueError:
        pass
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (2h, 30m) nor an ISO time") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def overview(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """The numbers of one service's overview card."""
    return {
        "inbox": messages_sql.health(conn, schema, names.INBOX),
        "outbox": messages_sql.health(conn, schema, names.OUTBOX),
        "dead_letters": dead_letters_sql.open_summary(conn, schema),
    }


WINDOWS: dict[str, tuple[timedelta, timedelta]] = {
    # window → (span, bucket)
    "1h": (timedelta(hours=1), timedelta(minutes=1)),
    "6h": (timedelta(hours=6), timedelta(minutes=10)),
    "24h": (timedelta(hours=24), timedelta(hours=1)),
    "7d": (timedelta(days=7), timedelta(hours=6)),
}


def timeline(conn: psycopg.Connection[Any], schema: str, window: str = "1h") -> dict[str, Any]:
    """Per bucket: messages received and processed by the inbox, published by the outbox and
    dead letters, over ``window``. Buckets without events are present with zeros."""
    span, bucket = WINDOWS[window]
    now = datetime.now(UTC)
    # Align to the bucket so consecutive page loads show the same bars.
    step = bucket.total_seconds()
    end = datetime.fromtimestamp((now.timestamp() // step + 1) * step, UTC)
    start = end - span
    params = {"start": start, "end": end, "bucket": bucket, "lookback": start - timedelta(hours=1)}
    series = messages_sql.timeline_bins(conn, schema, params)
    buckets = []
    at = start
    while at < end:
        buckets.append(at)
        at += bucket
    return {
        "window": window,
        "bucket_seconds": int(step),
        "buckets": [b.isoformat() for b in buckets],
        "series": {name: [values.get(b, 0) for b in buckets] for name, values in series.items()},
    }
