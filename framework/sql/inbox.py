"""All SQL of ``txbox.inbox``: the one INSERT, its row codec, and the worker's statements.

Writing: :class:`InboxRow` is the one shape of a row on its way in (the receiver's
intake builds it, the dead-letter replay too) and :func:`insert_rows` the one INSERT:
``INSERT ... SELECT FROM jsonb_array_elements(batch)`` stores a whole batch in one round trip;
``ON CONFLICT (id) DO NOTHING`` makes a duplicate delivery a no-op and ``RETURNING id``
tells duplicates from new rows. :func:`conflicting` tells a true duplicate from an id
reused for other content (docs/explanation/receive.md, "Receiver intake").

Working (docs/explanation/handle.md, "Worker"): the claim takes due rows that are at the head
of their sequential segment (no pending sequential row of the segment comes before them;
parallel rows need no such check), skips rows another worker has locked, and in the same
statement counts the start and sets the lease. Rows whose previous run never finished
(``started > finished`` with an expired lease: the process died) are claimed alone.
Claimed rows are tuples of :data:`CLAIM_COLUMNS`, in that order (:func:`fetch_claimed`).

The claim's UPDATE finds the locked rows by ``ctid`` (stable while ``due`` holds their
row locks): a TID scan whatever the statistics say. Matched by ``id``, a planner that had
last analyzed a small inbox scanned the whole table for every claim, a cost growing with
the table until the next ANALYZE (benchmarks/README.md, "2026-11-24, morning").
"""

from __future__ import annotations

import functools
import operator
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from psycopg import sql

from framework import jsoncodec, names
from framework.errors import TxboxError
from framework.sql import rendered
from framework.tables import pending_by_id, pending_in_segment

if TYPE_CHECKING:
    from framework.envelope import Message


def _on_inbox(schema: str, text: str) -> sql.Composed:
    """``text`` with ``{inbox}`` composed as the schema's inbox."""
    return sql.SQL(text).format(inbox=sql.Identifier(schema, names.INBOX))


@dataclass(kw_only=True, slots=True)
class InboxRow:
    """Column values of one txbox.inbox row on its way in.

    Not frozen: the receiver builds one per delivery, and a frozen dataclass pays a
    ``object.__setattr__`` call per field for it.
    """

    id: uuid.UUID
    message_type: str
    aggregate_type: str
    aggregate_id: str
    message_version: str
    kind: str
    routing_key: str
    payload: str  # JSON text
    message_context: str
    metadata: str
    segment: str
    concurrency: str
    priority: int
    message_timestamp: datetime
    queue: str
    redelivered: bool

    @classmethod
    def of(
        cls,
        message: Message,
        *,
        message_type: str,
        kind: str,
        routing_key: str,
        metadata: str,
        lane: tuple[str, str, int],
        queue: str,
        redelivered: bool = False,
    ) -> InboxRow:
        """``message`` as a row: its id, aggregate, version, timestamp (in UTC), payload and
        context (as JSON text) from the message; the type as it is to be stored, kind and
        routing key of its contract, ``metadata`` (JSON text), the lane (segment,
        concurrency, priority) and the queue it came from as the writer decides them."""
        segment, concurrency, priority = lane
        return cls(
            id=message.message_id,
            message_type=message_type,
            aggregate_type=message.aggregate_type,
            aggregate_id=message.aggregate_id,
            message_version=message.message_version,
            kind=kind,
            routing_key=routing_key,
            payload=jsoncodec.amqp_json(message.payload),
            message_context=jsoncodec.amqp_json(message.message_context),
            metadata=metadata,
            segment=segment,
            concurrency=concurrency,
            priority=priority,
            message_timestamp=message.timestamp.astimezone(UTC),
            queue=queue,
            redelivered=redelivered,
        )


# The PostgreSQL type of each InboxRow field that is not text, for the casts of the INSERT.
_TYPES = {
    "id": "uuid",
    "payload": "jsonb",
    "message_context": "jsonb",
    "metadata": "jsonb",
    "priority": "int2",
    "message_timestamp": "timestamptz",
    "redelivered": "bool",
}
_COLUMNS: tuple[tuple[str, str], ...] = tuple((f.name, _TYPES.get(f.name, "text")) for f in fields(InboxRow))
_VALUES = operator.attrgetter(*(c for c, _ in _COLUMNS))  # a row's values in column order


