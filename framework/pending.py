"""What is pending: the unfinished rows of the outbox and the inbox, as named SQL for people.

`txbox outbox list`, `txbox inbox list` and the dashboard's pending page read through
here (docs/architecture.md, "What is pending"). Each pending row is in exactly one
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

Bounded reads on the partial pending indexes, never over the processed history: the
list walks ``*_due_idx`` in its order (priority first, then oldest first: the order the
daemons take rows), and stops at ``limit``; with a segment it spells "pending" as the
segment index's predicate to reach ``*_segment_idx`` instead (framework/tables.py says
why spellings matter). The counts read every pending row once, as the overview does.
Filter values are bound parameters; only the schema is composed, as an identifier.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import psycopg
from psycopg import sql

from framework import names
from framework.tables import PENDING, pending_in_segment

State = Literal["leased", "failing", "parked", "scheduled", "due"]
STATES: tuple[State, ...] = ("leased", "failing", "parked", "scheduled", "due")
TABLES = (names.OUTBOX, names.INBOX)
DEFAULT_LIMIT = 50
MAX_LIMIT = 1000
ERROR_CHARS = 2000  # of last_error: enough to recognise the failure; the full text is in the row

_COLUMNS = (
    "o.id, o.message_type, o.kind, o.routing_key, o.aggregate_type, o.aggregate_id, o.segment, o.concurrency, "
    "o.priority, o.created_at, o.locked_until, o.started_attempts, o.finished_attempts, "
    f"left(o.last_error, {ERROR_CHARS}) AS last_error, o.payload, o.message_context, o.metadata"
)

# Seconds since the row was written (outbox) or stored (inbox).
_AGE = "extract(epoch FROM now() - o.created_at)::float8"

# The first state that holds, in the order of the module's docstring.
_STATE = """CASE
    WHEN o.started_attempts > o.finished_attempts AND o.locked_until > now() THEN 'leased'
    WHEN o.last_error IS NOT NULL OR o.started_attempts > o.finished_attempts THEN 'failing'
    WHEN {parked} THEN 'parked'
    WHEN o.locked_until > now() THEN 'scheduled'
    ELSE 'due' END"""

# Segments whose sequential rows the worker parks: found from the open dead letters
# (their partial indexes, then the inbox's primary key), so only as many as are open.
_PARKED_SEGMENTS = """parked AS MATERIALIZED (
    SELECT DISTINCT a.segment FROM {dead_letters} d JOIN {inbox} a ON a.id = d.message_id
    WHERE d.source = 'inbox' AND d.replayed_at IS NULL AND d.discarded_at IS NULL
      AND a.abandoned_at IS NOT NULL AND a.concurrency = 'sequential')"""


@dataclass(frozen=True, kw_only=True)
class Filters:
    """Which pending rows to show. Empty strings count as 'not given' (as HTML forms send them).

    ``park``: the worker parks segments behind open dead letters (its segment policy).
    """

    table: str = names.INBOX
    state: str | None = None
    message_type: str | None = None
    segment: str | None = None
    older_than: float | None = None  # seconds, as _AGE
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
        return self.park and self.table == names.INBOX


def _state_sql(parks: bool) -> sql.SQL:
    parked = "o.concurrency = 'sequential' AND o.segment IN (SELECT segment FROM parked)" if parks else "FALSE"
    return sql.SQL(_STATE.format(parked=parked))


def _with_parked(schema: str, parks: bool) -> sql.Composable:
    if not parks:
        return sql.SQL("")
    return sql.SQL("WITH " + _PARKED_SEGMENTS + " ").format(
        dead_letters=sql.Identifier(schema, names.DEAD_LETTERS), inbox=sql.Identifier(schema, names.INBOX)
    )


def list_query(schema: str, filters: Filters) -> tuple[sql.Composed, dict[str, Any]]:
    """The statement of :func:`list_pending` and its parameters (the plan tests read it)."""
    # The spellings of "pending" come unaliased: the inner FROM has one table, so none is needed.
    where: list[str] = [pending_in_segment() if filters.segment is not None else PENDING.text]
    params: dict[str, Any] = {"limit": filters.limit}
    if filters.message_type is not None:
        where.append("o.message_type = %(message_type)s")
        params["message_type"] = filters.message_type
    if filters.segment is not None:
        where.append("o.segment = %(segment)s")
        params["segment"] = filters.segment
    if filters.older_than is not None:
        where.append("o.created_at <= now() - make_interval(secs => %(older_than)s)")
        params["older_than"] = filters.older_than
    outer = ""
    if filters.state is not None:
        outer = "WHERE s.state = %(state)s "
        params["state"] = filters.state
    query = sql.SQL(
        "{parked}SELECT * FROM (SELECT "
        + _COLUMNS
        + f", {{state}} AS state, {_AGE} AS age_seconds{{extra}} FROM {{t}} o WHERE "
        + " AND ".join(where)
        + ") s "
        + outer
        + "ORDER BY s.priority DESC, s.created_at LIMIT %(limit)s"
    ).format(
        parked=_with_parked(schema, filters.parks),
        state=_state_sql(filters.parks),
        extra=sql.SQL(", o.queue, o.redelivered" if filters.table == names.INBOX else ""),
        t=sql.Identifier(schema, filters.table),
    )
    return query, params


def list_pending(conn: psycopg.Connection[Any], schema: str, filters: Filters) -> list[dict[str, Any]]:
    """Up to ``filters.limit`` pending rows, highest priority then oldest first, each with its state and age."""
    query, params = list_query(schema, filters)
    return [dict(r) for r in conn.execute(query, params).fetchall()]


def counts_query(schema: str, table: str, *, park: bool = False) -> sql.Composed:
    """The statement of :func:`counts` (the plan tests read it)."""
    parks = Filters(table=table, park=park).parks
    return sql.SQL(
        "{parked}SELECT state, count(*) AS n, max(age_seconds) AS oldest_seconds FROM (SELECT {state} AS state, "
        f"{_AGE} AS age_seconds FROM {{t}} o WHERE " + PENDING.text + ") s GROUP BY state"
    ).format(parked=_with_parked(schema, parks), state=_state_sql(parks), t=sql.Identifier(schema, table))


def counts(conn: psycopg.Connection[Any], schema: str, table: str, *, park: bool = False) -> dict[str, Any]:
    """Per state of ``table``: how many pending rows, and the age in seconds of the oldest."""
    query = counts_query(schema, table, park=park)
    found = {r["state"]: r for r in conn.execute(query).fetchall()}
    by_state = {
        state: {"n": int(found[state]["n"]) if state in found else 0, "oldest_seconds": _oldest(found.get(state))}
        for state in STATES
    }
    return {"pending": sum(s["n"] for s in by_state.values()), "states": by_state}


def _oldest(row: dict[str, Any] | None) -> float | None:
    return float(row["oldest_seconds"]) if row and row["oldest_seconds"] is not None else None
