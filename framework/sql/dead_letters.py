"""SQL of ``txbox.dead_letters``: the one INSERT every writer uses, replay and discard.

:meth:`framework.dead_letters.DeadLetter.row` is the row codec and :func:`insert_sql`
the one INSERT, used by the receiver, the worker, the relay and the collector alike;
``ON CONFLICT`` on the collector's ``delivery_key`` makes a broker delivery stored twice
(a crash before its ack) one row, and is never hit by the other writers, whose key is
NULL. The statements of replay and discard (framework/dead_letters/replay.py) follow, then the
read side of ``txbox dlq`` and the dashboard (the filters of a list, list, count, groups,
one letter, the open letters' numbers). Every filter value is a bound parameter; only the schema (a validated
identifier) is composed into the text. The list pages order by ``died_at DESC, id DESC``
so the ``dead_letters_died_at_idx`` / ``dead_letters_open_idx`` indexes answer them
without sorting 100,000 rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, Literal

import psycopg
from psycopg import sql

from framework import names, redaction
from framework.dead_letters import DeadLetter
from framework.sql.inbox import same_content

# The columns a writer sets (DeadLetter.row()'s keys); the others have their defaults.
COLUMNS = (
    "message_id",
    "source",
    "reason",
    "error",
    "fingerprint",
    "message_type",
    "routing_key",
    "message",
    "raw_body",
    "raw_encoding",
    "headers",
    "attempts",
    "delivery_key",
)


def insert_sql(schema: str) -> sql.Composed:
    """The dead-letter INSERT with named parameters (``DeadLetter.row()``)."""
    return sql.SQL(
        "INSERT INTO {t} ({cols}) VALUES ({vals}) ON CONFLICT (delivery_key) WHERE delivery_key IS NOT NULL DO NOTHING"
    ).format(
        t=sql.Identifier(schema, names.DEAD_LETTERS),
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
        vals=sql.SQL(", ").join(map(sql.Placeholder, COLUMNS)),
    )


def insert_letters(cur: psycopg.Cursor[Any], schema: str, letters: Sequence[DeadLetter]) -> None:
    """Store ``letters`` in the cursor's transaction."""
    if letters:
        cur.executemany(insert_sql(schema), [letter.row() for letter in letters])


# --- replay and discard (framework/dead_letters/replay.py) ------------------------------------


def _letters(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, names.DEAD_LETTERS)


def lock(schema: str) -> sql.Composed:
    """Params: ids. The letters, locked, in id order (no deadlock between two operators)."""
    return sql.SQL("SELECT * FROM {t} WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE").format(t=_letters(schema))


def by_delivery_key(schema: str) -> sql.Composed:
    """Params: key. The id and message id of the letter stored under that ``delivery_key``."""
    return sql.SQL("SELECT id, message_id FROM {t} WHERE delivery_key = %(key)s").format(t=_letters(schema))


def mark_resolved(schema: str) -> sql.Composed:
    """Params: id, at. The letter's message was processed (or published) at ``at``."""
    return sql.SQL("UPDATE {t} SET resolved_at = %(at)s WHERE id = %(id)s").format(t=_letters(schema))


def mark_discarded(schema: str) -> sql.Composed:
    """Params: id."""
    return sql.SQL("UPDATE {t} SET discarded_at = clock_timestamp() WHERE id = %(id)s").format(t=_letters(schema))


def note(schema: str, stamp: str, more: str) -> sql.Composed:
    """Params: id, entry (jsonb). Set column ``stamp`` to now, apply ``more`` (SQL of ours,
    never input) and append ``entry``, timed as ``stamp``, to the letter's history."""
    return sql.SQL(
        """UPDATE {t} SET {stamp} = clock_timestamp(), {more},
               attempts = jsonb_set(attempts, '{{history}}',
                   coalesce(attempts -> 'history', '[]'::jsonb)
                   || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object({key}, clock_timestamp())))
           WHERE id = %(id)s"""
    ).format(t=_letters(schema), stamp=sql.Identifier(stamp), more=sql.SQL(more), key=sql.Literal(stamp))