@functools.cache  # rendered once per schema, not once per batch
def insert_sql(schema: str) -> bytes:
    """The inbox INSERT: one parameter, the batch as a JSON array of rows (:func:`batch_json`).

    Each row is a JSON array of its values in :data:`_COLUMNS` order; PostgreSQL takes it
    apart by position. The JSON columns travel as JSON *strings* and are cast from their
    text exactly as a text column would be: a row's text can never spill into its
    neighbours' values, and a text jsonb refuses (``\\u0000``) fails the same way.
    """

    def value(index: int, column_type: str) -> sql.Composable:
        text = sql.SQL("r ->> {}").format(sql.Literal(index))
        return text if column_type == "text" else sql.SQL("({})::{}").format(text, sql.SQL(column_type))

    return rendered(
        sql.SQL(
            "INSERT INTO {table} ({cols}) SELECT {select} FROM jsonb_array_elements(%s::jsonb) AS r "
            "ON CONFLICT (id) DO NOTHING RETURNING id"
        ).format(
            table=sql.Identifier(schema, names.INBOX),
            cols=sql.SQL(", ").join(sql.Identifier(c) for c, _ in _COLUMNS),
            select=sql.SQL(", ").join(value(i, t) for i, (_, t) in enumerate(_COLUMNS)),
        )
    )


@functools.cache
def insert_all_new_sql(schema: str) -> bytes:
    """:func:`insert_sql` that fails unless every row was new: parameters ``$1`` the batch
    (:func:`batch_json`), ``$2`` its number of rows; for libpq's own calls.

    The receiver sends it alone, so it runs in an implicit transaction committed by the
    same round trip (docs/explanation/daemons.md, "The daemons and their threads"). A row that
    was not new (a duplicate, or a different message under a stored id, which must become
    an ``id_conflict`` letter in the same transaction) makes it divide by zero
    (SQLSTATE 22012, :data:`NOT_ALL_NEW`), which rolls the whole batch back: the caller
    writes it again the ordinary way.
    """
    statement = insert_sql(schema)
    if statement.count(b"%s") != 1 or b"$" in statement:
        raise TxboxError("the inbox INSERT must hold exactly one %s and no $ to be numbered")
    return (
        b"WITH inserted AS (" + statement.replace(b"%s", b"$1") + b") "
        b"SELECT 1 / (CASE WHEN count(*) = $2::int THEN 1 ELSE 0 END) FROM inserted"
    )


NOT_ALL_NEW = "22012"  # division_by_zero: what insert_all_new_sql raises when a row was not new


def batch_json(rows: Sequence[InboxRow]) -> str:
    """``rows`` as the one parameter of :func:`insert_sql`: a JSON array of value arrays.

    One C-speed ``orjson.dumps`` for the batch instead of sixteen arrays that psycopg
    adapts element by element in Python: the receiver's GIL-bound thread spends less per
    row, its backend a little more (docs/explanation/daemons.md, "Tables and their SQL").
    UUIDs, the timestamp (RFC 3339, with its zone) and booleans are written in a form
    their PostgreSQL types read back unchanged. A string no UTF-8 encoder takes (a lone
    surrogate) raises here, as psycopg's adaptation did: the receiver then stores the
    batch row by row and that row alone is refused.
    """
    return orjson.dumps(list(map(_VALUES, rows))).decode()


# PostgreSQL refuses a jsonb value whose elements take more than 256 MB. The receiver's
# budget of unacked bytes counts bodies, not headers (kept whole in ``metadata``, a control
# character spelled in six), so a batch of senders' largest headers could reach it: past
# this many characters (at most four UTF-8 bytes each) a batch goes in halves.
MAX_BATCH_CHARS = 32 << 20


def insert_rows(cur: psycopg.Cursor[Any], schema: str, rows: Sequence[InboxRow]) -> set[uuid.UUID]:
    """Store ``rows``; returns the ids that were new (the others were duplicates).

    A batch too large for one jsonb value goes as several statements of the caller's
    transaction, in order: a duplicate in a later part meets the row of an earlier part,
    so the first of a batch still wins.
    """
    if not rows:
        return set()
    text = batch_json(rows)
    if len(text) > MAX_BATCH_CHARS and len(rows) > 1:
        half = len(rows) // 2
        new = insert_rows(cur, schema, rows[:half])
        return new | insert_rows(cur, schema, rows[half:])
    cur.execute(insert_sql(schema), (text,))
    return {row[0] for row in cur.fetchall()}


# --- the dedup memory (framework/dedup.py, docs/explanation/guarantees.md "Dedup memory") ---------

