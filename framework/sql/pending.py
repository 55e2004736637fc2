"""The read statements of what is pending: unfinished outbox and inbox rows, one builder
for both tables (they share their columns and states), and the filters they take;
framework/pending.py says what each state means and runs them.

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

from psycopg import sql

from framework import names
from framework.tables import PENDING, pending_in_segment

State = Literal["leased", "failing", "parked", "scheduled", "due"]
STATES: tuple[State, ...] = ("leased", "failing", "parked", "scheduled", "due")
TABLES = (names.OUTBOX, names.INBOX)
DEFAULT_LIMIT = 50
MAX_LIMIT = 1000

# Of last_error: enough to recognise the failure; the full text is in the row. SQL reads
# one more for framework.redaction.clip to see a cut (framework/pending.py cuts).
ERROR_CHARS = 2000

_COLUMNS = (
    "o.id, o.message_type, o.kind, o.routing_key, o.aggregate_type, o.aggregate_id, o.segment, o.concurrency, "
    "o.priority, o.created_at, o.locked_until, o.started_attempts, o.finished_attempts, "
    f"left(o.last_error, {ERROR_CHARS + 1}) AS last_error, o.payload, o.message_context, o.metadata"
)

# Seconds since the row was written (outbox) or stored (inbox).
_AGE = "extract(epoch FROM now() - o.created_at)::float8"

# The first state that holds, in the order framework/pending.py's docstring gives.
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


def parks(table: str, *, park: bool) -> bool:
    """Whether the parked state applies: only the worker parks, so only in the inbox."""
    return park and table == names.INBOX


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
        return parks(self.table, park=self.park)


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
    """The list of ``framework.pending.list_pending`` and its parameters (the plan tests read it)."""
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


def counts_query(schema: str, table: str, *, park: bool = False) -> sql.Composed:
    """The counts of ``framework.pending.counts`` (the plan tests read it)."""
    parked = parks(table, park=park)
    return sql.SQL(
        "{parked}SELECT state, count(*) AS n, max(age_seconds) AS oldest_seconds FROM (SELECT {state} AS state, "
        f"{_AGE} AS age_seconds FROM {{t}} o WHERE " + PENDING.text + ") s GROUP BY state"
    ).format(
        parked=_with_parked(schema, parked),
        state=_state_sql(parked),
        t=sql.Identifier(schema, table),
    )