def resolve_replayed(schema: str, table: str) -> sql.Composed:
    """Params: sources, ids (or NULL: all). Replayed letters whose message ``table`` has since
    processed; touches only the ``dead_letters_unresolved_idx`` rows."""
    return sql.SQL(
        """UPDATE {dl} d SET resolved_at = m.processed_at FROM {m} m
           WHERE d.replayed_at IS NOT NULL AND d.resolved_at IS NULL AND d.discarded_at IS NULL
             AND d.source = ANY(%(sources)s) AND m.id = d.message_id AND m.processed_at IS NOT NULL
             AND (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))"""
    ).format(dl=_letters(schema), m=sql.Identifier(schema, table))


def resolve_processed(schema: str) -> sql.Composed:
    """Params: ids (message ids). Their replayed inbox and broker letters, resolved now."""
    return sql.SQL(
        """UPDATE {dl} SET resolved_at = clock_timestamp()
           WHERE message_id = ANY(%(ids)s) AND replayed_at IS NOT NULL AND resolved_at IS NULL
             AND discarded_at IS NULL AND source IN ('inbox', 'broker')"""
    ).format(dl=_letters(schema))


def resolve_forgotten(schema: str) -> sql.Composed:
    """Params: ids (inbox ids about to be forgotten). Their open or replayed inbox and
    broker letters whose message was processed with the same content, resolved (so a
    later replay cannot run it again; framework/dedup.py). A letter with other content
    (an id conflict) stays open."""
    letter = "d.message"
    return sql.SQL(
        """UPDATE {dl} d SET resolved_at = i.processed_at FROM {inbox} i
           WHERE i.id = ANY(%(ids)s::uuid[]) AND i.processed_at IS NOT NULL AND d.message_id = i.id
             AND d.source IN ('inbox', 'broker') AND d.resolved_at IS NULL AND d.discarded_at IS NULL
             AND jsonb_typeof({m}) = 'object' AND {same}"""
    ).format(
        dl=_letters(schema),
        inbox=sql.Identifier(schema, names.INBOX),
        m=sql.SQL(letter),
        same=same_content(
            "i",
            sql.SQL(f"{letter} ->> 'message_type'"),
            sql.SQL(f"{letter} ->> 'aggregate_type'"),
            sql.SQL(f"{letter} ->> 'aggregate_id'"),
            sql.SQL(f"{letter} -> 'payload'"),
        ),
    )


# --- reads: txbox dlq and the dashboard (framework/dead_letters/queries.py) ----------------------

Status = Literal["open", "replayed", "resolved", "discarded", "all"]
STATUSES: tuple[Status, ...] = ("open", "replayed", "resolved", "discarded", "all")

# The status of a row, as SQL over its own columns (the partial indexes use the same text).
STATUS_SQL: dict[Status, str] = {
    "open": "replayed_at IS NULL AND discarded_at IS NULL",
    "replayed": "replayed_at IS NOT NULL AND resolved_at IS NULL AND discarded_at IS NULL",
    "resolved": "resolved_at IS NOT NULL",
    "discarded": "discarded_at IS NOT NULL",
    "all": "TRUE",
}
STATUS_CASE = (
    "CASE WHEN discarded_at IS NOT NULL THEN 'discarded' WHEN resolved_at IS NOT NULL THEN 'resolved' "
    "WHEN replayed_at IS NOT NULL THEN 'replayed' ELSE 'open' END"
)
#: Characters of the error a list row and a group's sample show; SQL reads one more, so
#: :func:`framework.redaction.clip` can tell a cut text (and drop a URL the cut ran through).
LIST_ERROR_CHARS = 240
GROUP_ERROR_CHARS = 300
LIST_COLUMNS = (
    f"id, message_id, source, reason, left(error, {LIST_ERROR_CHARS + 1}) AS error, fingerprint, message_type, "
    "routing_key, "
    f"died_at, replayed_at, replay_count, resolved_at, discarded_at, {STATUS_CASE} AS status"
)