DIGEST_KEY = "payload_sha256"
FINISHED = "(processed_at IS NOT NULL OR abandoned_at IS NOT NULL)"
# The time a message's dedup window starts: when it was processed (or abandoned).
FINISHED_AT = "coalesce(processed_at, abandoned_at)"


def payload_digest(payload: sql.Composable) -> sql.Composed:
    """SQL: hex SHA-256 of a jsonb value's canonical text (keys sorted, spacing normalized)."""
    return sql.SQL("encode(sha256(convert_to(({})::text, 'UTF8')), 'hex')").format(payload)


def same_content(
    row: str,
    message_type: sql.Composable,
    aggregate_type: sql.Composable,
    aggregate_id: sql.Composable,
    payload: sql.Composable,
) -> sql.Composed:
    """SQL predicate: inbox row ``row`` (an alias) holds this content, live or tombstone.

    ``payload`` must be a jsonb expression.
    """
    r = sql.Identifier(row)
    return sql.SQL(
        "({r}.message_type = {mt} AND {r}.aggregate_type = {at} AND {r}.aggregate_id = {ai} AND {p})"
    ).format(r=r, mt=message_type, at=aggregate_type, ai=aggregate_id, p=same_payload(row, payload))


def same_payload(row: str, payload: sql.Composable) -> sql.Composed:
    """SQL predicate: inbox row ``row`` holds this payload (a jsonb expression), live or tombstone."""
    return sql.SQL(
        "CASE WHEN {r}.archived_at IS NULL THEN {r}.payload = {p} ELSE {r}.metadata ->> {key} = {digest} END"
    ).format(r=sql.Identifier(row), p=payload, key=sql.Literal(DIGEST_KEY), digest=payload_digest(payload))


def tombstone(schema: str) -> sql.Composed:
    """Params: ids, window. Finished rows of ``ids`` within the window become tombstones:
    payload, context and error stripped, the payload's digest kept in ``metadata``."""
    return sql.SQL(
        f"""UPDATE {{inbox}} SET archived_at = clock_timestamp(), payload = '{{{{}}}}'::jsonb,
               message_context = '{{{{}}}}'::jsonb, last_error = NULL,
               metadata = jsonb_build_object({{key}}, {{digest}})
           WHERE id = ANY(%(ids)s::uuid[]) AND {FINISHED} AND archived_at IS NULL
             AND {FINISHED_AT} >= now() - %(window)s::interval"""
    ).format(
        inbox=sql.Identifier(schema, names.INBOX),
        key=sql.Literal(DIGEST_KEY),
        digest=payload_digest(sql.SQL("payload")),
    )


def forget_expired(schema: str) -> sql.Composed:
    """Params: ids, window. Finished rows (or tombstones) of ``ids`` older than the window, deleted."""
    return _on_inbox(
        schema,
        f"""DELETE FROM {{inbox}} WHERE id = ANY(%(ids)s::uuid[]) AND {FINISHED}
             AND {FINISHED_AT} < now() - %(window)s::interval""",
    )


def expired_tombstones(schema: str) -> sql.Composed:
    """Params: window, limit. Ids of tombstones whose window has passed, oldest first
    (through inbox_tombstone_idx)."""
    return _on_inbox(
        schema,
        f"""SELECT id FROM {{inbox}} WHERE archived_at IS NOT NULL AND {FINISHED_AT} < now() - %(window)s::interval
            ORDER BY {FINISHED_AT} LIMIT %(limit)s""",
    )


# What makes two messages with one id the same message (docs/explanation/receive.md, "Receiver
# intake"): type, aggregate and payload, the payload compared as jsonb (key order and
# number spelling do not matter), or by its digest where the archive left a tombstone
# (below). Context, timestamp, version, token and headers may differ between
# two sends of one message and are not compared.
def _conflicts_sql(schema: str) -> sql.Composed:
    u = {c: sql.SQL("u." + c) for c in ("message_type", "aggregate_type", "aggregate_id")}
    payload = sql.SQL("u.payload::jsonb")
    return sql.SQL(
        "SELECT u.n, concat_ws(', ', "
        "CASE WHEN i.message_type IS DISTINCT FROM u.message_type THEN 'message_type' END, "
        "CASE WHEN i.aggregate_type IS DISTINCT FROM u.aggregate_type THEN 'aggregate_type' END, "
        "CASE WHEN i.aggregate_id IS DISTINCT FROM u.aggregate_id THEN 'aggregate_id' END, "
        "CASE WHEN NOT coalesce({same_payload}, false) THEN 'payload' END) "
        "FROM unnest(%s::int[], %s::uuid[], %s::text[], %s::text[], %s::text[], %s::text[]) "
        "AS u(n, id, message_type, aggregate_type, aggregate_id, payload) "
        "JOIN {table} i ON i.id = u.id WHERE NOT coalesce({same}, false) ORDER BY u.n"
    ).format(
        table=sql.Identifier(schema, names.INBOX),
        same_payload=same_payload("i", payload),
        same=same_content("i", u["message_type"], u["aggregate_type"], u["aggregate_id"], payload),
    )


