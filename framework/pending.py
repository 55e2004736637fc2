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

The statements and the filters they take (``Filters``), and how they stay on the partial
pending indexes: framework/sql/pending.py.
"""

from __future__ import annotations

from typing import Any

import psycopg

from framework import redaction
from framework.sql import pending as pending_sql


def list_pending(conn: psycopg.Connection[Any], schema: str, filters: pending_sql.Filters) -> list[dict[str, Any]]:
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
        for state in pending_sql.STATES
    }
    return {"pending": sum(s["n"] for s in by_state.values()), "states": by_state}


def _oldest(row: dict[str, Any] | None) -> float | None:
    return float(row["oldest_seconds"]) if row and row["oldest_seconds"] is not None else None
