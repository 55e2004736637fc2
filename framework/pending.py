"""What is pending: the unfinished rows of the outbox and the inbox, as named SQL for people.

`txbox outbox list`, `txbox inbox list` and the dashboard's pending page read through
here (docs/explanation/dead-letters.md, "What is pending"). Each pending row is in exactly one
*state*, the first that holds of:

- ``leased``: a claim holds it now (``started_attempts > finished_attempts`` and the
  lease in ``locked_until`` not over): being published or handled;
- ``failing``: a run failed (``last_error``) or died (started, unfinished, lease over):
  it waits for its backoff or is due again;
- ``parked`` (inbox, only under ``TXBOX_WORKER_SEGMENT_POLICY=park``): an earlier
  sequential message of its segment was abandoned and its dead letter is still open,
  so the worker leaves it alone (the worker's own rule, framework/sql/inbox.py);
- ``scheduled``: not before ``locked_until`` (a scheduled send, or given back later);
- ``due``: the daemons may take it now (when it heads its segment).

The statements, and how they stay on the partial pending indexes: framework/sql/pending.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import psycopg

from framework import names, redaction
from framework.sql import pending as pending_sql

State = Literal["leased", "failing", "parked", "scheduled", "due"]
STATES: tuple[State, ...] = ("leased", "failing", "parked", "scheduled", "due")
TABLES = (names.OUTBOX, names.INBOX)
DEFAULT_LIMIT = 50
MAX_LIMIT = 1000


@dataclass(frozen=True, kw_only=True)
class Filters:
    """Which pending rows to show. Empty strings count as 'not given' (as HTML forms send them).

    ``park``: the worker parks segments behind open dead letters (its segment policy).
    """

    table: str = names.INBOX
    state: str | None = None
    message_type: str | None = None
    segment: str | None = None
    older_than: float | None = None  # seconds
    limit: int = DEFAULT_LIMIT
    park: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) == "":
                object.__setattr__(self, f.name, None)
        if self.table not in TABLES:
            raise ValueError(f"table must be one of {', '.join(TABLES)}, not {self.table!r}")
        if self.state is not None and self.state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, not {self.state!r}")
        if self.older_than is not None and self.older_than < 0:
            raise ValueError(f"the age must not be negative: {self.older_than!r}")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise ValueError(f"limit must be from 1 to {MAX_LIMIT}, not {self.limit}")

    @property
    def parks(self) -> bool:
        return pending_sql.parks(self.table, park=self.park)


def list_pending(conn: psycopg.Connection[Any], schema: str, filters: Filters) -> list[dict[str, Any]]:
    """Up to ``filters.limit`` pending rows, highest priority then oldest first, each with its state and age."""
    query, params = pending_sql.list_query(schema, filters)
    rows = [dict(r) for r in conn.execute(query, params).fetchall()]
    for row in rows:  # a cut never leaves part of a URL's password (docs/explanation/operations.md, "Secrets")
        row["last_error"] = redaction.clip(row["last_error"], pending_sql.ERROR_CHARS)
    return rows


def counts(conn: psycopg.Connection[Any], schema: str, table: str, *, park: bool = False) -> dict[str, Any]:
    """Per state of ``table``: how many pending rows, and the age in seconds of the oldest."""
    query = pending_sql.counts_query(schema, table, park=park)
    found = {r["state"]: r for r in conn.execute(query).fetchall()}
    by_state = {
        state: {"n": int(found[state]["n"]) if state in found else 0, "oldest_seconds": _oldest(found.get(state))}
        for state in STATES
    }
    return {"pending": sum(s["n"] for s in by_state.values()), "states": by_state}


def _oldest(row: dict[str, Any] | None) -> float | None:
    return float(row["oldest_seconds"]) if row and row["oldest_seconds"] is not None else None