def conflicting(
    cur: psycopg.Cursor[Any], schema: str, rows: Sequence[InboxRow], new: set[uuid.UUID]
) -> list[tuple[int, str]]:
    """(index in ``rows``, fields that differ) of rows whose id is stored with other content.

    Only rows that did not insert are looked at (the first of several rows with one id
    in ``rows`` is the one that did): with no duplicate in a batch, no statement at all.
    """
    if len(new) == len(rows):
        # Every row inserted, so no id came twice: the usual batch, settled without a
        # look at each of its ids.
        return []
    inserted: set[uuid.UUID] = set()
    candidates: list[int] = []
    for index, row in enumerate(rows):
        if row.id in new and row.id not in inserted:
            inserted.add(row.id)
        else:
            candidates.append(index)
    if not candidates:
        return []
    picked = [rows[i] for i in candidates]
    cur.execute(
        _conflicts_sql(schema),
        (
            candidates,
            [r.id for r in picked],
            [r.message_type for r in picked],
            [r.aggregate_type for r in picked],
            [r.aggregate_id for r in picked],
            [r.payload for r in picked],
        ),
    )
    return [(int(n), str(fields)) for n, fields in cur.fetchall()]


# The message as stored: what the dead letter of a row that cannot be read keeps.
STORED_COLUMNS = (
    "id", "message_type", "aggregate_type", "aggregate_id", "message_version", "routing_key", "payload",
    "message_context", "metadata", "message_timestamp",
)  # fmt: skip
# What a claim returns, in this order (:func:`fetch_claimed`): tuples, read by position,
# and no column the worker does not read (each costs its decoding per message); the last
# two only order the rows (sorted here: an ORDER BY over the UPDATE's rows cost the
# server more than the sort costs the worker).
CLAIM_COLUMNS = (*STORED_COLUMNS, "started_attempts", "finished_attempts", "priority", "created_at")
_RETURNING = ", ".join(f"t.{c}" for c in CLAIM_COLUMNS)

_CLAIM = f"""
WITH due AS (
    SELECT i.ctid
    FROM {{inbox}} i
    WHERE i.processed_at IS NULL AND i.abandoned_at IS NULL
      AND i.locked_until <= {{now}}
      AND {{which}}
      AND (i.concurrency = 'parallel' OR NOT EXISTS (
            SELECT 1 FROM {{inbox}} p
            WHERE p.segment = i.segment
              AND {pending_in_segment("p")}
              AND p.concurrency = 'sequential'
              AND (p.priority > i.priority
                   OR (p.priority = i.priority AND (p.created_at, p.id) < (i.created_at, i.id)))))
      {{park}}
    {{take}}
    FOR UPDATE OF i SKIP LOCKED
)
UPDATE {{inbox}} t
SET started_attempts = t.started_attempts + 1,
    locked_until = {{now}} + make_interval(secs => %(lease)s)
WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM due))
RETURNING {{returning}}
"""

# Parked: an abandoned sequential message of the segment whose dead letter is still open.
_PARK = """
      AND NOT EXISTS (
            SELECT 1 FROM {inbox} a
            JOIN {dead_letters} d ON d.message_id = a.id AND d.source = 'inbox'
            WHERE a.abandoned_at IS NOT NULL AND a.segment = i.segment AND a.concurrency = 'sequential'
              AND d.replayed_at IS NULL AND d.discarded_at IS NULL)
"""


