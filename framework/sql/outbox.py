"""All SQL of ``txbox.outbox``: the one INSERT every writer uses, its row codec, and the relay's statements.

Writing (docs/explanation/write.md, "Outbox writes"): :class:`OutboxRow` is the one shape of
a row on its way in and :meth:`OutboxRow.params` its one encoding (JSON columns as text
by ``framework.jsoncodec``); :func:`insert` is the one statement, with named parameters
for psycopg, and :func:`insert_text` the same statement with ``$n`` parameters for the
COMMIT pipeline (framework/outbox_commit.py). The business code's outbox, the worker's
batches and the dead-letter replay all write through them.

Relaying: the claim is one statement: a CTE picks due rows that are the head of their ordering
lane, locks them with ``FOR UPDATE SKIP LOCKED`` so concurrent publishers never wait on
each other, and the outer UPDATE takes the lease and counts the attempt in the same
round trip. The UPDATE finds the locked rows by ``ctid`` (stable while the CTE holds
their row locks): a TID scan, instead of probing a primary key that is bloated with one
entry per earlier row version.
The same statement marks the rows the relay saw confirmed since its last claim
(``marked``), so a cycle is one statement and one commit (docs/explanation/daemons.md, "Wake-ups").

Ordering lane = (segment, priority) of a *sequential* row: a sequential row is due only
when no earlier pending sequential row of the same segment and priority exists, so
"ordering holds within a priority" and a higher-priority row never waits behind a
lower-priority one. Parallel rows skip that check entirely. Because a predecessor stays
pending until its confirm is *recorded*, at most one row per lane is ever in flight:
a failure (nack, return, lost connection) of an earlier row can never let a later one
overtake it, whichever publisher holds which row.

Planner note: the head-of-lane probe is one descent of ``outbox_segment_idx (segment,
created_at)`` per candidate. On a table bulk-filled since its last ANALYZE the planner
misjudged the partial indexes and walked ``outbox_due_idx`` over every earlier row
instead, per candidate (benchmarks/code-choices.md, "The relay's head-of-lane probe").
Since migration 0006 the probe spells "pending" as the segment
index's predicate, which ``outbox_due_idx`` cannot serve (framework/tables.py), and the
statements that find rows by id spell it so that neither partial index can. The relay
still analyzes the outbox itself when the statistics are stale (framework/relay/daemon.py): row counts
matter for the rest of the plan.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from psycopg import sql
from psycopg.rows import RowMaker, class_row

from framework import jsoncodec, names
from framework.tables import pending_by_id, pending_in_segment


@dataclass(frozen=True, kw_only=True)
class OutboxRow:
    """A message on its way into txbox.outbox (column values)."""

    id: uuid.UUID
    message_type: str
    aggregate_type: str
    aggregate_id: str
    message_version: str
    kind: str
    routing_key: str
    payload: dict[str, Any]
    message_context: dict[str, Any]
    metadata: dict[str, Any]
    segment: str
    concurrency: str
    priority: int
    locked_until: datetime | None  # None: due now (the database's clock). Keep it last: see _insert

    def params(self) -> dict[str, Any]:
        """The parameters of :func:`insert`, JSON columns as text, in column order."""
        values = {name: getattr(self, name) for name in COLUMNS}
        for key in _JSON_COLUMNS:
            values[key] = jsoncodec.dumps(values[key])
        return values


COLUMNS = tuple(f.name for f in fields(OutboxRow))
_JSON_COLUMNS = ("payload", "message_context", "metadata")


def _insert(schema: str, placeholders: list[sql.Composable]) -> sql.Composed:
    # One statement per row, never a multi-row INSERT: ``created_at`` (``clock_timestamp()``)
    # orders a segment, and rows of one statement may share a microsecond. The last
    # column, locked_until, falls back to the database's clock when NULL.
    assert COLUMNS[-1] == "locked_until"
    values = [*placeholders[:-1], sql.SQL("COALESCE({}::timestamptz, clock_timestamp())").format(placeholders[-1])]
    return sql.SQL("INSERT INTO {t} ({cols}) VALUES ({vals})").format(
        t=_outbox(schema),
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
        vals=sql.SQL(", ").join(values),
    )


def insert(schema: str) -> sql.Composed:
    """The outbox INSERT with named parameters (:meth:`OutboxRow.params`)."""
    return _insert(schema, [sql.Placeholder(c) for c in COLUMNS])


@functools.cache
def insert_text(schema: str) -> str:
    """:func:`insert` with ``$1``... parameters in :data:`COLUMNS` order (libpq's own, for the pipeline)."""
    return _insert(schema, [sql.SQL(f"${n}") for n in range(1, len(COLUMNS) + 1)]).as_string()


@functools.cache
def insert_pyformat(schema: str) -> str:
    """:func:`insert` as text, for a SQLAlchemy connection's ``exec_driver_sql``."""
    return insert(schema).as_string()


class Claimed(NamedTuple):
    """One claimed outbox row, read by the names of the claim's columns."""

    id: str
    message_type: str
    aggregate_type: str
    aggregate_id: str
    message_version: str
    kind: str
    routing_key: str
    payload_json: str
    context_json: str
    auth_token: str | None
    correlation_id: str | None
    priority: int
    stamp: str  # created_at as the envelope formats it (UTC, milliseconds, Z)
    epoch: int  # created_at in whole seconds (the AMQP timestamp property)
    started_attempts: int
    finished_attempts: int
    segment: str = ""  # "" or the default lane (aggregate_type:aggregate_id): no header
    concurrency: str = "sequential"
    trace: dict[str, Any] | None = None  # the writer's span (docs/explanation/operations.md, "Tracing")
    expires_at: Any = None  # metadata's expiry, a number when set (framework/expiry.py)
    # A pending row waits behind this one in its lane (False: none; None: not asked, maybe).
    has_next: bool | None = None


def fetch_claimed(
    conn: psycopg.Connection[Any], statement: bytes | sql.Composed, params: dict[str, Any]
) -> list[Claimed]:
    """Run a claim (:func:`claim`, :func:`claim_window`); its rows in claim order, read by name."""
    with conn.cursor(row_factory=_claimed) as cur:
        return cur.execute(statement, params).fetchall()


# The fields' names as a result spells them: ASCII, the same bytes in every client encoding.
_FIELD_NAMES = tuple(name.encode() for name in Claimed._fields)


def _claimed(cursor: psycopg.Cursor[Any]) -> RowMaker[Claimed]:
    """Rows as :class:`Claimed`, by column name: the names are matched once per result, not
    once per row (``class_row`` builds a keyword dict per row, on the relay's hot path).

    The names are compared as the result's bytes: ``cursor.description`` would build a
    ``Column`` and look its type up for each column of every claim, where comparing bytes
    builds nothing (benchmarks/cpu-per-message.md, "The relay's column names"). A
    non-ASCII name is never equal to a field's, whatever the encoding, since its bytes
    start at 0x80 or above."""
    result = cursor.pgresult
    index = {} if result is None else {result.fname(i): i for i in range(result.nfields)}
    missing = [name for name in _FIELD_NAMES if name not in index]
    if missing:
        return class_row(Claimed)(cursor)  # defaults for what the statement does not select
    positions = [index[name] for name in _FIELD_NAMES]
    if positions == list(range(len(index))):  # exactly the fields, in their order
        return Claimed._make
    return lambda values: Claimed._make([values[i] for i in positions])


def _outbox(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, names.OUTBOX)


# Statements that find their rows by id spell "pending" so that no partial index can
# serve them (framework/tables.py says why).
_PENDING_BY_ID = sql.SQL(pending_by_id())


def _published(row: str, at: str) -> str:
    """SQL SET list: outbox row ``row`` published at ``at``; its auth_token, no longer needed, dropped."""
    return (
        f"processed_at = {at}, finished_attempts = {row}.finished_attempts + 1, last_error = NULL, "
        f"metadata = {row}.metadata - 'auth_token'"
    )


def _others_in_lane(row: str, row_id: str, also: str = "") -> str:
    """SQL: another pending sequential row (id not ``row_id``) shares ``row``'s lane (``also``: more conditions)."""
    return f"""EXISTS (
        SELECT 1 FROM {{outbox}} p
        WHERE p.segment = {row}.segment AND p.priority = {row}.priority AND p.concurrency = 'sequential'
          AND {pending_in_segment("p")} AND p.id <> {row_id}{also})"""


# The rows the claim marks published (``marked``) are processed when it commits, so
# they block no successor: the probe passes over them.
_PROBE = f"""NOT EXISTS (
            SELECT 1 FROM {{outbox}} p
            WHERE p.segment = o.segment AND p.priority = o.priority
              AND p.concurrency = 'sequential'
              AND {pending_in_segment("p")}
              AND (p.created_at, p.id) < (o.created_at, o.id)
              AND p.id <> ALL(%(marked)s::uuid[]))"""

# The published rows of earlier claims, marked by the claim that follows them (one
# statement and one commit per cycle, not two: docs/explanation/daemons.md, "Wake-ups"). It
# marks only rows still pending, as :func:`mark_published` does; it is not referenced,
# so it runs to completion after the claim, and the claim never takes a row it marks.
# ``processed_at`` stays the time of the broker's confirm: ``ages`` holds, per marked
# id, the seconds since it came (the relay's own clock measures only the interval).
_CONFIRMED_AT = (
    "clock_timestamp() - make_interval(secs => (%(ages)s::float8[])[array_position(%(marked)s::uuid[], m.id)])"
)
_MARK = f"""
WITH marked AS (
    UPDATE {{outbox}} m
    SET {_published("m", _CONFIRMED_AT)}
    WHERE m.id = ANY(%(marked)s::uuid[]) AND {pending_by_id("m")}
),"""

# Claims of at most this many rows say of each sequential row whether its lane holds a
# pending row behind it (``has_next``): only then must its mark follow its confirm at
# once. Larger claims say "maybe" (NULL): they come at full load, where the relay
# claims again anyway.
HAS_NEXT_AT_MOST = 32

# Per claimed row, with ``marked`` passed over as in the probe (see HAS_NEXT_AT_MOST).
_HAS_NEXT = (
    f"CASE WHEN concurrency = 'parallel' THEN false WHEN count(*) OVER () <= {HAS_NEXT_AT_MOST} THEN "
    + _others_in_lane("taken", "taken.id::uuid", " AND p.id <> ALL(%(marked)s::uuid[])")
    + " END"
)

# Take the locked rows: the lease and the attempt in one UPDATE, found by ``ctid``, and
# return them in claim order. Text that the envelope needs verbatim (id, JSON, the
# timestamp in the envelope's format) is rendered by PostgreSQL in C rather than
# parsed into Python objects and formatted again per message.
_TAKE = (
    """, taken AS (
UPDATE {outbox} t
SET locked_until = now() + make_interval(secs => %(lease)s),
    started_attempts = t.started_attempts + 1
WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM due))
RETURNING t.id::text AS id, t.message_type, t.aggregate_type, t.aggregate_id, t.message_version,
    t.kind, t.routing_key, t.payload::text AS payload_json, t.message_context::text AS context_json,
    t.metadata->>'auth_token' AS auth_token,
    CASE WHEN t.message_context <> '{{}}'::jsonb THEN
        (SELECT c.value FROM jsonb_each_text(t.message_context) c
          WHERE c.key LIKE '%%correlation_id' ORDER BY c.key LIMIT 1) END AS correlation_id,
    t.priority,
    to_char(t.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS stamp,
    floor(extract(epoch FROM t.created_at))::bigint AS epoch,
    t.started_attempts, t.finished_attempts, t.created_at, t.segment, t.concurrency,
    t.metadata->'trace' AS trace, t.metadata->'expires_at' AS expires_at)
SELECT id, message_type, aggregate_type, aggregate_id, message_version, kind, routing_key, payload_json,
    context_json, auth_token, correlation_id, priority, stamp, epoch, started_attempts, finished_attempts,
    segment, concurrency, trace, expires_at, """
    + _HAS_NEXT
    + """ AS has_next
FROM taken ORDER BY priority DESC, created_at, id"""
)

# The end of both claims: of the due rows chosen, the heads of their lanes (a parallel
# row heads its own), in claim order, locked (skipping rows another publisher holds),
# then taken.
_HEADS_TAKEN = (
    """
      AND (o.concurrency = 'parallel' OR """
    + _PROBE
    + """)
      AND o.id <> ALL(%(marked)s::uuid[])
    ORDER BY o.priority DESC, o.created_at
    LIMIT %(limit)s
    FOR UPDATE OF o SKIP LOCKED
)"""
    + _TAKE
)


def claim_window(schema: str) -> sql.Composed:
    """Params: window, limit, lease (seconds), marked (ids to mark published) and ages (seconds
    since each one's confirm; see _MARK). The usual claim (rows: :func:`fetch_claimed`).

    Looks only at the ``window`` oldest due rows, and probes only the first row of each
    lane among them (a later row of a lane in the window is never its head). With deep
    segments most due rows wait behind their head: probing every one of them made a
    claim cost O(pending rows) however few the lanes (benchmarks/code-choices.md, "The
    relay's head-of-lane probe"); this costs O(window) and one probe per lane. Rows beyond
    the window are younger and get their turn as the window drains; when the window
    holds no claimable row at all the relay falls back to :func:`claim` (at most once per
    poll interval), so a lane blocked by a long backoff cannot starve the others. The
    relay uses this claim only while claims come back short (few lanes); with many lanes
    the plain claim stops at its limit sooner.

    The heads are found again by ``ctid`` (a TID scan; the lock re-checks a row another
    publisher changed meanwhile), not joined by ``id``: with statistics from a smaller
    outbox the planner made that join a nested loop that re-ran the window per row,
    quadratic in the window (benchmarks/README.md, "2026-11-24, morning").
    """
    return sql.SQL(
        _MARK
        + """ window_rows AS (
    SELECT o.ctid, o.id, o.segment, o.priority, o.created_at, o.concurrency
    FROM {outbox} o
    WHERE o.processed_at IS NULL AND o.abandoned_at IS NULL AND o.locked_until <= now()
    ORDER BY o.priority DESC, o.created_at
    LIMIT %(window)s
), firsts AS (
    SELECT ctid FROM (
        SELECT w.ctid, w.concurrency, row_number() OVER (
            PARTITION BY w.segment, w.priority, w.concurrency ORDER BY w.created_at, w.id) AS n
        FROM window_rows w) ranked
    WHERE n = 1 OR concurrency = 'parallel'
), due AS (
    SELECT o.ctid
    FROM {outbox} o
    WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM firsts))
      AND """
        + pending_by_id("o")
        + """ AND o.locked_until <= now()"""
        + _HEADS_TAKEN
    ).format(outbox=_outbox(schema))


def claim(schema: str) -> sql.Composed:
    """Params: limit, lease (seconds), marked and ages (as :func:`claim_window`). Every due head of lane, whole
    table (the fallback)."""
    return sql.SQL(
        _MARK
        + """ due AS (
    SELECT o.ctid
    FROM {outbox} o
    WHERE o.processed_at IS NULL AND o.abandoned_at IS NULL AND o.locked_until <= now()"""
        + _HEADS_TAKEN
    ).format(outbox=_outbox(schema))


# Marks of more rows than this skip the successor probe and report "maybe": they come
# from full claims, after which the relay claims again anyway.
PROBE_AT_MOST = 32


def mark_published(schema: str) -> sql.Composed:
    """Params: ids (uuid[]), probe (bool). Only rows still pending: a row another publisher
    finished stays as is. The row's auth_token is dropped: published, it is no longer needed.

    Returns one boolean: with ``probe``, does a marked sequential row have a pending
    successor in its lane, which the mark has just made a head? Only then is a claim
    worth making at once; at a trickle, where every lane holds one message, this saves a
    claim per message. The probe reads the statement's snapshot, in which the marked
    rows are still pending, so it skips the marked row itself (one lane never has two
    rows in flight). It runs once per marked row, as a subquery of RETURNING: as a join
    against the marked rows, statistics from a smaller outbox made it a nested loop
    over every pending row per marked row (benchmarks/README.md, "2026-11-24, morning");
    hence also the cap (:data:`PROBE_AT_MOST`). The UPDATE spells
    "pending" so that it finds its rows through the primary key: a spelling that matched
    a partial index's predicate let the same stale statistics walk every pending row of
    that index for the ids.
    """
    return sql.SQL(
        f"""
WITH marked AS (
    UPDATE {{outbox}} t
    SET {_published("t", "clock_timestamp()")}
    WHERE t.id = ANY(%(ids)s::uuid[]) AND {pending_by_id("t")}
    RETURNING %(probe)s AND t.concurrency = 'sequential' AND {_others_in_lane("t", "t.id")} AS frees
)
SELECT coalesce(bool_or(frees), false) FROM marked
"""
    ).format(outbox=_outbox(schema))


def retry_later(schema: str) -> sql.Composed:
    """Params: id, delay (seconds), error. A failed attempt: count it, back off."""
    return sql.SQL(
        """
UPDATE {outbox}
SET finished_attempts = finished_attempts + 1,
    locked_until = clock_timestamp() + make_interval(secs => %(delay)s),
    last_error = %(error)s
WHERE id = %(id)s::uuid AND {pending}
"""
    ).format(outbox=_outbox(schema), pending=_PENDING_BY_ID)


def abandon(schema: str) -> sql.Composed:
    """Params: id, error. The last failed attempt: give up (a dead letter is written beside); drop the auth_token."""
    return sql.SQL(
        """
UPDATE {outbox}
SET finished_attempts = finished_attempts + 1, abandoned_at = clock_timestamp(), last_error = %(error)s,
    metadata = metadata - 'auth_token'
WHERE id = %(id)s::uuid AND {pending}
"""
    ).format(outbox=_outbox(schema), pending=_PENDING_BY_ID)


def release(schema: str) -> sql.Composed:
    """Params: ids. Give back leases of rows this publisher will not finish (no attempt counted).

    ``started_attempts`` is not undone on purpose: poison detection wants to know the
    row was taken.
    """
    return sql.SQL(
        """
UPDATE {outbox} SET locked_until = clock_timestamp()
WHERE id = ANY(%(ids)s::uuid[]) AND {pending}
"""
    ).format(outbox=_outbox(schema), pending=_PENDING_BY_ID)


def backlog(schema: str) -> sql.Composed:
    """(pending rows, age in seconds of the oldest due row) for the metrics gauges."""
    return sql.SQL(
        """
SELECT count(*),
       COALESCE(EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE locked_until <= now())), 0)
FROM {outbox} WHERE processed_at IS NULL AND abandoned_at IS NULL
"""
    ).format(outbox=_outbox(schema))