@dataclass(frozen=True, kw_only=True)
class Filters:
    """What the list shows. Empty strings count as 'not given' (as HTML forms send them)."""

    status: Status = "open"
    source: str | None = None
    message_type: str | None = None
    reason: str | None = None
    fingerprint: str | None = None
    message_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) == "":
                object.__setattr__(self, f.name, None)
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")

    def as_query(self) -> dict[str, str]:
        """The filters as URL query parameters (given ones only)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name == "status" and value == "open"):
                out[f.name] = value.isoformat() if isinstance(value, datetime) else str(value)
        return out

    def with_(self, **changes: Any) -> Filters:
        return replace(self, **changes)


def where_clause(filters: Filters) -> tuple[sql.Composable, dict[str, Any]]:
    """The WHERE clause ``filters`` select, and its parameters."""
    parts: list[sql.Composable] = [sql.SQL(STATUS_SQL[filters.status])]
    params: dict[str, Any] = {}
    for column in ("source", "message_type", "reason", "fingerprint"):
        value = getattr(filters, column)
        if value is not None:
            parts.append(sql.SQL("{} = {}").format(sql.Identifier(column), sql.Placeholder(column)))
            params[column] = value
    if filters.message_id is not None:
        # Compare as text: a malformed id simply matches nothing instead of failing the query.
        parts.append(sql.SQL("message_id::text = lower({})").format(sql.Placeholder("message_id")))
        params["message_id"] = filters.message_id.strip()
    if filters.since is not None:
        parts.append(sql.SQL("died_at >= {}").format(sql.Placeholder("since")))
        params["since"] = filters.since
    if filters.until is not None:
        parts.append(sql.SQL("died_at < {}").format(sql.Placeholder("until")))
        params["until"] = filters.until
    return sql.SQL(" AND ").join(parts), params


def list_letters(
    conn: psycopg.Connection[Any], schema: str, filters: Filters, *, limit: int = 50, offset: int = 0
) -> list[dict[str, Any]]:
    where, params = where_clause(filters)
    query = sql.SQL(
        "SELECT "
        + LIST_COLUMNS
        + " FROM {t} WHERE {where} ORDER BY died_at DESC, id DESC LIMIT {limit} OFFSET {offset}"
    ).format(t=_letters(schema), where=where, limit=sql.Placeholder("limit"), offset=sql.Placeholder("offset"))
    rows = list(conn.execute(query, {**params, "limit": limit, "offset": offset}).fetchall())
    return _clipped(rows, LIST_ERROR_CHARS)


def count_letters(conn: psycopg.Connection[Any], schema: str, filters: Filters) -> int:
    where, params = where_clause(filters)
    query = sql.SQL("SELECT count(*) AS n FROM {t} WHERE {where}").format(t=_letters(schema), where=where)
    row = conn.execute(query, params).fetchone()
    return int(row["n"]) if row else 0


def groups(conn: psycopg.Connection[Any], schema: str, filters: Filters, *, limit: int = 100) -> list[dict[str, Any]]:
    """Letters grouped by fingerprint, biggest first, each with its latest error as sample.

    A fingerprint includes the message type, so each group has one type (from the sample).
    """
    where, params = where_clause(filters)
    query = sql.SQL(
        """WITH g AS (
               SELECT fingerprint, count(*) AS count, min(died_at) AS first_died_at, max(died_at) AS last_died_at
               FROM {t} WHERE {where} GROUP BY fingerprint ORDER BY count(*) DESC, max(died_at) DESC
               LIMIT {limit})
           SELECT g.*, s.message_type, s.reason, s.source, left(s.error, {chars}) AS error
           FROM g CROSS JOIN LATERAL (
               SELECT message_type, reason, source, error FROM {t} d
               WHERE d.fingerprint = g.fingerprint ORDER BY died_at DESC LIMIT 1) s
           ORDER BY g.count DESC, g.last_died_at DESC"""
    ).format(t=_letters(schema), where=where, limit=sql.Placeholder("limit"), chars=sql.Literal(GROUP_ERROR_CHARS + 1))
    return _clipped(list(conn.execute(query, {**params, "limit": limit}).fetchall()), GROUP_ERROR_CHARS)


def _clipped(rows: list[dict[str, Any]], chars: int) -> list[dict[str, Any]]:
    """The rows' errors cut to ``chars``, never leaving part of a URL's password.

    The cut is ``redaction.clip``'s (docs/explanation/operations.md, "Secrets").
    """
    for row in rows:
        row["error"] = redaction.clip(row["error"], chars)
    return rows


def get_letter(conn: psycopg.Connection[Any], schema: str, letter_id: int) -> dict[str, Any] | None:
    """One letter in full, plus the current state of its inbox/outbox row when there is one."""
    query = sql.SQL("SELECT *, " + STATUS_CASE + " AS status FROM {t} WHERE id = %(id)s").format(t=_letters(schema))
    row = conn.execute(query, {"id": letter_id}).fetchone()
    if row is None:
        return None
    row = dict(row)
    row["current"] = None
    if row["message_id"] is not None:
        table = names.OUTBOX if row["source"] == "outbox" else names.INBOX
        state = sql.SQL(
            "SELECT {table_name} AS table, created_at, locked_until, started_attempts, finished_attempts, "
            "processed_at, abandoned_at, last_error FROM {t} WHERE id = %(id)s"
        ).format(table_name=sql.Literal(table), t=sql.Identifier(schema, table))
        row["current"] = conn.execute(state, {"id": row["message_id"]}).fetchone()
    return row


def ids_matching(conn: psycopg.Connection[Any], schema: str, filters: Filters, *, limit: int = 100_000) -> list[int]:
    """Ids of the letters a filter selects (replay or discard of a whole group)."""
    where, params = where_clause(filters)
    query = sql.SQL("SELECT id FROM {t} WHERE {where} ORDER BY died_at, id LIMIT {limit}").format(
        t=_letters(schema), where=where, limit=sql.Placeholder("limit")
    )
    return [r["id"] for r in conn.execute(query, {**params, "limit": limit}).fetchall()]


def distinct_values(conn: psycopg.Connection[Any], schema: str, column: str, *, limit: int = 200) -> list[str]:
    """Values of a low-cardinality column for the filter drop-downs. Scans the table, so the
    dashboard caches the answer for a minute (benchmarks/code-choices.md, "The dashboard's
    filter values")."""
    if column not in ("message_type", "reason", "source"):
        raise ValueError(column)
    query = sql.SQL("SELECT {c} AS v FROM {t} WHERE {c} IS NOT NULL GROUP BY {c} ORDER BY {c} LIMIT {limit}").format(
        c=sql.Identifier(column), t=_letters(schema), limit=sql.Literal(limit)
    )
    return [r["v"] for r in conn.execute(query).fetchall()]


def open_summary(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """The open letters of the overview card: how many, in how many groups, the oldest, and
    how many died in the last 24 h."""
    row = conn.execute(
        sql.SQL(
            """SELECT count(*) AS open, count(DISTINCT fingerprint) AS open_groups, min(died_at) AS oldest_open_at,
                      (SELECT count(*) FROM {t} WHERE died_at >= now() - interval '24 hours') AS died_24h
               FROM {t} WHERE replayed_at IS NULL AND discarded_at IS NULL"""
        ).format(t=_letters(schema))
    ).fetchone()
    return dict(row) if row else {}