def claim(schema: str, *, suspects: bool, park: bool) -> sql.Composed:
    """Params: limit, lease (seconds). Rows: :data:`CLAIM_COLUMNS` (:func:`fetch_claimed`)."""
    # Suspects are found through inbox_suspect_idx (oldest expired lease first); the
    # others in priority, then arrival order through inbox_due_idx.
    which = "i.started_attempts > i.finished_attempts" if suspects else "i.started_attempts <= i.finished_attempts"
    order = "i.locked_until" if suspects else "i.priority DESC, i.created_at"
    take = sql.SQL("ORDER BY {order}\n    LIMIT %(limit)s").format(order=sql.SQL(order))
    return _claim(schema, which=sql.SQL(which), park=park, take=take, now=sql.SQL("now()"))


def claim_ids(schema: str, *, park: bool) -> sql.Composed:
    """Params: ids (a uuid array), lease (seconds). The worker's claim (not of suspects) of
    the rows among ``ids`` that it would claim now, with the same eligibility (due, not
    locked, at the head of their sequential segment, not parked when ``park``); rows:
    :data:`CLAIM_COLUMNS`, in no order (:func:`fetch_claimed` sorts them).

    For a daemon that stores rows and claims them for a worker of its process in the same
    transaction (framework/worker/daemon.py, ``Worker.take``). So "now" is the statement's
    own clock, not the transaction's start: a row inserted earlier in the transaction has a
    ``locked_until`` (its insert's ``clock_timestamp()``) after the transaction's ``now()``,
    and the lease must run from the claim, not from a ``BEGIN`` some time before. For
    libpq's own calls: ``positional(rendered(claim_ids(...)), ("ids", "lease"), {"lease":
    "float8"})`` (framework/sql/__init__.py).
    """
    which = sql.SQL("i.started_attempts <= i.finished_attempts AND i.id = ANY(%(ids)s::uuid[])")
    return _claim(schema, which=which, park=park, take=sql.SQL(""), now=sql.SQL("clock_timestamp()"))


def _claim(
    schema: str, *, which: sql.Composable, park: bool, take: sql.Composable, now: sql.Composable
) -> sql.Composed:
    """:data:`_CLAIM` for the rows ``which`` picks, ``take`` ordering and limiting them, with
    ``now`` the moment rows must be due by and the lease runs from."""
    inbox = sql.Identifier(schema, names.INBOX)
    park_sql = (
        sql.SQL(_PARK).format(inbox=inbox, dead_letters=sql.Identifier(schema, names.DEAD_LETTERS))
        if park
        else sql.SQL("")
    )
    return sql.SQL(_CLAIM).format(
        inbox=inbox, which=which, park=park_sql, take=take, now=now, returning=sql.SQL(_RETURNING)
    )


def fetch_claimed(
    conn: psycopg.Connection[Any], statement: bytes | sql.Composed, params: dict[str, Any]
) -> list[tuple[Any, ...]]:
    """Run a claim; its rows (:data:`CLAIM_COLUMNS`) in priority, then arrival order."""
    with conn.cursor() as cur:
        rows = cur.execute(statement, params).fetchall()
    rows.sort(key=_claim_order)
    return rows


def _claim_order(row: tuple[Any, ...]) -> tuple[Any, Any]:
    return -row[-2], row[-1]  # priority, created_at


# Our claims that still carry the started_attempts they had when we claimed them (the
# fencing token); params ``ids`` and ``started``. Each is looked up through the primary
# key by a scalar subquery, then updated by ``ctid`` (a TID scan). Both spell "pending"
# so that it matches no partial index's predicate (framework/tables.py): with statistics
# taken while the inbox was small, the planner picked one of them and scanned every
# pending row per id; a plain join to the unnest hashed the whole inbox per batch instead
# (benchmarks/README.md, "2026-11-23: every stage on a quiet machine").
#
# The arrays reach ``unnest`` through scalar subqueries: the planner counts the elements of
# a given array but guesses 10 for a parameter's, so for the small batches of a moderate
# load the plan for the values at hand looked cheaper than the generic one, and PostgreSQL
# planned the presumption again at every batch, which cost more than running it. It
# guesses the same for a subquery's array whatever the values, and so keeps the generic
# plan per connection (docs/explanation/daemons.md, "Generic plans").
_FENCE = f"""t.ctid = ANY(ARRAY(
    SELECT (SELECT i.ctid FROM {{inbox}} i WHERE i.id = c.id AND i.started_attempts = c.started
              AND {pending_by_id("i")})
    FROM unnest((SELECT %(ids)s::uuid[]), (SELECT %(started)s::int2[])) AS c(id, started)))
    AND {pending_by_id("t")}"""


# The presumption drops the message's auth_token (no longer needed once processed: no
# token at rest, docs/explanation/operations.md "Secrets"); a run that did not succeed gets it back
# from the claimed row (param: the token or NULL) for its next run.
_TOKEN_BACK = "jsonb_strip_nulls(jsonb_build_object('auth_token', %s::text))"


def presume_processed(schema: str) -> sql.Composed:
    """First statement of the processing transaction: mark our claims processed, lock them.

    It is the fence (a row whose ``started_attempts`` moved on was claimed again by
    someone else after our lease ran out, and is left alone; a row locked by us cannot
    be claimed while we work) and the success mark in one pass over the rows. The few
    that do not succeed are corrected by the statements below before the commit, so
    nobody ever sees the presumption. ``processed_at`` is thus when the batch started.

    Each row comes back as ``id`` and ``frees``: whether a later sequential row of its
    segment waits behind it. The batch's commit makes that row due, and only then is a
    claim worth making before the next NOTIFY. The probe reads the statement's snapshot, in which the batch
    is still pending, so it skips the batch's own rows.
    """
    return _on_inbox(
        schema,
        "UPDATE {inbox} t SET processed_at = clock_timestamp(), finished_attempts = t.finished_attempts + 1, "
        "locked_until = clock_timestamp(), metadata = t.metadata - 'auth_token' "
        f"WHERE {_FENCE} "
        "RETURNING t.id, t.concurrency = 'sequential' AND EXISTS ("
        "SELECT 1 FROM {inbox} p WHERE p.segment = t.segment AND p.concurrency = 'sequential' "
        f"AND {pending_in_segment('p')} AND p.id <> ALL(%(ids)s::uuid[])) AS frees",
    )


def mark_failed(schema: str) -> sql.Composed:
    """Undo the presumption for a failed run: due again after the backoff (the run counted)."""
    return _on_inbox(
        schema,
        "UPDATE {inbox} SET processed_at = NULL, "
        "locked_until = clock_timestamp() + make_interval(secs => %(delay)s), last_error = %(error)s, "
        f"metadata = metadata || {_TOKEN_BACK % '%(auth_token)s'} "
        "WHERE id = %(id)s",
    )


def mark_abandoned(schema: str) -> sql.Composed:
    """Undo the presumption for an abandon; ``finished`` is how many runs it settles in all."""
    return _on_inbox(
        schema,
        "UPDATE {inbox} SET processed_at = NULL, finished_attempts = finished_attempts - 1 + %(finished)s, "
        "abandoned_at = clock_timestamp(), locked_until = clock_timestamp(), last_error = %(error)s "
        "WHERE id = %(id)s",
    )


def unclaim(schema: str) -> sql.Composed:
    """Undo the presumption *and* the claim of messages that were never run (lease too short)."""
    return _on_inbox(
        schema,
        "UPDATE {inbox} t SET processed_at = NULL, finished_attempts = t.finished_attempts - 1, "
        "started_attempts = t.started_attempts - 1, locked_until = clock_timestamp(), "
        f"metadata = t.metadata || {_TOKEN_BACK % 'c.token'} "
        "FROM unnest(%s::uuid[], %s::text[]) AS c(id, token) WHERE t.id = c.id",
    )


def release(schema: str) -> sql.Composed:
    """Give back claims that were never run (stop, lost database): not an attempt, not poison."""
    return _on_inbox(
        schema,
        "UPDATE {inbox} t SET started_attempts = t.started_attempts - 1, locked_until = clock_timestamp() "
        f"WHERE {_FENCE}",
    )


def backlog(schema: str) -> sql.Composed:
    return _on_inbox(
        schema,
        "SELECT count(*), COALESCE(extract(epoch FROM now() - min(locked_until) "
        "FILTER (WHERE locked_until <= now())), 0) FROM {inbox} WHERE processed_at IS NULL AND abandoned_at IS NULL",
    )


def holds(schema: str) -> sql.Composed:
    """Params: id. One row if the inbox holds the message (live or tombstone)."""
    return _on_inbox(schema, "SELECT 1 FROM {inbox} WHERE id = %(id)s")


def restore_tombstone(schema: str) -> sql.Composed:
    """Params: id, payload, message_context, metadata. A tombstone filled in again (its id,
    type and aggregate already match; the dedup memory above)."""
    return _on_inbox(
        schema,
        """UPDATE {inbox} SET payload = %(payload)s, message_context = %(message_context)s, metadata = %(metadata)s,
               archived_at = NULL WHERE id = %(id)s""",
    )
